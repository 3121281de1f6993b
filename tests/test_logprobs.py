"""Log-probabilities through the engine (scheduler + backend) on both backends: prompt and output logprobs equal
transformers' log-softmax (float32, stories260K) within 1e-4, cold and with a warm prefix; the cache is reused only
up to the logprob start and cached_tokens says so; top lists are sorted; greedy outputs do not change."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
from backends_under_test import BACKENDS
from engine_harness import greedy, pool_is_clean, start_engine
from model_factory import reference_log_softmax

from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.runtime.sampling_params import SamplingParams

TOL = 1e-4
PAGE = 4
PAIRS = [  # (context, continuation): what lm-eval's loglikelihood requests score
    ("Once upon a time, there was a little girl named Lily.", " She loved to play outside in the park."),
    ("One day, a big dog saw a ball", " and ran to get it."),
    ("Tom and Sue went to the park. They", " played on the swings all day long, and they were happy."),
]
_ids = itertools.count()


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    input_lps: list = field(default_factory=list)
    input_top: list = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_lps: list = field(default_factory=list)
    output_top: list = field(default_factory=list)
    last: GenerateOutput | None = None
    increments: int = 0


async def _collect(engine, ids, params, stream) -> Collected:
    c = Collected()
    async for out in engine.generate(GenerateRequest(rid=f"lp{next(_ids)}", input_ids=list(ids),
                                                     sampling_params=params, stream=stream)):
        c.token_ids += out.token_ids
        c.increments += 1
        c.last = out
        lp = out.logprobs
        if lp is not None:
            c.input_ids += lp.input_token_ids
            c.input_lps += lp.input_logprobs
            c.input_top += lp.input_top or []
            c.output_ids += lp.output_token_ids
            c.output_lps += lp.output_logprobs
            c.output_top += lp.output_top or []
    return c


def run_lp(engine, prompts, params, stream=False) -> list[Collected]:
    plist = params if isinstance(params, list) else [params] * len(prompts)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, sp, stream) for p, sp in zip(prompts, plist)])

    return asyncio.run(main())


def lp_params(max_new_tokens=0, start=0, top=0, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_new_tokens=max_new_tokens, return_logprob=True, logprob_start_len=start,
                          top_logprobs_num=top, ignore_eos=True, **kw).normalize()


@pytest.fixture(scope="module")
def reference(stories_dir):
    """ids -> transformers' float32 log-softmax [len(ids), V] (row p scores token p + 1)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir), lambda ids: reference_log_softmax(stories_dir, ids)


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, stories_dir):
    e = start_engine(stories_dir, request.param, page_size=PAGE, chunked_prefill_size=8, max_total_tokens=2048)
    try:
        yield e
    finally:
        e.shutdown()


def _targets(ref: np.ndarray, ids: list[int], start: int) -> np.ndarray:
    """Reference logprobs of ids[start+1:] (token p scored by row p - 1)."""
    return ref[np.arange(start, len(ids) - 1), ids[start + 1:]]


