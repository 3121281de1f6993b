"""CPU decode attention that reads KV pages in place, through the page table (a small C kernel), for bf16 and
float32 pages.

torch has no paged attention on CPU: the torch_native path gathers each request's pages per layer, and the
matmuls then copy the gathered K/V again; at 3.9k cached tokens that was ~13 ms of a 28 ms llama-small bf16 step,
against ~4 MB of K/V per layer to read. This kernel reads each K and V row once, straight from the pool.
The same library holds the row softmax of bf16 prefill attention (``softmax_rows_bf16``, used by
cpu_blocked_attention.py), so one build, one cache file and one switch serve both.

Numerics: bf16 follows transformers' bf16 eager attention, so bf16 outputs stay those of transformers' bf16
model: scores are rounded to bf16 (the matmul's output), scaled and rounded again, softmax runs in float32, the
probabilities are rounded to bf16, and the weighted sum of V accumulates in float32 and is rounded once. float32
computes what torch's float32 SDPA computes (no roundings; only the summation order differs).

The source below is compiled once per CPU instruction level by c_kernel_build.py (cached per level, compiler and
CPU model). Without a compiler, or if neither the level's build nor a plain baseline build works, the torch path
is used (logged once). ``TIERLM_CPU_PAGED_DECODE=0`` turns the kernel off; ``TIERLM_CPU_ISA`` caps the level it
is built for.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import torch

from tierlm.backends.torch import c_kernel_build
from tierlm.backends.torch.c_kernel_build import KernelBuild, default_cache_dir
from tierlm.platforms.cpu_features import CpuFeatures, find_c_compiler, this_cpu

log = logging.getLogger(__name__)

_SOURCE = c_kernel_build.BF16_C + r"""
#include <math.h>
#include <float.h>
static inline float round_bf(float f) { return bf(to_bf(f)); }

/* q [R, H, D]; k, v: one layer of the pool, [slots, Hkv, D]; table [R, table_stride] int32 pages; kv_lens [R];
   out [R, H, D]; work: H * max_len + 2 * H * D + H floats of scratch. Token-major passes: each K and V row (all
   KV heads of one token, contiguous) is read once from memory, for every query head. restrict: float32 pages,
   queries, outputs and scratch are all float*, and without the promise that they never overlap gcc reloads K/V
   after every score it stores. BF16: transformers' bf16 eager rounding points (scores rounded to bf16, scaled,
   rounded again; softmax in float32; probabilities rounded to bf16; one rounding of the output). F32: torch's
   float32 SDPA (no roundings). */
