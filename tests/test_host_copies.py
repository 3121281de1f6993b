"""--hicache-io-backend kernel | direct (backends/torch/host_copies.py): the same bytes move either way, in both
host layouts and every KV dtype, and an L2 hit through either gives the cold output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend_driver import device_under_test
from tierlm.backends.base import HostKVPool
from tierlm.backends.torch.kv_pool import TorchKVPool


def _pool(dtype: torch.dtype, mode: str) -> TorchKVPool:
    pool = TorchKVPool(3, 8, 4, 2, 8, dtype, torch.device(device_under_test()))
    g = torch.Generator().manual_seed(0)
    pool.buffer.copy_(pool.quantize(torch.randn(pool.buffer.shape, generator=g).to(pool.device)))
    pool.set_io_backend(mode)
    return pool


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kernel_and_direct_move_the_same_bytes(layout, dtype):
    pages, host_pages = np.array([3, 1, 6]), np.array([4, 0, 2])
    hosts = {}
    for mode in ("kernel", "direct"):
        pool = _pool(dtype, mode)
        host = HostKVPool(num_pages=5, page_bytes=pool.page_bytes, num_layers=3, layout=layout, prefault=False)
        pool.to_host(pages, host, host_pages)
        hosts[mode] = host.data.copy()
        original = pool.buffer.clone()
        pool._page_view()[:, :, torch.as_tensor(pages)] = 0  # the pages leave the device ...
        pool.from_host(host, host_pages[::-1].copy(), pages[::-1].copy())  # ... and come back, in another order
        assert torch.equal(pool.buffer.view(torch.uint8), original.view(torch.uint8)), mode
    assert np.array_equal(hosts["kernel"], hosts["direct"])
    written = hosts["kernel"][:, [4, 0, 2]] if layout == "layer_first" else hosts["kernel"][[4, 0, 2]]
    untouched = hosts["kernel"][:, [1, 3]] if layout == "layer_first" else hosts["kernel"][[1, 3]]
    assert written.any() and not untouched.any()  # exactly the host pages asked for


def test_unknown_io_backend_is_refused():
    with pytest.raises(ValueError, match="kernel or direct"):
        _pool(torch.float32, "kernel_ascend")


@pytest.mark.parametrize("mode", ["kernel", "direct"])
def test_l2_hit_through_either_io_backend_gives_the_cold_output(tiny_llama, store, mode):
    from engine_harness import greedy, run
    from model_factory import reference_greedy
    from test_hicache import doc, hicache_engine, push_out_of_device

    engine = hicache_engine("torch", tiny_llama, storage=False, dtype="float32", hicache_io_backend=mode)
    try:
        prompt = doc(3) + [9, 9]
        cold, = run(engine, [prompt], greedy(6))
        push_out_of_device(engine)
        hot, = run(engine, [prompt], greedy(6))
        assert hot.last.cached.host > 0 and hot.token_ids == cold.token_ids == reference_greedy(tiny_llama, prompt, 6)
    finally:
        engine.shutdown()


def test_page_runs_split_where_either_list_stops_stepping_by_one():
    from tierlm.backends.torch.host_copies import page_runs

    assert page_runs(np.array([4, 5, 6, 9, 2, 3]), np.array([0, 1, 2, 3, 7, 8])) == [(4, 0, 3), (9, 3, 1), (2, 7, 2)]
    assert page_runs(np.array([1, 2]), np.array([5, 9])) == [(1, 5, 1), (2, 9, 1)]
    assert page_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_cpu_copies_move_runs_and_single_pages_in_one_pass(layout):
    """On CPU the kernel mode copies between the two pools' bytes run by run: pages in consecutive runs and lone
    pages land exactly where asked, byte for byte, and nothing else is written."""
    pool = TorchKVPool(3, 10, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
    pages, host_pages = np.array([0, 1, 2, 7, 5, 6]), np.array([3, 4, 5, 0, 8, 9])
    host = HostKVPool(num_pages=10, page_bytes=pool.page_bytes, num_layers=3, layout=layout, prefault=False)
    pool.to_host(pages, host, host_pages)
    for p, hp in zip(pages, host_pages):  # each host page holds its device page, layer by layer, K then V
        want = pool._page_view()[:, :, p].contiguous().view(torch.uint8).numpy().reshape(3, -1)
        got = host.data[:, hp] if layout == "layer_first" else host.data[hp].reshape(3, -1)
        assert np.array_equal(got.reshape(3, -1), want)
    assert not (host.data[:, [1, 2, 6, 7]] if layout == "layer_first" else host.data[[1, 2, 6, 7]]).any()
    original = pool.buffer.clone()
    pool.buffer.zero_()
    pool.from_host(host, host_pages, pages)
    moved = torch.as_tensor(pages)
    assert torch.equal(pool._page_view()[:, :, moved].view(torch.uint8),
                       original.view(pool._page_view().shape)[:, :, moved].view(torch.uint8))
    others = torch.as_tensor([3, 4, 8, 9])
    assert not pool._page_view()[:, :, others].view(torch.uint8).any()
