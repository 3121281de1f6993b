/* float32 extend attention on x86 CPUs that reads KV pages in place: a few new query rows of a request over its
   cached prefix (a warm request's suffix, a short chunk), the float32 twin of paged_extend.c's bf16 kernel.

   float32 is what ``--dtype auto`` serves on CPUs without native bf16 (AVX2-only x86). There a warm request's
   16-token suffix over 2000 cached llama-small tokens went through torch's float32 SDPA with a mask, over pages
   gathered per layer: 1.5 ms a layer, 12 of a 37 ms extend (EPYC capped at AVX2, one core), ~43 GFLOP/s.

   The layout is the bf16 kernel's: the query vectors that share a KV head (query rows x that head's query heads) sit in
   the lanes of a vector (8 with AVX2, 16 with AVX-512), so
   - scores: a tile of keys times two lane groups keeps its sums in registers while the head's dims go by, each K
     element read once per tile and broadcast (no horizontal sums, the K rows read where the pool holds them);
   - softmax runs down the lanes, one query vector per lane, its causal limit a compare;
   - probabilities times V: a tile of output dims times two lane groups in registers over a page of keys, each V
     element broadcast.
   Passes of 64 query vectors keep their scores (64 x keys float32) in L2 while K and V stream by.

   Numerics: what torch's float32 SDPA computes (no roundings: float32 products and sums, softmax in float32, the sum
   of V weighted by exp(s - max) divided once by the sum of the weights), in another summation order. The exp is a
   Cody-Waite reduction and a degree-6 polynomial (~1 ulp), as paged_decode.c's AVX-512 one.

   AVX2 and AVX-512 levels (paged_extend.py calls it). */
#include "kernels.h"
#include "levels.h"

#include <float.h>
#include <stdint.h>

#if defined(TIERLM_AVX2) || defined(TIERLM_AVX512)
#if defined(TIERLM_AVX512)
#define FX_W 16  /* lanes: query vectors per vector */
#define FX_JT 8  /* keys per score tile (x 2 lane groups: 16 sums of 32 registers) */
#define FX_DT 8  /* output dims per P.V tile (x 2 lane groups) */
#else
#define FX_W 8
#define FX_JT 6  /* 12 sums, 2 query vectors and a broadcast: 15 of AVX2's 16 registers */
#define FX_DT 4
#endif
#define FX_QB 64  /* query vectors per pass */
#define FX_G (FX_QB / FX_W)
#define FX_TB 16  /* keys per P.V block */
#include <immintrin.h>
/* The hot loops use the intrinsics' types and calls: with plain GCC vector types GCC 12 spilled the sums to the
   stack in the x86-64-v4 build (62 against 82 GFLOP/s). */
#if FX_W == 16
typedef __m512 fxv;
#define fx_load _mm512_loadu_ps
#define fx_store _mm512_storeu_ps
#define fx_splat _mm512_set1_ps
#define fx_fma _mm512_fmadd_ps
#else
typedef __m256 fxv;
#define fx_load _mm256_loadu_ps
#define fx_store _mm256_storeu_ps
#define fx_splat _mm256_set1_ps
#define fx_fma _mm256_fmadd_ps
#endif
typedef int32_t fxi __attribute__((vector_size(FX_W * 4)));

static inline fxv fx_select(fxi m, fxv a, fxv b) { return (fxv)(((fxi)a & m) | ((fxi)b & ~m)); }  /* m ? a : b */

static inline fxv fx_exp(fxv x) {  /* expf for x <= 0, ~1 ulp: Cody-Waite reduction, a degree-6 polynomial */
    x = fx_select(x < fx_splat(-87.f), fx_splat(-87.f), x);  /* below: ~1e-38, nothing next to the largest's 1 */
    /* n = round(x / ln 2): truncating x / ln 2 - 0.5 rounds a value <= 0 to nearest (no (y + c) - c trick:
       -ffast-math may fold it away) */
    const fxi ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, fxi);
    const fxv n = __builtin_convertvector(ni, fxv);
    fxv r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    fxv p = fx_splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.f);
    return p * (fxv)((ni + 127) << 23);  /* times 2^n: n >= -126, a normal float */
}

/* K or V row of key t for KV head kh: pages of page_size slots, each slot [Hkv, D] */
static inline const float *fx_row(const float *base, const int32_t *pages, int t, int page_size, int Hkv, int D,
                                  int kh) {
    return base + (((long)pages[t / page_size] * page_size + t % page_size) * Hkv + kh) * D;
}

/* Scores of the keys rows[0..FX_JT-1] (t0 on) for lane groups g0 .. g0 + GN - 1 (GN 1 or 2, a constant where
   inlined): sc[g][t] = (q . k) * scale, the first tn of them stored. */