#define PAGED_DECODE(NAME, T, LOAD, ROUND_SCORE, ROUND_PROB, STORE)                                               \
void NAME(const T *restrict q, const T *restrict k, const T *restrict v, const int32_t *restrict table,          \
          int table_stride, const int32_t *restrict kv_lens, int R, int H, int Hkv, int D, int page_size,        \
          float scale, T *restrict out, float *restrict work, int max_len) {                                      \
    const int n = H / Hkv;                                                                                        \
    float *scores = work;                       /* [H, max_len] */                                                \
    float *qf = scores + (long)H * max_len;     /* [H, D] */                                                      \
    float *acc = qf + (long)H * D;              /* [H, D] */                                                      \
    float *mx = acc + (long)H * D;              /* [H] */                                                         \
    for (int r = 0; r < R; r++) {                                                                                 \
        const int L = kv_lens[r];                                                                                 \
        const int32_t *pages = table + (long)r * table_stride;                                                    \
        for (int i = 0; i < H * D; i++) qf[i] = LOAD(q[(long)r * H * D + i]);                                     \
        for (int h = 0; h < H; h++) mx[h] = -FLT_MAX;  /* finite: -ffast-math assumes no infinities */           \
        for (int t = 0; t < L; t++) {                                                                             \
            const long slot = (long)pages[t / page_size] * page_size + t % page_size;                             \
            const T *kr = k + slot * Hkv * D;                                                                     \
            for (int h = 0; h < H; h++) {                                                                         \
                const T *kh = kr + (h / n) * D;                                                                   \
                const float *qh = qf + (long)h * D;                                                               \
                float s = 0.f;                                                                                    \
                for (int d = 0; d < D; d++) s += qh[d] * LOAD(kh[d]);                                             \
                s = ROUND_SCORE(s);                                                                               \
                scores[(long)h * max_len + t] = s;                                                                \
                if (s > mx[h]) mx[h] = s;                                                                         \
            }                                                                                                     \
        }                                                                                                         \
        for (int h = 0; h < H; h++) {                                                                             \
            float *sh = scores + (long)h * max_len;                                                               \
            float sum = 0.f;                                                                                      \
            for (int t = 0; t < L; t++) { sh[t] = expf(sh[t] - mx[h]); sum += sh[t]; }                            \
            const float inv = 1.f / sum;                                                                          \
            for (int t = 0; t < L; t++) sh[t] = ROUND_PROB(sh[t] * inv);                                          \
        }                                                                                                         \
        for (int i = 0; i < H * D; i++) acc[i] = 0.f;                                                             \
        for (int t = 0; t < L; t++) {                                                                             \
            const long slot = (long)pages[t / page_size] * page_size + t % page_size;                             \
            const T *vr = v + slot * Hkv * D;                                                                     \
            for (int h = 0; h < H; h++) {                                                                         \
                const T *vh = vr + (h / n) * D;                                                                   \
                const float p = scores[(long)h * max_len + t];                                                    \
                float *ah = acc + (long)h * D;                                                                    \
                for (int d = 0; d < D; d++) ah[d] += p * LOAD(vh[d]);                                             \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < H * D; i++) out[(long)r * H * D + i] = STORE(acc[i]);                                 \
    }                                                                                                             \
}

#define ROUND_SCORE_BF16(s) round_bf(round_bf(s) * scale)
#define ROUND_SCORE_F32(s) ((s) * scale)
#define IDENTITY(x) (x)
PAGED_DECODE(paged_decode_bf16, uint16_t, bf, ROUND_SCORE_BF16, round_bf, to_bf)
PAGED_DECODE(paged_decode_f32, float, IDENTITY, ROUND_SCORE_F32, IDENTITY, IDENTITY)

/* The softmax of blocked bf16 prefill attention (cpu_blocked_attention.py), in place over rows r0..r1-1 of bf16
   scores [R, E] as a bf16 matmul left them: row r keeps its first limits[g * b + i] columns (g = r / rows_per_group,
   i = r % b: the query row of its block), each scaled and rounded to bf16, softmax in float32, probabilities
   rounded to bf16, the rest of the row zeroed. transformers' bf16 eager rounding points, as the decode above.
   work: E floats. Callers split [0, R) between threads (ctypes releases the GIL). */
void softmax_rows_bf16(uint16_t *restrict s, long r0, long r1, int E, const int32_t *restrict limits,
                       long rows_per_group, int b, float scale, float *restrict work) {
    for (long r = r0; r < r1; r++) {
        int lim = limits[(r / rows_per_group) * b + (int)(r % b)];
        if (lim > E) lim = E;
        if (lim < 1) lim = 1;
        uint16_t *row = s + r * (long)E;
        float mx = -FLT_MAX;
        for (int t = 0; t < lim; t++) {
            const float x = round_bf(bf(row[t]) * scale);
            work[t] = x;
            mx = x > mx ? x : mx;
        }
        float sum = 0.f;
        for (int t = 0; t < lim; t++) { const float e = expf(work[t] - mx); work[t] = e; sum += e; }
        const float inv = 1.f / sum;
        for (int t = 0; t < lim; t++) row[t] = to_bf(work[t] * inv);
        for (int t = lim; t < E; t++) row[t] = 0;
    }
}
"""
# c_kernel_build's flags: the softmax's expf also vectorizes (glibc's libmvec) only under -ffast-math, and every
# value here is finite (the running max starts at -FLT_MAX).
CFLAGS = c_kernel_build.CFLAGS
KERNEL_DTYPES = (torch.bfloat16, torch.float32)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_build: KernelBuild = KernelBuild(None, None, "not loaded yet")
_NAME = "paged_decode"
_FALLBACK = "decode attention uses torch"


def _compiler() -> str | None:
    return find_c_compiler(os.environ)


def _cache_dir() -> Path:
    return default_cache_dir()


def library_name(level: str, cc_identity: str, target_flags: tuple[str, ...]) -> str:
    """The cached file's name: the level, then a hash of everything the machine code depends on."""
    return c_kernel_build.library_name(_NAME, _SOURCE, CFLAGS, level, cc_identity, target_flags)


def _bind(lib: ctypes.CDLL) -> None:
    for fn in (lib.paged_decode_bf16, lib.paged_decode_f32):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 5 + [
            ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.softmax_rows_bf16.restype = None
    lib.softmax_rows_bf16.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]


def load(cpu: CpuFeatures | None = None) -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use for this CPU's level; None when it cannot be built here
    (then torch's path). A build for the level that fails (an old compiler without the level's flags) is retried
    once as a plain baseline build."""
    global _lib, _tried, _build
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        _build = _load(cpu or this_cpu())
        _lib = _build.lib
        (log.info if _lib is not None else log.warning)("CPU paged decode kernel: %s", _build.why)
        return _lib


def _load(cpu: CpuFeatures) -> KernelBuild:
    if os.environ.get("TIERLM_CPU_PAGED_DECODE", "1") == "0":
        return KernelBuild(None, None, f"off (TIERLM_CPU_PAGED_DECODE=0); {_FALLBACK}")
    cc = _compiler()
    if cc is None:
        return KernelBuild(None, None, f"no C compiler (cc/gcc/clang); {_FALLBACK}")
    # One thread: a token-major loop reads each K/V row once for all heads; splitting it into (request, KV head)
    # items for OpenMP read every row Hkv times and ran 1.5-2x slower on one thread (measured here), so the
    # kernel stays serial until a split that keeps rows whole is measured where it pays (many cores).
    return c_kernel_build.build_for_cpu(_NAME, _SOURCE, CFLAGS, _bind, cpu, cc, _cache_dir(), _FALLBACK)


def describe() -> dict[str, str | None]:
    """The kernel as loaded (for /server_info and doctor): the level built for and why, or why not."""
    return {"level": _build.level, "why": _build.why}


def supported(q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes and dtypes the kernel handles (bf16 or float32 queries over pages of the same dtype, no window, no
    sinks: the caller)."""
    return q_dtype in KERNEL_DTYPES and kv_dtype == q_dtype and heads % kv_heads == 0


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
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
