/* bf16 extend attention on CPU that reads KV pages in place: a few new query rows of a request over its cached
   prefix (a warm request's suffix, a short chunk), one pass over K/V serving every query row and head.

   torch's fused SDPA kernel ran a 16-row llama-small extend over 2000 cached keys in ~1.8 ms a layer inside the model
   (AMX Xeon, one core; 14 of a 46 ms warm extend), where the arithmetic is ~66 MFLOP. It reads K/V once per query
   head, takes a mask tensor, and the paged path first gathers the request's pages. Here the query vectors that share
   a KV head (query rows x the query heads of that KV head) sit in the 16 lanes of a vector, so:

   - scores: each K row is converted to float32 once per block and serves every query vector (a broadcast fma per
     dimension, no horizontal sums);
   - softmax runs down the lanes, one query vector per lane, each lane's causal limit a compare;
   - probabilities times V: 16 query vectors' sums of one 16-dim slice of the head in registers per pass.

   Numerics are transformers' bf16 eager attention, as paged_decode.c (the decode and blocked paths round
   at the same points, only the float32 summation order differs): scores rounded to bf16, scaled and rounded again,
   softmax in float32, probabilities rounded to bf16, the weighted sum of V in float32 rounded once.

   AVX-512 levels (paged_extend.py calls it; paged_extend_amx.c is its tile twin). */
#include "attention_avx512.h"
#include "kernels.h"

#if defined(TIERLM_AVX512)
#define EXT_QB 64  /* query vectors per pass: their scores ([EXT_QB, keys] float32) stay in L2 while K/V stream by */
#define EXT_G (EXT_QB / 16)

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
