/* Decode attention over KV pages in place (paged_decode.py, decode_step.py): one query row per request over its
   pages through the page table, bf16 or float32 pages; and a decode-only step's layer in one call
   (paged_decode_step: the new K/V stored at their slots, the queries gathered, then the decode). */
#include "attention_avx512.h"
#include "kernels.h"

#if defined(TIERLM_AVX512)
#define DV 8        /* at most D / 16 vectors per head row: D <= 128 */
#define HC 4        /* query heads of one KV head per pass (their q rows or sums stay in registers) */
#define MAX_HEADS 128

/* Requests whose K (or V) rows of a layer take at most SHORT_KV_BYTES have them prefetched into L2 a request
   ahead: their rows sit on a few scattered pages (8 streams of ~100 tokens: ~6 pages of K and of V each per layer)
   that the hardware prefetcher barely gets going on, and the current V plus the next K fit in L2 (256 KB; 256
   tokens of llama-small's 4 x 64 bf16). Longer requests stream their ascending pages, which the hardware
   prefetcher follows (software prefetch ran 5-35 % slower there). llama-small, 8 streams of 128 tokens:
   0.95-0.98 -> 0.82-0.85 ms of attention a step. */
#define SHORT_KV_BYTES (128L * 1024)
static inline void prefetch_short_rows(const uint16_t *base, const int32_t *pages, int L, int page_size, int Hkv,
                                       int D) {
    const long row = (long)Hkv * D * 2;
    if (L * row > SHORT_KV_BYTES) return;
    for (int t0 = 0; t0 < L; t0 += page_size) {  /* a page's rows are contiguous */
        const int tn = L - t0 < page_size ? L - t0 : page_size;
        const char *p = (const char *)(base + (long)pages[t0 / page_size] * page_size * Hkv * D);
        for (long b = 0; b < tn * row; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
}

static inline __attribute__((always_inline)) void decode_bf16_avx512_body(
        const uint16_t *restrict q, const uint16_t *restrict k, const uint16_t *restrict v,
        const int32_t *restrict table, int table_stride, const int32_t *restrict kv_lens, int R, int H, int Hkv,
        int D, int page_size, float scale, uint16_t *restrict out, float *restrict work, int max_len, const int dv,
        const int n) {
    float *scores = work;                       /* [H, max_len] */
    float *qf = scores + (long)H * max_len;     /* [H, D] */
    float *acc = qf + (long)H * D;              /* [H, D] */
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < R; r++) {
        const int L = kv_lens[r];
        const int32_t *pages = table + (long)r * table_stride;
        if (r == 0) prefetch_short_rows(k, pages, L, page_size, Hkv, D);
        prefetch_short_rows(v, pages, L, page_size, Hkv, D);  /* read after this request's K pass */
        if (r + 1 < R)
            prefetch_short_rows(k, table + (long)(r + 1) * table_stride, kv_lens[r + 1], page_size, Hkv, D);
        for (int i = 0; i < H * D; i += 16) _mm512_storeu_ps(qf + i, load_bf16x16(q + (long)r * H * D + i, 0xffff));
        __m512 vmx[MAX_HEADS];  /* each head's running max */
        for (int h = 0; h < H; h++) vmx[h] = _mm512_set1_ps(-FLT_MAX);
        /* scores, 16 tokens at a time: their K rows (all KV heads) come into L1 once and serve every head */
        for (int t0 = 0; t0 < L; t0 += 16) {
            const int tn = L - t0 < 16 ? L - t0 : 16;
            const __mmask16 m = first(tn);
            const uint16_t *krow[16];  /* the block's token rows, found once for every head (no division per head) */
            for (int tt = 0; tt < tn; tt++) krow[tt] = kv_row(k, pages, t0 + tt, page_size, Hkv, D, 0);
            for (int kh = 0; kh < Hkv; kh++) {
                for (int j0 = 0; j0 < n; j0 += HC) {
                    const int hc = n - j0 < HC ? n - j0 : HC;
                    const int h0 = kh * n + j0;
                    __m512 part[HC][16];
                    for (int tt = 0; tt < 16; tt++) {
                        const int slot = SUM16_SLOT[tt];
                        if (tt >= tn) { for (int j = 0; j < hc; j++) part[j][slot] = _mm512_setzero_ps(); continue; }
                        const uint16_t *kr = krow[tt] + (long)kh * D;
                        __m512 kx[DV];
                        for (int i = 0; i < dv; i++) kx[i] = load_bf16x16(kr + 16 * i, 0xffff);
                        for (int j = 0; j < hc; j++) {
                            const float *qh = qf + (long)(h0 + j) * D;
                            __m512 s = _mm512_setzero_ps();
                            for (int i = 0; i < dv; i++) s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), kx[i], s);
                            part[j][slot] = s;
                        }
                    }
                    for (int j = 0; j < hc; j++) {  /* the matmul's bf16 score, scaled and rounded again */
                        const __m512 s = round_bf16x16(_mm512_mul_ps(round_bf16x16(sum16x16(part[j])), sc));
                        _mm512_mask_storeu_ps(scores + (long)(h0 + j) * max_len + t0, m, s);
                        vmx[h0 + j] = _mm512_mask_max_ps(vmx[h0 + j], m, vmx[h0 + j], s);
                    }
                }
            }
        }
        for (int h = 0; h < H; h++) {  /* softmax in float32, probabilities rounded to bf16 */
            float *sh = scores + (long)h * max_len;
            const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx[h]));
            const __m512 vsum = exp_in_place16(sh, L, mx);
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
            for (int t = 0; t < L; t += 16) {
                const __mmask16 m = first(L - t);
                _mm512_mask_storeu_ps(sh + t, m, round_bf16x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, sh + t), inv)));
            }
        }
        /* probabilities times V, 16 tokens at a time, each head's sums in registers across the block */
        for (int i = 0; i < H * D; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
        for (int t0 = 0; t0 < L; t0 += 16) {
            const int tn = L - t0 < 16 ? L - t0 : 16;
            const uint16_t *vrow[16];
            for (int tt = 0; tt < tn; tt++) vrow[tt] = kv_row(v, pages, t0 + tt, page_size, Hkv, D, 0);
            for (int kh = 0; kh < Hkv; kh++) {
                for (int j0 = 0; j0 < n; j0 += HC) {
                    const int hc = n - j0 < HC ? n - j0 : HC;
                    const int h0 = kh * n + j0;
                    __m512 a[HC][DV];
                    for (int j = 0; j < hc; j++)
                        for (int i = 0; i < dv; i++) a[j][i] = _mm512_loadu_ps(acc + (long)(h0 + j) * D + 16 * i);
                    for (int tt = 0; tt < tn; tt++) {
                        const uint16_t *vr = vrow[tt] + (long)kh * D;
                        __m512 vx[DV];
                        for (int i = 0; i < dv; i++) vx[i] = load_bf16x16(vr + 16 * i, 0xffff);
                        for (int j = 0; j < hc; j++) {
                            const __m512 p = _mm512_set1_ps(scores[(long)(h0 + j) * max_len + t0 + tt]);
                            for (int i = 0; i < dv; i++) a[j][i] = _mm512_fmadd_ps(p, vx[i], a[j][i]);
                        }
                    }
                    for (int j = 0; j < hc; j++)
                        for (int i = 0; i < dv; i++) _mm512_storeu_ps(acc + (long)(h0 + j) * D + 16 * i, a[j][i]);
                }
            }
        }
        for (int i = 0; i < H * D; i += 16)
            _mm256_storeu_si256((__m256i *)(out + (long)r * H * D + i), to_bf16x16(_mm512_loadu_ps(acc + i)));
    }
}

