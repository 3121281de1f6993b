"""Extend attention on CPU that reads KV pages in place: a few new query rows of each request over its cached prefix
(a warm request's suffix, a short chunk), one pass over K/V serving every query row and head. Three kernels, which
the CPU plan picks once per model (``extend_kernel``):

- ``avx512``: bf16 on AVX-512 (csrc/paged_extend.c): the query vectors sharing a KV head in the 16 lanes of a
  vector; 1.8x the blocked path at 16 rows over 2000 keys, where the blocked path serves prefill (no AMX);
- ``amx``: bf16 on AMX tiles (csrc/paged_extend_amx.c): scores and the weighted sum of V as tile products, the
  softmax in AVX-512; 1.9x torch's SDPA at 16 rows over 2000 keys (AMX Xeon, one core);
- ``f32``: float32 in AVX2 (8 lanes) or AVX-512 (16) vectors (csrc/paged_extend_f32.c), what AVX2-only CPUs serve:
  torch's float32 SDPA took 1.5 ms a layer of a 16-token suffix over 2000 cached llama-small tokens, 12 of a 37 ms
  extend (EPYC capped at AVX2, one core).

Numerics: bf16 is transformers' bf16 eager attention, as the decode kernel (scores rounded to bf16, scaled and
rounded again, softmax in float32, probabilities rounded to bf16, the weighted sum of V in float32 rounded once);
float32 is what torch's float32 SDPA computes, in another summation order.
"""
from __future__ import annotations

import torch

from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.cpu.threads import helper_threads

# Query rows per request up to which the bf16 kernels run: against the blocked path (AVX-512 without AMX) 1.8x
# faster at 16 rows over 2000 keys, even at 64 and slower at 128, where the blocked path's GEMMs win; on AMX tiles
# 1.9x torch's SDPA at 16 rows, even at 64, slower at 128 (one core, llama-small's 8/4 heads). With torch's intra-op
# threads the (request, KV head) items are split between them: on 2 threads a compiled 16-token extend took 24.6 ms
# against SDPA's 28.7 (AMX), and 34.2 against the blocked path's 43.2 (AVX-512 code).
MAX_ROWS = 32
# The float32 kernel's (against torch's float32 SDPA over gathered pages).
MAX_ROWS_F32 = 128

# kernel -> (its C function, its scratch-size function, the head-size multiple it takes, its row limit)
KERNELS = {"avx512": ("paged_extend_bf16", "extend_work_floats", 16, MAX_ROWS),
           "amx": ("paged_extend_amx", "amx_extend_work_floats", 32, MAX_ROWS),
           "f32": ("paged_extend_f32", "extend_f32_work_floats", 8, MAX_ROWS_F32)}


def runs(kernel: str, q: torch.Tensor, kv_dtype: torch.dtype, kv_heads: int, rows: int) -> bool:
    """Whether an extend group of at most ``rows`` query rows per request takes ``kernel`` (the plan's
    ``extend_kernel``; "none": never): its dtype over pages of that dtype, head sizes it takes, few enough rows (no
    window, no sinks: the caller)."""
    if kernel not in KERNELS:
        return False
    _fn, _work, multiple, max_rows = KERNELS[kernel]
    dtype = torch.float32 if kernel == "f32" else torch.bfloat16
    return q.dtype == dtype and kv_dtype == dtype and q.device.type == "cpu" and rows <= max_rows and \
        q.shape[0] % kv_heads == 0 and q.shape[-1] % multiple == 0


def paged_extend(lib: KernelLibrary, kernel: str, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                 page_table: torch.Tensor, kv_lens: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                 page_size: int, scale: float, max_len: int, out: torch.Tensor) -> None:
    """Requests' query rows of q [T, H, D] over their pages in the pool layer ``k_slots``/``v_slots`` [slots, Hkv,
    D] on ``kernel`` (``runs`` said yes): request r's ``q_lens[r]`` rows start at row ``q_starts[r]`` and row i sees
    keys 0..kv_lens[r] - q_lens[r] + i; the outputs go to the same rows of ``out`` [T, H, D] (others untouched).
    ``page_table`` [R, P], ``kv_lens``/``q_starts``/``q_lens`` [R] int32; ``max_len``: kv_lens' maximum."""
    T, H, D = q.shape
    Hkv = k_slots.shape[1]
    q = q.contiguous()
    table = page_table.contiguous()
    name, work_floats, _multiple, _rows = KERNELS[kernel]
    fn, floats = getattr(lib, name), getattr(lib, work_floats)(D, max_len)
    items = int(kv_lens.shape[0]) * Hkv
    n = max(1, min(torch.get_num_threads(), items))  # (request, KV head) items split between the intra-op threads
    work = torch.empty((n, floats), dtype=torch.float32)
    args = (q.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), table.data_ptr(), table.shape[1], kv_lens.data_ptr(),
            q_starts.data_ptr(), q_lens.data_ptr())
    rest = lambda t: (H, Hkv, D, page_size, float(scale), out.data_ptr(), work[t].data_ptr(), max_len)  # noqa: E731
    cuts = [items * t // n for t in range(n + 1)]
    pool = helper_threads(n - 1) if n > 1 else None
    futures = [pool.submit(fn, *args, cuts[t], cuts[t + 1], *rest(t)) for t in range(1, n)]
    fn(*args, cuts[0], cuts[1], *rest(0))
    for f in futures:
        f.result()
