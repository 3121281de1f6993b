"""The blocked prefill attention's scores and row softmax in one C pass, on CPUs with AVX512-BF16.

cpu_blocked_attention.py runs each block of query rows as scores = q @ K^T (oneDNN's bf16 GEMM, written out as
bf16), then the C row softmax reading them back. Here one kernel of cpu_paged_decode's library does both for a
block: the scores of 4 query rows x 64 keys sit in 16 vector registers, summed with ``vdpbf16ps`` over K laid out
in pairs ([D/2, keys] of bf16 pairs, made once per layer), then rounded to bf16, scaled and rounded again, their
row maximum kept, and stored as float32 in a small scratch row that stays in L1/L2 for the exponent and the
normalisation; the probabilities are written as bf16 for the P.V GEMM. No bf16 score matrix makes a round trip
through memory.

Numerics are the blocked path's (transformers' bf16 eager attention): the score rounded to bf16 from a float32 sum
of exact bf16 products, scaled and rounded again, the float32 softmax with the same exponent code and summation
order, bf16 probabilities. On the AVX512-BF16 EPYC this writes the blocked path's bits (the GEMM sums the pairs in
the same order); elsewhere a score may differ in its last bf16 bit where the GEMM sums in another order.

One 2016-token llama-small layer (the EPYC VM): scores and softmax 23 -> 19 ms on one core; the whole attention
36.4 -> 32.6 ms on one core, 31.1 -> 26.5 ms on two; a 2016-token prefill 717.7 -> 690.5 ms (the Qwen2.5-0.5B
shape 8278 -> 8146 ms). On more than one thread it runs only where cpu_product_op's C++ op splits it between
torch's own threads (``runs``). Only builds with AVX512-BF16 have the symbol (``available``);
``TIERLM_CPU_BLOCKED_SCORES=0`` keeps the GEMM and the separate softmax.
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable

import numpy as np
import torch


SWITCH_ENV = "TIERLM_CPU_BLOCKED_SCORES"
ROWS = 4  # query rows per register block (the C source's BS_QR): a thread's slice of rows is a multiple of it
KEYS = 64  # keys per register block (BS_KV vectors of 16): K's pair layout is padded to a multiple of it
# Below this many scores per thread a block stays on the calling thread (a hand-off costs ~30 us).
MIN_SCORES_PER_THREAD = 1 << 17

C_SOURCE = r"""
#if defined(TIERLM_AVX512) && defined(__AVX512BF16__)
#define BS_QR 4  /* query rows per register block */
#define BS_KV 4  /* 16-key vectors per register block: 16 float32 sums in registers */
static inline __mmask16 first_or_none(int n) { return n <= 0 ? (__mmask16)0 : first(n); }

/* Rows [r0, r1) of each of the B batches: q [B, M, D] bf16, kp [B, D/2, Lp] bf16 pairs (zero past the keys),
   p [B, M, E] bf16 probabilities. Row r of batch g sees keys 0..lim-1, lim = limits[(g / Hkv) * b + r % b]
   (clamped to 1..E); p is zero past it. work: BS_QR * Lp floats. */
