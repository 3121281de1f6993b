/* AMX tiles for paged_extend.c's extend attention (paged_extend.py) (CPUs with AMX-BF16): the same contract and rounding points,
   the two products on tiles.

   Per KV head and pass of up to 64 query vectors (query rows x the heads sharing the KV head):

   - scores: A = 16 query vectors x 32 dims (bf16 rows), B = a 16-key block of K transposed into dimension pairs (VNNI;
     one 16 x 16 32-bit transpose per 32 dims, shared by every lane group), C = 16 vectors x 16 keys in float32;
   - softmax along each vector's row in AVX-512, as the decode kernel: the bf16 score scaled and rounded, float32
     softmax, probabilities rounded to bf16 and zero past the row's causal limit;
   - output: A = 16 vectors' probabilities over 32 keys, B = 16 key pairs x 16 dims of V interleaved by key pairs
     (VNNI), C = 16 vectors x 16 dims in float32, rounded to bf16 once.

   The products are exact (bf16 x bf16 in float32) and summed in float32, so outputs equal transformers' bf16 eager
   attention but for the summation order (tests/test_cpu_paged_extend.py: bit for bit on its cases).

   16 rows over 2000 cached llama-small keys, one core of the AMX Xeon, while CI ran beside it: 0.81 ms against torch's
   SDPA at 1.55 ms and the AVX-512 kernel at 1.87 ms; at 64 rows SDPA catches up, so the same row limit applies.
   Linux hands the tile state to a process on request (``amx_request_permission``, arch_prctl); torch's oneDNN asks for
   it too. */
#include "attention_avx512.h"
#include "kernels.h"
/* AMX tiles (CPUs with AMX-BF16: Sapphire Rapids and later), built into the amx level (-mamx-tile -mamx-bf16: gcc 11,
   clang 12), called only where Linux granted the tile state (amx_request_permission). */
#if defined(TIERLM_AMX)
#include "amx.h"
#define AMX_G 4          /* lane groups of 16 query vectors per pass */
#define AMX_INLINE static inline __attribute__((always_inline))

