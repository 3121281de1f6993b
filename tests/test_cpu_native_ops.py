"""The compiled step's kernel calls as C++ operators (backends/torch/cpu/native_ops.py, csrc/torch_ops.cpp).

What must hold: ``tierlm_native::packed_linear`` returns cpu/linear.packed_product's bits for every input, serving
the decode-sized bf16 products itself and handing every other case (more rows, a product for helper threads, a
width or a thread count without its K chunks) to the Python op; ``tierlm_native::paged_attention`` serves a
decode-only step's layer from the step record, with the Python op's bits, and hands the layer to the Python op
where the record holds no attention (or the call is not the step's); and where the CPU plan has no C++ ops
(``compiled_ops=python``, ``compiled_attention=python``, no library), ``prepare`` hands out none and the compiled
step records the Python ops, with the reason. ``tierlm_native::f32_linear``: tests/test_cpu_f32_gemv.py; whole
compiled steps: tests/test_compiled_decode.py.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from packed_kernels import bf16_kernels
from tierlm.backends.torch import ops
from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.cpu import avx512_linear, decode_step, linear, native_ops, plan
from tierlm.backends.torch.cpu.step_record import StepRecord
from tierlm.backends.torch.kv_pool import TorchKVPool
from tierlm.platforms.cpu_plan import PLAN_ENV

KERNELS = bf16_kernels()  # this CPU's plan for a bf16 model, with the process's library
KERNEL = linear.KERNELS.get(KERNELS.plan.decode_products.value)
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"no decode-product kernel in this CPU's plan "
                                  f"({KERNELS.plan.decode_products}): the Python op serves every product, tested "
                                  "in test_cpu_linear.py")


def _linear(n: int, k: int, bias: bool, seed: int) -> linear.PackedLinear:
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return linear.PackedLinear(lin.to(torch.bfloat16), KERNEL, KERNELS.lib if KERNEL is not None else None)


@pytest.fixture
def native_op():
    """Two packed linears prepared for compiled steps as the plan has them (their kernel called from C++)."""
    if KERNELS.plan.compiled_ops.value != "native":
        pytest.skip(f"the plan has no C++ ops here: {KERNELS.plan.compiled_ops}")
    model = torch.nn.Sequential(_linear(256, 512, False, 0), _linear(192, 896, True, 1))
    record, why = native_ops.prepare(model, KERNELS)
    assert record is not None and "2 packed products" in why, why
    assert all(m.native and m.block == KERNEL.BLOCK for m in model)
    return model


def _both(m: linear.PackedLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the C++ op's output, the Python path's, how many products the C++ op ran itself)."""
    before = native_ops.served()["packed_linear"]
    got = torch.ops.tierlm_native.packed_linear(x, m.packed_weight, m.bias, m.out_features, m.fast_rows, m.block,
                                                m.k_chunks)
    served = native_ops.served()["packed_linear"] - before
    return got, linear.packed_product(x, m.packed_weight, m.bias, m.out_features, m.fast_rows, m.kernel, m.lib), \
        served


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 32])
def test_decode_sized_products_run_in_cpp_with_the_python_paths_bits(native_op, rows):
    for i, m in enumerate(native_op):
        assert m.fast_rows == 32
        x = torch.randn(1, rows, m.in_features, generator=torch.Generator().manual_seed(rows + i)).bfloat16()
        got, want, served = _both(m, x)
        assert served == 1 and got.shape == (1, rows, m.out_features) and torch.equal(got, want)


@needs_kernel
def test_rows_a_fixed_stride_apart_are_read_in_place_and_others_made_contiguous(native_op):
    m = native_op[0]
    wide = torch.randn(6, 2 * m.in_features).bfloat16()
    half = wide[:, m.in_features:]  # gate|up's second half: rows 2K apart
    got, want, served = _both(m, half)
    assert served == 1 and torch.equal(got, want) and torch.equal(got, _both(m, half.contiguous())[0])
    uneven = torch.randn(3, 4, 2 * m.in_features).bfloat16()[:, 1:3, :m.in_features]  # rows not evenly spaced
    got, want, served = _both(m, uneven)
    assert served == 1 and torch.equal(got, want)


@needs_kernel
def test_every_other_case_goes_to_the_python_op_with_its_bits(native_op):
    m = native_op[1]
    got, want, served = _both(m, torch.randn(40, m.in_features).bfloat16())  # more rows than the kernel takes
    assert served == 0 and torch.equal(got, want)
    x = torch.randn(2, m.in_features).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(x, m.packed_weight, m.bias, "none", [], "")
    before = native_ops.served()["packed_linear"]
    got = torch.ops.tierlm_native.packed_linear(x, m.packed_weight, m.bias, m.out_features, 0, m.block,
                                                m.k_chunks)  # oneDNN asked for
    assert torch.equal(got, onednn)
    got = torch.ops.tierlm_native.packed_linear(x, m.packed_weight, m.bias, m.out_features, m.fast_rows, 0,
                                                m.k_chunks)  # no kernel named (block 0)
    assert torch.equal(got, onednn) and native_ops.served()["packed_linear"] == before
    with pytest.raises(RuntimeError):  # a wrong width reaches oneDNN, which says
        torch.ops.tierlm_native.packed_linear(torch.randn(2, 64).bfloat16(), m.packed_weight, m.bias,
                                              m.out_features, m.fast_rows, m.block, m.k_chunks)


