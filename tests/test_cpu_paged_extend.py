"""bf16 extend attention reading pages in place (backends/torch/cpu_paged_extend.py): a few query rows per request
over its cached pages. Against transformers' bf16 eager attention for GQA and MHA shapes, head sizes with and
without a compiled-in specialization, pages of 16 and of 4 tokens, several requests in one call (outputs only in
their own rows); through paged_attention it takes short extends where the blocked path would run and leaves long
ones, AMX's SDPA choice and builds without the kernel to the paths they replace (tested in
test_cpu_blocked_attention.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_blocked_attention import _step, assert_bf16_equal, choose, eager_reference
from test_cpu_paged_decode import skip_unless_this_cpu_runs

from tierlm.backends.torch import cpu_blocked_attention, cpu_paged_decode, cpu_paged_extend, cpu_paged_extend_f32

lib = cpu_paged_decode.load()
needs_extend_kernel = pytest.mark.skipif(
    not cpu_paged_extend.available(lib),
    reason="the extend kernel is AVX-512 code and this CPU's build has none (or no C compiler): extends take the "
           "blocked path or SDPA, tested in test_cpu_blocked_attention.py")


@pytest.fixture(params=["amx", "avx512"])
def extend_code(request, monkeypatch):
    """The kernel's AMX tile code where this CPU runs it, and its AVX-512 code (forced off AMX on an AMX CPU)."""
    if request.param == "amx":
        if not cpu_paged_extend.amx_usable(lib):
            pytest.skip("this CPU has no AMX tiles (or its build or Linux gives none): the AVX-512 code serves")
    else:
        monkeypatch.setattr(cpu_paged_extend, "amx_usable", lambda lib: False)
    return request.param


@pytest.fixture(autouse=True)
def _blocked_unless_a_test_chooses(monkeypatch):
    """The blocked path's CPU class whatever this CPU is (AMX CPUs keep torch's SDPA for extends), on one intra-op
    thread unless a test splits the kernel itself."""
    choose(monkeypatch, "blocked")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    monkeypatch.undo()
    cpu_blocked_attention.choice.cache_clear()  # made again from the process's own setting


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
    q, k_slots, v_slots, table, kv_lens = _paged_problem(q_lens, cached, H, Hkv, D, page_size)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    out = torch.full_like(q, 7.0)
    t32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    cpu_paged_extend.paged_extend(lib, q, k_slots, v_slots, t32(table), t32(kv_lens), t32(starts), t32(q_lens),
                                  page_size, D ** -0.5, int(kv_lens.max()), out)
    assert_bf16_equal(out, _reference(q, k_slots, v_slots, table, kv_lens, q_lens, page_size, D ** -0.5))


@needs_extend_kernel
def test_extend_kernel_writes_only_the_rows_of_its_requests(extend_code):
    """Rows of requests the call does not name (another group's) keep what they held."""
    q_lens, cached = [4, 6], [20, 9]
    q, k_slots, v_slots, table, kv_lens = _paged_problem(q_lens, cached, 8, 4, 64, 16, seed=1)
    out = torch.full_like(q, 7.0)
    t32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    cpu_paged_extend.paged_extend(lib, q, k_slots, v_slots, t32(table[1:]), t32(kv_lens[1:]), t32([4]), t32([6]), 16,
                                  0.125, int(kv_lens[1]), out)
    assert torch.all(out[:4] == 7.0)
    ref = _reference(q, k_slots, v_slots, table, kv_lens, q_lens, 16, 0.125)
    assert_bf16_equal(out[4:], ref[4:])


@needs_extend_kernel
def test_paged_attention_sends_short_extends_to_the_kernel_and_long_ones_to_the_blocked_path(monkeypatch,
                                                                                            extend_code):
    """The blocked path's CPU class: an extend group of at most MAX_ROWS rows per request goes to the kernel (eager
    numerics, each request over its own pages), a longer one to the blocked GEMMs (they win there)."""
    calls = []
    real = cpu_paged_extend.paged_extend
    monkeypatch.setattr(cpu_paged_extend, "paged_extend", lambda *a: calls.append(a[7].tolist()) or real(*a))
    out, q, pool, table, kv_lens, positions = _step([20, 5], [33, 200], True, monkeypatch, expect_blocked=False)
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
    # _step's monkeypatch.undo() ended this test's patches and the forced choice: set them again
    choose(monkeypatch, "blocked")
    monkeypatch.setattr(cpu_paged_extend, "paged_extend", lambda *a: calls.append(a[7].tolist()) or real(*a))
    _step([20, 5, 70], [33, 200, 0], True, monkeypatch, expect_blocked=True)  # 70 rows: the blocked path
    assert calls == [[20, 5]]


