"""The AMX tile kernel for decode-sized bf16 products (backends/torch/cpu/amx_linear.py): it reads oneDNN's packed
weight only where the layout was checked byte for byte, gives oneDNN's bits for every row count it takes, leaves
larger products, other layouts and other CPUs to oneDNN (the CPU plan's decode_products, platforms/cpu_plan.py),
and splits between threads without changing a bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from packed_kernels import bf16_kernels, onednn_product, packing_refusal, planned_kernel, record_products

from tierlm.backends.torch.cpu import amx_linear, linear
from tierlm.backends.torch.cpu.linear import PackedLinear, pack_linears
from tierlm.platforms import cpu_plan
from tierlm.platforms.cpu_features import parse_cpuinfo

PACK_REFUSAL = packing_refusal()
needs_packing = pytest.mark.skipif(PACK_REFUSAL is not None, reason=PACK_REFUSAL or "")
LIB, KERNEL_WHY = planned_kernel("amx")  # the library where this CPU's plan runs decode products on AMX tiles
needs_kernel = pytest.mark.skipif(LIB is None, reason=f"the AMX kernel does not run here: {KERNEL_WHY}")


def _packed(lin: nn.Linear) -> PackedLinear:
    """``lin`` packed as the plan packs it on this CPU: the AMX kernel for decode-sized products."""
    return PackedLinear(lin, amx_linear, LIB)


@pytest.fixture
def kernel_calls(monkeypatch):
    return record_products(monkeypatch, amx_linear)


def test_expected_layout_is_blocks_of_32_columns_with_inputs_in_pairs():
    """Runs everywhere: the layout the kernel reads, from a weight whose values name their place."""
    n, k = 40, 36
    w = (torch.arange(n)[:, None] * 100 + torch.arange(k)[None, :]).float()
    lay = amx_linear.expected_layout(w)
    assert lay.shape == (2, 32, 32, 2)  # N 40 -> 64, K 36 -> 64, padded with zeros
    for (b, p, c, e) in [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 31, 1), (0, 5, 7, 0), (1, 17, 7, 1), (0, 17, 3, 1)]:
        col, row = b * 32 + c, 2 * p + e
        assert lay[b, p, c, e] == (w[col, row] if col < n and row < k else 0)


@needs_packing
def test_a_layout_other_than_the_kernels_is_refused():
    w = torch.randn(64, 64).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, linear.PACK_BATCH_HINT)
    other = torch.randn(64, 64).to(torch.bfloat16)
    assert not amx_linear.layout_matches(other, packed)  # another weight's bytes
    big = torch.randn(32 * 100 + 5, 64).to(torch.bfloat16)  # 101 blocks: 64 of them compared, the last included
    packed_big = torch.ops.mkldnn._reorder_linear_weight(big, linear.PACK_BATCH_HINT)
    if LIB is not None:  # (without AMX oneDNN may pick the same blocks: the kernel is off there)
        assert amx_linear.layout_matches(big, packed_big)
    changed = big.clone()
    changed[-1, 3] += 1
    assert not amx_linear.layout_matches(changed, packed_big)
    odd = torch.randn(64, 48).to(torch.bfloat16)  # K not a multiple of 32: the A tiles would read past a row
    assert not amx_linear.layout_matches(odd, torch.ops.mkldnn._reorder_linear_weight(odd, 32))


@needs_packing
def test_without_the_kernel_packed_linears_keep_onednns_product(kernel_calls):
    """The fallback (no AMX or AVX512-BF16 kernel, both ruled out, another layout): fast_rows 0, oneDNN at every
    count; the same where the plan says decode_products=onednn."""
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    packed = PackedLinear(lin)  # no kernel
    assert packed.fast_rows == 0 and packed.block == 0
    assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias)) and not kernel_calls
    assert PackedLinear(lin, amx_linear, None).fast_rows == 0  # a kernel without its library
    kernels = bf16_kernels("decode_products=onednn")
    assert kernels.plan.decode_products.value == "onednn"
    model = nn.Sequential(lin)
    assert pack_linears(model, kernels) == 1
    assert isinstance(model[0], PackedLinear) and model[0].fast_rows == 0 and model[0].kernel is None
    assert torch.equal(model(x), F.linear(x, lin.weight, lin.bias)) and not kernel_calls


AVX512_BF16 = "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16"
BF16_MODEL = cpu_plan.ModelFacts("bfloat16", "bfloat16", 8, 4, 64)
# the kernels of the install's avx512_bf16 and amx libraries (csrc/registry.c), as the plan reads them
AVX512_BF16_LIB = cpu_plan.LibraryFacts("avx512_bf16", frozenset({
    "paged_decode", "softmax_rows", "torch_ops", "paged_decode_avx512", "paged_extend_bf16", "paged_decode_dp",
    "blocked_attention", "avx512_linear", "paged_extend_f32", "f32_gemv", "int8_gemv"}), "the installed library")
AMX_LIB = cpu_plan.LibraryFacts("amx", AVX512_BF16_LIB.kernels | {"paged_extend_amx", "amx_linear"},
                                "the installed library", amx_granted=True)


def _decode_products(flags: str, lib: cpu_plan.LibraryFacts, env: dict) -> cpu_plan.Choice:
    cpu = parse_cpuinfo(f"flags\t: {flags}\nmodel name\t: some CPU\n", "x86_64")
    return cpu_plan.decide(cpu, BF16_MODEL, lib, env).decode_products


def test_the_kernel_is_off_without_amx_and_when_ruled_out():
    """The plan (platforms/cpu_plan.py) runs decode products on AMX tiles only on an AMX CPU whose oneDNN packs
    for tiles, with the library's AMX kernel and Linux's tile state; the rest falls to the AVX512-BF16 kernel or
    oneDNN, with the reason."""
    amx = AVX512_BF16 + " amx_bf16 amx_tile"
    assert _decode_products(amx, AMX_LIB, {}).value == "amx"
    without = _decode_products(AVX512_BF16, AVX512_BF16_LIB, {})  # no AMX on this CPU (an AMD EPYC)
    assert without.value == "avx512_bf16" and "no AMX" in without.why
    with pytest.raises(cpu_plan.CpuPlanError, match="no AMX"):  # asked for, refused with the reason
        _decode_products(AVX512_BF16, AVX512_BF16_LIB, {cpu_plan.PLAN_ENV: "decode_products=amx"})
    # switched off: the plan's override (oneDNN's product; the AVX512-BF16 kernel cannot read a tile layout)
    off = _decode_products(amx, AMX_LIB, {cpu_plan.PLAN_ENV: "decode_products=onednn"})
    assert off == cpu_plan.Choice("onednn", f"{cpu_plan.PLAN_ENV} decode_products=onednn")
    # its earlier switch, on a CPU without AMX: nothing to turn off, the AVX512-BF16 kernel as before
    old = _decode_products(AVX512_BF16, AVX512_BF16_LIB, {"TIERLM_CPU_AMX_LINEAR": "0"})
    assert old.value == "avx512_bf16" and "no AMX" in old.why
    # oneDNN's own products would not be tile ones: the AVX512-BF16 kernel reads its layout
    capped = _decode_products(amx, AMX_LIB, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert capped.value == "avx512_bf16" and "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in capped.why
    assert _decode_products(amx, AMX_LIB, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}).value == "amx"
    # a library without the AMX kernel (the avx512_bf16 level's), or Linux refusing the tile state
    no_kernel = _decode_products(amx, AVX512_BF16_LIB, {})
    assert no_kernel.value == "onednn" and "has no AMX kernel" in no_kernel.why and "AMX tiles" in no_kernel.why
    refused = _decode_products(amx, cpu_plan.LibraryFacts("amx", AMX_LIB.kernels, "", amx_granted=False), {})
    assert refused.value == "onednn" and "Linux refused the AMX tile state" in refused.why


def test_the_earlier_switch_turns_the_kernel_off_on_an_amx_cpu():
    """TIERLM_CPU_AMX_LINEAR=0 (read by the plan as an override, cpu_plan.RENAMED) turned the AMX kernel off and
    left decode products to oneDNN on AMX CPUs (the only ones where it ran); it must not stop the server there."""
    off = _decode_products(AVX512_BF16 + " amx_bf16 amx_tile", AMX_LIB, {"TIERLM_CPU_AMX_LINEAR": "0"})
    assert off.value == "onednn" and "TIERLM_CPU_AMX_LINEAR=0" in off.why, off


@needs_packing
@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(96, 64), (100, 512), (120, 64), (1056, 1408)])  # last blocks of 4, 24 columns
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32])
def test_kernel_gives_onednns_bits(bias, n, k, rows, kernel_calls):
    torch.manual_seed(n + k + rows)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    packed = _packed(lin)
    assert packed.fast_rows == amx_linear.MAX_ROWS
    x = torch.randn(1, rows, k).to(torch.bfloat16)
    out = packed(x)
    assert out.shape == (1, rows, n) and kernel_calls == [((1, rows, k), True)]
    assert torch.equal(out, onednn_product(x, lin)) and torch.equal(out, F.linear(x, lin.weight, lin.bias))


@needs_packing
@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 20])
def test_rows_a_stride_apart_are_read_in_place(rows, kernel_calls):
    """A half of a wider product (gate|up's gate half after the activation) is rows a fixed stride apart: the
    kernel reads them where they are; other layouts are made contiguous first. oneDNN's bits either way."""
    torch.manual_seed(rows)
    lin = nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    packed = _packed(lin)
    wide = torch.randn(1, rows, 640).to(torch.bfloat16)
    half = wide[..., 128:384]  # stride 640 between rows
    assert half.is_contiguous() == (rows == 1)  # one row is contiguous whatever the stride
    assert torch.equal(packed(half), onednn_product(half.contiguous(), lin))
    flat = wide[0, :, :256]  # 2-D, the same stride
    assert torch.equal(packed(flat), onednn_product(flat.contiguous(), lin))
    batched = torch.randn(3, rows, 512).to(torch.bfloat16)[:, :, ::2]  # every other input: copied first
    if 3 * rows <= amx_linear.MAX_ROWS:
        assert torch.equal(packed(batched), onednn_product(batched.contiguous(), lin))
    assert len(kernel_calls) == (3 if 3 * rows <= amx_linear.MAX_ROWS else 2)


@needs_packing
@needs_kernel
def test_nan_and_inf_sums_stay_nan_and_inf(kernel_calls):
    """The vector rounding keeps NaN a NaN and infinities infinite, as the scalar rounding and oneDNN do."""
    lin = nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.bias[3] = float("nan")
        lin.bias[33] = float("inf")
    packed = _packed(lin)
    x = torch.randn(3, 64).to(torch.bfloat16)
    x[1, 5] = float("nan")
    out, ref = packed(x), onednn_product(x, lin)
    assert kernel_calls
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan()[1].all() and out.isnan()[:, 3].all()
    assert torch.equal(out[[0, 2]][:, 33], ref[[0, 2]][:, 33]) and out[0, 33].isinf()
    finite = ~ref.isnan()
    assert torch.equal(out[finite], ref[finite])


@needs_packing
@needs_kernel
def test_larger_products_stay_withonednn_product(kernel_calls):
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    packed = _packed(lin)
    x = torch.randn(amx_linear.MAX_ROWS + 1, 64).to(torch.bfloat16)
    assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias)) and not kernel_calls
    with pytest.raises(RuntimeError):  # a wrong width: the kernel declines, oneDNN's error, no read past the weight
        packed(torch.randn(1, 96).to(torch.bfloat16))
    assert kernel_calls == [((1, 96), False)]
    assert torch.equal(packed(x[:0]), x[:0] @ lin.weight.T) and len(kernel_calls) == 1  # no rows: nothing to stream


