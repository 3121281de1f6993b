/* Decode-sized bf16 products with AVX512-BF16 dot products read straight from oneDNN's packed weight
   (avx512_linear.py): blocks of 64 output columns, K in pairs, summed in oneDNN's K chunks; AVX512-BF16 levels. */
#include "bf16.h"
#include "kernels.h"

#if defined(TIERLM_AVX512_BF16)
#include <immintrin.h>
/* Input pair k of a block (four 16-column vectors at wk, 256 bytes) into the sums of R rows (R <= 6): each row's
   pair broadcast to the four vectors, one vdpbf16ps each. The inner step of both kinds of pass below. */
static inline __attribute__((always_inline)) void pair_x_rows(
        const int R, const uint16_t *restrict x, long lda, long k, const uint16_t *restrict wk, __m512 acc[6][4]) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
    for (int r = 0; r < R; r++) {
        uint32_t pair;
        memcpy(&pair, x + r * lda + k, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
    }
}

/* R rows (R <= 6) x the 64 columns of one block: sums over K in chunks of kc inputs, each chunk from zero and added
   to the total in order (oneDNN's order); then the bias, then one rounding. The first pass over a block reads it
   from memory with no software prefetch: the hardware prefetcher follows that stream better (one row: 3.3-4.3 ms a
   step with 1-4 KB prefetched ahead, 2.9 without). A later pass reads the block from L2 while memory would idle,
   so it prefetches the next block into L2 (next_block: 7 rows 5.3 -> 4.9 ms, 8 rows 5.5 -> 5.2, 16 rows 7.7 -> 7.4;
   into L1: slower). */
static inline __attribute__((always_inline)) void rows_x_block(
        const int R, const int next_block, const uint16_t *restrict x, long lda, const uint16_t *restrict w, long K,
        long kc, const __m512 *b, const __mmask16 *cm, uint16_t *restrict y, long N) {
    __m512 acc[6][4], tot[6][4];
    for (int r = 0; r < R; r++)  /* the first chunk sets them (K > 0); zero only where gcc cannot see that */
        for (int j = 0; j < 4; j++) tot[r][j] = _mm512_setzero_ps();
    for (long k0 = 0; k0 < K; k0 += kc) {
        const long k1 = k0 + kc < K ? k0 + kc : K;
        for (int r = 0; r < R; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (long k = k0; k < k1; k += 2) {
            const uint16_t *wk = w + k * 64;  /* one input pair of 64 columns: 256 bytes */
            if (next_block)
                for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)(wk + K * 64) + l, _MM_HINT_T1);
            pair_x_rows(R, x, lda, k, wk, acc);
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) tot[r][j] = k0 ? _mm512_add_ps(tot[r][j], acc[r][j]) : acc[r][j];
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            if (cm[j])
                _mm256_mask_storeu_epi16(y + r * N + 16 * j, cm[j], to_bf16x16_keep_nan(_mm512_add_ps(tot[r][j], b[j])));
}

/* 7-10 rows: two passes whose reading of memory and arithmetic take about as long, so they are overlapped span by
   span. Per span of SPAN inputs of the block (16 KB, in L1 after the first pass), each pass loads its rows' sums
   from acc, runs the span and stores them back (float32 sums kept exactly: the same bits), every pass prefetching
   two spans ahead into L2. All llama-small linears at 8 rows: 4.1-4.4 -> 3.3-3.5 ms, 7 rows 3.6 -> 3.5, 10 rows
   4.4 -> 4.1; from 11 rows the products are compute-bound and the reloaded sums cost 2-5 %, so whole-block passes
   serve those. */
#define SPAN 128
#define SPAN_AHEAD (2 * SPAN * 128)
static inline __attribute__((always_inline)) void rows_x_span(
        const int R, const uint16_t *restrict x, long lda, const uint16_t *restrict w, long s0, long s1,
        float *restrict acc) {
    __m512 a[6][4];
    for (int r = 0; r < R; r++) for (int j = 0; j < 4; j++) a[r][j] = _mm512_loadu_ps(acc + r * 64 + 16 * j);
    for (long k = s0; k < s1; k += 2) {
        const uint16_t *wk = w + k * 64;
        for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)wk + SPAN_AHEAD + l, _MM_HINT_T1);
        pair_x_rows(R, x, lda, k, wk, a);
    }
    for (int r = 0; r < R; r++) for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + r * 64 + 16 * j, a[r][j]);
}

/* The span-by-span product of one block for 7 <= M <= 12 rows (two passes): the same sums in the same order as
   rows_x_block (each K chunk from zero, chunk sums added in order, then the bias, one rounding). */
