/* bf16 prefill and extend attention by blocks of query rows (blocked_attention.py): the row softmax between the
   two bf16 GEMMs of the general path, and, on AVX512-BF16 levels, the whole block in one pass (scores, softmax and
   P.V with vdpbf16ps over K and V in bf16 pairs, no score matrix in memory). */
#include "attention_avx512.h"
#include "kernels.h"

/* The softmax of blocked bf16 prefill attention (blocked_attention.py), in place over rows r0..r1-1 of bf16
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
#if defined(TIERLM_AVX512)  /* 16 scores per vector on the bf16 row itself: 1.0 ns per score, the loop below 1.8 */
        /* scale > 0 and rounding is monotonic: the largest rounded scaled score is the largest score, scaled
           and rounded, so the max pass reads the bf16 scores as they are */
        const __m512 sc = _mm512_set1_ps(scale);
        __m512 vmx = _mm512_set1_ps(-FLT_MAX);
        for (int t = 0; t < lim; t += 16)
            vmx = _mm512_mask_max_ps(vmx, first(lim - t), vmx, load_bf16x16(row + t, first(lim - t)));
        const __m512 mx = round_bf16x16(_mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(vmx)), sc));
        __m512 vsum = _mm512_setzero_ps();
        for (int t = 0; t < lim; t += 16) {
            const __mmask16 m = first(lim - t);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(
                round_bf16x16(_mm512_mul_ps(load_bf16x16(row + t, m), sc)), mx)));
            _mm512_mask_storeu_ps(work + t, m, e);  /* work holds E floats: masked at the row's end */
            vsum = _mm512_add_ps(vsum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
        for (int t = 0; t < lim; t += 16) {
            const __mmask16 m = first(lim - t);
            _mm256_mask_storeu_epi16(row + t, m, to_bf16x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, work + t), inv)));
        }
#else
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
#endif
        for (int t = lim; t < E; t++) row[t] = 0;
    }
}

#if defined(TIERLM_AVX512_BF16)
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
