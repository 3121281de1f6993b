"""The int8 weight-only decode kernel (backends/torch/cpu/int8_gemv.py): its product equals the dequantized one
for every row count, tile remainder and dtype, on each x86 code path this CPU can run (the avx512 and avx2 levels'
libraries) and in the plain-C tail (the x86-64 level's); threads split it without changing a value;
Int8WeightOnlyLinear sends decode rows to it and the rest to torch's kernel; where the CPU plan does not run it
(switched off, ARM, a library without vector code) torch's kernel serves."""
from __future__ import annotations

import os

import pytest
import torch
from kernel_levels import library_at_level

from tierlm.backends.torch.cpu import int8_gemv as cpu_int8_gemv
from tierlm.backends.torch.cpu import plan
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.weights.quant_linear import Int8WeightOnlyLinear, use_kernel
from tierlm.platforms import cpu_plan
from tierlm.platforms.cpu_features import CpuFeatures, this_cpu

INT8 = "torchao:int8wo+embedding"  # a weight format whose linears are int8 weight-only layers
KERNELS = plan.for_model(torch.bfloat16, weight_format=INT8)  # this CPU's plan for such a model
LIB = KERNELS.lib if KERNELS.plan.int8_products.value == "gemv" else None
needs_kernel = pytest.mark.skipif(LIB is None, reason=f"the int8 kernel does not run here: "
                                  f"{KERNELS.plan.int8_products}")


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) / 50 + 1e-3).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = x.double() @ (q.double() * scales.double()[:, None]).t()
    if b is not None:
        ref = ref + b.double()
    return x, q, scales, b, ref


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, torch_kernel: bool = False) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref).abs()
    if dtype == torch.float32:  # float32 products and sums: only the summation order differs
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    elif torch_kernel:  # torch's bf16 kernel rounds along the way (measured up to ~2^-7 of the row's size)
        assert err.max() <= 4 * 2.0 ** -8 * ref.abs().max(), err.max().item()
    else:  # this kernel: one rounding to bf16 of the float32 result, element by element
        assert (err <= 2.0 ** -8 * ref.abs() + 1e-3).all(), err.max().item()


