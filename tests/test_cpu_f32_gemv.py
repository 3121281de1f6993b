"""The float32 decode-product kernel (backends/torch/cpu/f32_gemv.py): in a decode step its product equals
x @ W.T (+ bias) within float32 rounding for 1..8 rows, every tile remainder and 2-D / 3-D / strided inputs, on each
x86 code path this CPU can run (the avx512 and avx2 levels' libraries), each row the same bits whatever the row
count; threads split it without changing a value; more rows than it takes, and every product outside a decode step
(prefill chunks, whose bits must not depend on the chunking), go to F.linear unchanged; the loader gives float32
models' linears its forward where the CPU plan says f32_products=gemv (the model's greedy output stays
transformers'), and where it cannot run (switched off, ARM, a library without its vector code) F.linear serves,
with the reason. Compiled steps call it from C++ (``tierlm_native::f32_linear``, cpu/native_ops.py) with the Python
op's bits."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from kernel_levels import library_at_level
from torch import nn

from tierlm.backends.torch.cpu import f32_gemv as cpu_f32_gemv
from tierlm.backends.torch.cpu import library, plan
from tierlm.backends.torch.cpu.f32_gemv import F32GemvLinear
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.platforms import cpu_plan
from tierlm.platforms.cpu_features import CpuFeatures, this_cpu

F32_PRODUCTS = plan.for_model(torch.float32).plan.f32_products  # this CPU's plan for a float32 model
needs_kernel = pytest.mark.skipif(F32_PRODUCTS.value != "gemv", reason=f"the float32 kernel does not run here: "
                                  f"{F32_PRODUCTS}")


# Partial weight tiles (N % 4 = 1, 2, 3), columns past the last full vector (K % 16 = 8, 7, 11; K % 8 = 7, 3), and
# rows 5, 6, 8: two passes over a tile (4 rows a pass; AVX2 takes 2 a pass in its tiles for one or two rows).
SHAPES = [(37, 72), (38, 23), (39, 27), (96, 896)]


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    return x, w, b, ref


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)  # only the order of the sums differs


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_the_product(m, n, k, bias, monkeypatch):
    calls = []
    spy = _Spy(library.load(), calls)
    monkeypatch.setattr(library, "load", lambda cpu=None: spy)
    x, w, b, ref = _case(m, n, k, bias)
    with cpu_f32_gemv.decode_step():
        y = cpu_f32_gemv.product(x, w, b)
        assert torch.equal(cpu_f32_gemv.product(x[-1:], w, b), y[-1:])  # a row's bits whatever the row count
    _check(y, ref)
    assert calls == [m, 1]  # the kernel computed them
    assert torch.equal(cpu_f32_gemv.product(x, w, b), F.linear(x, w, b)) and calls == [m, 1]  # not a decode step


class _Spy:
    """The process's library with its f32_linear calls counted (rows per call)."""

    def __init__(self, lib: KernelLibrary, calls: list) -> None:
        self._lib, self._calls = lib, calls

    def has(self, kernel: str) -> bool:
        return self._lib.has(kernel)

    def f32_linear(self, *args):
        self._calls.append(args[1])
        return self._lib.f32_linear(*args)

    def __getattr__(self, name: str):
        return getattr(self._lib, name)


@pytest.fixture
def in_decode_step():
    with cpu_f32_gemv.decode_step():
        yield


@needs_kernel
def test_batched_and_strided_rows_and_more_rows_than_it_takes(in_decode_step):
    x, w, b, ref = _case(6, 40, 64, True)
    _check(cpu_f32_gemv.product(x.view(2, 3, 64), w, b).view(6, 40), ref)  # [B, T, K] rows
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows a stride of 128 apart
    assert not wide.is_contiguous()
    _check(cpu_f32_gemv.product(wide, w, b), ref)
    x9, w9, b9, _ = _case(9, 40, 64, True)
    assert torch.equal(cpu_f32_gemv.product(x9, w9, b9), F.linear(x9, w9, b9))  # prefill-sized: MKL's GEMM


@needs_kernel
def test_threads_split_the_output_without_changing_a_value(monkeypatch, in_decode_step):
    x, w, b, _ = _case(3, 101, 160, True)
    one = cpu_f32_gemv.product(x, w, b)
    monkeypatch.setattr(cpu_f32_gemv, "MIN_WEIGHTS_PER_THREAD", 1)
    before = torch.get_num_threads()
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_f32_gemv.product(x, w, b), one)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("level,bits", [("avx512", 512), ("avx2", 256)])
def test_each_x86_code_path_this_cpu_runs_gives_the_product(level, bits, monkeypatch, in_decode_step):
    lib = library_at_level(level)
    assert lib.has("f32_gemv") and lib.tierlm_vector_bits() == bits
    monkeypatch.setattr(library, "load", lambda cpu=None: lib)  # the products run on that level's library
    # 4 x 4 tiles for 1-2 rows, 4 x 6 from 3 (AVX2: 2 x 4, then 4 x 2); each sum in the same order in all
    for m in range(1, 9):
        for n, k in SHAPES:
            x, w, b, ref = _case(m, n, k, m % 2 == 0)
            y = cpu_f32_gemv.product(x, w, b)
            _check(y, ref)
            assert torch.equal(cpu_f32_gemv.product(x[-1:], w, b), y[-1:])


