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