#if defined(TIERLM_AVX512_BF16)
/* 16 rows of 16 dwords -> 16 columns in place: r[i] lane j becomes r[j] lane i */
static inline __attribute__((always_inline)) void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

#define QG 8   /* query heads of one KV head whose scores are summed in one pass (their sums in registers) */
#define PVH 4  /* query heads whose P.V sums stay in registers through a block, at D = 64 (2 at D = 128) */

/* The decode above with AVX512-BF16 dot products (vdpbf16ps: two bf16 products added to a float32 sum, each
   product exact, as the float32 FMAs of the loop above): the same rounding points (bf16 score, scaled and rounded,
   float32 softmax, bf16 probabilities, one rounding of the output); only the order of the float32 sums differs.
   Scores: a block's 16 K rows, 16 input pairs at a time, are transposed in registers so that each pair of inputs
   is one vector over the 16 tokens; each query head then sums its 16 tokens' scores in one vector (no per-token
   horizontal sums, no bf16 -> float32 conversions). P.V: two tokens' V rows interleaved into pairs, each head's
   two probabilities broadcast as one pair. D % 32 == 0, D <= 128. vdpbf16ps reads subnormal bf16 inputs as zero
   and flushes subnormal sums: the float32 path differs from it only there. */
static inline __attribute__((always_inline)) void decode_bf16_dp_body(
        const uint16_t *restrict q, const uint16_t *restrict k, const uint16_t *restrict v,
        const int32_t *restrict table, int table_stride, const int32_t *restrict kv_lens, int R, int H, int Hkv,
        const int D, int page_size, float scale, uint16_t *restrict out, float *restrict work, int max_len,
        const int n) {
    float *scores = work;                       /* [H, max_len]: float32 scores, then bf16 probabilities */
    float *acc = scores + (long)H * max_len;    /* [H, D] (each 32 inputs as two interleaved halves) */
    const int chunks = D / 32, dv = D / 16, pvh = D > 64 ? PVH / 2 : PVH;
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512i zero = _mm512_setzero_si512();
    for (int r = 0; r < R; r++) {
        const int L = kv_lens[r];
        const int32_t *pages = table + (long)r * table_stride;
        const uint16_t *qr = q + (long)r * H * D;
        if (r == 0) prefetch_short_rows(k, pages, L, page_size, Hkv, D);
        prefetch_short_rows(v, pages, L, page_size, Hkv, D);
        if (r + 1 < R)
            prefetch_short_rows(k, table + (long)(r + 1) * table_stride, kv_lens[r + 1], page_size, Hkv, D);
        __m512 vmx[MAX_HEADS];
        for (int h = 0; h < H; h++) vmx[h] = _mm512_set1_ps(-FLT_MAX);
        for (int t0 = 0; t0 < L; t0 += 16) {
            const int tn = L - t0 < 16 ? L - t0 : 16;
            const __mmask16 m = first(tn);
            const uint16_t *krow[16];
            for (int tt = 0; tt < 16; tt++) krow[tt] = tt < tn ? kv_row(k, pages, t0 + tt, page_size, Hkv, D, 0) : 0;
            for (int kh = 0; kh < Hkv; kh++)
                for (int g0 = 0; g0 < n; g0 += QG) {
                    const int gn = n - g0 < QG ? n - g0 : QG;
                    const int h0 = kh * n + g0;
                    __m512 s[QG];
                    for (int j = 0; j < gn; j++) s[j] = _mm512_setzero_ps();
                    for (int c = 0; c < chunks; c++) {
                        __m512i kt[16];  /* kt[p]: input pair 16c + p of the block's 16 tokens */
                        for (int tt = 0; tt < 16; tt++)
                            kt[tt] = tt < tn ? _mm512_loadu_si512(krow[tt] + (long)kh * D + 32 * c) : zero;
                        transpose16x16(kt);
                        for (int j = 0; j < gn; j++) {
                            const uint16_t *qp = qr + (long)(h0 + j) * D + 32 * c;
                            for (int p = 0; p < 16; p++) {
                                uint32_t pair;  /* memcpy: q rows need not be 4-byte aligned */
                                memcpy(&pair, qp + 2 * p, 4);
                                s[j] = _mm512_dpbf16_ps(s[j], (__m512bh)kt[p], (__m512bh)_mm512_set1_epi32((int)pair));
                            }
                        }
                    }
                    for (int j = 0; j < gn; j++) {  /* the matmul's bf16 score, scaled and rounded again */
                        const __m512 x = round_bf16x16(_mm512_mul_ps(round_bf16x16(s[j]), sc));
                        _mm512_mask_storeu_ps(scores + (long)(h0 + j) * max_len + t0, m, x);
                        vmx[h0 + j] = _mm512_mask_max_ps(vmx[h0 + j], m, vmx[h0 + j], x);
                    }
                }
        }
        for (int h = 0; h < H; h++) {  /* softmax in float32; the bf16 probabilities overwrite the row's start */
            float *sh = scores + (long)h * max_len;
            uint16_t *ph = (uint16_t *)sh;
            const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx[h]));
            const __m512 vsum = exp_in_place16(sh, L, mx);
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
            for (int t = 0; t < L; t += 16) {  /* bf16 t..t+15 land on bytes already read (2t + 32 <= 4t + 64) */
                const __mmask16 mk = first(L - t);
                const __m256i pb = to_bf16x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sh + t), inv));
                _mm256_mask_storeu_epi16(ph + t, mk, pb);
            }
            if (L & 1) ph[L] = 0;  /* an odd last token pairs with a zero probability */
        }
        for (int i = 0; i < H * D; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
        for (int t0 = 0; t0 < L; t0 += 16) {
            const int tn = L - t0 < 16 ? L - t0 : 16;
            const uint16_t *vrow[16];
            for (int tt = 0; tt < tn; tt++) vrow[tt] = kv_row(v, pages, t0 + tt, page_size, Hkv, D, 0);
            for (int kh = 0; kh < Hkv; kh++)
                for (int j0 = 0; j0 < n; j0 += pvh) {
                    const int hc = n - j0 < pvh ? n - j0 : pvh;
                    const int h0 = kh * n + j0;
                    __m512 a[PVH][8];
                    for (int j = 0; j < hc; j++)
                        for (int i = 0; i < dv; i++) a[j][i] = _mm512_loadu_ps(acc + (long)(h0 + j) * D + 16 * i);
                    for (int tt = 0; tt < tn; tt += 2) {
                        const uint16_t *v0 = vrow[tt] + (long)kh * D;
                        const uint16_t *v1 = tt + 1 < tn ? vrow[tt + 1] + (long)kh * D : 0;
                        __m512i vp[8];  /* inputs 32c..32c+31 of the two tokens as pairs: low, high halves */
                        for (int c = 0; c < chunks; c++) {
                            const __m512i x0 = _mm512_loadu_si512(v0 + 32 * c);
                            const __m512i x1 = v1 ? _mm512_loadu_si512(v1 + 32 * c) : zero;
                            vp[2 * c] = _mm512_unpacklo_epi16(x0, x1);
                            vp[2 * c + 1] = _mm512_unpackhi_epi16(x0, x1);
                        }
                        for (int j = 0; j < hc; j++) {
                            uint32_t pp;
                            memcpy(&pp, (const uint16_t *)(scores + (long)(h0 + j) * max_len) + t0 + tt, 4);
                            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp);
                            for (int i = 0; i < dv; i++) a[j][i] = _mm512_dpbf16_ps(a[j][i], (__m512bh)vp[i], pb);
                        }
                    }
                    for (int j = 0; j < hc; j++)
                        for (int i = 0; i < dv; i++) _mm512_storeu_ps(acc + (long)(h0 + j) * D + 16 * i, a[j][i]);
                }
        }
        /* each 32 inputs were summed as two interleaved halves: lane j of the low half is input 8 (j / 4) + j % 4,
           of the high half 8 (j / 4) + 4 + j % 4; put them back in order */
        const __m512i lo_idx = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
        const __m512i hi_idx = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
        for (int h = 0; h < H; h++)
            for (int c = 0; c < chunks; c++) {
                const float *ac = acc + (long)h * D + 32 * c;
                const __m512 lo = _mm512_loadu_ps(ac), hi = _mm512_loadu_ps(ac + 16);
                uint16_t *o = out + (long)r * H * D + (long)h * D + 32 * c;
                _mm256_storeu_si256((__m256i *)o, to_bf16x16(_mm512_permutex2var_ps(lo, lo_idx, hi)));
                _mm256_storeu_si256((__m256i *)(o + 16), to_bf16x16(_mm512_permutex2var_ps(lo, hi_idx, hi)));
            }
    }
}
#endif