@needs_kernel
def test_a_width_or_thread_count_without_a_chunk_table_goes_to_the_python_op(native_op):
    if KERNEL is not avx512_linear:
        pytest.skip("the AMX kernel takes no K chunk")
    m = _linear(128, 1024, False, 2)  # K=1024: never prepared, so no K chunks handed to the op
    assert m.fast_rows and not m.native and m.k_chunks == []
    x = torch.randn(3, 1024).bfloat16()
    got, want, served = _both(m, x)
    assert served == 0 and torch.equal(got, want)
    m = native_op[0]  # a width prepared, at a thread count it was not
    threads = torch.get_num_threads()
    assert m.k_chunks[0] == threads
    torch.set_num_threads(threads + 1)
    try:
        got, want, served = _both(m, torch.randn(3, m.in_features).bfloat16())
    finally:
        torch.set_num_threads(threads)
    assert served == 0 and torch.equal(got, want)


@needs_kernel
def test_one_row_vectors_and_evenly_spaced_batches_are_served_in_place(native_op):
    m = native_op[1]
    got, want, served = _both(m, torch.randn(m.in_features).bfloat16())  # a 1-D row
    assert served == 1 and got.shape == (m.out_features,) and torch.equal(got, want)
    rows = torch.randn(2, 3, 2 * m.in_features).bfloat16()[:, :, :m.in_features]  # [2, 3, K], rows 2K apart
    got, want, served = _both(m, rows)
    assert served == 1 and got.shape == (2, 3, m.out_features) and torch.equal(got, want)


def test_no_cpp_ops_are_handed_out_where_the_plan_has_none():
    """compiled_ops=python (TIERLM_CPU_PLAN), or no kernel library: ``prepare`` gives no step record, the layers
    keep the Python op, and the reason is the plan's."""
    off = bf16_kernels("compiled_ops=python")
    assert off.plan.compiled_ops.value == off.plan.compiled_attention.value == "python"
    model = torch.nn.Sequential(_linear(256, 512, False, 0))
    record, why = native_ops.prepare(model, off)
    assert record is None and f"{PLAN_ENV} compiled_ops=python" in why
    assert not model[0].native and model[0].k_chunks == []
    none = plan.for_model(torch.bfloat16, env={}, lib=None)  # as where no library loads (TIERLM_CPU_KERNELS=0)
    assert none.plan.compiled_ops.value == "python" and "no kernel library" in none.plan.compiled_ops.why
    record, why = native_ops.prepare(model, none)
    assert record is None and "no kernel library" in why and not model[0].native


def _recorded_ops(m: linear.PackedLinear) -> str:
    """The code of the graph a trace of the product a compiled PackedLinear records (ops.packed_linear)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(t):
        return ops.packed_linear(t, m.packed_weight, None, m.out_features, m.fast_rows, m.block, m.k_chunks, m.native)

    return make_fx(step)(torch.randn(2, m.in_features).bfloat16()).code


@needs_kernel
def test_traces_record_the_cpp_op_where_the_plan_has_it_and_the_python_op_where_not(native_op):
    m = native_op[0]
    assert "tierlm_native.packed_linear" in _recorded_ops(m)
    model = torch.nn.Sequential(_linear(256, 512, False, 0))
    record, why = native_ops.prepare(model, bf16_kernels("compiled_ops=python"))
    assert record is None and "compiled_ops=python" in why
    code = _recorded_ops(model[0])
    assert "tierlm.packed_linear" in code and "tierlm_native" not in code


class _Attention(nn.Module):
    """What ``prepare`` and ops.attention read of transformers' attention modules."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.o_proj = nn.Identity()


def _attention_kernels(dtype: torch.dtype, overrides: str = "") -> plan.CpuKernels:
    env = dict(os.environ)
    if overrides:
        env[PLAN_ENV] = overrides
    return plan.for_model(dtype, dtype, 8, 4, 64, env=env)


