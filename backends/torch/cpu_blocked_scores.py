"""The blocked prefill attention in one C pass per block of query rows, on CPUs with AVX512-BF16.

cpu_blocked_attention.py's general path runs each block of query rows as scores = q @ K^T (oneDNN's bf16 GEMM,
written out as bf16), the C row softmax reading them back, then p @ V (another GEMM). Here one kernel of
cpu_paged_decode's library does the whole block, 4 query rows at a time:
- scores: 4 rows x 64 keys in 16 vector registers, summed with ``vdpbf16ps`` over K laid out in pairs ([D/2, keys]
  of bf16 pairs of dims, made once per layer), then rounded to bf16, scaled and rounded again, the row maximum
  kept, stored as float32 in a scratch row that stays in L1/L2;
- softmax: the C row softmax's exponent, sum and order; bf16 probabilities into a second scratch row;
- P.V: 4 rows x 64 dims in registers, each pair of keys' probabilities broadcast as one lane against V laid out
  in pairs of keys ([keys/2, D], made once per layer), rounded once to bf16.
No score or probability matrix makes a round trip through memory.

Numerics are the general path's (transformers' bf16 eager attention): the same rounding points, float32 sums of
exact bf16 products. On the AVX512-BF16 EPYC the outputs are the general path's bits, but for ~1 in 10^4 values
one bf16 ulp apart at 2016 keys, where oneDNN's GEMM splits the P.V sum over keys into blocks.

One 2016-token llama-small layer's attention (the EPYC VM): 35.4 -> 27.9 ms on one core, 27.1 -> 15.9 ms on two;
a 2016-token prefill 719.7 -> 664.0 ms, the Qwen2.5-0.5B shape 8552 -> 7918 ms (one core). On more than one
thread it runs only where cpu_product_op's C++ op splits it between torch's own threads (``runs``). Only builds
with AVX512-BF16 have the symbol (``available``), and it needs D % 16 == 0; ``TIERLM_CPU_BLOCKED_SCORES=0`` keeps
the general path.
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable

import numpy as np
import torch


SWITCH_ENV = "TIERLM_CPU_BLOCKED_SCORES"
ROWS = 4  # query rows per register block (the C source's BS_QR): a thread's slice of rows is a multiple of it
KEYS = 64  # keys per register block (BS_KV vectors of 16): K's and V's pair layouts are padded to a multiple of it
# Below this many scores per thread a block is not split further (cpu_blocked_attention's softmax split uses the same).
MIN_SCORES_PER_THREAD = 1 << 17

C_SOURCE = r"""
#if defined(TIERLM_AVX512) && defined(__AVX512BF16__)
#define BS_QR 4  /* query rows per register block */
#define BS_KV 4  /* 16-key vectors (scores) or 16-dim vectors (P.V) per register block: 16 float32 sums */
static inline __mmask16 first_or_none(int n) { return n <= 0 ? (__mmask16)0 : first(n); }

/* acc[i][c] = sum over x < n of a[i][x] . b[x * b_stride + 16 c ..] (bf16 pairs; the first nv vectors of b's rows,
   the rest read as zero): the register block both products of the kernel run */
static inline __attribute__((always_inline)) void pair_products(__m512 acc[BS_QR][BS_KV],
        const uint32_t *const a[BS_QR], const uint32_t *restrict b, long b_stride, int n, int nv) {
    for (int i = 0; i < BS_QR; i++)
        for (int c = 0; c < BS_KV; c++) acc[i][c] = _mm512_setzero_ps();
    for (int x = 0; x < n; x++) {
        const uint32_t *br = b + (long)x * b_stride;
        __m512i bv[BS_KV];
        for (int c = 0; c < BS_KV; c++) bv[c] = c < nv ? _mm512_loadu_si512(br + 16 * c) : _mm512_setzero_si512();
        for (int i = 0; i < BS_QR; i++) {
            const __m512i ab = _mm512_set1_epi32((int)a[i][x]);
            for (int c = 0; c < BS_KV; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)ab, (__m512bh)bv[c]);
        }
    }
}

/* Rows [r0, r1) of each of the B batches: q [B, M, D] bf16, kp [B, D/2, Lp] (bf16 pairs of dims d, d+1 of each
   key, zero past the keys), vp [B, Lp/2, D] (bf16 pairs of keys t, t+1 of each dim, zero past the keys) ->
   out [B, M, D] bf16. Row r of batch g sees keys 0..lim-1, lim = limits[(g / Hkv) * b + r % b] (clamped to 1..E).
   work: (BS_QR + BS_QR / 2) * Lp floats (float32 scores, then the bf16 probabilities). D % 16 == 0. */
