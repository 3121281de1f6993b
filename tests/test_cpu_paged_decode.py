"""The CPU decode kernel (backends/torch/cpu/paged_decode.py) against torch's attention over gathered pages (eager
bf16, SDPA float32), through the same paged_attention entry point with the model's CPU plan
(backends/torch/cpu/plan.py); each x86 level's library (backends/torch/cpu/library.py) running it; a capped CPU
loading its cap's library; and torch's path where no library loads or the plan switches the kernel off."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.cpu import decode_step, library, paged_decode
from tierlm.backends.torch.cpu import plan as cpu_plan
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.kv_pool import TorchKVPool
from tierlm.platforms import cpu_features
from tierlm.platforms.cpu_features import CpuFeatures, apply_cap, this_cpu
from tierlm.platforms.cpu_plan import KERNELS_ENV, PLAN_ENV

lib = library.load()
needs_kernel = pytest.mark.skipif(lib is None, reason=f"no CPU kernel library loaded here ({library.status()['why']}):"
                                                      " torch's paths serve")


def skip_unless_this_cpu_runs(level: str) -> CpuFeatures:
    """This CPU, or a skip when it cannot execute code built for the x86 ``level``."""
    cpu = this_cpu()
    levels = cpu_features.level_names(cpu.arch)
    if cpu.arch != "x86_64" or levels.index(cpu.level) < levels.index(level):
        pytest.skip(f"this CPU ({cpu.arch}, level {cpu.level}) cannot run code built for {level}")
    return cpu


def library_at(level: str) -> KernelLibrary:
    """The kernel library of the x86 ``level`` (the install's, ``library.load_level``), or a skip where this CPU
    cannot run its code."""
    skip_unless_this_cpu_runs(level)
    built = library.load_level(level)
    assert built.level == level
    return built


def kernels_for(dtype: torch.dtype, kv_dtype: torch.dtype | None = None, heads=(8, 4), D: int = 64, lib=True,
                plan: str = "") -> cpu_plan.CpuKernels:
    """A model's CPU plan and library as the backend builds them (``heads``: query and KV heads of ``D`` dims;
    ``lib``: True for the process's library, None for none, or another library), with ``plan`` as its
    TIERLM_CPU_PLAN overrides (the process's own environment is not read: the tests choose)."""
    return cpu_plan.for_model(dtype, kv_dtype, heads[0], heads[1], D, env={PLAN_ENV: plan} if plan else {}, lib=lib)


class _Layer:
    layer_idx = 1


def run_step(meta, pool, q, k, v, scale: float, monkeypatch, kernels: cpu_plan.CpuKernels | None = None
             ) -> torch.Tensor:
    """paged_attention of layer 1 over one step's metadata and pool with ``kernels`` (None: torch's paths, no C
    kernel); the test's monkeypatches end with it, and paged_attention.CURRENT is put back."""
    saved = pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels
    pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels = meta, pool, kernels
    try:
        out, _ = pa.paged_attention(_Layer, q, k, v, None, scaling=scale)
    finally:
        pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels = saved
        monkeypatch.undo()
    return out


def decode_inputs(heads, D, page_size, cached, dtype, seed=0, layers=2, q_transposed=True, k_transposed=False):
    """One decode step of requests with ``cached`` tokens before their new one, over scattered pages of a random
    pool: (pool, StepMeta, q [1, H, R, D], k, v [1, Hkv, R, D]); q and k optionally the projections' transposed
    views of [1, R, heads, D]."""
    H, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    kv_lens = np.asarray(cached) + 1
    R, P = len(cached), -(-int(kv_lens.max()) // page_size)
    num_pages = R * P + 3
    table = np.random.default_rng(seed).permutation(num_pages)[: R * P].reshape(R, P).astype(np.int32)
    pool = TorchKVPool(layers, num_pages, page_size, Hkv, D, dtype, torch.device("cpu"))
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(dtype))
    q = torch.randn(1, R, H, D, generator=g).to(dtype).transpose(1, 2) if q_transposed else \
        torch.randn(1, H, R, D, generator=g).to(dtype)
    k = torch.randn(1, R, Hkv, D, generator=g).to(dtype).transpose(1, 2) if k_transposed else \
        torch.randn(1, Hkv, R, D, generator=g).to(dtype)
    v = torch.randn(1, Hkv, R, D, generator=g).to(dtype)
    meta = pa.StepMeta(np.ones(R, np.int64), kv_lens, np.asarray(cached, np.int64), table, page_size,
                       torch.device("cpu"))
    return pool, meta, q, k, v


def _decode(heads, D, page_size, cached, kernels, monkeypatch, seed=0, dtype=torch.bfloat16):
    """paged_attention over one decode step of requests with ``cached`` tokens before their new one, with
    ``kernels``: the C kernel serves it exactly where the plan has it (``kernels.decode``), from that library."""
    pool, meta, q, k, v = decode_inputs(heads, D, page_size, cached, dtype, seed)
    calls = []
    # the general path's kernel call (tests/test_cpu_decode_step.py compares the one-call step with it)
    monkeypatch.setattr(decode_step, "ENABLED", False)
    real = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a: calls.append(a[0]) or real(*a))
    out = run_step(meta, pool, q, k, v, D ** -0.5, monkeypatch, kernels)
    want = [] if kernels is None or kernels.decode is None else [kernels.decode]
    assert len(calls) == len(want) and all(a is b for a, b in zip(calls, want))  # one call, from the plan's library
    return out[0].float()


def _torch_path(dtype, heads, D):
    """The plan with the decode kernel switched off: torch over gathered pages (the reference)."""
    kernels = kernels_for(dtype, heads=heads, D=D, plan="decode_attention=torch")
    assert kernels.decode is None
    return kernels


@needs_kernel
@pytest.mark.parametrize("heads,D,page_size,cached", [
    ((8, 4), 64, 16, [3, 200, 17]),   # llama-small's shape, 2 query heads per KV head
    ((4, 4), 24, 1, [0, 9, 30]),      # MHA, odd head dim, one token per page
    ((8, 2), 128, 4, [50]),           # 4 query heads per KV head
    ((14, 2), 64, 16, [1000, 5]),     # Qwen2.5-0.5B's 7:1 grouping, a long context
])
def test_kernel_equals_torch_eager_bf16_attention(heads, D, page_size, cached, monkeypatch):
    ref = _decode(heads, D, page_size, cached, _torch_path(torch.bfloat16, heads, D), monkeypatch)
    kernels = kernels_for(torch.bfloat16, heads=heads, D=D)
    assert kernels.decode is lib  # the plan's default: the kernel over the pages in place
    got = _decode(heads, D, page_size, cached, kernels, monkeypatch)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    # the same bf16 roundings in the same places; only the float32 summation order differs
    assert (got - ref).abs().max().item() <= 0.02 * max(1.0, ref.abs().max().item())
    assert (got == ref).float().mean().item() > 0.9


@needs_kernel
@pytest.mark.parametrize("level", ["x86-64", "avx2", "avx512", "avx512_bf16", "amx"])
def test_each_x86_build_of_the_bf16_kernel_equals_torch_eager_attention(level, monkeypatch):
    """The AVX-512 decode (16 tokens' float32 dot products reduced together), the AVX512-BF16 one (vdpbf16ps: K
    transposed in registers, P.V on token pairs; head sizes not a multiple of 32 keep the float32 one; the AMX
    level's library has it too) and the plain loop the other levels run (x86-64, AVX2), each level's library the
    plan's decode kernel."""
    built = library_at(level)
    for heads, D, page_size, cached in [((8, 4), 64, 16, [3, 200, 17]), ((14, 2), 64, 16, [1000, 5, 31]),
                                        ((8, 2), 128, 4, [50]), ((6, 2), 48, 8, [16, 0]),
                                        ((16, 1), 96, 16, [40, 0, 7])]:  # 16 heads a KV head, 3 pair chunks
        ref = _decode(heads, D, page_size, cached, _torch_path(torch.bfloat16, heads, D), monkeypatch)
        kernels = kernels_for(torch.bfloat16, heads=heads, D=D, lib=built)
        assert kernels.decode is built
        got = _decode(heads, D, page_size, cached, kernels, monkeypatch)
        assert got.shape == ref.shape and torch.isfinite(got).all()
        assert (got - ref).abs().max().item() <= 0.02 * max(1.0, ref.abs().max().item()), (heads, D, level)
        assert (got == ref).float().mean().item() > 0.9


@needs_kernel
@pytest.mark.parametrize("heads,D,page_size,cached", [
    ((8, 4), 64, 16, [3, 200, 17]),
    ((4, 4), 24, 1, [0, 9, 30]),
    ((14, 2), 64, 16, [1000, 5]),
])
def test_kernel_equals_torch_float32_sdpa(heads, D, page_size, cached, monkeypatch):
    ref = _decode(heads, D, page_size, cached, _torch_path(torch.float32, heads, D), monkeypatch,
                  dtype=torch.float32)
    kernels = kernels_for(torch.float32, heads=heads, D=D)
    assert kernels.decode is lib
    got = _decode(heads, D, page_size, cached, kernels, monkeypatch, dtype=torch.float32)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # no roundings: summation order only


@needs_kernel
def test_each_level_has_its_own_library_and_a_capped_cpu_loads_its_caps():
    cpu = this_cpu()
    levels = cpu_features.level_names(cpu.arch)
    if cpu.arch not in cpu_features.LEVELS or levels.index(cpu.level) < 1:
        pytest.skip(f"this CPU ({cpu.arch}, level {cpu.level}) has no lower level to cap at")
    lower = apply_cap(cpu, levels[levels.index(cpu.level) - 1])
    mine, capped = library.load_level(cpu.level), library.load_level(lower.level)
    assert (mine.level, capped.level) == (cpu.level, lower.level) and mine.path != capped.path
    assert mine.kernels >= capped.kernels  # a higher level's build has every kernel of the one below
    library.reset_for_tests()
    try:
        assert library.load(lower) is capped  # TIERLM_CPU_ISA=<lower>: the process runs the cap's library
        assert library.status()["level"] == lower.level
    finally:
        library.reset_for_tests()  # the next load decides for this CPU again
    assert library.load() is lib


def test_without_a_library_or_switched_off_the_torch_path_serves(monkeypatch):
    """TIERLM_CPU_KERNELS=0 (as where no library can load) leaves the plan without the kernel; with the library
    loaded, the plan's switch (and the old TIERLM_CPU_PAGED_DECODE=0 it replaces) turns it off: torch's path serves
    the step either way, with the same output."""
    monkeypatch.setenv(KERNELS_ENV, "0")
    library.reset_for_tests()
    try:
        assert library.load() is None and library.status()["why"] == f"{KERNELS_ENV}=0"
        kernels = cpu_plan.for_model(torch.bfloat16, None, 8, 4, 64, env={})
        assert kernels.lib is None and kernels.decode is None and kernels.plan.decode_attention.value == "torch"
    finally:
        monkeypatch.delenv(KERNELS_ENV)
        library.reset_for_tests()
    assert library.load() is lib
    none = _decode((8, 4), 64, 16, [3, 200, 17], kernels_for(torch.bfloat16, lib=None), monkeypatch)
    if lib is None:
        return
    for env in ({PLAN_ENV: "decode_attention=torch"}, {"TIERLM_CPU_PAGED_DECODE": "0"}):
        kernels = cpu_plan.for_model(torch.bfloat16, None, 8, 4, 64, env=env)
        assert kernels.lib is lib and kernels.decode is None and kernels.plan.decode_attention.value == "torch"
        assert torch.equal(_decode((8, 4), 64, 16, [3, 200, 17], kernels, monkeypatch), none)


def test_shapes_outside_the_kernel_take_the_torch_path():
    assert paged_decode.supported(torch.bfloat16, torch.bfloat16, 8, 4, 64)
    assert paged_decode.supported(torch.float32, torch.float32, 8, 4, 64)
    assert not paged_decode.supported(torch.float32, torch.bfloat16, 8, 4, 64)  # mixed: torch gathers
    assert not paged_decode.supported(torch.bfloat16, torch.uint8, 8, 4, 64)  # fp8 pages
    assert not paged_decode.supported(torch.bfloat16, torch.bfloat16, 6, 4, 64)  # heads not grouped evenly


@needs_kernel
def test_loading_the_kernel_leaves_denormals_alone():
    """Built with -ffast-math but linked without it: loading a level's library must not turn on flush-to-zero for
    the process (gcc < 13 links crtfastmath.o into -ffast-math shared libraries), which would change torch's
    float32. Every level this CPU runs, loaded."""
    cpu = this_cpu()
    levels = cpu_features.level_names(cpu.arch)
    for level in levels[: levels.index(cpu.level) + 1]:
        assert library.load_level(level).level == level
        tiny = torch.tensor([1e-40], dtype=torch.float32)
        assert (tiny * 1.5).item() != 0.0 and np.float32(1e-40) * np.float32(1.5) != 0, level