static void block_by_spans(const uint16_t *restrict x, long M, long K, long lda, const uint16_t *restrict w,
                           long kc, const __m512 *b, const __mmask16 *cm, uint16_t *restrict y, long N) {
    float acc[12 * 64] __attribute__((aligned(64))), tot[12 * 64] __attribute__((aligned(64)));
    const long first = M / 2;
    for (long k0 = 0; k0 < K; k0 += kc) {
        const long k1 = k0 + kc < K ? k0 + kc : K;
        /* zeroed inline: a memset call per block and chunk was ~1 % of a Qwen2.5-0.5B-shape 8-stream step */
        for (long e = 0; e < 64 * M; e += 16) _mm512_store_ps(acc + e, _mm512_setzero_ps());
        for (long s0 = k0; s0 < k1; s0 += SPAN) {
            const long s1 = s0 + SPAN < k1 ? s0 + SPAN : k1;
            for (int p = 0; p < 2; p++) {
                const long i = p ? first : 0, r = p ? M - first : first;
                const uint16_t *xi = x + i * lda;
                float *ai = acc + i * 64;
                switch (r) {  /* 3-6 rows a pass for 7-12 rows */
                    case 3: rows_x_span(3, xi, lda, w, s0, s1, ai); break;
                    case 4: rows_x_span(4, xi, lda, w, s0, s1, ai); break;
                    case 5: rows_x_span(5, xi, lda, w, s0, s1, ai); break;
                    default: rows_x_span(6, xi, lda, w, s0, s1, ai); break;
                }
            }
        }
        for (long e = 0; e < 64 * M; e += 16)
            _mm512_store_ps(tot + e, k0 ? _mm512_add_ps(_mm512_load_ps(tot + e), _mm512_load_ps(acc + e))
                                        : _mm512_load_ps(acc + e));
    }
    for (long r = 0; r < M; r++)
        for (int j = 0; j < 4; j++)
            if (cm[j]) _mm256_mask_storeu_epi16(y + r * N + 16 * j, cm[j],
                                                to_bf16x16_keep_nan(_mm512_add_ps(_mm512_load_ps(tot + r * 64 + 16 * j), b[j])));
}

/* y[M, N] = x[M, K] @ W.T (+ bias) for the 64-column blocks nb0..nb1-1 of W packed [Np/64][K/2][64][2]; M >= 1,
   K even, x rows lda elements apart, bias NULL or [N], kc the chunk of K summed from zero (even). 7-10 rows go span
   by span (block_by_spans); otherwise rows are split into passes of at most 6, as even as possible, later passes
   reading the block from L2. */
void avx512_linear_bf16(const uint16_t *restrict x, long M, long K, long lda, const uint16_t *restrict W,
                        const uint16_t *restrict bias, uint16_t *restrict y, long N, long kc, long nb0, long nb1) {
    const long passes = (M + 5) / 6;
    for (long nb = nb0; nb < nb1; nb++) {
        const uint16_t *w = W + nb * K * 64;
        const long n0 = nb * 64, nn = N - n0 < 64 ? N - n0 : 64;
        __mmask16 cm[4];
        __m512 b[4];
        for (int j = 0; j < 4; j++) {
            const long c = nn - 16 * j;
            cm[j] = c >= 16 ? 0xffff : c <= 0 ? 0 : (__mmask16)((1u << c) - 1);
            b[j] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(  /* bf16 bias -> float32: the bits shifted up */
                       _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cm[j], bias + n0 + 16 * j)), 16))
                        : _mm512_setzero_ps();
        }
        if (M >= 7 && M <= 10) {
            block_by_spans(x, M, K, lda, w, kc, b, cm, y + n0, N);
            continue;
        }
        for (long p = 0, i = 0; p < passes; p++) {
            const long r = (M - i) / (passes - p);
            const uint16_t *xi = x + i * lda;
            uint16_t *yi = y + i * N + n0;
            /* the last of several passes prefetches the next block of this slice, if any */
            const int next = passes > 1 && p == passes - 1 && nb + 1 < nb1;
#define PASS(R) (next ? rows_x_block(R, 1, xi, lda, w, K, kc, b, cm, yi, N) \
                      : rows_x_block(R, 0, xi, lda, w, K, kc, b, cm, yi, N))
            switch (r) {
                case 1: PASS(1); break;
                case 2: PASS(2); break;
                case 3: PASS(3); break;
                case 4: PASS(4); break;
                case 5: PASS(5); break;
                default: PASS(6); break;
            }
#undef PASS
            i += r;
        }
    }
}
#endif