void blocked_attention_rows_bf16(const uint16_t *restrict q, const uint32_t *restrict kp,
                                 const uint32_t *restrict vp, uint16_t *restrict out, int B, int M, int r0, int r1,
                                 int D, int Lp, int E, const int32_t *restrict limits, int Hkv, int b, float scale,
                                 float *restrict work) {
    const __m512 sc = _mm512_set1_ps(scale);
    const int D2 = D / 2;
    uint16_t *probs = (uint16_t *)(work + (long)BS_QR * Lp);  /* [BS_QR, Lp] */
    for (int g = 0; g < B; g++) {
        const uint32_t *qg = (const uint32_t *)(q + (long)g * M * D);
        const uint32_t *kg = kp + (long)g * D2 * Lp;
        const uint32_t *vg = vp + (long)g * (Lp / 2) * D;
        const int32_t *lg = limits + (long)(g / Hkv) * b;
        for (int rb = r0; rb < r1; rb += BS_QR) {
            const int nr = r1 - rb < BS_QR ? r1 - rb : BS_QR;
            int lim[BS_QR], lmax = 1;
            const uint32_t *qrow[BS_QR];
            __m512 vmx[BS_QR];
            for (int i = 0; i < BS_QR; i++) {
                const int l = lg[(rb + (i < nr ? i : 0)) % b];
                lim[i] = l > E ? E : l < 1 ? 1 : l;
                qrow[i] = qg + (long)(rb + (i < nr ? i : 0)) * D2;  /* rows past r1 repeat the first: discarded */
                vmx[i] = _mm512_set1_ps(-FLT_MAX);
                if (i < nr && lim[i] > lmax) lmax = lim[i];
            }
            /* scores: the bf16 score, scaled and rounded again, float32 in work; each row's maximum kept */
            for (int t0 = 0; t0 < lmax; t0 += 16 * BS_KV) {
                __m512 acc[BS_QR][BS_KV];
                pair_products(acc, qrow, kg + t0, Lp, D2, BS_KV);
                for (int i = 0; i < nr; i++) {
                    float *w = work + (long)i * Lp + t0;
                    for (int c = 0; c < BS_KV; c++) {
                        const __m512 x = round_bf16x16(_mm512_mul_ps(round_bf16x16(acc[i][c]), sc));
                        _mm512_storeu_ps(w + 16 * c, x);
                        vmx[i] = _mm512_mask_max_ps(vmx[i], first_or_none(lim[i] - t0 - 16 * c), vmx[i], x);
                    }
                }
            }
            /* softmax_rows_bf16's exponent and sum, in its order; bf16 probabilities, zero up to an even count */
            const int pairs = (lmax + 1) / 2;
            for (int i = 0; i < BS_QR; i++) {
                uint16_t *row = probs + (long)i * Lp;
                if (i >= nr) {
                    memset(row, 0, 4L * pairs);
                    continue;
                }
                const int L = lim[i];
                float *w = work + (long)i * Lp;
                const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx[i]));
                __m512 vsum = _mm512_setzero_ps();
                for (int t = 0; t < L; t += 16) {
                    const __mmask16 m = first(L - t);
                    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(w + t), mx)));
                    _mm512_storeu_ps(w + t, e);
                    vsum = _mm512_add_ps(vsum, e);
                }
                const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
                for (int t = 0; t < L; t += 16)
                    _mm256_mask_storeu_epi16(row + t, first(L - t),
                                             to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(w + t), inv)));
                for (int t = L; t < 2 * pairs; t++) row[t] = 0;
            }
            /* P.V: 4 rows x 64 dims in registers, each pair of keys' probabilities broadcast as one lane */
            const uint32_t *prow[BS_QR];
            for (int i = 0; i < BS_QR; i++) prow[i] = (const uint32_t *)(probs + (long)i * Lp);
            for (int d0 = 0; d0 < D; d0 += 16 * BS_KV) {
                const int nv = (D - d0) / 16 < BS_KV ? (D - d0) / 16 : BS_KV;
                __m512 acc[BS_QR][BS_KV];
                pair_products(acc, prow, vg + d0, D, pairs, nv);
                for (int i = 0; i < nr; i++) {
                    uint16_t *o = out + ((long)g * M + rb + i) * D + d0;
                    for (int c = 0; c < nv; c++) _mm256_storeu_si256((__m256i *)(o + 16 * c), to_bf16x16(acc[i][c]));
                }
            }
        }
    }
}
#endif
"""


def bind(lib: ctypes.CDLL) -> None:
    if hasattr(lib, "blocked_attention_rows_bf16"):
        fn = lib.blocked_attention_rows_bf16
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 7 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                                     ctypes.c_float, ctypes.c_void_p]


def available(lib: ctypes.CDLL | None) -> bool:
    """Whether the loaded library has the kernel (an AVX512-BF16 build) and the switch leaves it on."""
    return lib is not None and hasattr(lib, "blocked_attention_rows_bf16") and os.environ.get(SWITCH_ENV) != "0"


# tierlm_native::blocked_attention (cpu_product_op.py), once that C++ library has the kernel: it splits a block
# between torch's own intra-op threads. Python helper threads did not pay: between torch's parallel ops the OpenMP
# workers spin for their next task and took the cores (2 threads, scores-only kernel: 30.4 ms a 2016-token layer,
# the GEMM path 28.6).
_in_torch_threads: Callable | None = None


def use_torch_threads(op: Callable) -> None:
    global _in_torch_threads
    _in_torch_threads = op


def runs(lib: ctypes.CDLL | None) -> bool:
    """Whether blocks take the kernel now: the library has it, and either torch runs one thread or the C++ op can
    split it between torch's threads (else the general path: the GEMMs and the separate softmax)."""
    return available(lib) and (torch.get_num_threads() == 1 or _in_torch_threads is not None)