# Partial weight tiles (N % 4 = 1, 2, 3) and columns past the last full vector: K % 16 (AVX-512) = 8, 11, 7 and
# K % 8 (AVX2) = 3, 7; rows 5, 6 and 8 take two passes over each tile (the second with 1, 2 or 4 rows).
SHAPES = [(37, 72), (38, 23), (39, 27), (96, 896)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_the_dequantized_product(dtype, m, n, k, bias):
    x, q, scales, b, ref = _case(m, n, k, dtype, bias)
    _check(cpu_int8_gemv.int8_linear(LIB, x, q, scales, b), ref, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_threads_split_the_output_without_changing_a_value(dtype, monkeypatch):
    x, q, scales, b, _ = _case(3, 101, 160, dtype, True)
    one = cpu_int8_gemv.int8_linear(LIB, x, q, scales, b)
    monkeypatch.setattr(cpu_int8_gemv, "MIN_WEIGHTS_PER_THREAD", 1)
    before = torch.get_num_threads()
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_int8_gemv.int8_linear(LIB, x, q, scales, b), one)
    finally:
        torch.set_num_threads(before)


def _call(lib: KernelLibrary, x, q, scales, b) -> torch.Tensor:
    """One call of a level's library, single-threaded (what int8_linear does with one thread)."""
    m, k = x.shape
    y = torch.empty((m, q.shape[0]), dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    xf = torch.empty((m, k), dtype=torch.float32) if bf16 else x
    fn = lib.int8_linear_bf16 if bf16 else lib.int8_linear_f32
    fn(x.data_ptr(), xf.data_ptr(), int(bf16), m, k, q.data_ptr(), scales.data_ptr(),
       0 if b is None else b.data_ptr(), y.data_ptr(), q.shape[0], 0, q.shape[0])
    return y


@needs_kernel
@pytest.mark.parametrize("level,bits", [("avx512", 512), ("avx2", 256)])
def test_each_x86_code_path_this_cpu_runs_gives_the_product(level, bits):
    lib = library_at_level(level)
    assert lib.has("int8_gemv") and lib.tierlm_vector_bits() == bits
    for dtype in (torch.bfloat16, torch.float32):
        for m, (n, k) in zip((1, 2, 6, 8), SHAPES):
            x, q, scales, b, ref = _case(m, n, k, dtype, True)
            _check(_call(lib, x, q, scales, b), ref, dtype)


def test_the_plain_c_library_computes_the_product_but_is_left_to_torch():
    """The x86-64 level's library (no AVX2: the kernel's plain C) computes the product, but does not name the
    kernel, so the plan leaves int8 products to torch's kernel, which outruns it."""
    if this_cpu().arch != "x86_64":
        pytest.skip(f"the x86-64 level is an x86_64 one; this CPU is {this_cpu().arch}")
    lib = library_at_level("x86-64")
    assert lib.tierlm_vector_bits() == 0 and not lib.has("int8_gemv")
    for dtype in (torch.bfloat16, torch.float32):
        for m, (n, k) in zip((5, 2), SHAPES[1:3]):
            x, q, scales, b, ref = _case(m, n, k, dtype, True)
            _check(_call(lib, x, q, scales, b), ref, dtype)
    facts = cpu_plan.LibraryFacts(lib.level, lib.kernels, "the installed x86-64 library")
    decided = cpu_plan.decide(this_cpu(), cpu_plan.ModelFacts("bfloat16", "bfloat16", weight_format=INT8), facts,
                              {}).int8_products
    assert decided.value == "torch" and "(x86-64) has no AVX2/AVX-512 int8 kernel" in decided.why


def test_where_it_cannot_run_torch_kernel_serves(monkeypatch):
    arm = CpuFeatures(arch="aarch64", flags=frozenset({"fp", "asimd", "bf16"}))
    model = cpu_plan.ModelFacts("bfloat16", "bfloat16", weight_format=INT8)
    neon = cpu_plan.LibraryFacts("bf16", frozenset({"paged_decode", "softmax_rows", "torch_ops"}), "installed")
    decided = cpu_plan.decide(arm, model, neon, {}).int8_products
    assert decided.value == "torch" and "has no AVX2/AVX-512 int8 kernel" in decided.why
    with pytest.raises(cpu_plan.CpuPlanError, match="cannot run here"):  # asked for where it cannot run
        cpu_plan.decide(arm, model, neon, {cpu_plan.PLAN_ENV: "int8_products=gemv"})
    half = cpu_plan.decide(this_cpu(), cpu_plan.ModelFacts("float16", "float16", weight_format=INT8),
                           cpu_plan.LibraryFacts("avx2", frozenset({"int8_gemv"})), {}).int8_products
    assert half.value == "torch" and "not float16" in half.why  # activations the kernel does not take
    off = plan.for_model(torch.bfloat16, weight_format=INT8,
                         env={**os.environ, cpu_plan.PLAN_ENV: "int8_products=torch"})
    assert off.plan.int8_products.value == "torch" and "int8_products=torch" in off.plan.int8_products.why
    # the layer still computes its product, through torch's kernel
    x, q, scales, b, ref = _case(2, 40, 64, torch.bfloat16, True)
    layer = Int8WeightOnlyLinear.from_quantized(q, scales, b, dtype=torch.bfloat16)
    assert use_kernel(layer, off) == 0 and layer.lib is None
    calls = []
    monkeypatch.setattr(cpu_int8_gemv, "int8_linear", lambda *a: calls.append(1))  # must not be called
    _check(layer(x), ref, torch.bfloat16, torch_kernel=True)
    assert not calls


@needs_kernel
def test_the_layer_sends_decode_rows_to_the_kernel_and_other_bf16_rows_elsewhere(monkeypatch):
    calls: list[tuple[int, torch.dtype]] = []
    real = cpu_int8_gemv.int8_linear

    def spy(lib, x, *args):
        assert lib is LIB
        calls.append((x.shape[0], x.dtype))
        return real(lib, x, *args)

    monkeypatch.setattr(cpu_int8_gemv, "int8_linear", spy)
    for dtype, rows, expect in ((torch.bfloat16, 1, True), (torch.bfloat16, 8, True), (torch.bfloat16, 9, False),
                                (torch.bfloat16, 40, False), (torch.float32, 1, True), (torch.float32, 40, True)):
        calls.clear()
        x, q, scales, b, ref = _case(rows, 40, 64, dtype, True)
        layer = Int8WeightOnlyLinear.from_quantized(q, scales, b, dtype=dtype)
        assert use_kernel(layer, KERNELS) == 1 and layer.lib is LIB  # where the plan has the kernel
        with torch.inference_mode():  # as served (bf16 prefill's reused scratch may have been made in it)
            out = layer(x)
        _check(out, ref, dtype, torch_kernel=not expect)
        assert (calls == [(rows, dtype)]) == expect, (dtype, rows, calls)


@needs_kernel
def test_prefill_and_decode_of_the_same_rows_agree_within_bf16_rounding():
    """A prompt's rows through bf16 prefill (the widened weight through oneDNN) and the same rows one at a time
    through the decode kernel: a cache hit replays either, so they must not drift apart."""
    x, q, scales, b, ref = _case(40, 70, 96, torch.bfloat16, True, seed=5)
    layer = Int8WeightOnlyLinear.from_quantized(q, scales, b, dtype=torch.bfloat16)
    assert use_kernel(layer, KERNELS) == 1
    with torch.inference_mode():  # as served (bf16 prefill's reused scratch may have been made in it)
        prefill = layer(x)
        decode = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    _check(decode, ref, torch.bfloat16)
    _check(prefill, ref, torch.bfloat16, torch_kernel=True)
    assert ((prefill.double() - decode.double()).abs() <= 2.0 ** -7 * ref.abs() + 1e-2).all()


@needs_kernel
def test_torch_compile_keeps_the_layer_in_one_graph():
    """--enable-torch-compile: the kernel is one custom op (backends/torch/ops.py ``tierlm::int8_weight_only``), not
    a graph break per layer."""
    import torch._dynamo

    layers = torch.nn.Sequential(*[Int8WeightOnlyLinear.from_quantized(*_case(1, 64, 64, torch.float32, True)[1:4],
                                                                       dtype=torch.float32) for _ in range(3)])
    assert use_kernel(layers, KERNELS) == 3
    x = torch.randn(1, 64)
    explained = torch._dynamo.explain(layers)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(layers, backend="eager")
    torch.testing.assert_close(compiled(x), layers(x), rtol=0, atol=0)