@needs_extend_kernel
def test_where_the_kernel_runs(monkeypatch):
    """Without AMX tiles the AVX-512 code takes extends only where the blocked path would (not where torch's SDPA is
    chosen); with them, whichever is chosen. Never over fp8 pages or more than MAX_ROWS rows per request; float32
    takes cpu_paged_extend_f32's kernel (test_cpu_paged_extend_f32.py)."""
    q = torch.zeros(8, 3, 64, dtype=torch.bfloat16)
    runs = lambda q=q, kv=torch.bfloat16, rows=3: cpu_paged_extend.runs(lib, q, kv, 4, rows)  # noqa: E731
    amx = cpu_paged_extend.amx_usable(lib)
    choose(monkeypatch, "sdpa")
    assert runs() == amx
    choose(monkeypatch, "blocked")
    assert runs()
    assert not runs(kv=torch.float8_e4m3fn)
    assert runs(q.float(), torch.float32) == cpu_paged_extend_f32.available(lib)
    assert not runs(rows=cpu_paged_extend.MAX_ROWS + 1)
    monkeypatch.setattr(cpu_paged_extend, "amx_usable", lambda lib: False)
    choose(monkeypatch, "sdpa")
    assert not runs()


def test_builds_without_avx512_have_no_kernel_and_extends_still_run(monkeypatch, tmp_path):
    """An AVX2 build (what an AVX2-only CPU gets) lacks the kernel: ``available`` says so and paged_attention takes
    the blocked path for a short extend."""
    import ctypes

    from tierlm.backends.torch import c_kernel_build
    from tierlm.platforms.cpu_features import COMPILE_FLAGS, find_c_compiler

    skip_unless_this_cpu_runs("avx2")
    cc = find_c_compiler({})
    if cc is None:
        pytest.skip("no C compiler here")
    path = c_kernel_build.build_library("extend_test", cpu_paged_decode._SOURCE, cpu_paged_decode.CFLAGS, cc,
                                        c_kernel_build.compiler_identity(cc), "avx2", COMPILE_FLAGS["avx2"], tmp_path)
    built = ctypes.CDLL(str(path))
    cpu_paged_decode._bind(built)
    assert not cpu_paged_extend.available(built)
    monkeypatch.setattr(cpu_paged_decode, "load", lambda: built)
    out = _step([20, 5], [33, 200], True, monkeypatch, expect_blocked=True)[0]
    assert out.shape[0] == 25 and torch.isfinite(out.float()).all()


@needs_extend_kernel
def test_torch_tile_kernels_before_and_after_the_amx_code_give_the_same_results():
    """torch's own AMX code (its flash SDPA and oneDNN's bf16 matmul) keeps its tile configuration across a call of
    the tile kernel on the same thread: the same results before and after, no fault."""
    import torch.nn.functional as F

    if not cpu_paged_extend.amx_usable(lib):
        pytest.skip("this CPU has no AMX tiles (or its build or Linux gives none)")
    g = torch.Generator().manual_seed(5)
    a = torch.randn(1, 8, 300, 64, generator=g).bfloat16()
    x, w = torch.randn(64, 512, generator=g).bfloat16(), torch.randn(512, 512, generator=g).bfloat16()
    before = F.scaled_dot_product_attention(a, a, a, is_causal=True), x @ w
    q, k_slots, v_slots, table, kv_lens = _paged_problem([16], [300], 8, 4, 64, 16)
    t32 = lambda v: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int32))  # noqa: E731
    out = torch.empty_like(q)
    cpu_paged_extend.paged_extend(lib, q, k_slots, v_slots, t32(table), t32(kv_lens), t32([0]), t32([16]), 16,
                                  0.125, int(kv_lens[0]), out)
    after = F.scaled_dot_product_attention(a, a, a, is_causal=True), x @ w
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert_bf16_equal(out, _reference(q, k_slots, v_slots, table, kv_lens, [16], 16, 0.125))


@needs_extend_kernel
def test_threads_split_the_work_items_and_write_the_same_bits(monkeypatch, extend_code):
    """With several intra-op threads the (request, KV head) items go to helper threads beside the caller: the same
    outputs bit for bit as one thread."""
    from tierlm.backends.torch import cpu_threads

    q_lens, cached = [5, 12, 3], [40, 300, 0]
    q, k_slots, v_slots, table, kv_lens = _paged_problem(q_lens, cached, 8, 4, 64, 16, seed=2)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    t32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    call = lambda out: cpu_paged_extend.paged_extend(  # noqa: E731
        lib, q, k_slots, v_slots, t32(table), t32(kv_lens), t32(starts), t32(q_lens), 16, 0.125, int(kv_lens.max()),
        out)
    one = torch.full_like(q, 7.0)
    call(one)
    calls = []
    real = cpu_threads.helper_threads
    monkeypatch.setattr(cpu_paged_extend, "helper_threads", lambda n: calls.append(n) or real(n))
    torch.set_num_threads(3)  # the autouse fixture sets it back
    split = torch.full_like(q, 7.0)
    call(split)
    assert calls == [2]  # two helper threads beside the caller
    assert torch.equal(one, split)
