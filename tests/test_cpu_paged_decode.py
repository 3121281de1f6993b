"""The CPU decode kernel (backends/torch/cpu_paged_decode.py) against torch's attention over gathered pages
(eager bf16, SDPA float32), through the same paged_attention entry point; its builds per CPU level (cached under a
name no other CPU or compiler shares); and its fallbacks when it cannot be built."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tierlm.backends.torch import cpu_decode_step, cpu_paged_decode
from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.kv_pool import TorchKVPool
from tierlm.platforms import cpu_features
from tierlm.platforms.cpu_features import CpuFeatures, apply_cap, this_cpu

lib = cpu_paged_decode.load()
needs_kernel = pytest.mark.skipif(lib is None, reason="no C compiler here: the kernel is not built (torch path)")


def skip_unless_this_cpu_runs(level: str) -> CpuFeatures:
    """This CPU, or a skip when it cannot execute code built for the x86 ``level``."""
    cpu = this_cpu()
    levels = cpu_features.level_names(cpu.arch)
    if cpu.arch != "x86_64" or levels.index(cpu.level) < levels.index(level):
        pytest.skip(f"this CPU ({cpu.arch}, level {cpu.level}) cannot run code built for {level}")
    return cpu


class _Layer:
    layer_idx = 1


def run_step(meta, pool, q, k, v, scale: float, monkeypatch) -> torch.Tensor:
    """paged_attention of layer 1 over one step's metadata and pool; the test's monkeypatches end with it."""
    pa.CURRENT.meta, pa.CURRENT.pool = meta, pool
    try:
        out, _ = pa.paged_attention(_Layer, q, k, v, None, scaling=scale)
    finally:
        pa.CURRENT.meta = None
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


def _decode(heads, D, page_size, cached, use_kernel, monkeypatch, seed=0, dtype=torch.bfloat16):
    """paged_attention over one decode step of requests with ``cached`` tokens before their new one."""
    pool, meta, q, k, v = decode_inputs(heads, D, page_size, cached, dtype, seed)
    calls = []
    # the general path's kernel call (tests/test_cpu_decode_step.py compares the one-call step with it)
    monkeypatch.setattr(cpu_decode_step, "ENABLED", False)
    if not use_kernel:
        monkeypatch.setattr(cpu_paged_decode, "load", lambda: None)
    else:
        real = cpu_paged_decode.paged_decode
        monkeypatch.setattr(cpu_paged_decode, "paged_decode", lambda *a: calls.append(1) or real(*a))
    out = run_step(meta, pool, q, k, v, D ** -0.5, monkeypatch)
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


@needs_kernel
@pytest.mark.parametrize("level", ["avx2", "avx512", "avx512_bf16"])
def test_each_x86_build_of_the_bf16_kernel_equals_torch_eager_attention(level, monkeypatch, tmp_path):
    """The AVX-512 decode (16 tokens' float32 dot products reduced together), the AVX512-BF16 one (vdpbf16ps: K
    transposed in registers, P.V on token pairs; head sizes not a multiple of 32 keep the float32 one) and the plain
    loop every other build runs (the AVX2 one here), each loaded as the kernel."""
    cpu = skip_unless_this_cpu_runs(level)
    for heads, D, page_size, cached in [((8, 4), 64, 16, [3, 200, 17]), ((14, 2), 64, 16, [1000, 5, 31]),
                                        ((8, 2), 128, 4, [50]), ((6, 2), 48, 8, [16, 0]),
                                        ((16, 1), 96, 16, [40, 0, 7])]:  # 16 heads a KV head, 3 pair chunks
        ref = _decode(heads, D, page_size, cached, False, monkeypatch)
        assert _fresh_load(monkeypatch, tmp_path, apply_cap(cpu, level)) is not None
        assert cpu_paged_decode.describe()["level"] == level
        got = _decode(heads, D, page_size, cached, True, monkeypatch)  # its last step undoes the load above
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
    ref = _decode(heads, D, page_size, cached, False, monkeypatch, dtype=torch.float32)
    got = _decode(heads, D, page_size, cached, True, monkeypatch, dtype=torch.float32)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # no roundings: summation order only


def _fresh_load(monkeypatch, tmp_path, cpu):
    monkeypatch.setattr(cpu_paged_decode, "_tried", False)
    monkeypatch.setattr(cpu_paged_decode, "_lib", None)
    monkeypatch.setattr(cpu_paged_decode, "_build", cpu_paged_decode._build)  # restored after the test
    monkeypatch.setattr(cpu_paged_decode, "_cache_dir", lambda: tmp_path)
    return cpu_paged_decode.load(cpu)


@needs_kernel
def test_each_cpu_level_gets_its_own_build_and_a_capped_level_builds_for_the_cap(monkeypatch, tmp_path):
    cpu = this_cpu()
    levels = cpu_features.level_names(cpu.arch)
    if cpu.arch not in cpu_features.LEVELS or levels.index(cpu.level) < 1:
        pytest.skip(f"this CPU ({cpu.arch}, level {cpu.level}) has no lower level to cap at")
    lower = apply_cap(cpu, levels[levels.index(cpu.level) - 1])
    assert _fresh_load(monkeypatch, tmp_path, lower) is not None
    assert cpu_paged_decode.describe()["level"] == lower.level
    assert _fresh_load(monkeypatch, tmp_path, cpu) is not None
    names = sorted(p.name for p in tmp_path.glob("*.so"))
    assert len(names) == 2 and {n.split("_")[2] for n in names} >= {lower.level.split("_")[0], cpu.level.split("_")[0]}
    # one kernel name per (level, compiler, flags): another compiler or level never reuses the file
    same = cpu_paged_decode.library_name(cpu.level, "gcc 12", cpu.compile_flags)
    assert same == cpu_paged_decode.library_name(cpu.level, "gcc 12", cpu.compile_flags)
    assert same != cpu_paged_decode.library_name(cpu.level, "clang 16", cpu.compile_flags)
    assert same != cpu_paged_decode.library_name(lower.level, "gcc 12", lower.compile_flags)


@needs_kernel
def test_a_level_the_compiler_cannot_target_falls_back_to_a_baseline_build(monkeypatch, tmp_path):
    cpu = CpuFeatures(arch=this_cpu().arch, flags=this_cpu().flags)
    monkeypatch.setitem(cpu_features.COMPILE_FLAGS, cpu.level, ("-mno-such-target-flag",))
    lib = _fresh_load(monkeypatch, tmp_path, cpu)
    assert lib is not None and cpu_paged_decode.describe()["level"] == "baseline"
    assert "failed" in cpu_paged_decode.describe()["why"]


def test_without_a_compiler_the_torch_path_serves(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_paged_decode, "_build", cpu_paged_decode._build)
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
    assert cpu_paged_decode.supported(torch.float32, torch.float32, 8, 4, 64)
    assert not cpu_paged_decode.supported(torch.float32, torch.bfloat16, 8, 4, 64)  # mixed: torch gathers
    assert not cpu_paged_decode.supported(torch.bfloat16, torch.uint8, 8, 4, 64)  # fp8 pages
    assert not cpu_paged_decode.supported(torch.bfloat16, torch.bfloat16, 6, 4, 64)  # heads not grouped evenly


@needs_kernel
def test_loading_the_kernel_leaves_denormals_alone(monkeypatch, tmp_path):
    """Built with -ffast-math but linked without it: loading it must not turn on flush-to-zero for the process
    (gcc < 13 links crtfastmath.o into -ffast-math shared libraries), which would change torch's float32."""
    assert _fresh_load(monkeypatch, tmp_path, this_cpu()) is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.5).item() != 0.0 and np.float32(1e-40) * np.float32(1.5) != 0
