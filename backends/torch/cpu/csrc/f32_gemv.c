/* float32 decode products (f32_gemv.py): a few activation rows times a float32, bf16- or fp16-held [N, K] weight,
   a tile of weight rows by every row, the weight prefetched into L2; AVX2 and AVX-512 code, a plain-C rest.
   Built without -ffast-math (CMakeLists.txt): the sums stay in the order written. */
#include "kernels.h"
#include "levels.h"

#include <stdint.h>

#if defined(TIERLM_AVX2) || defined(TIERLM_AVX512)
#include <immintrin.h>
#endif


/* Weight element types: WT is 0 (float32), 1 (bf16, widened exactly: its bits are a float32's upper half) or 2
   (fp16, widened exactly); WB(WT) is the element's size in bytes. */
#define WB(WT) ((WT) == 0 ? 4 : 2)

static inline float f16_to_f32(uint16_t h) {  /* exact, as F16C's conversion (plain C: the tails, other builds) */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits;
    if (e == 0) {  /* zero or subnormal: m * 2^-24, exact in float32 */
        const float f = (float)m * 5.9604644775390625e-8f;
        __builtin_memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

static inline float w_at(const void *w, long idx, const int WT) {
    if (WT == 0) return ((const float *)w)[idx];
    const uint16_t h = ((const uint16_t *)w)[idx];
    if (WT == 2) return f16_to_f32(h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

#if defined(TIERLM_AVX512)
static inline __m512 w_vec(const void *w, long idx, const int WT) {
    if (WT == 0) return _mm512_loadu_ps((const float *)w + idx);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + idx));
    if (WT == 2) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(TIERLM_AVX2)
static inline __m256 w_vec(const void *w, long idx, const int WT) {
    if (WT == 0) return _mm256_loadu_ps((const float *)w + idx);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx));
    if (WT == 2) return _mm256_cvtph_ps(h);  /* F16C: part of x86-64-v3, as AVX2 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* out[i * TR + j] = x[i, :] . w[j, :] for mr activation rows and nr <= TR weight rows (both row stride K); TR, mr
   and WT are constants where it is inlined, so the accumulators stay in registers. The weight stream is
   prefetched into L2 two tiles (2 * TR rows, contiguous) ahead: per 16 elements of each row consumed, the next
   TR * WB(WT) / 4 lines of that region. A bf16 or fp16 weight gives the same products and sums in the same order
   as its float32 widening, so the same bits. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int mr, const void *restrict w,
                                                        long K, int nr, int prefetch, float *restrict out,
                                                        const int TR, const int WT) {
    long k = 0;
    const char *ahead = (const char *)w + 2L * TR * K * WB(WT);
    const int lines = TR * WB(WT) / 4;
#if defined(TIERLM_AVX512)
    __m512 acc[4][6];
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) acc[i][j] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        if (prefetch) for (int l = 0; l < lines; l++) _mm_prefetch(ahead + k * TR * WB(WT) + 64 * l, _MM_HINT_T1);
        __m512 wv[6];
        for (int j = 0; j < TR; j++) wv[j] = j < nr ? w_vec(w, j * K + k, WT) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * K + k);
            for (int j = 0; j < TR; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) out[i * TR + j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(TIERLM_AVX2)
    __m256 acc[4][4];
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) acc[i][j] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        if (prefetch && (k & 15) == 0)
            for (int l = 0; l < lines; l++) _mm_prefetch(ahead + k * TR * WB(WT) + 64 * l, _MM_HINT_T1);
        __m256 wv[4];
        for (int j = 0; j < TR; j++) wv[j] = j < nr ? w_vec(w, j * K + k, WT) : _mm256_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < TR; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        out[i * TR + j] = _mm_cvtss_f32(s);
    }
#else
    (void)ahead; (void)prefetch; (void)lines;
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) out[i * TR + j] = 0.f;
#endif
    for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {  /* the columns past the last full vector */
        float s = 0.f;
        /* fused multiply-adds written out: a compiler contracts a * b + c or not as it likes, per build */
        for (long kk = k; kk < K; kk++) s = __builtin_fmaf(x[i * K + kk], w_at(w, j * K + kk, WT), s);
        out[i * TR + j] += s;
    }
}

