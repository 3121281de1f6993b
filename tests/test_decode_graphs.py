"""The static, bucketed decode path (backends/torch/decode_graphs.py) that CUDA graphs capture on a GPU.

On CPU the path runs without capture (``--cuda-graph-max-bs`` turns it on there), so CI checks what a capture
would freeze: bucketing, padding into a scratch page, the static buffers filled in place, the slicing of the
logits, and that every other step still runs the plain path; all against transformers' greedy output.
"""
from __future__ import annotations

import json

import pytest

from backend_driver import device_under_test, run_greedy
from engine_harness import greedy, pool_is_clean, run, start_engine
from model_factory import reference_greedy
from tierlm.backends.torch.decode_graphs import bucket_sizes

PROMPTS = [[5, 9, 13, 2, 7], [11, 4], list(range(20, 43)), [8], [30, 31, 32, 33, 34, 35, 36]]


def test_buckets_are_small_powers_then_multiples_of_eight_up_to_the_max():
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(1) == [1]


@pytest.mark.parametrize("page_size,chunk", [(1, None), (4, 3), (16, 8)])
def test_static_decode_steps_give_the_reference_output(tiny_model, page_size, chunk):
    """Five requests joining one by one: decode-only steps of 1..4 requests take the static path (padded to
    buckets 1, 2, 4), steps of 5 and every step with a prefill chunk run the plain path."""
    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(tiny_model, dtype="float32", device=device_under_test())
    drivers: list = []
    num_pages = sum(-(-(len(p) + 16 - 1) // page_size) for p in PROMPTS)
    backend.init_kv_pool(num_pages, page_size)
    real_init = backend.init_kv_pool
    backend.init_kv_pool = lambda n, ps: None  # the driver's own call: keep the pool (and the graphs on it)
    try:
        backend.init_decode_graphs(max_bs=4, context_length=64, capture=False)
        outs = run_greedy(backend, PROMPTS, 16, page_size=page_size, chunk_size=chunk, num_pages=num_pages,
                          stagger=2, driver_out=drivers)
    finally:
        backend.init_kv_pool = real_init
    for prompt, out in zip(PROMPTS, outs):
        assert out == reference_greedy(tiny_model, prompt, 16), f"prompt of {len(prompt)} tokens"
    shapes = drivers[0].batch_shapes
    decode_only = [s for s in shapes if all(q == 1 for q in s)]
    assert any(len(s) == 3 for s in decode_only)  # 3 requests ride in bucket 4: one padded row
    assert any(len(s) == 5 for s in decode_only)  # more than the largest bucket: the plain path
    stats = backend.decode_graph_stats()
    assert stats["static"] == sum(1 for s in decode_only if len(s) <= 4) and stats["replayed"] == 0
    assert stats["buckets"] == [1, 2, 4] and stats["captured"] == []
    # the padded rows wrote only into the scratch page, past the pages the runtime hands out
    assert backend.pool.num_pages == num_pages + 1 and backend.scratch_page == num_pages


def test_padding_rows_never_touch_a_real_page(tiny_llama):
    """Every real page keeps the K/V the plain path writes, whatever the padded rows compute."""
    import torch

    from tierlm.backends.torch.backend import TorchBackend

    prompts = [[5, 9, 13], [7, 8, 9, 10, 11], [1, 2, 3, 4]]  # 3 decoding requests: bucket 4, one padded row
    pools = []
    for static in (False, True):
        backend = TorchBackend(tiny_llama, dtype="float32")
        backend.init_kv_pool(8, 4)
        real_init, backend.init_kv_pool = backend.init_kv_pool, lambda n, ps: None
        if static:
            backend.init_decode_graphs(max_bs=4, context_length=32, capture=False)
        run_greedy(backend, prompts, 6, page_size=4, num_pages=8, stagger=0)
        backend.init_kv_pool = real_init
        pools.append(backend.pool.buffer.clone())
        if static:
            assert backend.decode_graph_stats()["static"] > 0
    real = pools[0].shape[2] // 9 * 8  # slots of the 8 real pages ([layer, K/V, slot, head, dim])
    # the same K/V up to float rounding (a GEMM over 4 rows may round differently from one over 3); a padded row
    # writing into a real page would put another token's K/V there
    assert torch.allclose(pools[0][:, :, :real], pools[1][:, :, :real], rtol=0, atol=1e-4)
    assert not pools[0][:, :, real:].any() and pools[1][:, :, real:].any()  # only padding wrote the scratch page


@pytest.mark.parametrize("backend_name", ["torch"])
def test_engine_serves_through_the_static_path_and_reports_it(tiny_llama, backend_name):
    engine = start_engine(tiny_llama, backend_name, dtype="float32", page_size=4, cuda_graph_max_bs=4)
    try:
        prompts = [[5, 9, 13, 2, 7], [11, 4, 6], [8, 8, 9]]
        outs = run(engine, prompts, greedy(10))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(tiny_llama, prompt, 10)
        info = json.loads(json.dumps(engine.server_info(), default=str))["decode_graphs"]
        assert info["enabled"] and info["buckets"] == [1, 2, 4]
        if engine.parts.backend.device == "cuda":  # the GPU check: captured with the Triton attention default
            assert info["captured"] == [1, 2, 4] and info["replayed"] > 0
        else:
            assert info["static"] > 0 and info["captured"] == [] and "without capture" in info["why"]
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_disable_cuda_graph_and_the_plain_default_on_cpu(tiny_llama):
    engine = start_engine(tiny_llama, "torch", dtype="float32", disable_cuda_graph=True)
    try:
        assert engine.server_info()["decode_graphs"] == {"enabled": False, "why": "--disable-cuda-graph"}
    finally:
        engine.shutdown()
    engine = start_engine(tiny_llama, "torch", dtype="float32")
    try:
        assert engine.server_info()["decode_graphs"] is None  # CPU without --cuda-graph-max-bs: the plain path
        assert engine.parts.backend.decode_graph_stats() is None
    finally:
        engine.shutdown()


def test_captured_cuda_graphs_give_the_reference_output(tiny_model):
    """On a GPU (TIERLM_TEST_DEVICE=cuda, scripts/device_check.sh): one captured graph per bucket, replayed."""
    from tierlm.backends.torch.backend import TorchBackend

    if device_under_test() != "cuda":
        pytest.skip("CUDA graphs need a GPU: run with TIERLM_TEST_DEVICE=cuda (scripts/device_check.sh)")
    backend = TorchBackend(tiny_model, dtype="float32", device="cuda", attention_backend="triton")
    page_size = 4
    num_pages = sum(-(-(len(p) + 16 - 1) // page_size) for p in PROMPTS)
    backend.init_kv_pool(num_pages, page_size)
    real_init, backend.init_kv_pool = backend.init_kv_pool, lambda n, ps: None
    try:
        info = backend.init_decode_graphs(max_bs=4, context_length=64, capture=True)
        outs = run_greedy(backend, PROMPTS, 16, page_size=page_size, num_pages=num_pages, stagger=2)
    finally:
        backend.init_kv_pool = real_init
    assert info["captured"] == [1, 2, 4]
    for prompt, out in zip(PROMPTS, outs):
        assert out == reference_greedy(tiny_model, prompt, 16)
    assert backend.decode_graph_stats()["replayed"] > 0

