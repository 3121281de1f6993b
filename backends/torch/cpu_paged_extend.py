"""bf16 extend attention on CPU that reads KV pages in place: a few new query rows of a request over its cached
prefix (a warm request's suffix, a short chunk), one pass over K/V serving every query row and head.

torch's fused SDPA kernel ran a 16-row llama-small extend over 2000 cached keys in ~1.8 ms a layer inside the model
(AMX Xeon, one core; 14 of a 46 ms warm extend), where the arithmetic is ~66 MFLOP. It reads K/V once per query
head, takes a mask tensor, and the paged path first gathers the request's pages. Here the query vectors that share
a KV head (query rows x the query heads of that KV head) sit in the 16 lanes of a vector, so:

- scores: each K row is converted to float32 once per block and serves every query vector (a broadcast fma per
  dimension, no horizontal sums);
- softmax runs down the lanes, one query vector per lane, each lane's causal limit a compare;
- probabilities times V: 16 query vectors' sums of one 16-dim slice of the head in registers per pass.

Numerics are transformers' bf16 eager attention, as cpu_paged_decode's kernel (the decode and blocked paths round
at the same points, only the float32 summation order differs): scores rounded to bf16, scaled and rounded again,
softmax in float32, probabilities rounded to bf16, the weighted sum of V in float32 rounded once.

On CPUs with AMX the two products run on tiles instead (cpu_paged_extend_amx.py, same contract and rounding
points): 1.9x torch's SDPA at 16 rows over 2000 keys, where this AVX-512 code only tied SDPA.

The C source joins cpu_paged_decode's library (one build, one cache file, one switch: TIERLM_CPU_PAGED_DECODE=0).
It is AVX-512 only; other builds lack the symbol and ``available`` is False (the SDPA or blocked path runs).
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from tierlm.backends.torch import cpu_blocked_attention, cpu_paged_extend_amx, cpu_paged_extend_f32
from tierlm.backends.torch.cpu_threads import helper_threads
from tierlm.platforms.cpu_features import this_cpu

log = logging.getLogger(__name__)

# Query rows per request up to which the kernel runs: against the blocked path (AVX-512 without AMX) it was 1.8x
# faster at 16 rows over 2000 keys, even at 64 and slower at 128, where the blocked path's GEMMs win; on AMX tiles
# 1.9x torch's SDPA at 16 rows, even at 64, slower at 128 (one core, llama-small's 8/4 heads).
# With torch's intra-op threads the (request, KV head) items are split between them: on 2 threads a compiled 16-token
# extend took 24.6 ms against SDPA's 28.7 (AMX), and 34.2 against the blocked path's 43.2 (AVX-512 code).
MAX_ROWS = 32

C_SOURCE = r"""
#if defined(TIERLM_AVX512)
#define EXT_QB 64  /* query vectors per pass: their scores ([EXT_QB, keys] float32) stay in L2 while K/V stream by */
#define EXT_G (EXT_QB / 16)

/* Row j of the block of keys starting at t0 (t0 a multiple of 16): with pages of whole 16-key blocks the block is
   one page's consecutive slots, so one page lookup serves it (a division per key cost more than the arithmetic) */
static inline const uint16_t *block_row(const uint16_t *base, const int32_t *pages, int t0, int j, int page_size,
                                        int Hkv, int D, int kh, const uint16_t *first) {
    return page_size % 16 == 0 ? first + (long)j * Hkv * D : kv_row(base, pages, t0 + j, page_size, Hkv, D, kh);
}

/* Scores of keys t0 + h0 .. t0 + h0 + 7 (their float32 rows in ``rows``) for lane groups g0 .. g0 + gn - 1 (gn 1 or
   2, a constant where inlined): the matmul's bf16 score, scaled and rounded again, into sc[g][t] */
static inline __attribute__((always_inline)) void scores8(
        const float *restrict Qt, const float *restrict rows, const int D, int g0, const int gn, int h0, int tn,
        int t0, __m512 scv, float *restrict sc, int max_len) {
    __m512 s[2][8];
    for (int g = 0; g < gn; g++) for (int j = 0; j < 8; j++) s[g][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 a[2];
        for (int g = 0; g < gn; g++) a[g] = _mm512_loadu_ps(Qt + ((long)(g0 + g) * D + d) * 16);
        for (int j = 0; j < 8; j++) {
            const __m512 kd = _mm512_set1_ps(rows[(h0 + j) * D + d]);  /* rows past tn: scratch, never stored */
            for (int g = 0; g < gn; g++) s[g][j] = _mm512_fmadd_ps(a[g], kd, s[g][j]);
        }
    }
    for (int g = 0; g < gn; g++)
        for (int j = 0; j < 8 && h0 + j < tn; j++)
            _mm512_storeu_ps(sc + ((long)(g0 + g) * max_len + t0 + h0 + j) * 16,
                             round_bf16x16(_mm512_mul_ps(round_bf16x16(s[g][j]), scv)));
}