/* Output columns n0..n1-1 in tiles of TR weight rows, RM activation rows per pass over a tile (the tile stays in
   L1/L2 between passes). The prefetch stops two tiles before n1: past it lie another thread's rows or the end. */
static inline __attribute__((always_inline)) void tiles(const float *restrict x, long M, long K,
                                                         const void *restrict w, const float *restrict bias,
                                                         float *restrict y, long N, long n0, long n1, const int RM,
                                                         const int TR, const int WT) {
    float out[24];
    for (long n = n0; n < n1; n += TR) {
        const int nr = n1 - n < TR ? (int)(n1 - n) : TR;
        const int prefetch = n + 3 * TR <= n1;
        const char *wn = (const char *)w + n * K * WB(WT);
        for (long m = 0; m < M; m += RM) {
            const int mr = M - m < RM ? (int)(M - m) : RM;
            switch (mr) {  /* constant row counts: the accumulators stay in registers */
            case 1: tile(x + m * K, 1, wn, K, nr, prefetch, out, TR, WT); break;
            case 2: tile(x + m * K, 2, wn, K, nr, prefetch, out, TR, WT); break;
            case 3: tile(x + m * K, 3, wn, K, nr, prefetch, out, TR, WT); break;
            default: tile(x + m * K, 4, wn, K, nr, prefetch, out, TR, WT); break;
            }
            for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++)
                y[(m + i) * N + n + j] = bias ? out[i * TR + j] + bias[n + j] : out[i * TR + j];
        }
    }
}

/* Tiles: AVX-512 4 rows x 4 weight rows for one or two rows, 4 x 6 from three (24 of 32 registers for sums, 6
   weight vectors and a row's vector: each weight vector serves 4 multiply-adds, each row's vector 6; 1.2-1.4x at
   4-8 rows, measured; one or two rows are memory-bound and gained nothing); AVX2 (16 registers) 2 x 4 for one or
   two rows, 4 x 2 from three (the weight read once per 4 rows: +15-35 % at 8 rows, measured; 4 x 3 ran the same). */
static inline __attribute__((always_inline)) void linear(const float *restrict x, long M, long K,
                                                          const void *restrict w, const float *restrict bias,
                                                          float *restrict y, long N, long n0, long n1, const int WT) {
#if defined(TIERLM_AVX512)
    if (M >= 3) tiles(x, M, K, w, bias, y, N, n0, n1, 4, 6, WT);
    else tiles(x, M, K, w, bias, y, N, n0, n1, 4, 4, WT);
#else
    if (M >= 3) tiles(x, M, K, w, bias, y, N, n0, n1, 4, 2, WT);
    else tiles(x, M, K, w, bias, y, N, n0, n1, 2, 4, WT);
#endif
}

/* y[M, N] = x[M, K] @ w[N, K].T (+ bias[N]) for output columns n0..n1-1 (threads split N at multiples of 4);
   bias may be NULL. w float32. */
void f32_linear(const float *restrict x, long M, long K, const float *restrict w, const float *restrict bias,
                float *restrict y, long N, long n0, long n1) {
    linear(x, M, K, w, bias, y, N, n0, n1, 0);
}

/* The same with w stored as bf16 (half the bytes to read; the same bits as its float32 widening). */
void f32_linear_bf16w(const float *restrict x, long M, long K, const uint16_t *restrict w,
                      const float *restrict bias, float *restrict y, long N, long n0, long n1) {
    linear(x, M, K, w, bias, y, N, n0, n1, 1);
}

/* The same with w stored as fp16 (F16C's exact widening). */
void f32_linear_f16w(const float *restrict x, long M, long K, const uint16_t *restrict w,
                     const float *restrict bias, float *restrict y, long N, long n0, long n1) {
    linear(x, M, K, w, bias, y, N, n0, n1, 2);
}
