"""bf16 extend attention reading pages in place (backends/torch/cpu/paged_extend.py, its ``avx512`` and ``amx``
kernels): a few query rows per request over its cached pages. Against transformers' bf16 eager attention for GQA
and MHA shapes, head sizes with and without a compiled-in specialization, pages of 16 and of 4 tokens, several
requests in one call (outputs only in their own rows); through paged_attention it takes short extends where the CPU
plan (cpu/plan.py: ``extend_kernel``) has it and leaves long ones to the blocked path; the plan keeps it where the
blocked path runs or AMX tiles do, never beside AMX-less SDPA, and libraries without it leave extends to the paths
they replace (tested in test_cpu_blocked_attention.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_cpu_blocked_attention import _step, assert_bf16_equal, eager_reference, prefill_kernels
from test_cpu_paged_decode import kernels_for, lib, library_at

from tierlm.backends.torch.cpu import paged_extend
from tierlm.backends.torch.cpu import plan as cpu_plan
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.platforms.cpu_features import this_cpu
from tierlm.platforms.cpu_plan import Choice

needs_extend_kernel = pytest.mark.skipif(
    lib is None or not lib.has("paged_extend_bf16"),
    reason="the extend kernel is AVX-512 code and this CPU's library has none (or none loaded): extends take the "
           "blocked path or SDPA, tested in test_cpu_blocked_attention.py")


def amx_library() -> KernelLibrary:
    """The AMX level's library where this CPU runs it and Linux grants this process the tile state, else a skip."""
    amx = library_at("amx")  # skips on CPUs without AMX
    assert amx.has("paged_extend_amx") and this_cpu().has("amx_bf16", "amx_tile")
    if amx.amx_request_permission() != 1:
        pytest.skip("this CPU has AMX but Linux refused the tile state (arch_prctl): the AVX-512 code serves")
    return amx


@pytest.fixture(params=["amx", "avx512"])
def extend_code(request) -> tuple[KernelLibrary, str]:
    """(library, kernel): the AMX tile code where this CPU runs it, and the AVX-512 code of the process's library
    (on an AMX CPU too, where the plan would take the tiles)."""
    if request.param == "amx":
        return amx_library(), "amx"
    return lib, "avx512"