/* One pass of up to EXT_QB query vectors of request r and KV head kh (ng lane groups of 16) over its first E keys.
   Qt [ng][D][16]: the vectors, transposed (lane = vector); lims [ng][16]: keys each lane sees (>= 1). */
static inline __attribute__((always_inline)) void extend_pass(
        const uint16_t *restrict k, const uint16_t *restrict v, const int32_t *restrict pages, int page_size,
        int Hkv, const int D, int kh, int E, int ng, float scale, const float *restrict Qt,
        const int32_t *restrict lims, float *restrict sc, float *restrict acc, float *restrict rows, int max_len) {
    const __m512 scv = _mm512_set1_ps(scale);
    /* scores: sc[g][t] holds group g's 16 lanes for key t */
    for (int t0 = 0; t0 < E; t0 += 16) {
        const int tn = E - t0 < 16 ? E - t0 : 16;
        const uint16_t *k0 = kv_row(k, pages, t0, page_size, Hkv, D, kh);
        for (int tt = 0; tt < tn; tt++) {  /* the block's K rows in float32, once for every query vector */
            const uint16_t *kr = block_row(k, pages, t0, tt, page_size, Hkv, D, kh, k0);
            for (int x = 0; x < D; x += 16) _mm512_storeu_ps(rows + tt * D + x, load_bf16x16(kr + x, 0xffff));
        }
        for (int h0 = 0; h0 < tn; h0 += 8) {
            int g0 = 0;
            for (; g0 + 2 <= ng; g0 += 2) scores8(Qt, rows, D, g0, 2, h0, tn, t0, scv, sc, max_len);
            if (g0 < ng) scores8(Qt, rows, D, g0, 1, h0, tn, t0, scv, sc, max_len);
        }
    }
    /* softmax down each lane over the keys it sees; probabilities rounded to bf16, the rest zero */
    for (int g = 0; g < ng; g++) {
        float *s = sc + (long)g * max_len * 16;
        const __m512i lim = _mm512_loadu_si512(lims + g * 16);
        __m512 mx = _mm512_set1_ps(-FLT_MAX);
        for (int t = 0; t < E; t++) {
            const __mmask16 m = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(t));
            mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(s + t * 16));
        }
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < E; t++) {
            const __mmask16 m = _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(t));
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t * 16), mx)));
            _mm512_storeu_ps(s + t * 16, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), sum);
        for (int t = 0; t < E; t++)
            _mm512_storeu_ps(s + t * 16, round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(s + t * 16), inv)));
    }
    /* probabilities times V: acc[g][d][16] */
    for (long i = 0; i < (long)ng * D * 16; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
    for (int t0 = 0; t0 < E; t0 += 16) {
        const int tn = E - t0 < 16 ? E - t0 : 16;
        const uint16_t *v0 = kv_row(v, pages, t0, page_size, Hkv, D, kh);
        for (int tt = 0; tt < tn; tt++) {
            const uint16_t *vr = block_row(v, pages, t0, tt, page_size, Hkv, D, kh, v0);
            for (int x = 0; x < D; x += 16) _mm512_storeu_ps(rows + tt * D + x, load_bf16x16(vr + x, 0xffff));
        }
        for (int g = 0; g < ng; g++) {
            const float *p = sc + ((long)g * max_len + t0) * 16;
            for (int x = 0; x < D; x += 16) {
                float *ag = acc + ((long)g * D + x) * 16;
                __m512 a[16];
                for (int dd = 0; dd < 16; dd++) a[dd] = _mm512_loadu_ps(ag + dd * 16);
                for (int tt = 0; tt < tn; tt++) {
                    const __m512 pv = _mm512_loadu_ps(p + tt * 16);
                    for (int dd = 0; dd < 16; dd++)
                        a[dd] = _mm512_fmadd_ps(pv, _mm512_set1_ps(rows[tt * D + x + dd]), a[dd]);
                }
                for (int dd = 0; dd < 16; dd++) _mm512_storeu_ps(ag + dd * 16, a[dd]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void extend_bf16_avx512_body(
        const uint16_t *restrict q, const uint16_t *restrict k, const uint16_t *restrict v,
        const int32_t *restrict table, int table_stride, const int32_t *restrict kv_lens,
        const int32_t *restrict q_starts, const int32_t *restrict q_lens, int it0, int it1, int H, int Hkv,
        const int D, int page_size, float scale, uint16_t *restrict out, float *restrict work, int max_len) {
    const int n = H / Hkv;
    float *Qt = work;                          /* [EXT_G][D][16] */
    float *acc = Qt + EXT_G * D * 16;          /* [EXT_G][D][16] */
    float *rows = acc + EXT_G * D * 16;        /* [16][D]: a block's K or V rows in float32 */
    float *sc = rows + 16 * D;                 /* [EXT_G][max_len][16] */
    int32_t lims[EXT_G * 16];
    for (int it = it0; it < it1; it++) {  /* work items (request, KV head): it = r * Hkv + kh */
        const int r = it / Hkv, kh = it % Hkv;
        const int ql = q_lens[r], base = kv_lens[r] - ql;
        const int32_t *pages = table + (long)r * table_stride;
        {
            for (int c0 = 0; c0 < ql * n; c0 += EXT_QB) {  /* vector u: query row u / n, head kh * n + u % n */
                const int c = ql * n - c0 < EXT_QB ? ql * n - c0 : EXT_QB, ng = (c + 15) / 16;
                for (int l = 0; l < ng * 16; l++) {
                    const int u = c0 + l, i = u / n;
                    const uint16_t *qs = q + ((long)(q_starts[r] + i) * H + kh * n + u % n) * D;
                    for (int d = 0; d < D; d++) Qt[((l / 16) * D + d) * 16 + l % 16] = l < c ? bf(qs[d]) : 0.f;
                    lims[l] = l < c ? base + i + 1 : 1;  /* spare lanes see key 0: finite, never stored */
                }
                const int E = base + (c0 + c - 1) / n + 1;  /* the pass's last row sees the most keys */
                extend_pass(k, v, pages, page_size, Hkv, D, kh, E, ng, scale, Qt, lims, sc, acc, rows, max_len);
                for (int l = 0; l < c; l++) {
                    const int u = c0 + l;
                    uint16_t *o = out + ((long)(q_starts[r] + u / n) * H + kh * n + u % n) * D;
                    for (int d = 0; d < D; d++) o[d] = to_bf(acc[((l / 16) * D + d) * 16 + l % 16]);
                }
            }
        }
    }
}

/* q [T, H, D] (the step's flat rows); k, v: one layer of the pool, [slots, Hkv, D]; request r's q_lens[r] rows
   start at row q_starts[r] and its row i sees keys 0 .. kv_lens[r] - q_lens[r] + i (pages table[r]); its outputs
   go to the same rows of out [T, H, D]. Work items it0 .. it1 - 1 of (request r, KV head kh) = r * Hkv + kh, so
   threads split a call by items. work: extend_work_floats(D, max_len) floats, one per thread. */
void paged_extend_bf16(const uint16_t *restrict q, const uint16_t *restrict k, const uint16_t *restrict v,
                       const int32_t *restrict table, int table_stride, const int32_t *restrict kv_lens,
                       const int32_t *restrict q_starts, const int32_t *restrict q_lens, int it0, int it1, int H,
                       int Hkv, int D, int page_size, float scale, uint16_t *restrict out, float *restrict work,
                       int max_len) {
#define BODY(D_) extend_bf16_avx512_body(q, k, v, table, table_stride, kv_lens, q_starts, q_lens, it0, it1, H, Hkv, \
                                         D_, page_size, scale, out, work, max_len)
    if (D == 64) BODY(64);
    else if (D == 128) BODY(128);
    else BODY(D);
#undef BODY
}
long extend_work_floats(int D, int max_len) { return 2L * EXT_G * D * 16 + 16L * D + (long)EXT_G * max_len * 16; }
#endif
""" + cpu_paged_extend_amx.C_SOURCE


def available(lib: ctypes.CDLL | None) -> bool:
    """Whether the loaded library has the kernel (an AVX-512 build)."""
    return lib is not None and hasattr(lib, "paged_extend_bf16")


_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 6 + \
    [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


# Each extend kernel of the library (one signature) and its scratch-size function, where its build has it: bf16
# (AVX-512 builds), AMX tiles (the same), float32 (cpu_paged_extend_f32.py: AVX2 and AVX-512 builds).
_KERNELS = (("paged_extend_bf16", "extend_work_floats"), ("paged_extend_amx", "amx_extend_work_floats"),
            ("paged_extend_f32", "extend_f32_work_floats"))


def bind(lib: ctypes.CDLL) -> None:
    for kernel, work_floats in _KERNELS:
        if hasattr(lib, kernel):
            getattr(lib, kernel).restype = None
            getattr(lib, kernel).argtypes = _ARGTYPES
            getattr(lib, work_floats).restype = ctypes.c_long
            getattr(lib, work_floats).argtypes = [ctypes.c_int, ctypes.c_int]
    if hasattr(lib, "amx_request_permission"):
        lib.amx_request_permission.restype = ctypes.c_int


def amx_usable(lib: ctypes.CDLL | None) -> bool:
    """Whether the tile kernel runs here: the library has it, the CPU has AMX-BF16 (after a TIERLM_CPU_ISA cap),
    and Linux granted this process the tile state. Decided once per library (logged)."""
    return lib is not None and _amx_usable(lib)


@functools.lru_cache(maxsize=4)
def _amx_usable(lib: ctypes.CDLL) -> bool:
    if not hasattr(lib, "paged_extend_amx"):
        return False
    if not this_cpu().has("amx_bf16", "amx_tile"):
        return False
    if lib.amx_request_permission() != 1:
        log.warning("paged extend: this CPU has AMX but Linux refused the tile state (arch_prctl); the AVX-512 "
                    "path and torch's SDPA serve extends")
        return False
    log.info("paged extend: short extends run on AMX tiles")
    return True


def runs(lib: ctypes.CDLL | None, q: torch.Tensor, kv_dtype: torch.dtype, kv_heads: int, rows: int) -> bool:
    """Whether an extend group of at most ``rows`` query rows per request takes this kernel: few rows (MAX_ROWS),
    shapes and dtypes it handles, and either AMX tiles or, where bf16 prefill and extend attention take the blocked
    path (cpu_blocked_attention.choice), the AVX-512 code. float32 takes cpu_paged_extend_f32's kernel (AVX2 and
    AVX-512 builds) up to its MAX_ROWS."""
    if q.dtype == torch.float32:
        return rows <= cpu_paged_extend_f32.MAX_ROWS and cpu_paged_extend_f32.available(lib) and \
            q.device.type == "cpu" and \
            cpu_paged_extend_f32.supported(q.dtype, kv_dtype, q.shape[0], kv_heads, q.shape[-1])
    if not (rows <= MAX_ROWS and available(lib) and q.device.type == "cpu" and
            supported(q.dtype, kv_dtype, q.shape[0], kv_heads, q.shape[-1])):
        return False
    return (amx_usable(lib) and q.shape[-1] % 32 == 0) or cpu_blocked_attention.runs_on("cpu", q.dtype)


def supported(q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes and dtypes the kernel handles: bf16 queries over bf16 pages, whole 16-lane slices of the head (no
    window, no sinks: the caller)."""
    return q_dtype == torch.bfloat16 and kv_dtype == torch.bfloat16 and heads % kv_heads == 0 and \
        head_dim % 16 == 0


def paged_extend(lib: ctypes.CDLL, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                 page_table: torch.Tensor, kv_lens: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                 page_size: int, scale: float, max_len: int, out: torch.Tensor) -> None:
    """Requests' query rows of q [T, H, D] (bf16, or float32: cpu_paged_extend_f32's kernel) over their pages in
    the pool layer ``k_slots``/``v_slots`` [slots, Hkv, D]: request r's ``q_lens[r]`` rows start at row
    ``q_starts[r]`` and row i sees keys 0..kv_lens[r] - q_lens[r] + i; the outputs go to the same rows of ``out``
    [T, H, D] (others untouched).
    ``page_table`` [R, P], ``kv_lens``/``q_starts``/``q_lens`` [R] int32; ``max_len``: kv_lens' maximum."""
    T, H, D = q.shape
    Hkv = k_slots.shape[1]
    q = q.contiguous()
    table = page_table.contiguous()
    if q.dtype == torch.float32:
        fn, floats = lib.paged_extend_f32, lib.extend_f32_work_floats(D, max_len)
    elif amx_usable(lib) and D % 32 == 0:
        fn, floats = lib.paged_extend_amx, lib.amx_extend_work_floats(D, max_len)
    else:
        fn, floats = lib.paged_extend_bf16, lib.extend_work_floats(D, max_len)
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