def key_pairs(k: torch.Tensor) -> torch.Tensor:
    """k [B, L, D] bf16 -> [B, D/2, Lp] int32: each bf16 pair (d, d+1) of a key as one 32-bit lane, keys along the
    last dim, zero-padded to Lp, a multiple of ``KEYS``."""
    B, L, D = k.shape
    kp = torch.zeros((B, D // 2, padded(L)), dtype=torch.int32)
    kp[:, :, :L] = k.contiguous().view(torch.int32).transpose(1, 2)
    return kp


def value_pairs(v: torch.Tensor) -> torch.Tensor:
    """v [B, L, D] bf16 -> [B, Lp/2, D] int32: dim d of keys t and t+1 (t even) as one 32-bit lane, zero past L."""
    B, L, D = v.shape
    vp = torch.zeros((B, padded(L), D), dtype=torch.bfloat16)
    vp[:, :L] = v
    return vp.view(B, -1, 2, D).transpose(2, 3).contiguous().view(torch.int32).view(B, -1, D)


def padded(L: int) -> int:
    return -(-L // KEYS) * KEYS


def work_floats(L: int) -> int:
    """Scratch floats a thread needs for L keys: float32 scores and bf16 probabilities of ROWS rows."""
    return (ROWS + ROWS // 2) * padded(L)


def attend(lib: ctypes.CDLL, qb: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, limits: np.ndarray, Hkv: int,
           E: int, scale: float, work: torch.Tensor) -> torch.Tensor:
    """qb [B, M, D] bf16 (contiguous), kp / vp from ``key_pairs`` / ``value_pairs``, limits [G, b] int32 (row r of
    batch g sees limits[g // Hkv, r % b] keys, at most E) -> the attention [B, M, D] bf16; ``work``
    [threads, work_floats(L)] float32. Split between torch's threads (``runs`` says when this may be called)."""
    B, M, D = qb.shape
    out = torch.empty((B, M, D), dtype=torch.bfloat16)
    if torch.get_num_threads() == 1:
        lib.blocked_attention_rows_bf16(qb.data_ptr(), kp.data_ptr(), vp.data_ptr(), out.data_ptr(), B, M, 0, M, D,
                                        kp.shape[2], E, limits.ctypes.data, Hkv, limits.shape[1], float(scale),
                                        work.data_ptr())
        return out
    grain = -(-MIN_SCORES_PER_THREAD // (B * ROWS * E))  # row slices a thread takes at least
    _in_torch_threads(qb, kp, vp, out, torch.from_numpy(limits), E, Hkv, float(scale), work, grain)
    return out