static inline __attribute__((always_inline)) void fx_scores(
        const float *restrict Qt, const float *const *rows, const int D, int g0, const int GN, int t0, int tn,
        float scale, float *restrict sc, int max_len) {
    fxv s[2][FX_JT];
    for (int g = 0; g < GN; g++) for (int j = 0; j < FX_JT; j++) s[g][j] = fx_splat(0.f);
    for (int d = 0; d < D; d++) {
        fxv a[2];
        for (int g = 0; g < GN; g++) {
            a[g] = fx_load(Qt + ((long)(g0 + g) * D + d) * FX_W);
            __asm__("" : "+v"(a[g]));  /* loaded once into a register, not again into each multiply-add */
        }
        for (int j = 0; j < FX_JT; j++) {
            const fxv kd = fx_splat(rows[j][d]);  /* rows past tn repeat a real row: computed, never stored */
            for (int g = 0; g < GN; g++) s[g][j] = fx_fma(a[g], kd, s[g][j]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < FX_JT && j < tn; j++)
            fx_store(sc + ((long)(g0 + g) * max_len + t0 + j) * FX_W, s[g][j] * fx_splat(scale));
}

/* acc[g][d0 + j] += sum over the block's tn keys of w[g][t] * v[t][d0 + j], for lane groups g0 .. g0 + GN - 1 */
static inline __attribute__((always_inline)) void fx_pv(
        const float *restrict sc, const float *const *rows, int tn, int t0, int g0, const int GN, int d0,
        const int D, float *restrict acc, int max_len) {
    fxv a[2][FX_DT];
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < FX_DT; j++) a[g][j] = fx_load(acc + ((long)(g0 + g) * D + d0 + j) * FX_W);
    for (int t = 0; t < tn; t++) {
        fxv p[2];
        for (int g = 0; g < GN; g++) {
            p[g] = fx_load(sc + ((long)(g0 + g) * max_len + t0 + t) * FX_W);
            __asm__("" : "+v"(p[g]));
        }
        for (int j = 0; j < FX_DT; j++) {
            const fxv vd = fx_splat(rows[t][d0 + j]);
            for (int g = 0; g < GN; g++) a[g][j] = fx_fma(p[g], vd, a[g][j]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < FX_DT; j++) fx_store(acc + ((long)(g0 + g) * D + d0 + j) * FX_W, a[g][j]);
}

/* One pass of ng lane groups of query vectors (Qt [ng][D][FX_W], lane = vector) of KV head kh over the first E keys;
   lims [ng][FX_W]: keys each lane sees (>= 1). Leaves acc [ng][D][FX_W] (the sums of exp-weighted V rows) and
   sums [ng][FX_W] (the weights' sums). */
static inline __attribute__((always_inline)) void fx_pass(
        const float *restrict k, const float *restrict v, const int32_t *restrict pages, int page_size, int Hkv,
        const int D, int kh, int E, int ng, float scale, const float *restrict Qt, const int32_t *restrict lims,
        float *restrict sc, float *restrict acc, float *restrict sums, int max_len) {
    const float *rows[FX_TB];
    for (int t0 = 0; t0 < E; t0 += FX_JT) {
        const int tn = E - t0 < FX_JT ? E - t0 : FX_JT;
        for (int j = 0; j < FX_JT; j++) rows[j] = fx_row(k, pages, t0 + (j < tn ? j : tn - 1), page_size, Hkv, D, kh);
        int g = 0;
        for (; g + 2 <= ng; g += 2) fx_scores(Qt, rows, D, g, 2, t0, tn, scale, sc, max_len);
        if (g < ng) fx_scores(Qt, rows, D, g, 1, t0, tn, scale, sc, max_len);
    }
    for (int g = 0; g < ng; g++) {  /* softmax down the lanes; a lane's keys past its limit weigh 0 */
        float *s = sc + (long)g * max_len * FX_W;
        fxi lim;
        __builtin_memcpy(&lim, lims + g * FX_W, sizeof lim);
        int seen = E;  /* keys every lane sees: no limit to compare before them */
        for (int l = 0; l < FX_W; l++) seen = lims[g * FX_W + l] < seen ? lims[g * FX_W + l] : seen;
        fxv mx = fx_splat(-3.0e38f);
        for (int t = 0; t < seen; t++) {
            const fxv x = fx_load(s + (long)t * FX_W);
            mx = fx_select(x > mx, x, mx);
        }
        for (int t = seen; t < E; t++) {
            const fxv x = fx_load(s + (long)t * FX_W);
            mx = fx_select((x > mx) & (lim > (fxi){} + t), x, mx);
        }
        fxv sum = fx_splat(0.f);
        for (int t = 0; t < seen; t++) {
            const fxv e = fx_exp(fx_load(s + (long)t * FX_W) - mx);
            fx_store(s + (long)t * FX_W, e);
            sum += e;
        }
        for (int t = seen; t < E; t++) {
            const fxv e = fx_select(lim > (fxi){} + t, fx_exp(fx_load(s + (long)t * FX_W) - mx), fx_splat(0.f));
            fx_store(s + (long)t * FX_W, e);
            sum += e;
        }
        fx_store(sums + g * FX_W, sum);
    }
    for (long i = 0; i < (long)ng * D * FX_W; i += FX_W) fx_store(acc + i, fx_splat(0.f));
    for (int t0 = 0; t0 < E; t0 += FX_TB) {
        const int tn = E - t0 < FX_TB ? E - t0 : FX_TB;
        for (int t = 0; t < tn; t++) rows[t] = fx_row(v, pages, t0 + t, page_size, Hkv, D, kh);
        int g = 0;
        for (; g + 2 <= ng; g += 2)
            for (int d0 = 0; d0 < D; d0 += FX_DT) fx_pv(sc, rows, tn, t0, g, 2, d0, D, acc, max_len);
        if (g < ng)
            for (int d0 = 0; d0 < D; d0 += FX_DT) fx_pv(sc, rows, tn, t0, g, 1, d0, D, acc, max_len);
    }
}

static inline __attribute__((always_inline)) void extend_f32_body(
        const float *restrict q, const float *restrict k, const float *restrict v, const int32_t *restrict table,
        int table_stride, const int32_t *restrict kv_lens, const int32_t *restrict q_starts,
        const int32_t *restrict q_lens, int it0, int it1, int H, int Hkv, const int D, int page_size, float scale,
        float *restrict out, float *restrict work, int max_len) {
    const int n = H / Hkv;
    float *Qt = work;                          /* [FX_G][D][FX_W] */
    float *acc = Qt + FX_G * D * FX_W;         /* [FX_G][D][FX_W] */
    float *sums = acc + FX_G * D * FX_W;       /* [FX_G][FX_W] */
    float *sc = sums + FX_G * FX_W;            /* [FX_G][max_len][FX_W] */
    int32_t lims[FX_G * FX_W];
    for (int it = it0; it < it1; it++) {  /* work items (request, KV head): it = r * Hkv + kh */
        const int r = it / Hkv, kh = it % Hkv;
        const int ql = q_lens[r], base = kv_lens[r] - ql;
        const int32_t *pages = table + (long)r * table_stride;
        for (int c0 = 0; c0 < ql * n; c0 += FX_QB) {  /* vector u: query row u / n, head kh * n + u % n */
            const int c = ql * n - c0 < FX_QB ? ql * n - c0 : FX_QB, ng = (c + FX_W - 1) / FX_W;
            for (int l = 0; l < ng * FX_W; l++) {
                const int u = c0 + l, i = u / n;
                const float *qs = q + ((long)(q_starts[r] + i) * H + kh * n + u % n) * D;
                for (int d = 0; d < D; d++) Qt[((l / FX_W) * D + d) * FX_W + l % FX_W] = l < c ? qs[d] : 0.f;
                lims[l] = l < c ? base + i + 1 : 1;  /* spare lanes see key 0: finite, never stored */
            }
            const int E = base + (c0 + c - 1) / n + 1;  /* the pass's last row sees the most keys */
            fx_pass(k, v, pages, page_size, Hkv, D, kh, E, ng, scale, Qt, lims, sc, acc, sums, max_len);
            for (int l = 0; l < c; l++) {
                const int u = c0 + l;
                float *o = out + ((long)(q_starts[r] + u / n) * H + kh * n + u % n) * D;
                const float inv = 1.f / sums[l];
                for (int d = 0; d < D; d++) o[d] = acc[((l / FX_W) * D + d) * FX_W + l % FX_W] * inv;
            }
        }
    }
}

/* q [T, H, D] (the step's flat rows); k, v: one layer of the pool, [slots, Hkv, D]; request r's q_lens[r] rows
   start at row q_starts[r] and its row i sees keys 0 .. kv_lens[r] - q_lens[r] + i (pages table[r]); its outputs
   go to the same rows of out [T, H, D]. Work items it0 .. it1 - 1 of (request r, KV head kh) = r * Hkv + kh, so
   threads split a call by items. work: extend_f32_work_floats(D, max_len) floats, one per thread. D: a multiple
   of FX_DT (8 covers both builds). */
void paged_extend_f32(const float *restrict q, const float *restrict k, const float *restrict v,
                      const int32_t *restrict table, int table_stride, const int32_t *restrict kv_lens,
                      const int32_t *restrict q_starts, const int32_t *restrict q_lens, int it0, int it1, int H,
                      int Hkv, int D, int page_size, float scale, float *restrict out, float *restrict work,
                      int max_len) {
#define BODY(D_) extend_f32_body(q, k, v, table, table_stride, kv_lens, q_starts, q_lens, it0, it1, H, Hkv, D_, \
                                 page_size, scale, out, work, max_len)
    if (D == 64) BODY(64);
    else if (D == 128) BODY(128);
    else BODY(D);
#undef BODY
}
long extend_f32_work_floats(int D, int max_len) {
    return 2L * FX_G * D * FX_W + FX_G * FX_W + (long)FX_G * max_len * FX_W;
}
#endif
