"""NGRAM speculative decoding through the real engine: greedy output is token for token the output without it (and
transformers'), on every tiny family and stories260K, with mixed batches, chunked prefill, prefix hits in every tier,
retraction, stop rules and abort; drafts are really accepted (the statistics say so) and the pool stays exact."""
import pytest

from engine_harness import disconnect_after, greedy, pool_is_clean, run, settles_clean, start_engine
from model_factory import reference_greedy
from test_hicache import hicache_engine, push_out_of_device
from tierlm.runtime.sampling_params import SamplingParams

NGRAM = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}
PASSAGE = [(j * 13) % 250 + 7 for j in range(24)]
# Short prompts, and one that repeats a passage: random tiny models fall into loops, so drafts from the request's
# own tokens are accepted as well as rejected in these runs.
PROMPTS = [[5], list(range(10, 17)), PASSAGE + [3] + PASSAGE[:6], [(i * 7) % 280 + 3 for i in range(41)]]


def spec_info(engine) -> dict:
    return engine.parts.describe()["speculative"]


def check_meta(res) -> None:
    """completion tokens = one per verify step + every accepted draft, + the first token when a prefill chunk
    sampled it (a prompt whose last token ran alone as a decode step verifies drafts for its first token too)."""
    m = res.last.meta_info()
    assert m["completion_tokens"] - m["spec_verify_ct"] - m["spec_accept_token_num"] in (0, 1)
    assert m["spec_accept_token_num"] <= m["spec_draft_token_num"]


@pytest.mark.parametrize("page_size,chunk", [(4, 16), (16, 2048)])
def test_greedy_output_is_unchanged_on_every_family(tiny_model, page_size, chunk, backend_name):
    engine = start_engine(tiny_model, backend_name, page_size=page_size, chunked_prefill_size=chunk,
                          max_total_tokens=4096, **NGRAM)
    try:
        # The second round finds each first round's whole sequence in the shared n-gram store: long runs of
        # drafts are accepted there, while the first round mostly rejects them.
        for _ in range(2):
            results = run(engine, PROMPTS, greedy(40))
            for prompt, res in zip(PROMPTS, results):
                assert res.token_ids == reference_greedy(tiny_model, prompt, 40), f"prompt of {len(prompt)} tokens"
                check_meta(res)
        assert min(r.last.meta_info()["spec_accept_length"] for r in results) > 2
        info = spec_info(engine)
        assert info["accepted_tokens"] > 0 and info["draft_tokens"] > info["accepted_tokens"]  # both paths ran
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_copying_real_model_accepts_drafts(stories_dir, backend_name):
    """stories260K continues a story it was just shown by copying it: drafts from the prompt are accepted."""
    plain = start_engine(stories_dir, backend_name, page_size=16)
    try:
        tok = plain.parts.tokenizer
        story = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside in "
                           "the park. One day, she saw a big, red ball.")
        prompt = story + story[:8]  # the story, then its start again: the model goes on copying it
        want, = run(plain, [prompt], greedy(32))
    finally:
        plain.shutdown()
    engine = start_engine(stories_dir, backend_name, page_size=16, **NGRAM)
    try:
        got, = run(engine, [prompt], greedy(32))
        assert got.token_ids == want.token_ids
        m = got.last.meta_info()
        assert m["spec_accept_length"] > 1.5 and m["spec_verify_ct"] < 32 // 1.5
        check_meta(got)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_mixed_batch_sampled_rows_and_logprob_rows_are_unchanged(tiny_llama, backend_name):
    """Greedy rows verify drafts; seeded sampled rows, penalised rows and logprob rows decode one token a step in the
    same batch, and everyone's output equals the run without NGRAM."""
    params = [greedy(24), SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, ignore_eos=True).normalize(),
              greedy(24, repetition_penalty=1.3), greedy(24, return_logprob=True, logprob_start_len=-1, top_logprobs_num=2), greedy(24)]
    prompts = [PASSAGE + PASSAGE[:4], PASSAGE[:10], PASSAGE + PASSAGE[:3], list(range(20, 50)), [8, 9, 10]]
    outs = {}
    for name, kw in (("plain", {}), ("ngram", NGRAM)):
        engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=2048, **kw)
        try:
            outs[name] = run(engine, prompts, params)
            assert pool_is_clean(engine)
        finally:
            engine.shutdown()
    for a, b in zip(outs["plain"], outs["ngram"]):
        assert a.token_ids == b.token_ids
    assert outs["ngram"][3].last.logprobs is not None
    metas = [r.last.meta_info() for r in outs["ngram"]]
    assert metas[0]["spec_accept_token_num"] > 0
    assert all("spec_verify_ct" not in metas[i] for i in (1, 2, 3))  # never verified drafts


