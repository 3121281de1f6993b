"""The AVX512-BF16 kernel for decode-sized bf16 products (backends/torch/cpu/avx512_linear.py): it reads oneDNN's
packed weight only where the layout was checked byte for byte, sums K in the chunks the probe found oneDNN to use,
gives oneDNN's bits for every row count it takes, and leaves the rest (larger products, other layouts, widths that
are not whole blocks, row counts the probe could not match, other CPUs: the CPU plan's decode_products,
platforms/cpu_plan.py) to oneDNN. On an AMX machine it runs in tests/test_cpu_isa_emulation.py (a process capped at
avx512_bf16)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from packed_kernels import onednn_product, packing_refusal, planned_kernel, record_products

from tierlm.backends.torch.cpu import avx512_linear, linear, onednn_packed_weight
from tierlm.backends.torch.cpu.linear import PackedLinear
from tierlm.platforms import cpu_plan
from tierlm.platforms.cpu_features import parse_cpuinfo

PACK_REFUSAL = packing_refusal()
needs_packing = pytest.mark.skipif(PACK_REFUSAL is not None, reason=PACK_REFUSAL or "")
LIB, KERNEL_WHY = planned_kernel("avx512_bf16")  # the library where this CPU's plan runs decode products on it
needs_kernel = pytest.mark.skipif(LIB is None, reason=f"the AVX512-BF16 kernel does not run here: {KERNEL_WHY}")

AVX512_BF16 = "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16"
# the kernels of the install's avx512_bf16 and amx libraries (csrc/registry.c), as the plan reads them
AVX512_BF16_LIB = cpu_plan.LibraryFacts("avx512_bf16", frozenset({
    "paged_decode", "softmax_rows", "torch_ops", "paged_decode_avx512", "paged_extend_bf16", "paged_decode_dp",
    "blocked_attention", "avx512_linear", "paged_extend_f32", "f32_gemv", "int8_gemv"}), "the installed library")
AMX_LIB = cpu_plan.LibraryFacts("amx", AVX512_BF16_LIB.kernels | {"paged_extend_amx", "amx_linear"},
                                "the installed library", amx_granted=True)


def _packed(lin: nn.Linear) -> PackedLinear:
    """``lin`` packed as the plan packs it on this CPU: the AVX512-BF16 kernel for decode-sized products."""
    return PackedLinear(lin, avx512_linear, LIB)


@pytest.fixture
def kernel_calls(monkeypatch):
    return record_products(monkeypatch, avx512_linear)


def test_expected_layout_is_blocks_of_64_columns_with_inputs_in_pairs():
    """Runs everywhere: the layout the kernel reads, from a weight whose values name their place."""
    n, k = 70, 64
    w = (torch.arange(n)[:, None] * 100 + torch.arange(k)[None, :]).float()
    lay = avx512_linear.expected_layout(w)
    assert lay.shape == (2, 32, 64, 2)  # N 70 -> 128, padded with zeros
    for (b, p, c, e) in [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 63, 1), (0, 5, 7, 0), (1, 17, 5, 1), (1, 3, 6, 0)]:
        col, row = b * 64 + c, 2 * p + e
        assert lay[b, p, c, e] == (w[col, row] if col < n else 0)


@pytest.mark.parametrize("flags,lib,env,ok,why", [
    (AVX512_BF16, AVX512_BF16_LIB, {}, True, "AVX512-BF16"),
    ("fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512dq",
     cpu_plan.LibraryFacts("avx512", frozenset({"paged_decode", "softmax_rows", "torch_ops"})), {}, False,
     "no AVX512-BF16"),
    (AVX512_BF16, AVX512_BF16_LIB, {cpu_plan.PLAN_ENV: "decode_products=onednn"}, False, "decode_products=onednn"),
    (AVX512_BF16, AVX512_BF16_LIB, {"TIERLM_CPU_AVX512_LINEAR": "0"}, False, "TIERLM_CPU_AVX512_LINEAR=0"),
    (AVX512_BF16, AVX512_BF16_LIB, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False, "ONEDNN_MAX_CPU_ISA=AVX512_CORE"),
    (AVX512_BF16, cpu_plan.LibraryFacts("avx512", frozenset({"paged_decode", "softmax_rows", "torch_ops"})), {},
     False, "has no AVX512-BF16 kernel"),  # a library below the level (another install)
    (AVX512_BF16 + " amx_bf16 amx_tile", AMX_LIB, {}, False, "AMX-BF16: tile products"),  # the AMX kernel's
    (AVX512_BF16 + " amx_bf16 amx_tile", cpu_plan.LibraryFacts("amx", AMX_LIB.kernels, "", amx_granted=False), {},
     False, "AMX tiles"),  # not even where the AMX kernel cannot run: oneDNN's packed layout is the tiles'
    (AVX512_BF16 + " amx_bf16 amx_tile", AMX_LIB, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True, "AVX512-BF16"),
])
def test_the_kernel_runs_where_onednns_own_products_are_avx512_bf16_ones(flags, lib, env, ok, why):
    cpu = parse_cpuinfo(f"flags\t: {flags}\nmodel name\t: some CPU\n", "x86_64")
    decided = cpu_plan.decide(cpu, cpu_plan.ModelFacts("bfloat16", "bfloat16", 8, 4, 64), lib, env).decode_products
    assert (decided.value == "avx512_bf16") == ok and why in decided.why, decided
    if not ok and "decode_products" not in cpu_plan.read_overrides(env):  # not switched off: it cannot run here,
        with pytest.raises(cpu_plan.CpuPlanError, match="avx512_bf16 cannot run here"):  # and asking for it says why
            cpu_plan.decide(cpu, cpu_plan.ModelFacts("bfloat16", "bfloat16", 8, 4, 64), lib,
                            {**env, cpu_plan.PLAN_ENV: "decode_products=avx512_bf16"})


@needs_packing
@needs_kernel
def test_a_layout_other_than_the_kernels_and_partial_blocks_are_refused():
    w = torch.randn(128, 64).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, linear.PACK_BATCH_HINT)
    assert avx512_linear.layout_matches(w, packed)
    assert not avx512_linear.layout_matches(torch.randn(128, 64).to(torch.bfloat16), packed)  # other bytes
    changed = w.clone()
    changed[-1, 3] += 1
    assert not avx512_linear.layout_matches(changed, packed)
    partial = nn.Linear(64, 100).to(torch.bfloat16)  # 100 columns: not whole blocks of 64, oneDNN keeps it
    assert _packed(partial).fast_rows == 0
    assert _packed(nn.Linear(64, 128).to(torch.bfloat16)).fast_rows == avx512_linear.MAX_ROWS


@needs_packing
@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(128, 64), (192, 512), (1024, 1408), (256, 4864), (896, 896)])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 10, 11, 13, 32])
def test_kernel_gives_onednns_bits(bias, n, k, rows, kernel_calls):
    """K of 1408, 4864 (and 896 at one row) are summed by oneDNN in several chunks; 7-10 rows go span by span (3 + 4
    to 5 + 5 rows; K=64 shorter than a span); 11 and 13 rows take uneven whole-block passes of the kernel's 6-row
    groups."""
    torch.manual_seed(n + k + rows)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    packed = _packed(lin)
    assert packed.fast_rows == avx512_linear.MAX_ROWS
    x = torch.randn(1, rows, k).to(torch.bfloat16)
    out = packed(x)
    assert out.shape == (1, rows, n) and kernel_calls == [((1, rows, k), True)]
    assert torch.equal(out, onednn_product(x, lin)) and torch.equal(out, F.linear(x, lin.weight, lin.bias))


@needs_packing
@needs_kernel
@pytest.mark.parametrize("kc", [126, 200, 1408])
def test_span_by_span_rows_equal_the_whole_block_passes(kc):
    """7-10 rows (span by span) against the same rows inside an 11-row product (whole-block passes): the same bits,
    with K chunks that end inside a span (126, 200) and one chunk of all K; strided rows, a bias-free weight."""
    torch.manual_seed(kc)
    w = torch.randn(192, 1408).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    if not avx512_linear.layout_matches(w, packed):
        pytest.skip("oneDNN packed this weight in another layout here")
    x = torch.randn(11, 2000).to(torch.bfloat16)[:, 100:1508]  # rows 2000 elements apart
    whole = avx512_linear._product_at(LIB, x, packed, 192, kc)
    for rows in (7, 8, 9, 10):
        assert torch.equal(avx512_linear._product_at(LIB, x[:rows], packed, 192, kc), whole[:rows])


@needs_packing
@needs_kernel
def test_the_probe_tells_the_chunkings_apart():
    """Only one candidate chunking reproduces oneDNN's bits on the probe at each row count: a probe that let two
    pass could pick the wrong one."""
    k = 1408
    threads = torch.get_num_threads()
    found = avx512_linear.chunk_sizes(LIB, k, threads)
    assert all(found[1:]), found
    x, w, packed = avx512_linear._probe(k, threads)
    for rows in (1, 2, 8):
        want = torch.ops.mkldnn._linear_pointwise(x[:rows], packed, None, "none", [], "")
        matching = [c for c in [k, *avx512_linear.CHUNK_CANDIDATES] if c <= k and torch.equal(
            avx512_linear._product_at(LIB, x[:rows], packed, w.shape[0], c), want)]
        assert matching == [found[rows]]


@needs_packing
@needs_kernel
def test_with_more_threads_the_probe_widens_to_onednns_layout(kernel_calls):
    """oneDNN packs a weight with few columns per thread in narrower blocks (128 columns at 3 threads): the probe
    widens until its layout is the kernel's, and a weight packed another way keeps oneDNN's product."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        found = avx512_linear.chunk_sizes(LIB, 512, 4)
        assert all(found[1:]), found
        assert avx512_linear._probe(512, 4)[1].shape[0] >= 64 * 4
        torch.manual_seed(4)
        wide = nn.Linear(512, 1024, bias=True).to(torch.bfloat16)
        packed = _packed(wide)
        x = torch.randn(3, 512).to(torch.bfloat16)
        if packed.fast_rows:  # oneDNN packed this width in the kernel's layout at 4 threads
            assert torch.equal(packed(x), onednn_product(x, wide)) and kernel_calls == [((3, 512), True)]
        narrow = nn.Linear(512, 128).to(torch.bfloat16)
        narrow_packed = _packed(narrow)
        if not avx512_linear.layout_matches(narrow.weight.detach(), narrow_packed.packed_weight):
            assert narrow_packed.fast_rows == 0
        assert torch.equal(narrow_packed(x), onednn_product(x, narrow))
    finally:
        torch.set_num_threads(before)


