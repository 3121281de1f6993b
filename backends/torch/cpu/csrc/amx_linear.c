/* Decode-sized bf16 products on AMX tiles read straight from oneDNN's packed weight (amx_linear.py): blocks of 32
   output columns, K in pairs (VNNI), the next weight blocks prefetched; the amx level only. */
#include "bf16.h"
#include "kernels.h"

/* Built into the amx level (-mamx-tile -mamx-bf16: gcc 11, clang 12); called only where Linux granted the tile
   state (amx_request_permission). */
#if defined(TIERLM_AMX)
#include "amx.h"

/* Bytes ahead of the current weight block that are prefetched: 6 KB (three 32-input steps) measured best, 4.7 ->
   8.4 GB/s (none: 6.1 GB/s; 12 KB: 6.2; prefetching into L2 only or non-temporally: slower). */
#define AHEAD 6144
/* y[M, N] = x[M, K] @ W.T (+ bias) for the 32-column blocks nb0..nb1-1 of W packed [Np/32][K/2][32][2];
   M <= 32, K a multiple of 32, x rows lda elements apart (a split's half: no copy), bias NULL or [N]. Tiles: 0-1
   C of rows 0-15 (columns 0-15, 16-31), 2-3 C of rows 16-31, 4-5 A of those rows, 6-7 B (the block's two column
   halves). The sums are rounded 16 columns at a time (a scalar loop cost ~0.6 ms of an 8-row llama-small step). */
void amx_linear_bf16(
        const uint16_t *restrict x, long M, long K, long lda, const uint16_t *restrict W,
        const uint16_t *restrict bias, uint16_t *restrict y, long N, long nb0, long nb1) {
    /* torch's brgemm remembers per thread which configuration it loaded: the caller's is loaded again after */
    tile_cfg saved, cfg;
    _tile_storeconfig(&saved);
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int m0 = M < 16 ? (int)M : 16, m1 = M > 16 ? (int)M - 16 : 0;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)m0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(m1 ? m1 : 1);
    cfg.rows[6] = cfg.rows[7] = 16;
    _tile_loadconfig(&cfg);
    float c[32][32];
    for (long nb = nb0; nb < nb1; nb++) {
        const uint16_t *w = W + nb * K * 32;
        _tile_zero(0); _tile_zero(1);
        if (m1) { _tile_zero(2); _tile_zero(3); }
        for (long k = 0; k < K; k += 32) {
            const char *b = (const char *)(w + k * 32);  /* 16 pairs x 32 columns: 2 KB */
            for (int l = 0; l < 2048; l += 64) _mm_prefetch(b + AHEAD + l, _MM_HINT_T0);
            _tile_loadd(4, x + k, lda * 2);
            _tile_loadd(6, b, 128);
            _tile_loadd(7, b + 64, 128);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (m1) {
                _tile_loadd(5, x + 16 * lda + k, lda * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, &c[0][0], 128);
        _tile_stored(1, &c[0][16], 128);
        if (m1) { _tile_stored(2, &c[16][0], 128); _tile_stored(3, &c[16][16], 128); }
        __asm__ volatile("" ::: "memory");  /* gcc's tile stores are asm without memory operands */
        const long n0 = nb * 32, nn = N - n0 < 32 ? N - n0 : 32;
        const __mmask16 cm0 = nn >= 16 ? 0xffff : (__mmask16)((1u << nn) - 1);
        const __mmask16 cm1 = nn <= 16 ? 0 : nn >= 32 ? 0xffff : (__mmask16)((1u << (nn - 16)) - 1);
        __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        if (bias) {  /* bf16 bias -> float32: the bits shifted up */
            b0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cm0, bias + n0)), 16));
            b1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cm1, bias + n0 + 16)), 16));
        }
        for (long i = 0; i < M; i++) {
            __m512 v0 = _mm512_loadu_ps(&c[i][0]), v1 = _mm512_loadu_ps(&c[i][16]);
            if (bias) { v0 = _mm512_add_ps(v0, b0); v1 = _mm512_add_ps(v1, b1); }
            _mm256_mask_storeu_epi16(y + i * N + n0, cm0, to_bf16x16_keep_nan(v0));
            if (cm1) _mm256_mask_storeu_epi16(y + i * N + n0 + 16, cm1, to_bf16x16_keep_nan(v1));
        }
    }
    if (saved.palette) _tile_loadconfig(&saved);
    else _tile_release();
}
#endif