@needs_packing
@needs_kernel
def test_threads_split_the_columns_without_changing_a_bit(kernel_calls):
    torch.manual_seed(0)
    lin = nn.Linear(1024, 3100, bias=False).to(torch.bfloat16)  # 3.2 M weights: three threads' worth, 97 blocks
    packed = _packed(lin)
    assert packed.fast_rows
    x = torch.randn(5, 1024).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        threaded = packed(x)
    finally:
        torch.set_num_threads(before)
    assert kernel_calls == [((5, 1024), True)] and torch.equal(threaded, onednn_product(x, lin))


@needs_packing
@needs_kernel
def test_torch_tile_kernels_before_and_after_give_the_same_results(kernel_calls):
    """The kernel loads its own tile configuration and gives the caller's back: torch's brgemm (bf16 flash SDPA)
    keeps one per thread and skips reloading it."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 4, 64, 64).to(torch.bfloat16) for _ in range(3))
    a, b = torch.randn(64, 512).to(torch.bfloat16), torch.randn(512, 256).to(torch.bfloat16)
    first_sdpa, first_mm = F.scaled_dot_product_attention(q, k, v, is_causal=True), a @ b
    lin = nn.Linear(512, 128).to(torch.bfloat16)
    packed = _packed(lin)
    packed(torch.randn(2, 512).to(torch.bfloat16))
    assert kernel_calls
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), first_sdpa)
    assert torch.equal(a @ b, first_mm)
    assert torch.equal(packed(a[:4]), F.linear(a[:4], lin.weight, lin.bias))
