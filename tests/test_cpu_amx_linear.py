"""The AMX tile kernel for decode-sized bf16 products (backends/torch/cpu_amx_linear.py): it reads oneDNN's packed
weight only where the layout was checked byte for byte, gives oneDNN's bits for every row count it takes, leaves
larger products, other layouts and other CPUs to oneDNN, and splits between threads without changing a bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from packed_kernels import onednn_product, record_products

from tierlm.backends.torch import cpu_amx_linear, cpu_linear
from tierlm.backends.torch.cpu_linear import PackedLinear, packing_available
from tierlm.platforms.cpu_features import parse_cpuinfo

PACKS, PACK_WHY = packing_available()
needs_packing = pytest.mark.skipif(not PACKS, reason=PACK_WHY)
needs_kernel = pytest.mark.skipif(cpu_amx_linear.load() is None, reason=cpu_amx_linear.describe()["why"] or "")


@pytest.fixture
def kernel_calls(monkeypatch):
    return record_products(monkeypatch, cpu_amx_linear)


def test_expected_layout_is_blocks_of_32_columns_with_inputs_in_pairs():
    """Runs everywhere: the layout the kernel reads, from a weight whose values name their place."""
    n, k = 40, 36
    w = (torch.arange(n)[:, None] * 100 + torch.arange(k)[None, :]).float()
    lay = cpu_amx_linear.expected_layout(w)
    assert lay.shape == (2, 32, 32, 2)  # N 40 -> 64, K 36 -> 64, padded with zeros
    for (b, p, c, e) in [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 31, 1), (0, 5, 7, 0), (1, 17, 7, 1), (0, 17, 3, 1)]:
        col, row = b * 32 + c, 2 * p + e
        assert lay[b, p, c, e] == (w[col, row] if col < n and row < k else 0)


@needs_packing
def test_a_layout_other_than_the_kernels_is_refused():
    w = torch.randn(64, 64).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.PACK_BATCH_HINT)
    other = torch.randn(64, 64).to(torch.bfloat16)
    assert not cpu_amx_linear.layout_matches(other, packed)  # another weight's bytes
    big = torch.randn(32 * 100 + 5, 64).to(torch.bfloat16)  # 101 blocks: 64 of them compared, the last included
    packed_big = torch.ops.mkldnn._reorder_linear_weight(big, cpu_linear.PACK_BATCH_HINT)
    if cpu_amx_linear.load() is not None:  # (without AMX oneDNN may pick the same blocks: the kernel is off there)
        assert cpu_amx_linear.layout_matches(big, packed_big)
    changed = big.clone()
    changed[-1, 3] += 1
    assert not cpu_amx_linear.layout_matches(changed, packed_big)
    odd = torch.randn(64, 48).to(torch.bfloat16)  # K not a multiple of 32: the A tiles would read past a row
    assert not cpu_amx_linear.layout_matches(odd, torch.ops.mkldnn._reorder_linear_weight(odd, 32))


@needs_packing
def test_without_the_kernel_packed_linears_keep_onednns_product(monkeypatch, kernel_calls):
    """The fallback (no AMX or AVX512-BF16 kernel, both ruled out, another layout): fast_rows 0, oneDNN at every
    count."""
    monkeypatch.setattr(cpu_linear, "decode_kernel", lambda: None)
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.fast_rows == 0
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias)) and not kernel_calls


def test_the_kernel_is_off_without_amx_and_when_ruled_out(monkeypatch):
    monkeypatch.delenv(cpu_amx_linear.ENV, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    avx512 = parse_cpuinfo("flags\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16\n"
                           "model name\t: AMD EPYC\n", "x86_64")
    build = cpu_amx_linear._load(avx512)
    assert build.lib is None and "no AMX" in build.why
    monkeypatch.setenv(cpu_amx_linear.ENV, "0")
    build = cpu_amx_linear._load(avx512)
    assert build.lib is None and f"{cpu_amx_linear.ENV}=0" in build.why
    amx = parse_cpuinfo("flags\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 amx_bf16 "
                        "amx_tile\nmodel name\t: Xeon\n", "x86_64")
    monkeypatch.delenv(cpu_amx_linear.ENV)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # oneDNN's own products would not be tile ones
    build = cpu_amx_linear._load(amx)
    assert build.lib is None and "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in build.why


@needs_packing
@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(96, 64), (100, 512), (120, 64), (1056, 1408)])  # last blocks of 4, 24 columns
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32])
def test_kernel_gives_onednns_bits(bias, n, k, rows, kernel_calls):
    torch.manual_seed(n + k + rows)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.fast_rows == cpu_amx_linear.MAX_ROWS
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
    packed = PackedLinear(lin)
    wide = torch.randn(1, rows, 640).to(torch.bfloat16)
    half = wide[..., 128:384]  # stride 640 between rows
    assert half.is_contiguous() == (rows == 1)  # one row is contiguous whatever the stride
    assert torch.equal(packed(half), onednn_product(half.contiguous(), lin))
    flat = wide[0, :, :256]  # 2-D, the same stride
    assert torch.equal(packed(flat), onednn_product(flat.contiguous(), lin))
    batched = torch.randn(3, rows, 512).to(torch.bfloat16)[:, :, ::2]  # every other input: copied first
    if 3 * rows <= cpu_amx_linear.MAX_ROWS:
        assert torch.equal(packed(batched), onednn_product(batched.contiguous(), lin))
    assert len(kernel_calls) == (3 if 3 * rows <= cpu_amx_linear.MAX_ROWS else 2)


@needs_packing
@needs_kernel
def test_nan_and_inf_sums_stay_nan_and_inf(kernel_calls):
    """The vector rounding keeps NaN a NaN and infinities infinite, as the scalar rounding and oneDNN do."""
    lin = nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.bias[3] = float("nan")
        lin.bias[33] = float("inf")
    packed = PackedLinear(lin)
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
    packed = PackedLinear(lin)
    x = torch.randn(cpu_amx_linear.MAX_ROWS + 1, 64).to(torch.bfloat16)
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
    packed = PackedLinear(lin)
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
    packed = PackedLinear(lin)
    packed(torch.randn(2, 512).to(torch.bfloat16))
    assert kernel_calls
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), first_sdpa)
    assert torch.equal(a @ b, first_mm)
    assert torch.equal(packed(a[:4]), F.linear(a[:4], lin.weight, lin.bias))