def test_prompt_logprobs_match_transformers_cold_and_warm(engine, reference):
    tok, ref_lp = reference
    engine.parts.cache.flush()
    worst = 0.0
    for ctx, cont in PAIRS:
        ids = tok.encode(ctx + cont)
        n_ctx = len(tok.encode(ctx))
        ref = ref_lp(ids)
        # cold, the whole prompt (echo + max_tokens 0): the first token's logprob is None
        cold = run_lp(engine, [ids], lp_params(start=0))[0]
        assert cold.last.cached.total == 0 and cold.last.completion_tokens == 0 and cold.token_ids == []
        assert cold.input_ids == ids and cold.input_lps[0] is None
        worst = max(worst, float(np.abs(np.array(cold.input_lps[1:]) - _targets(ref, ids, 0)).max()))
        # warm: the whole prompt is cached now, but a start at the continuation reuses pages only before it
        warm = run_lp(engine, [ids], lp_params(start=n_ctx))[0]
        assert warm.last.cached.total == (n_ctx // PAGE) * PAGE > 0
        assert warm.input_ids == ids[n_ctx:] and warm.input_lps[0] is None
        worst = max(worst, float(np.abs(np.array(warm.input_lps[1:]) - _targets(ref, ids, n_ctx)).max()))
        # start 0 again: nothing may come from the cache (a cached position has no logits)
        again = run_lp(engine, [ids], lp_params(start=0))[0]
        assert again.last.cached.total == 0 and again.input_lps[1:] == pytest.approx(cold.input_lps[1:], abs=1e-6)
    print(f"\n{engine.parts.backend.name}: max |server - transformers| = {worst:.2e}")
    assert worst < TOL
    assert pool_is_clean(engine)


def test_batched_mixed_requests_keep_their_rows(engine, reference):
    """Prompt rows of several requests (and requests without logprobs) in the same steps land where they belong."""
    tok, ref_lp = reference
    prompts = [tok.encode(c + x) for c, x in PAIRS]
    params = [lp_params(start=0), greedy(4), lp_params(max_new_tokens=3, start=2, top=2)]
    out = run_lp(engine, prompts, params)
    for ids, p, res in zip(prompts, params, out):
        if not p.return_logprob:
            assert res.last.logprobs is None
            continue
        s = p.logprob_start_len
        np.testing.assert_allclose(res.input_lps[1:], _targets(ref_lp(ids), ids, s), atol=TOL)
    full = prompts[2] + out[2].token_ids
    ref = ref_lp(full)
    np.testing.assert_allclose(out[2].output_lps, _targets(ref, full, len(prompts[2]) - 1)[:3], atol=TOL)


def test_output_logprobs_top_lists_and_unchanged_greedy(engine, reference):
    tok, ref_lp = reference
    ids = tok.encode("Once upon a time")
    plain = run_lp(engine, [ids], greedy(12))[0]
    res = run_lp(engine, [ids], lp_params(max_new_tokens=12, start=-1, top=5))[0]
    assert res.token_ids == plain.token_ids  # asking for logprobs changes no token
    assert res.output_ids == res.token_ids and res.input_ids == []
    ref = ref_lp(ids + res.token_ids)
    np.testing.assert_allclose(res.output_lps, _targets(ref, ids + res.token_ids, len(ids) - 1), atol=TOL)
    for tok_id, lp, top in zip(res.output_ids, res.output_lps, res.output_top):
        vals = [v for _, v in top]
        assert len(top) == 5 and vals == sorted(vals, reverse=True)
        assert top[0] == (tok_id, lp)  # greedy: the sampled token is the top entry, same number


def test_sampled_logprobs_are_the_raw_distribution(engine, reference):
    """Temperature, top-k and penalties change which token is drawn, never the logprob reported for it."""
    tok, ref_lp = reference
    ids = tok.encode("One day, a big dog")
    res = run_lp(engine, [ids], lp_params(max_new_tokens=10, start=-1, top=3, temperature=1.7, top_k=3, seed=7,
                                          repetition_penalty=1.3))[0]
    full = ids + res.token_ids
    np.testing.assert_allclose(res.output_lps, _targets(ref_lp(full), full, len(ids) - 1), atol=TOL)
    for tok_id, lp, top in zip(res.output_ids, res.output_lps, res.output_top):
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        if tok_id in dict(top):
            assert dict(top)[tok_id] == pytest.approx(lp, abs=1e-6)


def test_streamed_logprobs_concatenate_to_the_whole(engine, reference):
    tok, _ = reference
    ids = tok.encode("Tom and Sue went to the park.")
    whole = run_lp(engine, [ids], lp_params(max_new_tokens=8, start=3, top=2))[0]
    streamed = run_lp(engine, [ids], lp_params(max_new_tokens=8, start=3, top=2), stream=True)[0]
    assert streamed.increments > 2
    assert streamed.token_ids == whole.token_ids == streamed.output_ids
    assert streamed.input_ids == whole.input_ids
    np.testing.assert_allclose(streamed.output_lps, whole.output_lps, atol=1e-6)
    np.testing.assert_allclose(streamed.input_lps[1:], whole.input_lps[1:], atol=1e-6)
    assert [[i for i, _ in t] for t in streamed.output_top] == [[i for i, _ in t] for t in whole.output_top]
    assert pool_is_clean(engine)


def test_tiny_model_prompt_logprobs_with_chunks_and_cache_limit(tiny_llama, backend_name):
    """Without ../shared: a seeded tiny model, chunk boundaries inside the scored rows, the cache cut at the start."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = [(i * 11) % 250 + 3 for i in range(37)]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    engine = start_engine(tiny_llama, backend_name, page_size=PAGE, chunked_prefill_size=5, max_total_tokens=1024)
    try:
        run_lp(engine, [ids], greedy(2))  # the whole prompt is cached now
        for start in (0, 6, 13, 36, 50):
            res = run_lp(engine, [ids], lp_params(start=start, top=4))[0]
            s = min(start, len(ids))
            # max_tokens 0 and no prompt row to score (start at or past the last token): nothing runs at all
            assert res.last.cached.total == (s // PAGE * PAGE if len(ids) - s > 1 else 0)
            assert res.input_ids == ids[s:] and (not res.input_lps or res.input_lps[0] is None)
            if len(ids) - s > 1:
                np.testing.assert_allclose(res.input_lps[1:], _targets(ref, ids, s), atol=TOL)
                assert all(len(t) == 4 for t in res.input_top[1:])
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()
