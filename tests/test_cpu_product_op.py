"""The compiled step's packed bf16 product as a C++ operator (backends/torch/cpu_product_op.py).

What must hold: ``tierlm_native::packed_linear`` returns cpu_linear.packed_product's bits for every input, serving
the decode-sized bf16 products itself and handing every other case (more rows, a product for helper
threads, a width with no chunk table) to the Python op; and where it cannot be built or is switched off, the
compiled step records the Python op, with the reason.
"""
from __future__ import annotations

import pytest
import torch

from tierlm.backends.torch import c_kernel_build, compiled_decode, cpu_linear, cpu_product_op  # noqa: F401 (ops)

pytestmark = pytest.mark.skipif(cpu_linear.decode_kernel() is None,
                                reason="no decode-product kernel on this CPU (AVX512-BF16 or AMX): the Python op "
                                       "serves every product, tested in test_cpu_linear.py")


def _linear(n: int, k: int, bias: bool, seed: int) -> cpu_linear.PackedLinear:
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return cpu_linear.PackedLinear(lin.to(torch.bfloat16))


@pytest.fixture(scope="module")
def native_op():
    model = torch.nn.Sequential(_linear(256, 512, False, 0), _linear(192, 896, True, 1))
    ok, why = cpu_product_op.ready(model)
    if not ok:
        pytest.skip(f"the C++ op does not load here: {why}")
    return model


def _both(m: cpu_linear.PackedLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the C++ op's output, the Python path's, how many products the C++ op ran itself)."""
    before = cpu_product_op.served()
    got = torch.ops.tierlm_native.packed_linear(x, m.packed_weight, m.bias, m.out_features, m.fast_rows)
    return got, cpu_linear.packed_product(x, m.packed_weight, m.bias, m.out_features, m.fast_rows), \
        cpu_product_op.served() - before


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 32])
def test_decode_sized_products_run_in_cpp_with_the_python_paths_bits(native_op, rows):
    for i, m in enumerate(native_op):
        assert m.fast_rows == 32
        x = torch.randn(1, rows, m.in_features, generator=torch.Generator().manual_seed(rows + i)).bfloat16()
        got, want, served = _both(m, x)
        assert served == 1 and got.shape == (1, rows, m.out_features) and torch.equal(got, want)


def test_rows_a_fixed_stride_apart_are_read_in_place_and_others_made_contiguous(native_op):
    m = native_op[0]
    wide = torch.randn(6, 2 * m.in_features).bfloat16()
    half = wide[:, m.in_features:]  # gate|up's second half: rows 2K apart
    got, want, served = _both(m, half)
    assert served == 1 and torch.equal(got, want) and torch.equal(got, _both(m, half.contiguous())[0])
    uneven = torch.randn(3, 4, 2 * m.in_features).bfloat16()[:, 1:3, :m.in_features]  # rows not evenly spaced
    got, want, served = _both(m, uneven)
    assert served == 1 and torch.equal(got, want)


def test_every_other_case_goes_to_the_python_op_with_its_bits(native_op):
    m = native_op[1]
    got, want, served = _both(m, torch.randn(40, m.in_features).bfloat16())  # more rows than the kernel takes
    assert served == 0 and torch.equal(got, want)
    x = torch.randn(2, m.in_features).bfloat16()
    got = torch.ops.tierlm_native.packed_linear(x, m.packed_weight, m.bias, m.out_features, 0)  # oneDNN asked for
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, m.packed_weight, m.bias, "none", [], ""))
    with pytest.raises(RuntimeError):  # a wrong width reaches oneDNN, which says
        torch.ops.tierlm_native.packed_linear(torch.randn(2, 64).bfloat16(), m.packed_weight, m.bias,
                                              m.out_features, m.fast_rows)


def test_a_width_or_thread_count_without_a_chunk_table_goes_to_the_python_op(native_op):
    if cpu_linear.decode_kernel().NAME != "AVX512-BF16":
        pytest.skip("the AMX kernel takes no K chunk")
    m = _linear(128, 1024, False, 2)  # K=1024: ready() never handed this width over
    assert m.fast_rows
    x = torch.randn(3, 1024).bfloat16()
    got, want, served = _both(m, x)
    assert served == 0 and torch.equal(got, want)
    m = native_op[0]  # a width handed over, at a thread count it was not
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        got, want, served = _both(m, torch.randn(3, m.in_features).bfloat16())
    finally:
        torch.set_num_threads(threads)
    assert served == 0 and torch.equal(got, want)


def test_one_row_vectors_and_evenly_spaced_batches_are_served_in_place(native_op):
    m = native_op[1]
    got, want, served = _both(m, torch.randn(m.in_features).bfloat16())  # a 1-D row
    assert served == 1 and got.shape == (m.out_features,) and torch.equal(got, want)
    rows = torch.randn(2, 3, 2 * m.in_features).bfloat16()[:, :, :m.in_features]  # [2, 3, K], rows 2K apart
    got, want, served = _both(m, rows)
    assert served == 1 and got.shape == (2, 3, m.out_features) and torch.equal(got, want)


def test_the_op_is_not_built_when_switched_off_or_without_a_cpp_compiler(monkeypatch):
    monkeypatch.setenv(cpu_product_op.ENV, "0")
    off = cpu_product_op._op.fresh()
    assert off() is None and "TIERLM_CPU_PRODUCT_OP=0" in off.describe()["why"]
    monkeypatch.delenv(cpu_product_op.ENV)
    monkeypatch.setattr(cpu_product_op, "find_cxx_compiler", lambda env: None)
    none = cpu_product_op._op.fresh()
    assert none() is None and "no C++ compiler" in none.describe()["why"]


def _recorded_ops(m: cpu_linear.PackedLinear) -> str:
    """The code of the graph a trace of compiled_decode.packed_linear_op records."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(t):
        return compiled_decode.packed_linear_op(t, m.packed_weight, None, m.out_features, m.fast_rows)

    return make_fx(step)(torch.randn(2, m.in_features).bfloat16()).code


def test_traces_record_the_cpp_op_where_it_loaded_and_the_python_op_where_not(native_op, monkeypatch):
    m = native_op[0]
    assert "tierlm_native.packed_linear" in _recorded_ops(m)
    monkeypatch.setenv(cpu_product_op.ENV, "0")
    monkeypatch.setattr(cpu_product_op, "_op", cpu_product_op._op.fresh())
    ok, why = cpu_product_op.ready(native_op)
    assert not ok and f"{cpu_product_op.ENV}=0" in why
    code = _recorded_ops(m)
    assert "tierlm.packed_linear" in code and "tierlm_native" not in code


def test_the_attention_op_is_handed_the_decode_step_kernel_unless_switched_off(native_op, monkeypatch):
    """compiled_decode.attention_op records the C++ attention op only where ready() handed it cpu_paged_decode's
    step kernel; TIERLM_CPU_ATTENTION_OP=0 (or no C kernel) keeps the Python op. Its outputs: test_compiled_decode's
    bit-for-bit test, where the decode-only step's layers run in it."""
    from tierlm.backends.torch import cpu_paged_decode

    monkeypatch.setitem(cpu_product_op._ATTENTION, "ready", False)
    monkeypatch.setenv(cpu_product_op.ATTENTION_ENV, "0")
    cpu_product_op.ready(native_op)
    assert not cpu_product_op.attention_loaded()
    monkeypatch.delenv(cpu_product_op.ATTENTION_ENV)
    cpu_product_op.ready(native_op)
    assert cpu_product_op.attention_loaded() == (cpu_paged_decode.load() is not None)