def _recorded_attention(module: _Attention) -> str:
    """The code of the graph a trace of a compiled layer's attention records (ops.attention)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v):
        return ops.attention(module, q, k, v, None, None, None)

    q, k = torch.randn(1, 8, 2, 64).bfloat16(), torch.randn(1, 4, 2, 64).bfloat16()
    return make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(q, k, k.clone()).code  # the record: real


def test_the_attention_modules_carry_the_step_record_unless_switched_off():
    """Compiled steps record the C++ attention op (the module carries the step record) only where the plan has
    compiled_attention=native over paged decode attention; compiled_attention=python, decode_attention=torch or
    compiled_ops=python keep the Python op. Its outputs: the test below, and test_compiled_decode's bit-for-bit
    test, where the decode-only step's layers run in it."""
    base = _attention_kernels(torch.bfloat16)
    if base.plan.compiled_attention.value != "native" or base.decode is None:
        pytest.skip(f"the plan has no C++ attention op here: {base.plan.compiled_attention}; "
                    f"{base.plan.decode_attention}")
    for overrides, carries in (("", True), ("compiled_attention=python", False), ("decode_attention=torch", False),
                               ("compiled_ops=python", False)):
        kernels = _attention_kernels(torch.bfloat16, overrides)
        model = nn.Sequential(_Attention(0), _Attention(1))
        record, why = native_ops.prepare(model, kernels)
        held = [getattr(m, ops.BUFFER, None) for m in model]
        if carries:
            assert record is not None and all(t is record.tensor for t in held) and "attention" in why, why
            assert "tierlm_native.paged_attention" in _recorded_attention(model[0])
        else:
            assert all(t is None for t in held), overrides
            code = _recorded_attention(model[0])
            assert "tierlm.paged_attention" in code and "tierlm_native" not in code, overrides


def _decode_step_inputs(H: int, Hkv: int, D: int, page_size: int, cached: list[int], dtype: torch.dtype,
                        layers: int = 2, seed: int = 0):
    """One decode step of requests with ``cached`` tokens before their new one, over scattered pages of a random
    pool: (pool, StepMeta, q [1, H, R, D], k, v [1, Hkv, R, D]), q and k the projections' transposed views."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = np.asarray(cached) + 1
    R, P = len(cached), -(-int(kv_lens.max()) // page_size)
    table = np.random.default_rng(seed).permutation(R * P + 3)[: R * P].reshape(R, P).astype(np.int32)
    pool = TorchKVPool(layers, R * P + 3, page_size, Hkv, D, dtype, torch.device("cpu"))
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(dtype))
    q = torch.randn(1, R, H, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, R, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, Hkv, R, D, generator=g).to(dtype)
    meta = pa.StepMeta(np.ones(R, np.int64), kv_lens, np.asarray(cached, np.int64), table, page_size,
                       torch.device("cpu"))
    return pool, meta, q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_attention_op_serves_the_records_step_and_hands_the_rest_to_the_python_op(dtype, monkeypatch):
    """A decode-only step's layer: with the step's DecodeStep in the record the C++ op runs it (paged_decode_step)
    with the Python op's bits and the same pool bytes; with the record's attention field 0 (a step the record does
    not hold, a sliding window) the Python op serves, and outside a tierlm step the Python op says so."""
    H, Hkv, D = 8, 4, 64
    kernels = plan.for_model(dtype, dtype, H, Hkv, D)
    if kernels.decode is None or kernels.plan.compiled_attention.value != "native":
        pytest.skip(f"the plan has no C++ attention op here: {kernels.plan.compiled_attention}; "
                    f"{kernels.plan.decode_attention}")
    lib = native_ops.registered(kernels.lib)
    assert lib is kernels.lib  # the process's library registered the ops
    record = StepRecord(lib, attention=True)
    pool, meta, q, k, v = _decode_step_inputs(H, Hkv, D, 16, [3, 200, 17], dtype)
    monkeypatch.setattr(pa.CURRENT, "meta", meta)
    monkeypatch.setattr(pa.CURRENT, "pool", pool)
    monkeypatch.setattr(pa.CURRENT, "kernels", kernels)
    layer, scale = 1, D ** -0.5

    def call(window: int = 0) -> tuple[torch.Tensor, int]:
        before = native_ops.served()["paged_attention"]
        out = torch.ops.tierlm_native.paged_attention(q, k, v, layer, scale, window, None, record.tensor)
        return out, native_ops.served()["paged_attention"] - before

    with record.step(True):  # a decode step whose attention the record does not hold
        assert record.read("attention") == 0
        python, served = call()
    assert served == 0 and python.shape == (1, 3, H, D)
    assert isinstance(meta.decode_step, decode_step.DecodeStep)  # the Python op planned the step's one call
    written = pool.buffer.clone()
    with record.step(True, meta.decode_step):
        assert record.read("attention") == 1
        native, served = call()
        assert call(window=8)[1] == 0  # a sliding window: the Python op
    assert served == 1 and torch.equal(native, python)
    assert torch.equal(pool.buffer, written)  # the same K/V at the same slots, nothing else moved
    assert record.read("attention") == 0 and record.read("decode") == 0  # cleared after the step
    assert torch.equal(torch.ops.tierlm.paged_attention(q, k, v, layer, scale, 0, None), python)
    monkeypatch.setattr(pa.CURRENT, "meta", None)
    with pytest.raises(RuntimeError, match="outside a tierlm forward step"):  # handed to the Python op
        call()