/* 16 x 16 32-bit transpose: in[r] row r -> out[c] column c */
static inline void transpose16(const __m512i *in, __m512i *out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[4i+j] holds rows 4i..4i+3 of columns 4L+j (128-bit lane L): gather the lanes of the four row groups */
    for (int j = 0; j < 4; j++) {
        const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        out[j] = _mm512_shuffle_i32x4(a, c, 0x88);
        out[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);
        out[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
        out[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
}

/* One pass of up to AMX_G * 16 query vectors (Qa rows, lims: the keys each sees) of one KV head over its first E
   keys. Tiles 0-3: scores of the lane groups, then four 16-dim slices of the output; 4: A operand; 5: B operand. */
AMX_INLINE void amx_extend_pass(const uint16_t *restrict k, const uint16_t *restrict v, const int32_t *restrict pages,
        int page_size, int Hkv, int D, int kh, int E, int ng, float scale, const uint16_t *restrict Qa,
        const int32_t *restrict lims, float *restrict sc, uint16_t *restrict p, uint32_t *restrict Kt,
        uint32_t *restrict Vv, float *restrict acc, int Ep) {
    const int nc = D / 32;  /* 32-dim chunks */
    const int Eq = (E + 31) / 32 * 32;  /* this pass's keys, padded for the 32-key tiles (rows keep stride Ep) */
    /* scores S[g][u][t] = q_u . k_t: A = Q rows (16 vectors x 32 dims), B = K^T chunk in pairs (VNNI) */
    for (int t0 = 0; t0 < E; t0 += 16) {
        const int tn = E - t0 < 16 ? E - t0 : 16;
        const uint16_t *rows[16];
        const uint16_t *k0 = kv_row(k, pages, t0, page_size, Hkv, D, kh);
        for (int j = 0; j < 16; j++)
            rows[j] = j >= tn ? 0 : page_size % 16 == 0 ? k0 + (long)j * Hkv * D
                                                          : kv_row(k, pages, t0 + j, page_size, Hkv, D, kh);
        for (int c = 0; c < nc; c++) {
            __m512i in[16], out[16];
            for (int j = 0; j < 16; j++)
                in[j] = rows[j] ? _mm512_loadu_si512(rows[j] + c * 32) : _mm512_setzero_si512();
            transpose16(in, out);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(Kt + (c * 16 + j) * 16, out[j]);
        }
        /* gcc's tile loads are asm without memory operands: make the stores to Kt and Qa visible to them */
        __asm__ volatile("" ::: "memory");
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int c = 0; c < nc; c++) {
            _tile_loadd(5, Kt + c * 256, 64);
#define QK(G) if (ng > G) { _tile_loadd(4, Qa + (long)G * 16 * D + c * 32, D * 2); _tile_dpbf16ps(G, 4, 5); }
            QK(0) QK(1) QK(2) QK(3)
#undef QK
        }
#define ST(G) if (ng > G) _tile_stored(G, sc + (long)G * 16 * Ep + t0, Ep * 4);
        ST(0) ST(1) ST(2) ST(3)
#undef ST
    }
    /* softmax along each vector's row: the matmul's bf16 score scaled and rounded, float32 softmax, bf16
       probabilities (transformers' rounding points, as the other kernels) */
    const __m512 scv = _mm512_set1_ps(scale);
    for (int u = 0; u < ng * 16; u++) {
        float *s = sc + (long)u * Ep;
        uint16_t *pr = p + (long)u * Ep;
        const int lim = lims[u];
        __m512 vmx = _mm512_set1_ps(-FLT_MAX);
        for (int t = 0; t < lim; t += 16) {
            const __mmask16 m = first(lim - t);
            const __m512 x = round_bf16x16(_mm512_mul_ps(round_bf16x16(_mm512_maskz_loadu_ps(m, s + t)), scv));
            _mm512_mask_storeu_ps(s + t, m, x);
            vmx = _mm512_mask_max_ps(vmx, m, vmx, x);
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
        const __m512 vsum = exp_in_place16(s, lim, mx);
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
        for (int t = 0; t < Eq; t += 16) {  /* zero past the row's limit, up to the padded length */
            const __mmask16 m = t < lim ? first(lim - t) : 0;
            _mm256_storeu_si256((__m256i *)(pr + t),
                                to_bf16x16(_mm512_maskz_mul_ps(m, _mm512_maskz_loadu_ps(m, s + t), inv)));
        }
    }
    /* V in (t, t+1) pairs per dimension (VNNI), zero past E; one page lookup per 16-key block where pages hold them */
    for (int t0 = 0; t0 < Eq; t0 += 16) {
        const int tn = E - t0 >= 16 ? 16 : E - t0 > 0 ? E - t0 : 0;
        const uint16_t *v0 = tn ? kv_row(v, pages, t0, page_size, Hkv, D, kh) : 0;
        for (int j = 0; j < 8; j++) {
            uint32_t *dst = Vv + (long)(t0 / 2 + j) * D;
            if (2 * j + 1 < tn) {
                const uint16_t *a = block_row(v, pages, t0, 2 * j, page_size, Hkv, D, kh, v0);
                const uint16_t *b = block_row(v, pages, t0, 2 * j + 1, page_size, Hkv, D, kh, v0);
                for (int x = 0; x < D; x += 16)
                    _mm512_storeu_si512(dst + x, _mm512_or_si512(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + x))),
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + x))), 16)));
            } else if (2 * j < tn) {
                const uint16_t *a = block_row(v, pages, t0, 2 * j, page_size, Hkv, D, kh, v0);
                for (int x = 0; x < D; x += 16)
                    _mm512_storeu_si512(dst + x, _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + x))));
            } else {
                for (int x = 0; x < D; x += 16) _mm512_storeu_si512(dst + x, _mm512_setzero_si512());
            }
        }
    }
    /* out[g] = P[g] V: A = 16 vectors' probabilities over 32 keys, B = 16 key pairs x 16 dims; 4 dim tiles a pass */
    for (int g = 0; g < ng; g++) {
        for (int x0 = 0; x0 < D; x0 += 64) {
            __asm__ volatile("" ::: "memory");  /* the stores to p and Vv, before the tile loads read them */
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            const int nx = (D - x0) / 16 < 4 ? (D - x0) / 16 : 4;
            for (int t0 = 0; t0 < Eq; t0 += 32) {
                _tile_loadd(4, p + (long)g * 16 * Ep + t0, Ep * 2);
#define PV(X) if (nx > X) { _tile_loadd(5, Vv + (long)(t0 / 2) * D + x0 + X * 16, D * 4); \
                          _tile_dpbf16ps(X, 4, 5); }
                PV(0) PV(1) PV(2) PV(3)
#undef PV
            }
#define SA(X) if (nx > X) _tile_stored(X, acc + (long)g * 16 * D + x0 + X * 16, D * 4);
            SA(0) SA(1) SA(2) SA(3)
#undef SA
        }
    }
}

