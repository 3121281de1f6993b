"""Paged attention in Triton: queries attend over K/V read in place from the pool through the page table.

``--attention-backend triton`` (the default on CUDA when Triton imports). Same inputs and results as
``paged_attention.attend`` over gathered pages (``torch_native``, the reference these kernels are tested
against), without copying a single page:

- ``decode``: one query row per request. Grid (requests, KV heads, splits): each program takes all query heads
  of one KV head (GQA) as the rows of one ``tl.dot`` and one slice of the request's keys (split-KV, so a batch of
  a few long requests still fills the GPU); a second kernel merges the splits' partial softmaxes.
- ``extend``: q_len >= 1 queries per request (a prefill chunk after a cached prefix, verify rows). Grid
  (requests, query heads, query blocks); causal over the cached prefix and the chunk's own tokens, which the
  layer has already written into the pool.

Both: sliding windows (a query at p sees keys p-window+1..p), attention sinks (gpt-oss ``s_aux``: one logit per
head in the softmax with no value: the running max starts at the sink, the running sum at 1), queries in
float32/bfloat16/float16, KV pages in a float dtype or fp8 (e4m3fn / e5m2) held as uint8 bits
(``kv_pool.TorchKVPool``), converted in registers. Slot of position n: ``page_table[n // page_size] *
page_size + n % page_size`` (any page size, 1 included). Softmax in float32 with exp2; float32 queries use
IEEE dots (no TF32), so float32 results match the reference to float rounding.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run in Triton's CPU interpreter:
that is how the CPU tests exercise them. The interpreter cannot call triton.language's own @jit helpers (tl.zeros,
tl.cdiv, ...) unless triton itself was imported with the variable set, which torch may already have done: the
kernels use builtins only (tl.full, integer division). The interpreter's bf16/fp16 ``tl.dot`` is wrong, so interpreted
kernels upcast dot operands to float32 (``UPCAST``); on a GPU, bf16/fp16 dots run natively.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# KV_FMT: how the pool stores elements. 0: a float dtype; 1: float8_e4m3fn bits; 2: float8_e5m2 bits.
_KV_FMT = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_LOG2E = 1.4426950408889634
_NEG = -1.0e30  # "no key yet": finite, so exp2(m_old - m_new) never sees -inf - -inf


@triton.jit
def _as_float(x, KV_FMT: tl.constexpr):
    if KV_FMT == 1:
        x = x.to(tl.float8e4nv, bitcast=True)
    elif KV_FMT == 2:
        x = x.to(tl.float8e5, bitcast=True)
    return x


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _extend_kernel(Q, K, V, O, Sinks, QStart, QLen, KVLen, PageTable,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt,
                   sm_scale_log2, window, page_size,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, KV_FMT: tl.constexpr,
                   UPCAST: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(QStart + r)
    q_len = tl.load(QLen + r)
    kv_len = tl.load(KVLen + r)
    kvh = h // GQA
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_valid = offs_m < q_len
    d_valid = offs_d < HEAD_DIM
    q_pos = kv_len - q_len + offs_m  # absolute positions of this block's queries
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)

    # Keys this block can see: up to its last query (causal), from its first query's window start.
    block_first = kv_len - q_len + mb * BLOCK_M
    hi = tl.minimum(kv_len, block_first + BLOCK_M)
    hi = tl.where(mb * BLOCK_M < q_len, hi, 0)  # a block past this request's queries does nothing
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(block_first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    if HAS_SINK:
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        n_valid = n < hi
        page = tl.load(PageTable + r * stride_pt + n // page_size, mask=n_valid, other=0)
        slot = page.to(tl.int64) * page_size + n % page_size
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0)
        k = _as_float(k, KV_FMT).to(q.dtype)
        qk = _dot(q, tl.trans(k), UPCAST) * sm_scale_log2
        see = n_valid[None, :] & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            see = see & (n[None, :] > q_pos[:, None] - window)
        qk = tl.where(see, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0)
        v = _as_float(v, KV_FMT).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, UPCAST)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_valid[:, None] & d_valid[None, :])


@triton.jit
def _decode_split_kernel(Q, K, V, MidAcc, MidM, MidL, QStart, KVLen, PageTable,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt,
                         sm_scale_log2, window, page_size, num_heads, num_splits,
                         GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_FMT: tl.constexpr,
                         UPCAST: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    row = tl.load(QStart + r).to(tl.int64)
    kv_len = tl.load(KVLen + r)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_valid = offs_h < GQA
    d_valid = offs_d < HEAD_DIM
    heads = kvh * GQA + offs_h
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_valid[:, None] & d_valid[None, :], other=0.0)

    chunk = ((kv_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = s * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    if HAS_WINDOW:  # the query at kv_len - 1 sees kv_len - window .. kv_len - 1
        first = tl.maximum(kv_len - window, 0)
        lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)
    else:
        first = 0

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        n_valid = (n < hi) & (n >= first)
        page = tl.load(PageTable + r * stride_pt + n // page_size, mask=n < hi, other=0)
        slot = page.to(tl.int64) * page_size + n % page_size
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0)
        k = _as_float(k, KV_FMT).to(q.dtype)
        qk = _dot(q, tl.trans(k), UPCAST) * sm_scale_log2
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0)
        v = _as_float(v, KV_FMT).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, UPCAST)
        m_i = m_new

    # Partials [request, head, split]: unnormalised acc, running max (log2 domain), running sum.
    mid = (r * num_heads + heads).to(tl.int64) * num_splits + s
    tl.store(MidAcc + mid[:, None] * BLOCK_D + offs_d[None, :], acc, mask=h_valid[:, None])
    tl.store(MidM + mid, m_i, mask=h_valid)
    tl.store(MidL + mid, l_i, mask=h_valid)


@triton.jit
def _decode_merge_kernel(MidAcc, MidM, MidL, O, Sinks, QStart, stride_ot, stride_oh, num_heads, num_splits,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    if HAS_SINK:  # the sink: a logit with no value, i.e. max starts at it and the sum at exp(0) = 1
        m = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        l_sum = 1.0
    else:
        m = -1.0e30
        l_sum = 0.0
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    base = (r * num_heads + h).to(tl.int64) * num_splits
    for s in range(0, num_splits):
        ms = tl.load(MidM + base + s)
        ls = tl.load(MidL + base + s)
        accs = tl.load(MidAcc + (base + s) * BLOCK_D + offs_d)
        m_new = tl.maximum(m, ms)
        a = tl.math.exp2(m - m_new)
        b = tl.math.exp2(ms - m_new)
        l_sum = l_sum * a + ls * b
        acc = acc * a + accs * b
        m = m_new
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)
    row = tl.load(QStart + r).to(tl.int64)
    tl.store(O + row * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


INTERPRETED = type(_extend_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 when imported


def kv_format(kv_dtype: torch.dtype) -> int:
    return _KV_FMT.get(kv_dtype, 0)


def _common(q: torch.Tensor, k_slots: torch.Tensor, scale: float):
    H, D = q.shape[1], q.shape[2]
    Hkv = k_slots.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} KV heads")
    block_d = max(16, triton.next_power_of_2(D))
    upcast = INTERPRETED or q.dtype == torch.float32
    return H, D, Hkv, H // Hkv, block_d, upcast, scale * _LOG2E


def extend(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, out: torch.Tensor, q_start: torch.Tensor,
           q_lens: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor, page_size: int, max_q_len: int,
           scale: float, kv_dtype: torch.dtype, sliding_window: int | None = None,
           sinks: torch.Tensor | None = None) -> None:
    """Attention of every request's q_len queries over its kv_len keys (the last q_len of which are its own).

    q [T, H, D] (any strides with unit last stride) flat over the step; out [T, H, D]: rows q_start[r] ..
    q_start[r] + q_lens[r] - 1 are written, others untouched. k_slots/v_slots [slots, Hkv, D]: one layer of the
    pool (``TorchKVPool.k[layer]``), elements as stored (``kv_dtype``: what they mean). q_start, q_lens,
    kv_lens int32 [R]; page_table int32 [R, P] with P * page_size >= kv_lens; max_q_len: max(q_lens) (host int).
    """
    R = q_start.shape[0]
    if R == 0:
        return
    H, D, _, gqa, block_d, upcast, sm_scale_log2 = _common(q, k_slots, scale)
    block_n = 64 if block_d <= 128 else 32
    block_m = 16 if (INTERPRETED or max_q_len <= 16) else (64 if block_d <= 128 else 32)
    grid = (R, H, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_slots, v_slots, out, sinks if sinks is not None else q, q_start, q_lens, kv_lens, page_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_slots.stride(0), k_slots.stride(1),
        v_slots.stride(0), v_slots.stride(1), page_table.stride(0),
        sm_scale_log2, int(sliding_window or 0), page_size,
        GQA=gqa, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, HAS_SINK=sinks is not None, KV_FMT=kv_format(kv_dtype),
        UPCAST=upcast, num_warps=4 if block_d <= 64 else 8, num_stages=1 if INTERPRETED else 2,
    )


def decode_splits(max_kv_len: int, num_requests: int) -> int:
    """KV splits per request: enough programs to fill a GPU when the batch is small and the context long."""
    if num_requests >= 64:
        return 1
    return max(1, min(16, math.ceil(max_kv_len / 512)))


def decode(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, out: torch.Tensor, q_start: torch.Tensor,
           kv_lens: torch.Tensor, page_table: torch.Tensor, page_size: int, max_kv_len: int, scale: float,
           kv_dtype: torch.dtype, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
           num_splits: int | None = None) -> None:
    """One query per request (row q_start[r] of q/out) over its kv_lens[r] keys; arguments as in ``extend``."""
    R = q_start.shape[0]
    if R == 0:
        return
    H, D, Hkv, gqa, block_d, upcast, sm_scale_log2 = _common(q, k_slots, scale)
    S = num_splits or decode_splits(max_kv_len, R)
    block_n = 64 if block_d <= 128 else 32
    block_h = max(16, triton.next_power_of_2(gqa))
    mid_acc = torch.empty((R, H, S, block_d), dtype=torch.float32, device=q.device)
    mid_m = torch.empty((R, H, S), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((R, H, S), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(R, Hkv, S)](
        q, k_slots, v_slots, mid_acc, mid_m, mid_l, q_start, kv_lens, page_table,
        q.stride(0), q.stride(1), k_slots.stride(0), k_slots.stride(1), v_slots.stride(0), v_slots.stride(1),
        page_table.stride(0), sm_scale_log2, int(sliding_window or 0), page_size, H, S,
        GQA=gqa, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, KV_FMT=kv_format(kv_dtype), UPCAST=upcast,
        num_warps=4, num_stages=1 if INTERPRETED else 2,
    )
    _decode_merge_kernel[(R, H)](
        mid_acc, mid_m, mid_l, out, sinks if sinks is not None else q, q_start, out.stride(0), out.stride(1), H, S,
        HEAD_DIM=D, BLOCK_D=block_d, HAS_SINK=sinks is not None, num_warps=1,
    )
