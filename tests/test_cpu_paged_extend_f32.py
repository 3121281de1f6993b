"""float32 extend attention reading pages in place (backends/torch/cpu/paged_extend.py's ``f32`` kernel), in the
AVX2 library (what an AVX2-only CPU serves float32 with) and the AVX-512 one, wherever this CPU runs them: against
the float64 attention of each request over its own pages for GQA and MHA shapes, head sizes 8 to 128, pages of 16,
8 and 4 tokens, several requests in one call (outputs only in their own rows), passes of 64 query vectors; through
paged_attention with the CPU plan of a float32 model (cpu/plan.py: ``extend_kernel=f32``) it takes short float32
extends and leaves longer ones, bf16 and libraries without it to the paths they replace."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_cpu_paged_decode import kernels_for, library_at, run_step
from test_cpu_paged_extend import _paged_problem

from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.cpu import paged_extend
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.kv_pool import TorchKVPool


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def built(request) -> KernelLibrary:
    """The kernel library of the level (its 8-lane or its 16-lane code), where this CPU runs it."""
    lib = library_at(request.param)
    assert lib.has("paged_extend_f32")
    return lib


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def t32(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def _problem(q_lens, cached, H, Hkv, D, page_size, seed=0):
    """A float32 pool layer with shuffled pages and a step's queries: request r brings q_lens[r] rows after
    cached[r]."""
    return _paged_problem(q_lens, cached, H, Hkv, D, page_size, seed, torch.float32)


def _reference(q, k_slots, v_slots, table, kv_lens, q_lens, page_size, scale) -> torch.Tensor:
    """Each request's rows attending causally over its own pages, in float64: [T, H, D]."""
    outs, start = [], 0
    for r, n in enumerate(q_lens):
        L = int(kv_lens[r])
        slots = torch.from_numpy(table[r, np.arange(L) // page_size].astype(np.int64) * page_size +
                                 np.arange(L) % page_size)
        k, v = (s.index_select(0, slots).transpose(0, 1)[None].double() for s in (k_slots, v_slots))
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
        qr = q[start:start + n].transpose(0, 1)[None].double()
        o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).float())
        start += n
    return torch.cat(outs)


def _extend(lib, q, k_slots, v_slots, table, kv_lens, q_lens, page_size, scale, out=None) -> torch.Tensor:
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    out = torch.full_like(q, 7.0) if out is None else out
    paged_extend.paged_extend(lib, "f32", q, k_slots, v_slots, t32(table), t32(kv_lens), t32(starts), t32(q_lens),
                              page_size, scale, int(kv_lens.max()), out)
    return out


@pytest.mark.parametrize("q_lens,cached,H,Hkv,D,page_size", [
    ([16], [2000], 8, 4, 64, 16),           # a warm suffix over a long cached prefix, llama-small's heads
    ([3, 31, 1, 9], [40, 7, 300, 0], 14, 2, 64, 16),  # four requests, 7:1 GQA, one fresh, one a single row
    ([5, 12], [33, 150], 4, 4, 128, 4),     # MHA, 128 dims, pages of 4 tokens
    ([20], [61], 6, 3, 24, 8),              # 24 dims (no specialization), 8-token pages
    ([40, 2], [100, 3], 8, 4, 64, 16),      # 80 query vectors of one KV head: two passes (64 + 16)
    ([128], [10], 2, 1, 8, 16),             # the most rows, 8 dims, keys fewer than a score tile at first
    ([1], [0], 2, 1, 64, 16),               # one row over one key
])
def test_extend_kernel_equals_the_float64_attention(built, q_lens, cached, H, Hkv, D, page_size):
    q, k_slots, v_slots, table, kv_lens = _problem(q_lens, cached, H, Hkv, D, page_size)
    out = _extend(built, q, k_slots, v_slots, table, kv_lens, q_lens, page_size, D ** -0.5)
    ref = _reference(q, k_slots, v_slots, table, kv_lens, q_lens, page_size, D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=3e-6)