def test_prefix_hits_in_every_tier_keep_the_output(tiny_llama, store, backend_name):
    prompt = PASSAGE + PASSAGE + [4] * 12 + [9]
    want = reference_greedy(tiny_llama, prompt, 24)
    engine = hicache_engine(backend_name, tiny_llama, **NGRAM)
    try:
        cold, = run(engine, [prompt], greedy(24))
        device_hit, = run(engine, [prompt], greedy(24))
        push_out_of_device(engine)
        host_hit, = run(engine, [prompt], greedy(24))
        assert device_hit.last.cached.device > 0 and host_hit.last.cached.host > 0
        for r in (cold, device_hit, host_hit):
            assert r.token_ids == want
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()
    engine = hicache_engine(backend_name, tiny_llama, **NGRAM)
    try:
        storage_hit, = run(engine, [prompt], greedy(24))
        assert storage_hit.last.cached.storage > 0 and storage_hit.token_ids == want
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_retraction_in_a_tiny_pool_keeps_the_output(tiny_llama, backend_name):
    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=96, chunked_prefill_size=32,
                          **NGRAM)
    try:
        prompts = [[(i * 11 + j) % 280 + 3 for j in range(37 + i)] for i in range(4)]
        prompts[0] = PASSAGE + PASSAGE[:13]
        results = run(engine, prompts, greedy(24))
        for p, r in zip(prompts, results):
            assert r.token_ids == reference_greedy(tiny_llama, p, 24)
        assert pool_is_clean(engine)
        assert "tierlm_retracted_requests_total" in engine.metrics_text().decode()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_stop_rules_are_checked_token_by_token(tiny_llama, backend_name, max_new):
    """max_tokens and a stop token that fall inside an accepted run of drafts end the request exactly there."""
    prompt = PASSAGE + PASSAGE[:5]
    full = reference_greedy(tiny_llama, prompt, 30)
    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=2048, **NGRAM)
    try:
        r, = run(engine, [prompt], greedy(max_new))
        assert r.token_ids == full[:max_new] and r.last.finish_reason == "length"
        stop_at = full[max_new]  # first occurrence ends it: the output is everything before it
        cut = full.index(stop_at)
        p = SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[stop_at]).normalize()
        r, = run(engine, [prompt], p)
        assert r.token_ids[:-1] == full[:cut] and r.last.finish_reason == "stop"
        check_meta(r)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_abort_while_verifying_frees_every_page(tiny_llama, backend_name):
    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=1024, **NGRAM)
    try:
        disconnect_after(engine, PASSAGE + PASSAGE[:4], greedy(400), increments=3)
        assert settles_clean(engine)
    finally:
        engine.shutdown()


def test_shared_store_drafts_from_a_finished_request(tiny_llama, backend_name):
    """A second request that repeats the first one's prompt and output gets drafts from the shared store."""
    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=2048, disable_radix_cache=True,
                          **NGRAM)
    try:
        prompt = [(j * 17) % 260 + 5 for j in range(20)]
        first, = run(engine, [prompt], greedy(20))
        again, = run(engine, [prompt], greedy(20))
        assert again.token_ids == first.token_ids == reference_greedy(tiny_llama, prompt, 20)
        assert again.last.meta_info()["spec_accept_token_num"] > first.last.meta_info()["spec_accept_token_num"]
        assert spec_info(engine)["store_entries"] > 0
    finally:
        engine.shutdown()


def test_costly_drafts_back_off_without_changing_the_output(tiny_llama, backend_name):
    """Where a verify forward costs more than its drafts earn (draft_cost), a request pauses its drafts for 1, 2, 4 ...
    steps; the output stays the reference's, and it takes many more steps than with free drafts."""
    prompts = [[(i * 7 + j * 3) % 250 + 5 for j in range(30)] for i in range(3)]
    steps = {}
    for cost in (0.0, 100.0):
        engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=2048, **NGRAM)
        try:
            engine.parts.scheduler.spec.draft_cost = cost
            for _ in range(2):  # the second round finds matches at every step (the first round's sequences)
                results = run(engine, prompts, greedy(48))
                for p, r in zip(prompts, results):
                    assert r.token_ids == reference_greedy(tiny_llama, p, 48)
                    check_meta(r)
            steps[cost] = sum(r.last.meta_info()["spec_verify_ct"] for r in results)
            assert pool_is_clean(engine)
        finally:
            engine.shutdown()
    # free drafts: long accepted runs, few steps; costly ones: paused most of the time, nearly a step per token
    assert steps[100.0] > 2 * steps[0.0]


def test_verify_cost_probe_times_the_backend(tiny_llama, backend_name):
    from tierlm.runtime.speculative.verify_cost import measure_verify_cost

    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=256)
    try:
        ratio = measure_verify_cost(engine.parts.backend, 4, 64, drafts=5)
        assert 0.05 < ratio < 50  # a real timing of two real forwards (no assertion on speed itself)
        r, = run(engine, [PASSAGE], greedy(8))  # the probe's garbage K/V is overwritten before it is read
        assert r.token_ids == reference_greedy(tiny_llama, PASSAGE, 8) and pool_is_clean(engine)
    finally:
        engine.shutdown()
