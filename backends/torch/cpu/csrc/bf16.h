/* bfloat16 <-> float32 as torch converts them: bf16 is the top half of a float32; float32 -> bf16 rounds to
   nearest even. */
#ifndef TIERLM_BF16_H
#define TIERLM_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* NaN stays NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline float round_bf(float f) { return bf(to_bf(f)); }

#include "levels.h"
#if defined(TIERLM_AVX512)
#include <immintrin.h>
/* 16 float32 -> bf16, round to nearest even, NaN kept a quiet NaN: to_bf's bits, 16 at a time (the products'
   outputs: cpu/avx512_linear.c, cpu/amx_linear.c) */
static inline __m256i to_bf16x16_keep_nan(__m512 f) {
    const __m512i x = _mm512_castps_si512(f);
    __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1))));
    /* NaN found on the bits (a float compare may be folded away under -ffast-math) */
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, x, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#endif

#endif
