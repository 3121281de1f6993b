"""The blocked prefill attention's blocks in one C pass (backends/torch/cpu/blocked_one_pass.py): in an AVX512-BF16
library the kernel writes the GEMM path's attention (but for rare one-ulp roundings where the GEMM sums in another
order), which stays transformers' bf16 eager attention; split between torch's threads by the library's C++ op it
writes one thread's bits; it runs only where it can use the threads torch has; the CPU plan
(``prefill_attention=one_pass``) sends blocks to it, and its switch (``blocked``) keeps them on the GEMMs; K's and
V's pair layouts. Where the library has no kernel, the GEMM path serves (test_cpu_blocked_attention.py) and the
kernel's tests skip."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import torch_threads as threads
from test_cpu_blocked_attention import _step, assert_bf16_equal, eager_reference, prefill_kernels
from test_cpu_paged_decode import kernels_for, lib

from tierlm.backends.torch.cpu import blocked_attention as cba
from tierlm.backends.torch.cpu import blocked_one_pass as one_pass
from tierlm.backends.torch.cpu import native_ops
from tierlm.backends.torch.cpu import plan as cpu_plan
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.platforms.cpu_features import this_cpu
from tierlm.platforms.cpu_plan import PLAN_ENV

needs_kernel = pytest.mark.skipif(
    lib is None or not lib.has("blocked_attention"),
    reason=f"the kernel library here ({lib.level if lib is not None else 'none'}) has no AVX512-BF16 block kernel: "
           "the GEMM path serves")


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
    real = one_pass.attend
    monkeypatch.setattr(one_pass, "attend", lambda *a: ran.append(1) or real(*a))
    with threads(1):
        fused = cba.blocked_attention(lib, q, k, v, limits, D ** -0.5, True)
        assert ran, "the blocked path did not take the one-pass kernel"
        ran.clear()
        gemm = cba.blocked_attention(lib, q, k, v, limits, D ** -0.5, False)  # prefill_attention=blocked
        assert not ran
    assert_bf16_equal(fused, gemm)
    assert_bf16_equal(fused, eager_reference(q, k, v, limits, D ** -0.5))


@needs_kernel
def test_split_between_torchs_threads_it_writes_one_threads_bits(monkeypatch):
    if native_ops.registered(lib) is not lib:
        pytest.skip("another library's tierlm_native ops are registered in this process: the split does not run")
    q, k, v, limits = inputs(2, 8, 4, 150, 260, 64, seed=5)
    with threads(1):
        one = cba.blocked_attention(lib, q, k, v, limits, 0.125, True)
    calls = []
    op = torch.ops.tierlm_native.blocked_attention
    monkeypatch.setattr(torch.ops.tierlm_native, "blocked_attention", lambda *a: calls.append(a[-1]) or op(*a))
    monkeypatch.setattr(one_pass, "MIN_SCORES_PER_THREAD", 1)  # every block split, the smallest too
    with threads(3):
        split = cba.blocked_attention(lib, q, k, v, limits, 0.125, True)
    assert calls and all(grain == 1 for grain in calls)
    assert torch.equal(one, split)


def test_the_kernel_runs_only_where_it_can_use_torchs_threads(monkeypatch):
    with_kernel = KernelLibrary("avx512_bf16", Path("/nonexistent"), "test", frozenset({"blocked_attention"}), None)
    without = KernelLibrary("avx512", Path("/nonexistent"), "test", frozenset({"paged_decode"}), None)
    registered = []  # the library whose C++ ops the process registered (none: the op cannot split a block)
    monkeypatch.setattr(native_ops, "registered", lambda lib=None: registered[0] if registered else None)
    with threads(1):
        assert one_pass.runs(with_kernel)
        assert not one_pass.runs(without)  # a library without the kernel
    with threads(2):
        assert not one_pass.runs(with_kernel)  # Python threads lose their cores to OpenMP's spinning workers
        registered.append(without)
        assert not one_pass.runs(with_kernel)  # the ops of another library would run another library's kernels
        registered[0] = with_kernel
        assert one_pass.runs(with_kernel)
        assert not one_pass.runs(without)


@needs_kernel
def test_the_plan_sends_blocks_to_it_and_its_switch_keeps_them_on_the_gemms(monkeypatch):
    """prefill_attention=one_pass (the default of AVX512-BF16 CPUs without AMX) runs each block in the kernel;
    prefill_attention=blocked, and TIERLM_CPU_BLOCKED_SCORES=0 it replaces, the GEMMs: within bf16 rounding."""
    default = kernels_for(torch.bfloat16).plan.prefill_attention.value
    assert default == ("sdpa" if this_cpu().has("amx_bf16", "amx_tile") else "one_pass")  # AMX: torch's SDPA
    for env in ({PLAN_ENV: "prefill_attention=blocked"}, {"TIERLM_CPU_BLOCKED_SCORES": "0"}):
        switched = cpu_plan.for_model(torch.bfloat16, None, 8, 4, 64, env=env)
        assert switched.plan.prefill_attention.value == "blocked" and switched.blocked is lib
    outs = {}
    for prefill in ("one_pass", "blocked"):
        ran = []
        real = one_pass.attend
        monkeypatch.setattr(one_pass, "attend", lambda *a: ran.append(1) or real(*a))
        with threads(1):
            outs[prefill] = _step([150], [0], prefill_kernels(prefill), monkeypatch)[0]  # a fresh prefill
        assert bool(ran) == (prefill == "one_pass")
    assert_bf16_equal(outs["one_pass"], outs["blocked"])


def test_keys_and_values_are_laid_out_in_bf16_pairs_padded_with_zeros():
    k, v = torch.randn(2, 70, 8).bfloat16(), torch.randn(2, 70, 8).bfloat16()
    kp, vp = one_pass.key_pairs(k), one_pass.value_pairs(v)
    assert kp.shape == (2, 4, 128) and kp.dtype == torch.int32  # [B, D/2, Lp]: dims d, d+1 of a key
    assert torch.equal(kp[:, :, :70].transpose(1, 2).contiguous().view(torch.bfloat16), k)
    assert not kp[:, :, 70:].any()
    assert vp.shape == (2, 64, 8) and vp.dtype == torch.int32  # [B, Lp/2, D]: keys t, t+1 of a dim
    halves = vp.view(torch.bfloat16).view(2, 64, 8, 2)
    assert torch.equal(halves[:, :35, :, 0], v[:, 0::2]) and torch.equal(halves[:, :35, :, 1], v[:, 1::2])
    assert not halves[:, 35:].any()


@needs_kernel
def test_a_head_size_not_a_multiple_of_16_takes_the_gemm_path(monkeypatch):
    """The plan keeps such a model on the GEMMs, and blocked_attention does so itself when asked for one pass."""
    assert kernels_for(torch.bfloat16, heads=(4, 2), D=40).plan.prefill_attention.value in ("blocked", "sdpa")
    q, k, v, limits = inputs(1, 4, 2, 50, 50, 40)
    ran = []
    real = one_pass.attend
    monkeypatch.setattr(one_pass, "attend", lambda *a: ran.append(1) or real(*a))
    with threads(1):
        out = cba.blocked_attention(lib, q, k, v, limits, 40 ** -0.5, True)
    assert not ran
    assert_bf16_equal(out, eager_reference(q, k, v, limits, 40 ** -0.5))
