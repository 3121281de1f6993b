"""CPU decode attention that reads KV pages in place, through the page table (a small C kernel), for bf16 and
float32 pages.

torch has no paged attention on CPU: the torch_native path gathers each request's pages per layer, and the
matmuls then copy the gathered K/V again; at 3.9k cached tokens that was ~13 ms of a 28 ms llama-small bf16 step,
against ~4 MB of K/V per layer to read. This kernel reads each K and V row once, straight from the pool.
The same file holds ``paged_decode_step`` (decode_step.py: a decode-only step's layer in one call, its new K/V
stored first).

Numerics: bf16 follows transformers' bf16 eager attention, so bf16 outputs stay those of transformers' bf16
model: scores are rounded to bf16 (the matmul's output), scaled and rounded again, softmax runs in float32, the
probabilities are rounded to bf16, and the weighted sum of V accumulates in float32 and is rounded once. float32
computes what torch's float32 SDPA computes (no roundings; only the summation order differs).

AVX-512 builds decode bf16 with explicit vector code: 16 tokens' K rows at a time serve every query head (their dot
products reduced together, no horizontal sum per token), the running sums in registers: 1.75x the plain loop at 3.9k
keys, 2.2x for Qwen2.5-0.5B's 14/2 heads (one core, AMX Xeon). The head size and the query heads per KV head are
compile-time constants for the common shapes (64 or 128 dims; 1, 2, 4, 7 or 8 heads per KV head), so their loops
unroll: another 1.3-1.5x at 250-3900 keys (llama-small's 8/4 heads, Qwen2.5-0.5B's 14/2, 16/8 at 128 dims;
bit-identical). Software prefetch of the next blocks' rows was tried and ran 5-35 % slower (pages are handed out in
ascending order, which the hardware prefetcher follows). Builds with AVX512-BF16 (Zen 4/5, Cooper Lake, AMX
Xeons) run ``vdpbf16ps`` instead for head sizes that are a multiple of 32: scores with the 16 tokens in the lanes
of one vector per head (K rows transposed in registers, no horizontal sums, no conversions), P.V on pairs of
tokens; the same rounding points, float32 sums in another order. One core of the AVX512-BF16 EPYC, 8 requests,
hot / cold caches: Qwen2.5-0.5B's 14/2 heads at 200 keys 159 -> 95 / 280 -> 222 us, llama-small's 8/4 84 -> 73 /
256 -> 217 us, 32/8 heads of 128 dims at 400 keys 1048 -> 756 / 2202 -> 1620 us. Head sizes that are not a
multiple of 16, float32 pages and every other build run the plain loop.

The C source is csrc/paged_decode.c, in every level's library (library.py); the plan (``decode_attention``) says
whether it serves, else torch's path over gathered pages.
"""
from __future__ import annotations

import torch

from tierlm.backends.torch.cpu.library import KernelLibrary

KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def supported(q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes and dtypes the kernel handles (bf16 or float32 queries over pages of the same dtype, no window, no
    sinks: the caller)."""
    return q_dtype in KERNEL_DTYPES and kv_dtype == q_dtype and heads % kv_heads == 0


def paged_decode(lib: KernelLibrary, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                 page_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float,
                 max_len: int | None = None) -> torch.Tensor:
    """q [R, H, D] (one query per request) over each request's kv_lens[r] keys in the pool layer
    ``k_slots``/``v_slots`` [slots, Hkv, D] of q's dtype, pages from ``page_table`` [R, P] int32 -> [R, H, D].
    ``max_len``: kv_lens' maximum when the caller knows it (the step's metadata: no reduction per layer)."""
    R, H, D = q.shape
    Hkv = k_slots.shape[1]
    q = q.contiguous()
    table = page_table.contiguous()
    lens = kv_lens.contiguous()
    out = torch.empty_like(q)
    max_len = max(1, int(lens.max()) if max_len is None else max_len)
    work = torch.empty(H * max_len + 2 * H * D + H, dtype=torch.float32)
    fn = lib.paged_decode_bf16 if q.dtype == torch.bfloat16 else lib.paged_decode_f32
    fn(q.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), table.data_ptr(), table.shape[1], lens.data_ptr(), R, H,
       Hkv, D, page_size, float(scale), out.data_ptr(), work.data_ptr(), max_len)
    return out
