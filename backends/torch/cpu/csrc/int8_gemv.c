/* int8 weight-only decode products (int8_gemv.py): a few bf16 or float32 activation rows times an int8 [N, K]
   weight with one scale per output row, streamed with software prefetch; AVX2 and AVX-512 code, a plain-C rest. */
#include "bf16.h"
#include "kernels.h"
#include "levels.h"

#if defined(TIERLM_AVX2) || defined(TIERLM_AVX512)
#include <immintrin.h>
#endif


#define NR 4  /* weight rows per tile */
#define MR 4  /* activation rows per pass over a tile */

/* out[i][j] = x[i, :] . q[j, :] for mr activation rows (float32, row stride K) and nr <= NR weight rows (int8,
   row stride K). The weight stream is prefetched two tiles (2 * NR rows) ahead: the hardware prefetcher alone
   left it at a third of DRAM speed. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int mr, const int8_t *restrict q,
                                                        long K, int nr, float out[MR][NR]) {
    long k = 0;
    const char *ahead = (const char *)(q + 2 * NR * K);
#if defined(TIERLM_AVX512)
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; i++) for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        _mm_prefetch(ahead + k * NR, _MM_HINT_T0);  /* 64 bytes per 16 columns: the next tiles' 4 rows */
        __m512 w[NR];
        for (int j = 0; j < NR; j++)
            w[j] = j < nr ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j * K + k))))
                          : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * K + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(w[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) for (int j = 0; j < NR; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(TIERLM_AVX2)
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; i++) for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        if ((k & 15) == 0) _mm_prefetch(ahead + k * NR, _MM_HINT_T0);
        __m256 w[NR];
        for (int j = 0; j < NR; j++)
            w[j] = j < nr ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j * K + k))))
                          : _mm256_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(w[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) for (int j = 0; j < NR; j++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        out[i][j] = _mm_cvtss_f32(s);
    }
#else
    (void)ahead;
    for (int i = 0; i < mr; i++) for (int j = 0; j < NR; j++) out[i][j] = 0.f;
#endif
    for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {  /* the columns past the last full vector */
        float s = 0.f;
        for (long kk = k; kk < K; kk++) s += x[i * K + kk] * (float)q[j * K + kk];
        out[i][j] += s;
    }
}

/* y[M, N] = x[M, K] @ (q[N, K] * scale[N, None]).T (+ bias[N]) for output columns n0..n1-1 (threads split N).
   x arrives in T; with convert set it is widened into xf [M, K] first, else xf already holds it (the caller
   widened it once for all threads; float32 x is passed as xf itself). bias may be NULL. */
#define INT8_LINEAR(NAME, T, LOAD, STORE)                                                                           \
void NAME(const T *restrict x, float *restrict xf, int convert, long M, long K, const int8_t *restrict q,           \
          const T *restrict scale, const T *restrict bias, T *restrict y, long N, long n0, long n1) {               \
    if (convert) for (long i = 0; i < M * K; i++) xf[i] = LOAD(x[i]);                                               \
    float out[MR][NR];                                                                                              \
    for (long n = n0; n < n1; n += NR) {                                                                            \
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;                                                            \
        for (long m = 0; m < M; m += MR) {  /* the tile's rows stay in L1 between passes */                         \
            const int mr = M - m < MR ? (int)(M - m) : MR;                                                          \
            switch (mr) {  /* constant row counts: the accumulators stay in registers */                            \
            case 1: tile(xf + m * K, 1, q + n * K, K, nr, out); break;                                              \
            case 2: tile(xf + m * K, 2, q + n * K, K, nr, out); break;                                              \
            case 3: tile(xf + m * K, 3, q + n * K, K, nr, out); break;                                              \
            default: tile(xf + m * K, MR, q + n * K, K, nr, out); break;                                            \
            }                                                                                                       \
            for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {                                             \
                float v = out[i][j] * LOAD(scale[n + j]);                                                           \
                if (bias) v += LOAD(bias[n + j]);                                                                   \
                y[(m + i) * N + n + j] = STORE(v);                                                                  \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
}
#define IDENTITY(v) (v)
INT8_LINEAR(int8_linear_bf16, uint16_t, bf, to_bf)
INT8_LINEAR(int8_linear_f32, float, IDENTITY, IDENTITY)