/* paged_extend_bf16's contract on AMX tiles; work: amx_extend_work_floats(D, max_len) floats; D a multiple of 32.
   The caller has had amx_request_permission() return 1. */
void paged_extend_amx(
        const uint16_t *restrict q, const uint16_t *restrict k, const uint16_t *restrict v,
        const int32_t *restrict table, int table_stride, const int32_t *restrict kv_lens,
        const int32_t *restrict q_starts, const int32_t *restrict q_lens, int it0, int it1, int H, int Hkv,
        int D, int page_size, float scale, uint16_t *restrict out, float *restrict work, int max_len) {
    const int n = H / Hkv, Ep = (max_len + 31) / 32 * 32;
    /* torch's brgemm remembers per thread which tile configuration it loaded and skips reloading it: whatever was
       configured before this call is configured again after it (a release would leave torch's next tile op without
       one) */
    tile_cfg saved, cfg;
    _tile_storeconfig(&saved);
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
    float *sc = work;                                        /* [AMX_G * 16][Ep] scores, then exponentials */
    float *acc = sc + (long)AMX_G * 16 * Ep;                  /* [AMX_G * 16][D] */
    uint32_t *Kt = (uint32_t *)(acc + (long)AMX_G * 16 * D);  /* [D / 32][16][16] */
    uint32_t *Vv = Kt + (D / 32) * 256;                       /* [Ep / 2][D] */
    uint16_t *p = (uint16_t *)(Vv + (long)(Ep / 2) * D);      /* [AMX_G * 16][Ep] bf16 probabilities */
    uint16_t *Qa = p + (long)AMX_G * 16 * Ep;                 /* [AMX_G * 16][D] */
    int32_t lims[AMX_G * 16];
    for (int it = it0; it < it1; it++) {  /* work items (request, KV head): it = r * Hkv + kh */
        const int r = it / Hkv, kh = it % Hkv;
        const int ql = q_lens[r], base = kv_lens[r] - ql;
        const int32_t *pages = table + (long)r * table_stride;
        {
            for (int c0 = 0; c0 < ql * n; c0 += AMX_G * 16) {
                const int c = ql * n - c0 < AMX_G * 16 ? ql * n - c0 : AMX_G * 16, ng = (c + 15) / 16;
                for (int l = 0; l < ng * 16; l++) {
                    const int u = c0 + l, i = u / n;
                    if (l < c)
                        memcpy(Qa + (long)l * D, q + ((long)(q_starts[r] + i) * H + kh * n + u % n) * D, D * 2);
                    else memset(Qa + (long)l * D, 0, D * 2);
                    lims[l] = l < c ? base + i + 1 : 1;
                }
                const int E = base + (c0 + c - 1) / n + 1;
                amx_extend_pass(k, v, pages, page_size, Hkv, D, kh, E, ng, scale, Qa, lims, sc, p, Kt, Vv, acc, Ep);
                for (int l = 0; l < c; l++) {
                    const int u = c0 + l;
                    uint16_t *o = out + ((long)(q_starts[r] + u / n) * H + kh * n + u % n) * D;
                    for (int x = 0; x < D; x += 16)
                        _mm256_storeu_si256((__m256i *)(o + x), to_bf16x16(_mm512_loadu_ps(acc + (long)l * D + x)));
                }
            }
        }
    }
    if (saved.palette) _tile_loadconfig(&saved);
    else _tile_release();
}

long amx_extend_work_floats(int D, int max_len) {
    const long Ep = (max_len + 31) / 32 * 32;
    return AMX_G * 16 * Ep + AMX_G * 16L * D + (D / 32) * 256L + Ep / 2 * D + (AMX_G * 16 * Ep + AMX_G * 16L * D) / 2
           + 64;
}
#endif