@needs_packing
@needs_kernel
def test_a_row_count_the_probe_could_not_match_keepsonednn_product(monkeypatch, kernel_calls):
    lin = nn.Linear(512, 128, bias=True).to(torch.bfloat16)
    packed = _packed(lin)
    real = avx512_linear.chunk_sizes(LIB, 512, torch.get_num_threads())
    no_match_at_3 = real[:3] + (0,) + real[4:]
    monkeypatch.setattr(avx512_linear, "chunk_sizes", lambda lib, k, threads: no_match_at_3)
    x = torch.randn(3, 512).to(torch.bfloat16)
    assert torch.equal(packed(x), onednn_product(x, lin)) and kernel_calls == [((3, 512), False)]  # asked, declined
    assert torch.equal(packed(x[:2]), onednn_product(x[:2], lin))


@needs_packing
@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 20])
def test_rows_a_stride_apart_are_read_in_place(rows, kernel_calls):
    torch.manual_seed(rows)
    lin = nn.Linear(256, 128, bias=True).to(torch.bfloat16)
    packed = _packed(lin)
    wide = torch.randn(1, rows, 640).to(torch.bfloat16)
    half = wide[..., 128:384]  # stride 640 between rows
    assert torch.equal(packed(half), onednn_product(half.contiguous(), lin))
    flat = wide[0, :, :256]
    assert torch.equal(packed(flat), onednn_product(flat.contiguous(), lin))
    assert kernel_calls == [((1, rows, 256), True), ((rows, 256), True)]


