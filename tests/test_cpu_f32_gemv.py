"""The float32 decode-product kernel (backends/torch/cpu_f32_gemv.py): in a decode step its product equals
x @ W.T (+ bias) within float32 rounding for 1..8 rows, every tile remainder and 2-D / 3-D / strided inputs, on each
x86 code path this CPU can run (AVX-512, AVX2), each row the same bits whatever the row count; threads split it
without changing a value; more rows than it takes, and every product outside a decode step (prefill chunks, whose
bits must not depend on the chunking), go to F.linear unchanged; the loader gives float32 models' linears its
forward (the model's greedy output stays transformers'), and where it cannot run (switched off, ARM) F.linear
serves, with the reason."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from kernel_levels import build_at_level, fresh_build
from torch import nn

from tierlm.backends.torch import cpu_f32_gemv
from tierlm.backends.torch.cpu_f32_gemv import F32GemvLinear
from tierlm.platforms.cpu_features import CpuFeatures

needs_kernel = pytest.mark.skipif(cpu_f32_gemv.load() is None, reason=f"the float32 kernel does not run here: "
                                  f"{cpu_f32_gemv.describe()['why']}")

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
    lib = cpu_f32_gemv._kernel.lib
    monkeypatch.setattr(cpu_f32_gemv._kernel, "lib", _Spy(lib, calls))
    x, w, b, ref = _case(m, n, k, bias)
    with cpu_f32_gemv.decode_step():
        y = cpu_f32_gemv.product(x, w, b)
        assert torch.equal(cpu_f32_gemv.product(x[-1:], w, b), y[-1:])  # a row's bits whatever the row count
    _check(y, ref)
    assert calls == [m, 1]  # the kernel computed them
    assert torch.equal(cpu_f32_gemv.product(x, w, b), F.linear(x, w, b)) and calls == [m, 1]  # not a decode step


class _Spy:
    """The loaded library with its f32_linear calls counted (rows per call)."""

    def __init__(self, lib: ctypes.CDLL, calls: list) -> None:
        self._lib, self._calls = lib, calls

    def f32_linear(self, *args):
        self._calls.append(args[1])
        return self._lib.f32_linear(*args)


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
def test_each_x86_code_path_this_cpu_runs_gives_the_product(level, bits, monkeypatch, tmp_path, in_decode_step):
    build = build_at_level(cpu_f32_gemv, level, monkeypatch, tmp_path)
    assert build.lib.f32_gemv_simd_bits() == bits
    monkeypatch.setattr(cpu_f32_gemv._kernel, "lib", build.lib)
    # 4 x 4 tiles for 1-2 rows, 4 x 6 from 3 (AVX2: 2 x 4, then 4 x 2); each sum in the same order in all
    for m in range(1, 9):
        for n, k in SHAPES:
            x, w, b, ref = _case(m, n, k, m % 2 == 0)
            y = cpu_f32_gemv.product(x, w, b)
            _check(y, ref)
            assert torch.equal(cpu_f32_gemv.product(x[-1:], w, b), y[-1:])


def test_where_it_cannot_run_f_linear_serves(monkeypatch, tmp_path):
    arm = CpuFeatures(arch="aarch64", flags=frozenset({"fp", "asimd", "bf16"}))
    build = fresh_build(cpu_f32_gemv, monkeypatch, tmp_path, arm)
    assert build.lib is None and "aarch64" in build.why and "F.linear" in build.why
    monkeypatch.setenv(cpu_f32_gemv.ENV, "0")
    monkeypatch.setattr(cpu_f32_gemv, "_kernel", cpu_f32_gemv._kernel.fresh())  # set up again, under the env
    model = nn.Sequential(nn.Linear(64, 40))
    assert cpu_f32_gemv.use_for_linears(model) == 0 and type(model[0]) is nn.Linear
    assert f"off ({cpu_f32_gemv.ENV}=0)" in cpu_f32_gemv.describe()["why"]
    x = torch.randn(2, 64)
    with cpu_f32_gemv.decode_step():
        assert torch.equal(cpu_f32_gemv.product(x, model[0].weight, model[0].bias), model[0](x))


@needs_kernel
def test_float32_models_get_the_kernel_and_keep_transformers_greedy_output(tiny_llama):
    from backend_driver import run_greedy
    from transformers import AutoModelForCausalLM

    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(tiny_llama, dtype="float32")
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
    """tierlm_native::f32_linear (cpu_product_op.py) runs decode steps' products itself, float32 or bf16-held
    weight, and hands every other case to the Python op: the same bits either way."""
    from tierlm.backends.torch import compiled_decode, cpu_product_op  # noqa: F401 (the ops)

    model = nn.Sequential(nn.Linear(512, 256), nn.Linear(896, 192, bias=False))
    assert cpu_f32_gemv.use_for_linears(model) == 2
    ok, why = cpu_product_op.ready(model)
    if not ok:
        pytest.skip(f"the C++ op does not load here: {why}")

    def both(x, w, b):
        before = cpu_product_op.served()
        got = torch.ops.tierlm_native.f32_linear(x, w, b)
        return got, cpu_f32_gemv.product(x, w, b), cpu_product_op.served() - before

    for m in model:
        for w in (m.weight, m.weight.to(torch.bfloat16)):
            for rows in range(1, cpu_f32_gemv.MAX_ROWS + 1):
                x = torch.randn(1, rows, m.in_features, generator=torch.Generator().manual_seed(rows))
                with cpu_f32_gemv.decode_step():
                    got, want, served = both(x, w, m.bias)
                assert served == 1 and got.shape == (1, rows, m.out_features) and torch.equal(got, want)
            x = torch.randn(3, m.in_features)
            got, want, served = both(x, w, m.bias)  # not a decode step: MKL's bits
            assert served == 0 and torch.equal(got, want) and torch.equal(got, F.linear(x, w.float(), m.bias))
            with cpu_f32_gemv.decode_step():
                for x in (torch.randn(9, m.in_features), torch.randn(3, 2 * m.in_features)[:, :m.in_features]):
                    got, want, served = both(x, w, m.bias)  # more rows than it takes; rows not contiguous
                    assert served == 0 and torch.equal(got, want)