/* D and the query heads per KV head as compile-time constants for the common shapes (head size 64 or 128; 1, 2,
   4, 7 or 8 query heads per KV head): the loops over them unroll and their vectors stay in registers */
static void paged_decode_bf16_avx512(const uint16_t *restrict q, const uint16_t *restrict k,
                                     const uint16_t *restrict v, const int32_t *restrict table, int table_stride,
                                     const int32_t *restrict kv_lens, int R, int H, int Hkv, int D, int page_size,
                                     float scale, uint16_t *restrict out, float *restrict work, int max_len) {
    const int dv = D / 16, n = H / Hkv;
/* CALL(DV, N) with the common shapes' head size (DV vectors of 16) and query heads per KV head as constants */
#define COMMON_SHAPES(CALL)                                                                                       \
    if (dv == 4 && n == 2) CALL(4, 2);                                                                            \
    else if (dv == 4 && n == 1) CALL(4, 1);                                                                       \
    else if (dv == 4 && n == 4) CALL(4, 4);                                                                       \
    else if (dv == 4 && n == 7) CALL(4, 7);                                                                       \
    else if (dv == 4 && n == 8) CALL(4, 8);                                                                       \
    else if (dv == 8 && n == 2) CALL(8, 2);                                                                       \
    else if (dv == 8 && n == 4) CALL(8, 4);                                                                       \
    else if (dv == 8 && n == 8) CALL(8, 8);                                                                       \
    else CALL(dv, n);
#if defined(TIERLM_AVX512_BF16)
    if (D % 32 == 0) {  /* AVX512-BF16 builds: dot products (decode_bf16_dp_body) */
#define DP(DV_, N_) decode_bf16_dp_body(q, k, v, table, table_stride, kv_lens, R, H, Hkv, 16 * (DV_), page_size, \
                                        scale, out, work, max_len, N_)
        COMMON_SHAPES(DP)
#undef DP
        return;
    }
