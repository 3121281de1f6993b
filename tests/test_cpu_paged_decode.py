"""The CPU bf16 decode kernel (backends/torch/cpu_paged_decode.py) against torch's eager bf16 attention over
gathered pages, through the same paged_attention entry point; and its fallback when it cannot be built."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tierlm.backends.torch import cpu_paged_decode
from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.kv_pool import TorchKVPool

lib = cpu_paged_decode.load()
needs_kernel = pytest.mark.skipif(lib is None, reason="no C compiler here: the kernel is not built (torch path)")


class _Layer:
    layer_idx = 1


def _decode(heads, D, page_size, cached, use_kernel, monkeypatch, seed=0):
    """paged_attention over one decode step of requests with ``cached`` tokens before their new one."""
    H, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    kv_lens = np.asarray(cached) + 1
    R, P = len(cached), -(-int(kv_lens.max()) // page_size)
    num_pages = R * P + 3
    table = np.random.default_rng(seed).permutation(num_pages)[: R * P].reshape(R, P).astype(np.int32)
    pool = TorchKVPool(2, num_pages, page_size, Hkv, D, torch.bfloat16, torch.device("cpu"))
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(torch.bfloat16))
    q = torch.randn(1, R, H, D, generator=g).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, Hkv, R, D, generator=g).to(torch.bfloat16)
    v = torch.randn(1, Hkv, R, D, generator=g).to(torch.bfloat16)
    calls = []
    if not use_kernel:
        monkeypatch.setattr(cpu_paged_decode, "load", lambda: None)
    else:
        real = cpu_paged_decode.paged_decode
        monkeypatch.setattr(cpu_paged_decode, "paged_decode", lambda *a: calls.append(1) or real(*a))
    pa.CURRENT.meta = pa.StepMeta(np.ones(R, np.int64), kv_lens, np.asarray(cached, np.int64), table, page_size,
                                  torch.device("cpu"))
    pa.CURRENT.pool = pool
    try:
        out, _ = pa.paged_attention(_Layer, q, k, v, None, scaling=D ** -0.5)
    finally:
        pa.CURRENT.meta = None
        monkeypatch.undo()
    assert len(calls) == (1 if use_kernel else 0)  # the kernel served the step exactly when asked to
    return out[0].float()


@needs_kernel
@pytest.mark.parametrize("heads,D,page_size,cached", [
    ((8, 4), 64, 16, [3, 200, 17]),   # llama-small's shape, 2 query heads per KV head
    ((4, 4), 24, 1, [0, 9, 30]),      # MHA, odd head dim, one token per page
    ((8, 2), 128, 4, [50]),           # 4 query heads per KV head
    ((14, 2), 64, 16, [1000, 5]),     # Qwen2.5-0.5B's 7:1 grouping, a long context
])
def test_kernel_equals_torch_eager_bf16_attention(heads, D, page_size, cached, monkeypatch):
    ref = _decode(heads, D, page_size, cached, False, monkeypatch)
    got = _decode(heads, D, page_size, cached, True, monkeypatch)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    # the same bf16 roundings in the same places; only the float32 summation order differs
    assert (got - ref).abs().max().item() <= 0.02 * max(1.0, ref.abs().max().item())
    assert (got == ref).float().mean().item() > 0.9


def test_without_a_compiler_the_torch_path_serves(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_paged_decode, "_tried", False)
    monkeypatch.setattr(cpu_paged_decode, "_lib", None)
    monkeypatch.setattr(cpu_paged_decode, "_compiler", lambda: None)
    assert cpu_paged_decode.load() is None
    monkeypatch.setattr(cpu_paged_decode, "_tried", False)
    monkeypatch.setenv("TIERLM_CPU_PAGED_DECODE", "0")
    monkeypatch.setattr(cpu_paged_decode, "_compiler", lambda: "cc")
    assert cpu_paged_decode.load() is None  # switched off


def test_shapes_outside_the_kernel_take_the_torch_path():
    assert cpu_paged_decode.supported(torch.bfloat16, torch.bfloat16, 8, 4, 64)
    assert not cpu_paged_decode.supported(torch.float32, torch.float32, 8, 4, 64)  # float32: the fused SDPA
    assert not cpu_paged_decode.supported(torch.bfloat16, torch.uint8, 8, 4, 64)  # fp8 pages
    assert not cpu_paged_decode.supported(torch.bfloat16, torch.bfloat16, 6, 4, 64)  # heads not grouped evenly