def test_extend_kernel_is_as_close_as_torch_sdpa_in_float32(built):
    """Its distance from the float64 result is of the order of float32 SDPA's own."""
    q_lens, cached = [16, 7], [900, 60]
    q, k_slots, v_slots, table, kv_lens = _problem(q_lens, cached, 8, 2, 64, 16, seed=3)
    ref = _reference(q, k_slots, v_slots, table, kv_lens, q_lens, 16, 0.125)
    ours = (_extend(built, q, k_slots, v_slots, table, kv_lens, q_lens, 16, 0.125) - ref).abs().max().item()
    sdpa = []
    start = 0
    for r, n in enumerate(q_lens):
        L = int(kv_lens[r])
        slots = torch.from_numpy(table[r, np.arange(L) // 16].astype(np.int64) * 16 + np.arange(L) % 16)
        k, v = (s.index_select(0, slots).transpose(0, 1)[None] for s in (k_slots, v_slots))
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
        o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1)[None], k, v, attn_mask=mask,
                                           scale=0.125, enable_gqa=True)[0].transpose(0, 1)
        sdpa.append(o)
        start += n
    theirs = (torch.cat(sdpa) - ref).abs().max().item()
    assert ours <= 4 * theirs + 1e-7, (ours, theirs)


def test_extend_kernel_writes_only_the_rows_of_its_requests(built):
    """Rows of requests the call does not name (another group's) keep what they held."""
    q_lens, cached = [4, 6], [20, 9]
    q, k_slots, v_slots, table, kv_lens = _problem(q_lens, cached, 8, 4, 64, 16, seed=1)
    out = torch.full_like(q, 7.0)
    paged_extend.paged_extend(built, "f32", q, k_slots, v_slots, t32(table[1:]), t32(kv_lens[1:]), t32([4]),
                              t32([6]), 16, 0.125, int(kv_lens[1]), out)
    assert torch.all(out[:4] == 7.0)
    ref = _reference(q, k_slots, v_slots, table, kv_lens, q_lens, 16, 0.125)
    torch.testing.assert_close(out[4:], ref[4:], rtol=0, atol=3e-6)


def test_threads_split_the_work_items_and_write_the_same_bits(built):
    """With several intra-op threads the (request, KV head) items go to helper threads beside the caller: the same
    outputs bit for bit as one thread."""
    q_lens, cached = [9, 16, 3], [120, 700, 40]
    q, k_slots, v_slots, table, kv_lens = _problem(q_lens, cached, 14, 2, 64, 16, seed=2)
    one = _extend(built, q, k_slots, v_slots, table, kv_lens, q_lens, 16, 0.125)
    torch.set_num_threads(3)
    assert torch.equal(_extend(built, q, k_slots, v_slots, table, kv_lens, q_lens, 16, 0.125), one)