#endif
#define BODY(DV_, N_) decode_bf16_avx512_body(q, k, v, table, table_stride, kv_lens, R, H, Hkv, D, page_size, scale, \
                                              out, work, max_len, DV_, N_)
    COMMON_SHAPES(BODY)
#undef BODY
#undef COMMON_SHAPES
}
#endif

/* q [R, H, D]; k, v: one layer of the pool, [slots, Hkv, D]; table [R, table_stride] int32 pages; kv_lens [R];
   out [R, H, D]; work: H * max_len + 2 * H * D + H floats of scratch. Token-major passes: each K and V row (all
   KV heads of one token, contiguous) is read once from memory, for every query head. restrict: float32 pages,
   queries, outputs and scratch are all float*, and without the promise that they never overlap gcc reloads K/V
   after every score it stores. BF16: transformers' bf16 eager rounding points (scores rounded to bf16, scaled,
   rounded again; softmax in float32; probabilities rounded to bf16; one rounding of the output). F32: torch's
   float32 SDPA (no roundings). */
#define PAGED_DECODE(NAME, T, LOAD, ROUND_SCORE, ROUND_PROB, STORE)                                               \
void NAME(const T *restrict q, const T *restrict k, const T *restrict v, const int32_t *restrict table,          \
          int table_stride, const int32_t *restrict kv_lens, int R, int H, int Hkv, int D, int page_size,        \
          float scale, T *restrict out, float *restrict work, int max_len) {                                      \
    const int n = H / Hkv;                                                                                        \
    float *scores = work;                       /* [H, max_len] */                                                \
    float *qf = scores + (long)H * max_len;     /* [H, D] */                                                      \
    float *acc = qf + (long)H * D;              /* [H, D] */                                                      \
    float *mx = acc + (long)H * D;              /* [H] */                                                         \
    for (int r = 0; r < R; r++) {                                                                                 \
        const int L = kv_lens[r];                                                                                 \
        const int32_t *pages = table + (long)r * table_stride;                                                    \
        for (int i = 0; i < H * D; i++) qf[i] = LOAD(q[(long)r * H * D + i]);                                     \
        for (int h = 0; h < H; h++) mx[h] = -FLT_MAX;  /* finite: -ffast-math assumes no infinities */           \
        for (int t = 0; t < L; t++) {                                                                             \
            const long slot = (long)pages[t / page_size] * page_size + t % page_size;                             \
            const T *kr = k + slot * Hkv * D;                                                                     \
            for (int h = 0; h < H; h++) {                                                                         \
                const T *kh = kr + (h / n) * D;                                                                   \
                const float *qh = qf + (long)h * D;                                                               \
                float s = 0.f;                                                                                    \
                for (int d = 0; d < D; d++) s += qh[d] * LOAD(kh[d]);                                             \
                s = ROUND_SCORE(s);                                                                               \
                scores[(long)h * max_len + t] = s;                                                                \
                if (s > mx[h]) mx[h] = s;                                                                         \
            }                                                                                                     \
        }                                                                                                         \
        for (int h = 0; h < H; h++) {                                                                             \
            float *sh = scores + (long)h * max_len;                                                               \
            float sum = 0.f;                                                                                      \
            for (int t = 0; t < L; t++) { sh[t] = expf(sh[t] - mx[h]); sum += sh[t]; }                            \
            const float inv = 1.f / sum;                                                                          \
            for (int t = 0; t < L; t++) sh[t] = ROUND_PROB(sh[t] * inv);                                          \
        }                                                                                                         \
        for (int i = 0; i < H * D; i++) acc[i] = 0.f;                                                             \
        for (int t = 0; t < L; t++) {                                                                             \
            const long slot = (long)pages[t / page_size] * page_size + t % page_size;                             \
            const T *vr = v + slot * Hkv * D;                                                                     \
            for (int h = 0; h < H; h++) {                                                                         \
                const T *vh = vr + (h / n) * D;                                                                   \
                const float p = scores[(long)h * max_len + t];                                                    \
                float *ah = acc + (long)h * D;                                                                    \
                for (int d = 0; d < D; d++) ah[d] += p * LOAD(vh[d]);                                             \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < H * D; i++) out[(long)r * H * D + i] = STORE(acc[i]);                                 \
    }                                                                                                             \
}

#define ROUND_SCORE_BF16(s) round_bf(round_bf(s) * scale)
#define ROUND_SCORE_F32(s) ((s) * scale)
#define IDENTITY(x) (x)
PAGED_DECODE(paged_decode_bf16_plain, uint16_t, bf, ROUND_SCORE_BF16, round_bf, to_bf)
PAGED_DECODE(paged_decode_f32, float, IDENTITY, ROUND_SCORE_F32, IDENTITY, IDENTITY)

/* bf16 decode: the AVX-512 kernel where the head size fits its registers, else the plain loop (same roundings) */
void paged_decode_bf16(const uint16_t *restrict q, const uint16_t *restrict k, const uint16_t *restrict v,
                       const int32_t *restrict table, int table_stride, const int32_t *restrict kv_lens, int R, int H,
                       int Hkv, int D, int page_size, float scale, uint16_t *restrict out, float *restrict work,
                       int max_len) {
#if defined(TIERLM_AVX512)
    if (D >= 16 && D % 16 == 0 && D <= 16 * DV && H <= MAX_HEADS) {
        paged_decode_bf16_avx512(q, k, v, table, table_stride, kv_lens, R, H, Hkv, D, page_size, scale, out, work,
                                 max_len);
        return;
    }
#endif
    paged_decode_bf16_plain(q, k, v, table, table_stride, kv_lens, R, H, Hkv, D, page_size, scale, out, work, max_len);
}

/* One layer of a decode step in one call (paged_attention.DecodeStep): request r's new K and V rows are stored at
   slots[r] of the layer's pool, its query row is gathered into the scratch after the decode's own, then the
   decode above runs. q, k_new, v_new are the projections' strided views (element strides per request and per head;
   each head's D values contiguous), so no tensor op runs per layer. work: paged_decode_step_floats(). */
void paged_decode_step(const void *restrict q, long qs_r, long qs_h, const void *restrict kn, long ks_r, long ks_h,
                       const void *restrict vn, long vs_r, long vs_h, const int64_t *restrict slots,
                       void *restrict k, void *restrict v, const int32_t *restrict table, int table_stride,
                       const int32_t *restrict kv_lens, int R, int H, int Hkv, int D, int page_size, float scale,
                       void *restrict out, float *restrict work, int max_len, int bf16) {
    const long eb = bf16 ? 2 : 4, row = (long)D * eb;
    for (int r = 0; r < R; r++)
        for (int h = 0; h < Hkv; h++) {
            const long dst = ((long)slots[r] * Hkv + h) * row;
            memcpy((char *)k + dst, (const char *)kn + (r * ks_r + h * ks_h) * eb, row);
            memcpy((char *)v + dst, (const char *)vn + (r * vs_r + h * vs_h) * eb, row);
        }
    char *qc = (char *)(work + (long)H * max_len + 2L * H * D + H);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++)
            memcpy(qc + ((long)r * H + h) * row, (const char *)q + (r * qs_r + h * qs_h) * eb, row);
    if (bf16)
        paged_decode_bf16((const uint16_t *)qc, k, v, table, table_stride, kv_lens, R, H, Hkv, D, page_size, scale,
                          out, work, max_len);
    else
        paged_decode_f32((const float *)qc, k, v, table, table_stride, kv_lens, R, H, Hkv, D, page_size, scale, out,
                         work, max_len);
}

long paged_decode_step_floats(int R, int H, int D, int max_len) {
    return (long)H * max_len + 2L * H * D + H + (long)R * H * D + 16;
}
