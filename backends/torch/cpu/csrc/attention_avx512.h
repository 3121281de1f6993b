/* What the AVX-512 attention kernels share (paged_decode.c, paged_extend.c, paged_extend_amx.c,
   blocked_attention.c): 16 floats per vector, bf16 loads and roundings, the exponent, and K/V rows found through a
   request's pages. */
#ifndef TIERLM_ATTENTION_AVX512_H
#define TIERLM_ATTENTION_AVX512_H

#include "bf16.h"
#include "levels.h"

#include <float.h>
#include <math.h>

#if defined(TIERLM_AVX512)
#include <immintrin.h>
static inline __m512 exp16(__m512 x) {  /* expf, ~1 ulp: Cody-Waite reduction and a degree-6 polynomial */
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  /* below: 0 (or a denormal), as expf gives */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m256i to_bf16x16(__m512 f) {  /* round to nearest even (finite values; AVX512-BF16's instruction
                                                 also flushes subnormals to zero, which no probability here is) */
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    __m512i x = _mm512_castps_si512(f);
    x = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1)),
                                             _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16));
#endif
}
static inline __m512 round_bf16x16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(f)), 16));
}
static inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
static inline __m512 sum16x16(const __m512 *v) {  /* lane i: the sum of the 16 lanes of v[SUM16_SLOT[i]] */
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}
/* the reduction tree above leaves token i in lane SUM16_SLOT[i] (a 4x4 transpose: its own inverse), so token i's
   partial sums are stored at SUM16_SLOT[i] and come out in token order */
static const int SUM16_SLOT[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
/* exp(s[t] - mx) in place over s[0..n), returned summed in 16 lanes: the softmax's middle pass (decode, extend) */
static inline __m512 exp_in_place16(float *s, int n, __m512 mx) {
    __m512 vsum = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
        const __mmask16 m = first(n - t);
        const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx)));
        _mm512_mask_storeu_ps(s + t, m, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    return vsum;
}

/* K or V row of key t for KV head kh: pages of page_size slots, each slot [Hkv, D] */
static inline const uint16_t *kv_row(const uint16_t *base, const int32_t *pages, int t, int page_size, int Hkv,
                                     int D, int kh) {
    const long slot = (long)pages[t / page_size] * page_size + t % page_size;
    return base + (slot * Hkv + kh) * D;
}

/* Row j of the block of keys starting at t0 (t0 a multiple of 16): with pages of whole 16-key blocks the block is
   one page's consecutive slots, so one page lookup serves it (a division per key cost more than the arithmetic) */
static inline const uint16_t *block_row(const uint16_t *base, const int32_t *pages, int t0, int j, int page_size,
                                        int Hkv, int D, int kh, const uint16_t *first) {
    return page_size % 16 == 0 ? first + (long)j * Hkv * D : kv_row(base, pages, t0 + j, page_size, Hkv, D, kh);
}
#endif

#endif