def _step(q_lens, cached, monkeypatch, lib, dtype=torch.float32, H=8, Hkv=4, D=64, page_size=16):
    """paged_attention over one float32 step whose requests bring q_lens new tokens after ``cached`` pool tokens,
    with the plan of a float32 model on ``lib``; returns the output [T, H, D], the queries [H, T, D], the pool, its
    page table, kv_lens and the rows each extend-kernel call took."""
    g = torch.Generator().manual_seed(sum(q_lens))
    q_lens, cached = np.asarray(q_lens, np.int64), np.asarray(cached, np.int64)
    kv_lens = cached + q_lens
    R, P = len(q_lens), -(-int(kv_lens.max()) // page_size)
    table = np.random.default_rng(0).permutation(R * P + 2)[: R * P].reshape(R, P).astype(np.int32)
    pool = TorchKVPool(2, R * P + 2, page_size, Hkv, D, dtype, torch.device("cpu"))  # layer 1 runs
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(dtype))
    T = int(q_lens.sum())
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, q_lens)])
    q = torch.randn(1, T, H, D, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(1, T, Hkv, D, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    kernels = kernels_for(dtype, heads=(H, Hkv), D=D, lib=lib)
    calls = []
    real = paged_extend.paged_extend

    def counted(*a):
        assert a[0] is lib and a[1] == "f32"  # the plan's library, its float32 kernel
        calls.append(a[8].tolist())
        return real(*a)

    monkeypatch.setattr(paged_extend, "paged_extend", counted)
    out = run_step(pa.StepMeta(q_lens, kv_lens, positions, table, page_size, torch.device("cpu")), pool, q, k, v,
                   D ** -0.5, monkeypatch, kernels)
    return out[0], q[0], pool, table, kv_lens, calls


def _pool_reference(q, pool, table, kv_lens, q_lens) -> torch.Tensor:
    """The float64 attention of each request's rows over its pages as the pool holds them after the step."""
    T = q.shape[1]
    k_slots, v_slots = pool.k[1].reshape(-1, pool.k[1].shape[-2], pool.k[1].shape[-1]), \
        pool.v[1].reshape(-1, pool.v[1].shape[-2], pool.v[1].shape[-1])
    return _reference(q.transpose(0, 1).reshape(T, q.shape[0], -1), k_slots, v_slots, table, kv_lens,
                      list(q_lens), pool.page_size, q.shape[-1] ** -0.5)


def test_paged_attention_sends_short_float32_extends_to_the_kernel(built, monkeypatch):
    """A float32 extend group of at most MAX_ROWS rows per request goes to the kernel, each request over its own
    pages (the step's new K/V written first); the outputs are the float64 attention's within float32 rounding."""
    q_lens, cached = [20, 5], [33, 200]
    out, q, pool, table, kv_lens, calls = _step(q_lens, cached, monkeypatch, built)
    assert calls == [q_lens]
    torch.testing.assert_close(out, _pool_reference(q, pool, table, kv_lens, q_lens), rtol=0, atol=3e-6)


def test_longer_extends_bf16_and_libraries_without_the_kernel_take_sdpa(built, monkeypatch):
    """Past MAX_ROWS_F32 rows per request, in bf16 (the bf16 paths) and with a library that lacks the kernel (the
    baseline x86 level's, or an ARM one: the plan has no float32 extend kernel) float32 extends go to torch's SDPA
    over gathered pages, with the same results."""
    assert kernels_for(torch.float32, lib=built).plan.extend_kernel.value == "f32"
    rows = paged_extend.MAX_ROWS_F32 + 1
    out, q, pool, table, kv_lens, calls = _step([rows, 3], [40, 10], monkeypatch, built)
    assert calls == []
    torch.testing.assert_close(out, _pool_reference(q, pool, table, kv_lens, [rows, 3]), rtol=0, atol=3e-6)
    q = torch.zeros(8, 3, 64)  # [H, T, D]: 8 query heads over 4 KV heads
    assert paged_extend.runs("f32", q, torch.float32, 4, paged_extend.MAX_ROWS_F32)
    assert not paged_extend.runs("f32", q, torch.float32, 4, rows)
    assert not paged_extend.runs("f32", q.bfloat16(), torch.float32, 4, 3)
    assert not paged_extend.runs("f32", q.bfloat16(), torch.bfloat16, 4, 3)
    assert not paged_extend.runs("avx512", q, torch.float32, 4, 3)  # the bf16 kernels take bf16 only
    assert not paged_extend.runs("f32", q, torch.float8_e4m3fn, 4, 3)
    assert not paged_extend.runs("f32", torch.zeros(8, 3, 60), torch.float32, 4, 3)  # 60 dims: not 8-aligned
    assert not paged_extend.runs("f32", torch.zeros(6, 3, 64), torch.float32, 4, 3)  # 6 heads over 4 KV heads
    # a bf16 model's plan never takes the float32 kernel
    assert kernels_for(torch.bfloat16, lib=built).plan.extend_kernel.value != "f32"

    baseline = library_at("x86-64")
    assert not baseline.has("paged_extend_f32")
    plan = kernels_for(torch.float32, lib=baseline).plan
    assert plan.extend_kernel.value == "none" and plan.extend_attention.value == "torch"
    out, q, pool, table, kv_lens, calls = _step([20, 5], [33, 200], monkeypatch, baseline)
    assert calls == []
    torch.testing.assert_close(out, _pool_reference(q, pool, table, kv_lens, [20, 5]), rtol=0, atol=3e-6)
