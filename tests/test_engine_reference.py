"""The whole engine (scheduler, radix cache, torch backend) reproduces transformers' greedy output."""
import pytest

from engine_harness import disconnect_after, greedy, pool_is_clean, run, settles_clean, start_engine
from model_factory import reference_greedy

PROMPTS = [[5], list(range(10, 17)), list(range(40, 73)), [(i * 7) % 280 + 3 for i in range(61)]]


@pytest.mark.parametrize("page_size,chunk", [(4, 16), (16, 2048), (1, 7)])
def test_batched_greedy_matches_reference(tiny_model, page_size, chunk, backend_name):
    engine = start_engine(tiny_model, backend_name, page_size=page_size, chunked_prefill_size=max(chunk, page_size),
                          max_total_tokens=4096)
    try:
        results = run(engine, PROMPTS, greedy(64))
        for prompt, res in zip(PROMPTS, results):
            assert res.token_ids == reference_greedy(tiny_model, prompt, 64), f"prompt of {len(prompt)} tokens"
            assert res.last.finish_reason == "length" and res.last.completion_tokens == 64
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_prefix_hit_reuses_pages_and_keeps_output(tiny_llama, backend_name):
    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=2048)
    try:
        system = list(range(3, 43))  # 40 shared tokens = 10 pages
        a, b = system + [50, 51, 52], system + [60, 61]
        cold = run(engine, [a], greedy(16))[0]
        assert cold.last.cached.device == 0
        hot = run(engine, [b], greedy(16))[0]
        assert hot.last.cached.device == 40
        assert hot.token_ids == reference_greedy(tiny_llama, b, 16)
        again = run(engine, [a], greedy(16))[0]
        assert again.token_ids == cold.token_ids
        assert again.last.cached.device == 40  # whole pages of a's prompt (43 tokens -> 10 full pages)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_tiny_pool_evicts_and_retracts_without_changing_output(tiny_llama, backend_name):
    # 24 pages of 4 tokens: 4 requests of ~40 tokens + 24 new each cannot all fit at once.
    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=96, chunked_prefill_size=32)
    try:
        prompts = [[(i * 11 + j) % 280 + 3 for j in range(37 + i)] for i in range(4)]
        results = run(engine, prompts, greedy(24))
        for p, r in zip(prompts, results):
            assert r.token_ids == reference_greedy(tiny_llama, p, 24)
        assert pool_is_clean(engine)
        text = engine.metrics_text().decode()
        assert "tierlm_retracted_requests_total" in text
    finally:
        engine.shutdown()


def test_disabled_radix_cache_never_hits(tiny_llama, backend_name):
    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=1024, disable_radix_cache=True)
    try:
        p = list(range(3, 40))
        r1, = run(engine, [p], greedy(8))
        r2, = run(engine, [p], greedy(8))
        assert r2.last.cached.device == 0 and r1.token_ids == r2.token_ids
        acc = engine.parts.cache.accounting()
        assert acc["free_pages"] == acc["total_pages"]
    finally:
        engine.shutdown()


def test_abort_frees_pages(tiny_llama, backend_name):
    engine = start_engine(tiny_llama, backend_name, page_size=4, max_total_tokens=1024)
    try:
        disconnect_after(engine, list(range(3, 30)), greedy(500))  # the client goes away after the first increment
        assert settles_clean(engine)
    finally:
        engine.shutdown()