void blocked_scores_softmax_bf16(const uint16_t *restrict q, const uint32_t *restrict kp, uint16_t *restrict p,
                                 int B, int M, int r0, int r1, int D, int Lp, int E, const int32_t *restrict limits,
                                 int Hkv, int b, float scale, float *restrict work) {
    const __m512 sc = _mm512_set1_ps(scale);
    const int D2 = D / 2;
    for (int g = 0; g < B; g++) {
        const uint32_t *qg = (const uint32_t *)(q + (long)g * M * D);
        const uint32_t *kg = kp + (long)g * D2 * Lp;
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
            for (int t0 = 0; t0 < lmax; t0 += 16 * BS_KV) {
                __m512 acc[BS_QR][BS_KV];
                for (int i = 0; i < BS_QR; i++)
                    for (int c = 0; c < BS_KV; c++) acc[i][c] = _mm512_setzero_ps();
                for (int d = 0; d < D2; d++) {
                    const uint32_t *kr = kg + (long)d * Lp + t0;
                    __m512i kv[BS_KV];
                    for (int c = 0; c < BS_KV; c++) kv[c] = _mm512_loadu_si512(kr + 16 * c);
                    for (int i = 0; i < BS_QR; i++) {
                        const __m512i qb = _mm512_set1_epi32((int)qrow[i][d]);
                        for (int c = 0; c < BS_KV; c++)
                            acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)qb, (__m512bh)kv[c]);
                    }
                }
                for (int i = 0; i < nr; i++) {
                    float *w = work + (long)i * Lp + t0;
                    for (int c = 0; c < BS_KV; c++) {
                        const __m512 x = round_bf16x16(_mm512_mul_ps(round_bf16x16(acc[i][c]), sc));
                        _mm512_storeu_ps(w + 16 * c, x);
                        vmx[i] = _mm512_mask_max_ps(vmx[i], first_or_none(lim[i] - t0 - 16 * c), vmx[i], x);
                    }
                }
            }
            for (int i = 0; i < nr; i++) {  /* softmax_rows_bf16's exponent and sum, in its order */
                const int L = lim[i];
                float *w = work + (long)i * Lp;
                uint16_t *row = p + ((long)g * M + rb + i) * E;
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
                for (int t = L; t < E; t++) row[t] = 0;
            }
        }
    }
}
#endif
"""


def bind(lib: ctypes.CDLL) -> None:
    if hasattr(lib, "blocked_scores_softmax_bf16"):
        fn = lib.blocked_scores_softmax_bf16
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 7 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                                     ctypes.c_float, ctypes.c_void_p]


def available(lib: ctypes.CDLL | None) -> bool:
    """Whether the loaded library has the kernel (an AVX512-BF16 build) and the switch leaves it on."""
    return lib is not None and hasattr(lib, "blocked_scores_softmax_bf16") and os.environ.get(SWITCH_ENV) != "0"


# tierlm_native::blocked_scores (cpu_product_op.py), once that C++ library has the kernel: it splits a block between
# torch's own intra-op threads. Python helper threads did not pay: after each block's P.V GEMM the OpenMP workers
# spin for their next task and took the cores (2 threads: 30.4 ms a 2016-token layer, the GEMM path 28.6).
_in_torch_threads: Callable | None = None


def use_torch_threads(op: Callable) -> None:
    global _in_torch_threads
    _in_torch_threads = op


def runs(lib: ctypes.CDLL | None) -> bool:
    """Whether blocks take the kernel now: the library has it, and either torch runs one thread or the C++ op can
    split it between torch's threads (else the GEMM and the separate softmax, whose bits are the same here)."""
    return available(lib) and (torch.get_num_threads() == 1 or _in_torch_threads is not None)


def key_pairs(k: torch.Tensor) -> torch.Tensor:
    """k [B, L, D] bf16 -> [B, D/2, Lp] int32: each bf16 pair (d, d+1) of a key as one 32-bit lane, keys along the
    last dim, zero-padded to a multiple of ``KEYS``."""
    B, L, D = k.shape
    kp = torch.zeros((B, D // 2, -(-L // KEYS) * KEYS), dtype=torch.int32)
    kp[:, :, :L] = k.contiguous().view(torch.int32).transpose(1, 2)
    return kp


def scores_softmax(lib: ctypes.CDLL, qb: torch.Tensor, kp: torch.Tensor, limits: np.ndarray, Hkv: int, E: int,
                   scale: float, work: torch.Tensor) -> torch.Tensor:
    """qb [B, M, D] bf16 (contiguous), kp from ``key_pairs``, limits [G, b] int32 (row r of batch g sees
    limits[g // Hkv, r % b] keys) -> probabilities [B, M, E] bf16; ``work`` [threads, ROWS * Lp] float32. Split
    between torch's threads (``runs`` says when this may be called)."""
    B, M, D = qb.shape
    p = torch.empty((B, M, E), dtype=torch.bfloat16)
    if torch.get_num_threads() == 1:
        lib.blocked_scores_softmax_bf16(qb.data_ptr(), kp.data_ptr(), p.data_ptr(), B, M, 0, M, D, kp.shape[2], E,
                                        limits.ctypes.data, Hkv, limits.shape[1], float(scale), work.data_ptr())
        return p
    grain = -(-MIN_SCORES_PER_THREAD // (B * ROWS * E))  # row slices a thread takes at least
    _in_torch_threads(qb, kp, p, torch.from_numpy(limits), Hkv, float(scale), work, grain)
    return p