@needs_packing
@needs_kernel
def test_nan_and_inf_sums_stay_nan_and_inf(kernel_calls):
    lin = nn.Linear(64, 64, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.bias[3] = float("nan")
        lin.bias[33] = float("inf")
    packed = _packed(lin)
    x = torch.randn(8, 64).to(torch.bfloat16)  # 8 rows: the span-by-span path (3 rows: whole-block passes below)
    x[1, 5] = float("nan")
    out, ref = packed(x), onednn_product(x, lin)
    assert kernel_calls == [((8, 64), True)]
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan()[1].all() and out.isnan()[:, 3].all()
    assert out[0, 33].isinf() and torch.equal(out[~ref.isnan()], ref[~ref.isnan()])
    kernel_calls.clear()
    x = x[:3].clone()
    out, ref = packed(x), onednn_product(x, lin)
    assert kernel_calls == [((3, 64), True)]
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan()[1].all() and out.isnan()[:, 3].all()
    assert out[0, 33].isinf() and torch.equal(out[~ref.isnan()], ref[~ref.isnan()])


@needs_packing
@needs_kernel
def test_larger_products_and_wrong_widths_stay_withonednn_product(kernel_calls):
    lin = nn.Linear(64, 128).to(torch.bfloat16)
    packed = _packed(lin)
    x = torch.randn(avx512_linear.MAX_ROWS + 1, 64).to(torch.bfloat16)
    assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias)) and not kernel_calls
    with pytest.raises(RuntimeError):  # a wrong width: the kernel declines, oneDNN's error, no read past the weight
        packed(torch.randn(1, 96).to(torch.bfloat16))
    assert kernel_calls == [((1, 96), False)]


@needs_packing
@needs_kernel
def test_threads_split_the_columns_without_changing_a_bit(kernel_calls, monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(1408, 3072, bias=False).to(torch.bfloat16)  # 4.3 M weights: two threads' worth, 48 blocks
    x = torch.randn(5, 1408).to(torch.bfloat16)
    helpers = onednn_packed_weight.helper_threads
    handed_off = []
    monkeypatch.setattr(onednn_packed_weight, "helper_threads", lambda n: handed_off.append(n) or helpers(n))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        packed = _packed(lin)  # packed at 2 threads, as a server computing with 2 threads packs it
        threaded = packed(x)
    finally:
        torch.set_num_threads(before)
    assert kernel_calls == [((5, 1408), True)] and handed_off == [1]  # one slice on a helper, one on the caller
    assert torch.equal(threaded, onednn_product(x, lin))