def test_where_it_cannot_run_f_linear_serves(monkeypatch):
    """The plan leaves float32 products to MKL on ARM (its library has no float32 kernel: plain C is slower than
    MKL), with a library of a level below AVX2, without a library, and where switched off (f32_products=mkl); and
    a library without the kernel computes F.linear's bits even inside a decode step."""
    f32 = cpu_plan.ModelFacts("float32", "float32", 8, 4, 64)
    arm = CpuFeatures(arch="aarch64", flags=frozenset({"fp", "asimd", "bf16"}))
    neon = cpu_plan.LibraryFacts("bf16", frozenset({"paged_decode", "softmax_rows", "torch_ops"}), "installed")
    decided = cpu_plan.decide(arm, f32, neon, {}).f32_products
    assert decided.value == "mkl" and "no AVX2/AVX-512 float32 kernel" in decided.why
    none = cpu_plan.decide(arm, f32, cpu_plan.LibraryFacts(None, why="TIERLM_CPU_KERNELS=0"), {}).f32_products
    assert none.value == "mkl" and "no kernel library (TIERLM_CPU_KERNELS=0)" in none.why
    with pytest.raises(cpu_plan.CpuPlanError, match="cannot run here"):  # asked for where it cannot run
        cpu_plan.decide(arm, f32, neon, {cpu_plan.PLAN_ENV: "f32_products=gemv"})
    off = plan.for_model(torch.float32, env={**os.environ, cpu_plan.PLAN_ENV: "f32_products=mkl"})
    assert off.plan.f32_products.value == "mkl" and "f32_products=mkl" in off.plan.f32_products.why
    model = nn.Sequential(nn.Linear(64, 40))
    assert cpu_f32_gemv.use_for_linears(model, off) == 0 and type(model[0]) is nn.Linear
    x = torch.randn(2, 64)
    # no library; the x86-64 level's (plain C, which the plan never runs: the library does not name the kernel)
    for lib in [None] + ([library_at_level("x86-64")] if this_cpu().arch == "x86_64" else []):
        assert lib is None or not lib.has("f32_gemv")
        monkeypatch.setattr(library, "load", lambda cpu=None, lib=lib: lib)
        with cpu_f32_gemv.decode_step():
            assert torch.equal(cpu_f32_gemv.product(x, model[0].weight, model[0].bias), model[0](x))


@needs_kernel
def test_float32_models_get_the_kernel_and_keep_transformers_greedy_output(tiny_llama):
    from backend_driver import run_greedy
    from transformers import AutoModelForCausalLM

    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(tiny_llama, dtype="float32")
    assert backend.cpu_kernels.plan.f32_products.value == "gemv"
    linears = [m for m in backend.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is F32GemvLinear for m in linears)
    assert backend.kernels()["linear"].startswith(f"float32: up to {cpu_f32_gemv.MAX_ROWS} rows on tierlm's C kernel")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = [[1, 72, 101, 108, 108, 111, 44, 32, 119], [1, 84, 104, 101, 32, 99]]
    ours = run_greedy(backend, prompts, 8)
    for ids, out in zip(prompts, ours):
        with torch.inference_mode():
            assert out == hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    bf16 = TorchBackend(tiny_llama, dtype="bfloat16")  # other dtypes keep their own linears
    assert not any(isinstance(m, F32GemvLinear) for m in bf16.model.modules())


@needs_kernel
def test_compiled_steps_call_the_kernel_from_cpp_with_the_python_ops_bits():
    """tierlm_native::f32_linear (cpu/native_ops.py) runs decode steps' products itself (the step record says the
    step is one), float32 or bf16-held weight, and hands every other case to the Python op: the same bits either
    way."""
    from tierlm.backends.torch import ops
    from tierlm.backends.torch.cpu import native_ops

    kernels = plan.for_model(torch.float32)
    if kernels.plan.compiled_ops.value != "native":
        pytest.skip(f"the plan has no C++ ops here: {kernels.plan.compiled_ops}")
    model = nn.Sequential(nn.Linear(512, 256), nn.Linear(896, 192, bias=False))
    assert cpu_f32_gemv.use_for_linears(model, kernels) == 2
    record, why = native_ops.prepare(model, kernels)
    assert record is not None and "2 float32 products" in why, why
    assert all(getattr(m, ops.BUFFER) is record.tensor for m in model)  # the compiled calls pass the record on

    def both(x, w, b):
        before = native_ops.served()["f32_linear"]
        got = torch.ops.tierlm_native.f32_linear(x, w, b, record.tensor)
        return got, cpu_f32_gemv.product(x, w, b), native_ops.served()["f32_linear"] - before

    # in inference mode, as compiled steps run (where the bf16 weight's widening scratch may have been made)
    with torch.inference_mode():
        for m in model:
            for w in (m.weight, m.weight.to(torch.bfloat16)):
                for rows in range(1, cpu_f32_gemv.MAX_ROWS + 1):
                    x = torch.randn(1, rows, m.in_features, generator=torch.Generator().manual_seed(rows))
                    with cpu_f32_gemv.decode_step(), record.step(True):
                        got, want, served = both(x, w, m.bias)
                    assert served == 1 and got.shape == (1, rows, m.out_features) and torch.equal(got, want)
                x = torch.randn(3, m.in_features)
                with cpu_f32_gemv.decode_step(False), record.step(False):
                    got, want, served = both(x, w, m.bias)  # not a decode step: MKL's bits
                assert served == 0 and torch.equal(got, want) and torch.equal(got, F.linear(x, w.float(), m.bias))
                got, want, served = both(x, w, m.bias)  # outside any step: the record says none
                assert served == 0 and torch.equal(got, want)
                with cpu_f32_gemv.decode_step(), record.step(True):
                    for x in (torch.randn(9, m.in_features), torch.randn(3, 2 * m.in_features)[:, :m.in_features]):
                        got, want, served = both(x, w, m.bias)  # more rows than it takes; rows not contiguous
                        assert served == 0 and torch.equal(got, want)