def extend_kernels(code: tuple[KernelLibrary, str]) -> cpu_plan.CpuKernels:
    """The plan of llama-small's shape with prefill on the blocked path, extends on ``code``'s kernel: the plan's
    own choice, except the AVX-512 code on an AMX CPU (the plan takes the tiles there: chosen here by hand)."""
    built, kernel = code
    kernels = prefill_kernels("blocked", lib=built)
    if kernels.plan.extend_kernel.value != kernel:
        assert (kernel, kernels.plan.extend_kernel.value) == ("avx512", "amx")
        kernels = cpu_plan.CpuKernels(dataclasses.replace(kernels.plan, extend_kernel=Choice(kernel, "the test")),
                                      built)
    assert kernels.extend is built and kernels.plan.extend_attention.value == "paged"
    return kernels


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread unless a test splits the kernel itself; the process's count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _paged_problem(q_lens, cached, H, Hkv, D, page_size, seed=0, dtype=torch.bfloat16):
    """A pool layer with shuffled pages and a step's queries: request r brings q_lens[r] rows after cached[r]."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = np.asarray(cached) + np.asarray(q_lens)
    R, P = len(q_lens), -(-int(kv_lens.max()) // page_size)
    pages = R * P + 3
    table = np.random.default_rng(seed).permutation(pages)[: R * P].reshape(R, P).astype(np.int32)
    k_slots, v_slots = (torch.randn(pages * page_size, Hkv, D, generator=g).to(dtype) for _ in range(2))
    T = int(sum(q_lens))
    q = torch.randn(T, H, D, generator=g).to(dtype)
    return q, k_slots, v_slots, table, kv_lens.astype(np.int32)


def _reference(q, k_slots, v_slots, table, kv_lens, q_lens, page_size, scale):
    """Each request's rows against transformers' bf16 eager attention over its own pages: [T, H, D]."""
    outs, start = [], 0
    for r, n in enumerate(q_lens):
        L = int(kv_lens[r])
        slots = torch.from_numpy(table[r, np.arange(L) // page_size].astype(np.int64) * page_size +
                                 np.arange(L) % page_size)
        k, v = (s.index_select(0, slots).transpose(0, 1)[None] for s in (k_slots, v_slots))
        limits = np.arange(L - n + 1, L + 1, dtype=np.int32)[None]
        outs.append(eager_reference(q[start:start + n].transpose(0, 1)[None], k, v, limits, scale)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def t32(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


@needs_extend_kernel
@pytest.mark.parametrize("q_lens,cached,H,Hkv,D,page_size", [
    ([16], [2000], 8, 4, 64, 16),           # a warm suffix over a long cached prefix, llama-small's heads
    ([3, 31, 1, 9], [40, 7, 300, 0], 14, 2, 64, 16),  # four requests, 7:1 GQA, one fresh, one a single row
    ([5, 12], [33, 150], 4, 4, 128, 4),     # MHA, 128 dims, pages of 4 tokens (a page lookup per key)
    ([20], [61], 6, 3, 32, 8),              # a head size without a specialization, an odd 8-token page
    ([40, 2], [100, 3], 8, 4, 64, 16),      # 80 query vectors of one KV head: two passes (64 + 16)
    ([7, 30], [50, 900], 6, 3, 96, 16),     # 96 dims: three 32-dim tiles, a 64-dim and a 32-dim output pass
])
def test_extend_kernel_equals_transformers_bf16_eager(q_lens, cached, H, Hkv, D, page_size, extend_code):
    built, kernel = extend_code
    q, k_slots, v_slots, table, kv_lens = _paged_problem(q_lens, cached, H, Hkv, D, page_size)
    assert paged_extend.runs(kernel, q.transpose(0, 1), torch.bfloat16, Hkv, min(q_lens))  # q [H, T, D]
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    out = torch.full_like(q, 7.0)
    paged_extend.paged_extend(built, kernel, q, k_slots, v_slots, t32(table), t32(kv_lens), t32(starts),
                              t32(q_lens), page_size, D ** -0.5, int(kv_lens.max()), out)
    assert_bf16_equal(out, _reference(q, k_slots, v_slots, table, kv_lens, q_lens, page_size, D ** -0.5))


@needs_extend_kernel
def test_extend_kernel_writes_only_the_rows_of_its_requests(extend_code):
    """Rows of requests the call does not name (another group's) keep what they held."""
    built, kernel = extend_code
    q_lens, cached = [4, 6], [20, 9]
    q, k_slots, v_slots, table, kv_lens = _paged_problem(q_lens, cached, 8, 4, 64, 16, seed=1)
    out = torch.full_like(q, 7.0)
    paged_extend.paged_extend(built, kernel, q, k_slots, v_slots, t32(table[1:]), t32(kv_lens[1:]), t32([4]),
                              t32([6]), 16, 0.125, int(kv_lens[1]), out)
    assert torch.all(out[:4] == 7.0)
    ref = _reference(q, k_slots, v_slots, table, kv_lens, q_lens, 16, 0.125)
    assert_bf16_equal(out[4:], ref[4:])


@needs_extend_kernel
def test_paged_attention_sends_short_extends_to_the_kernel_and_long_ones_to_the_blocked_path(monkeypatch,
                                                                                            extend_code):
    """The plan with the blocked path: an extend group of at most MAX_ROWS rows per request goes to the kernel
    (eager numerics, each request over its own pages), a longer one to the blocked GEMMs (they win there)."""
    kernels = extend_kernels(extend_code)
    calls = []
    real = paged_extend.paged_extend

    def counted(*a):
        assert a[0] is kernels.extend and a[1] == extend_code[1]  # the plan's library and kernel
        calls.append(a[8].tolist())
        return real(*a)

    monkeypatch.setattr(paged_extend, "paged_extend", counted)
    out, q, pool, table, kv_lens, positions = _step([20, 5], [33, 200], kernels, monkeypatch, expect_blocked=False)
    assert calls == [[20, 5]]
    start = 0
    for r, n in enumerate([20, 5]):
        L = int(kv_lens[r])
        slots = torch.from_numpy(table[r, np.arange(L) // 16].astype(np.int64) * 16 + np.arange(L) % 16)
        k, v = (pool.k[1].index_select(0, slots).transpose(0, 1)[None],
                pool.v[1].index_select(0, slots).transpose(0, 1)[None])
        limits = (positions[start:start + n] + 1)[None].astype(np.int32)
        ref = eager_reference(q[:, start:start + n][None], k, v, limits, 64 ** -0.5)[0].transpose(0, 1)
        assert_bf16_equal(out[start:start + n], ref)
        start += n
    # _step's monkeypatch.undo() ended this test's patches: set the count again
    monkeypatch.setattr(paged_extend, "paged_extend", counted)
    _step([20, 5, 70], [33, 200, 0], kernels, monkeypatch, expect_blocked=True)  # 70 rows: the blocked path
    assert calls == [[20, 5]]


@needs_extend_kernel
def test_where_the_kernel_runs():
    """The plan: without AMX tiles the AVX-512 code takes extends only where the blocked path serves prefill (not
    beside torch's SDPA); with them, the tiles whichever prefill path is chosen; never over fp8 pages; float32
    takes the float32 kernel (test_cpu_paged_extend_f32.py). The kernels: their dtype, head sizes and no more than
    MAX_ROWS rows per request."""
    amx = lib.has("paged_extend_amx") and this_cpu().has("amx_bf16", "amx_tile") and \
        lib.amx_request_permission() == 1
    tiles = "amx" if amx else "none"
    assert prefill_kernels("sdpa").plan.extend_kernel.value == tiles
    assert prefill_kernels("blocked").plan.extend_kernel.value == ("amx" if amx else "avx512")
    assert kernels_for(torch.bfloat16).plan.extend_kernel.value in ("amx", "avx512")  # the default prefill path
    fp8 = kernels_for(torch.bfloat16, torch.float8_e4m3fn)
    assert fp8.extend is None and fp8.plan.extend_attention.value == "torch" and fp8.plan.extend_kernel.value == "none"
    f32 = kernels_for(torch.float32)
    assert f32.plan.extend_kernel.value == ("f32" if lib.has("paged_extend_f32") else "none")
    # a library without the tile kernel beside SDPA (an AVX-512 library on any CPU): torch's path
    avx512 = library_at("avx512")
    assert prefill_kernels("sdpa", lib=avx512).plan.extend_kernel.value == "none"
    assert prefill_kernels("blocked", lib=avx512).plan.extend_kernel.value == "avx512"

    q = torch.zeros(8, 3, 64, dtype=torch.bfloat16)
    for kernel in ("avx512", "amx"):
        runs = lambda q=q, kv=torch.bfloat16, rows=3: paged_extend.runs(kernel, q, kv, 4, rows)  # noqa: E731
        assert runs()
        assert not runs(kv=torch.float8_e4m3fn)
        assert not runs(q.float(), torch.float32)  # float32: the f32 kernel's
        assert not runs(rows=paged_extend.MAX_ROWS + 1) and runs(rows=paged_extend.MAX_ROWS)
        assert not runs(torch.zeros(6, 3, 64, dtype=torch.bfloat16))  # 6 query heads over 4 KV heads
    assert paged_extend.runs("avx512", torch.zeros(8, 3, 48, dtype=torch.bfloat16), torch.bfloat16, 4, 3)
    assert not paged_extend.runs("amx", torch.zeros(8, 3, 48, dtype=torch.bfloat16), torch.bfloat16, 4, 3)  # 32s
    assert paged_extend.runs("f32", q.float(), torch.float32, 4, 3)
    assert not paged_extend.runs("none", q, torch.bfloat16, 4, 3)


def test_libraries_without_avx512_have_no_kernel_and_extends_still_run(monkeypatch):
    """An AVX2 library (what an AVX2-only CPU loads) lacks the kernel: the plan takes torch's path for extends and
    paged_attention takes the blocked path for a short extend."""
    avx2 = library_at("avx2")
    assert not avx2.has("paged_extend_bf16") and not avx2.has("paged_extend_amx")
    kernels = prefill_kernels("blocked", lib=avx2)
    assert kernels.extend is None and kernels.plan.extend_kernel.value == "none" and kernels.blocked is avx2
    out = _step([20, 5], [33, 200], kernels, monkeypatch, expect_blocked=True)[0]
    assert out.shape[0] == 25 and torch.isfinite(out.float()).all()


@needs_extend_kernel
def test_torch_tile_kernels_before_and_after_the_amx_code_give_the_same_results():
    """torch's own AMX code (its flash SDPA and oneDNN's bf16 matmul) keeps its tile configuration across a call of
    the tile kernel on the same thread: the same results before and after, no fault."""
    import torch.nn.functional as F

    amx = amx_library()
    g = torch.Generator().manual_seed(5)
    a = torch.randn(1, 8, 300, 64, generator=g).bfloat16()
    x, w = torch.randn(64, 512, generator=g).bfloat16(), torch.randn(512, 512, generator=g).bfloat16()
    before = F.scaled_dot_product_attention(a, a, a, is_causal=True), x @ w
    q, k_slots, v_slots, table, kv_lens = _paged_problem([16], [300], 8, 4, 64, 16)
    out = torch.empty_like(q)
    paged_extend.paged_extend(amx, "amx", q, k_slots, v_slots, t32(table), t32(kv_lens), t32([0]), t32([16]), 16,
                              0.125, int(kv_lens[0]), out)
    after = F.scaled_dot_product_attention(a, a, a, is_causal=True), x @ w
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert_bf16_equal(out, _reference(q, k_slots, v_slots, table, kv_lens, [16], 16, 0.125))


@needs_extend_kernel
def test_threads_split_the_work_items_and_write_the_same_bits(monkeypatch, extend_code):
    """With several intra-op threads the (request, KV head) items go to helper threads beside the caller: the same
    outputs bit for bit as one thread."""
    from tierlm.backends.torch.cpu import threads as cpu_threads

    built, kernel = extend_code
    q_lens, cached = [5, 12, 3], [40, 300, 0]
    q, k_slots, v_slots, table, kv_lens = _paged_problem(q_lens, cached, 8, 4, 64, 16, seed=2)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    call = lambda out: paged_extend.paged_extend(  # noqa: E731
        built, kernel, q, k_slots, v_slots, t32(table), t32(kv_lens), t32(starts), t32(q_lens), 16, 0.125,
        int(kv_lens.max()), out)
    one = torch.full_like(q, 7.0)
    call(one)
    calls = []
    real = cpu_threads.helper_threads
    monkeypatch.setattr(paged_extend, "helper_threads", lambda n: calls.append(n) or real(n))
    torch.set_num_threads(3)  # the autouse fixture sets it back
    split = torch.full_like(q, 7.0)
    call(split)
    assert calls == [2]  # two helper threads beside the caller
    assert torch.equal(one, split)
