"""The blocked prefill attention's scores and softmax in one C pass (backends/torch/cpu_blocked_scores.py): on an
AVX512-BF16 build the kernel writes the GEMM path's probabilities (but for rare one-ulp roundings where the GEMM
sums in another order) and the attention stays transformers' bf16 eager attention; split between torch's threads by
the C++ op it writes one thread's bits; it runs only where it can use the threads torch has; K's pair layout. Where
the build has no kernel, the GEMM path serves (test_cpu_blocked_attention.py) and the kernel's tests skip."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from test_cpu_blocked_attention import assert_bf16_equal, eager_reference

from tierlm.backends.torch import cpu_blocked_attention as cba
from tierlm.backends.torch import cpu_blocked_scores as cbs
from tierlm.backends.torch import cpu_paged_decode
from tierlm.platforms.cpu_features import PREFILL_ATTENTION_ENV

lib = cpu_paged_decode.load()
needs_kernel = pytest.mark.skipif(
    not cbs.available(lib), reason=f"the C library here ({cpu_paged_decode.describe()['level']} build, or none) has "
                                   "no AVX512-BF16 scores kernel: the GEMM path serves")


@pytest.fixture(autouse=True)
def _blocked_path(monkeypatch):
    """The blocked path whatever the CPU (AMX CPUs choose torch's SDPA by default)."""
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "blocked")
    cba.choice.cache_clear()
    yield
    cba.choice.cache_clear()


@contextlib.contextmanager
def threads(n: int):
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def inputs(G, H, Hkv, Q, L, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(G, h, n, D, generator=g).bfloat16() for h, n in ((H, Q), (Hkv, L), (Hkv, L)))
    limits = np.stack([np.clip(np.arange(Q) + (L - Q) + 1 - 7 * r, 1, L) for r in range(G)]).astype(np.int32)
    return q, k, v, limits


@needs_kernel
@pytest.mark.parametrize("G,H,Hkv,Q,L,D", [
    (1, 8, 4, 200, 200, 64),   # a fresh causal prefill: 3 full blocks and a partial one, GQA 2:1
    (3, 14, 2, 37, 300, 64),   # three extends over cached prefixes, GQA 7:1, keys not a multiple of 64
    (2, 4, 4, 130, 181, 32),   # MHA, D = 32, an odd key count (the last pair of keys half zero)
    (1, 16, 8, 70, 70, 128),   # D = 128 (scale not a power of two)
])
def test_the_kernel_writes_the_gemm_paths_attention(G, H, Hkv, Q, L, D, monkeypatch):
    q, k, v, limits = inputs(G, H, Hkv, Q, L, D, seed=Q)
    ran = []
    real = cbs.attend
    monkeypatch.setattr(cbs, "attend", lambda *a: ran.append(1) or real(*a))
    with threads(1):
        fused = cba.blocked_attention(lib, q, k, v, limits, D ** -0.5)
        assert ran, "the blocked path did not take the scores kernel"
        ran.clear()
        monkeypatch.setenv(cbs.SWITCH_ENV, "0")
        gemm = cba.blocked_attention(lib, q, k, v, limits, D ** -0.5)
        assert not ran
    assert_bf16_equal(fused, gemm)
    assert_bf16_equal(fused, eager_reference(q, k, v, limits, D ** -0.5))


@needs_kernel
def test_split_between_torchs_threads_it_writes_one_threads_bits(monkeypatch):
    from tierlm.backends.torch import cpu_product_op

    if cpu_product_op._op() is None:
        pytest.skip(f"the C++ op library is not built here: {cpu_product_op._op.build.why}")
    cpu_product_op._hand_block_kernel()
    q, k, v, limits = inputs(2, 8, 4, 150, 260, 64, seed=5)
    with threads(1):
        one = cba.blocked_attention(lib, q, k, v, limits, 0.125)
    calls = []
    op = cbs._in_torch_threads
    monkeypatch.setattr(cbs, "_in_torch_threads", lambda *a: calls.append(a[-1]) or op(*a))
    monkeypatch.setattr(cbs, "MIN_SCORES_PER_THREAD", 1)  # every block split, the smallest too
    with threads(3):
        split = cba.blocked_attention(lib, q, k, v, limits, 0.125)
    assert calls and all(grain == 1 for grain in calls)
    assert torch.equal(one, split)


def test_the_kernel_runs_only_where_it_can_use_torchs_threads(monkeypatch):
    class Lib:  # a library whose build has the kernel
        blocked_attention_rows_bf16 = None

    monkeypatch.setattr(cbs, "_in_torch_threads", None)
    with threads(1):
        assert cbs.runs(Lib())
        assert not cbs.runs(None) and not cbs.runs(object())  # no library; a build without the kernel
        monkeypatch.setenv(cbs.SWITCH_ENV, "0")
        assert not cbs.runs(Lib())
        monkeypatch.delenv(cbs.SWITCH_ENV)
    with threads(2):
        assert not cbs.runs(Lib())  # Python threads lose their cores to OpenMP's spinning workers: the GEMM path
        monkeypatch.setattr(cbs, "_in_torch_threads", lambda *a: None)
        assert cbs.runs(Lib())


def test_keys_and_values_are_laid_out_in_bf16_pairs_padded_with_zeros():
    k, v = torch.randn(2, 70, 8).bfloat16(), torch.randn(2, 70, 8).bfloat16()
    kp, vp = cbs.key_pairs(k), cbs.value_pairs(v)
    assert kp.shape == (2, 4, 128) and kp.dtype == torch.int32  # [B, D/2, Lp]: dims d, d+1 of a key
    assert torch.equal(kp[:, :, :70].transpose(1, 2).contiguous().view(torch.bfloat16), k)
    assert not kp[:, :, 70:].any()
    assert vp.shape == (2, 64, 8) and vp.dtype == torch.int32  # [B, Lp/2, D]: keys t, t+1 of a dim
    halves = vp.view(torch.bfloat16).view(2, 64, 8, 2)
    assert torch.equal(halves[:, :35, :, 0], v[:, 0::2]) and torch.equal(halves[:, :35, :, 1], v[:, 1::2])
    assert not halves[:, 35:].any()


@needs_kernel
def test_a_head_size_not_a_multiple_of_16_takes_the_gemm_path(monkeypatch):
    q, k, v, limits = inputs(1, 4, 2, 50, 50, 40)
    ran = []
    real = cbs.attend
    monkeypatch.setattr(cbs, "attend", lambda *a: ran.append(1) or real(*a))
    with threads(1):
        out = cba.blocked_attention(lib, q, k, v, limits, 40 ** -0.5)
    assert not ran
    assert_bf16_equal(out, eager_reference(q, k, v, limits, 40 ** -0.5))
