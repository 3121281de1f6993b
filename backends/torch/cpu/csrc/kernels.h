/* Every function a tierlm CPU kernel library exports: the kernels (called from Python through ctypes, and from the
   torch ops of torch_ops.cpp), the level's kernel table, and the ops' registration.

   Built once per CPU level (CMakeLists.txt); a kernel that needs instructions the level lacks is not compiled in,
   and the table (registry.c) says which are. Everything else in the library is hidden (-fvisibility=hidden). */
#ifndef TIERLM_KERNELS_H
#define TIERLM_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TIERLM_API __attribute__((visibility("default")))

/* --- attention over the KV pool's pages, in place (pages of page_size slots, each slot [Hkv, D]) --- */

/* q [R, H, D] (one query per request) over each request's kv_lens[r] keys -> out [R, H, D]; work:
   H * max_len + 2 * H * D + H floats (paged_decode.c) */
TIERLM_API void paged_decode_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *table,
                                  int table_stride, const int32_t *kv_lens, int R, int H, int Hkv, int D,
                                  int page_size, float scale, uint16_t *out, float *work, int max_len);
TIERLM_API void paged_decode_f32(const float *q, const float *k, const float *v, const int32_t *table,
                                 int table_stride, const int32_t *kv_lens, int R, int H, int Hkv, int D, int page_size,
                                 float scale, float *out, float *work, int max_len);
/* one layer of a decode-only step: the new K/V stored at their slots, the queries gathered, the decode above */
TIERLM_API void paged_decode_step(const void *q, long qs_r, long qs_h, const void *kn, long ks_r, long ks_h,
                                  const void *vn, long vs_r, long vs_h, const int64_t *slots, void *k, void *v,
                                  const int32_t *table, int table_stride, const int32_t *kv_lens, int R, int H,
                                  int Hkv, int D, int page_size, float scale, void *out, float *work, int max_len,
                                  int bf16);
TIERLM_API long paged_decode_step_floats(int R, int H, int D, int max_len);

/* a few query rows per request over its pages: items it0..it1-1 of (request, KV head) (paged_extend*.c) */
#define TIERLM_EXTEND_ARGS(T)                                                                                       \
    const T *q, const T *k, const T *v, const int32_t *table, int table_stride, const int32_t *kv_lens,              \
        const int32_t *q_starts, const int32_t *q_lens, int it0, int it1, int H, int Hkv, int D, int page_size,      \
        float scale, T *out, float *work, int max_len
TIERLM_API void paged_extend_bf16(TIERLM_EXTEND_ARGS(uint16_t)); /* AVX-512 levels */
TIERLM_API long extend_work_floats(int D, int max_len);
TIERLM_API void paged_extend_amx(TIERLM_EXTEND_ARGS(uint16_t)); /* the amx level */
TIERLM_API long amx_extend_work_floats(int D, int max_len);
TIERLM_API void paged_extend_f32(TIERLM_EXTEND_ARGS(float)); /* AVX2 and AVX-512 levels */
TIERLM_API long extend_f32_work_floats(int D, int max_len);

/* bf16 prefill attention by blocks of query rows (blocked_attention.c): the general path's row softmax, and the
   one-pass block (AVX512-BF16 levels) */
TIERLM_API void softmax_rows_bf16(uint16_t *s, long r0, long r1, int E, const int32_t *limits, long rows_per_group,
                                  int b, float scale, float *work);
TIERLM_API void blocked_attention_rows_bf16(const uint16_t *q, const uint32_t *kp, const uint32_t *vp, uint16_t *out,
                                            int B, int M, int r0, int r1, int D, int Lp, int E,
                                            const int32_t *limits, int Hkv, int b, float scale, float *work);

/* --- products --- */

/* float32 decode products, y[M, N] = x[M, K] @ w[N, K].T (+ bias) for columns n0..n1-1 (f32_gemv.c) */
TIERLM_API void f32_linear(const float *x, long M, long K, const float *w, const float *bias, float *y, long N,
                           long n0, long n1);
TIERLM_API void f32_linear_bf16w(const float *x, long M, long K, const uint16_t *w, const float *bias, float *y,
                                 long N, long n0, long n1);
TIERLM_API void f32_linear_f16w(const float *x, long M, long K, const uint16_t *w, const float *bias, float *y,
                                long N, long n0, long n1);
/* int8 weight-only decode products (int8_gemv.c) */
TIERLM_API void int8_linear_bf16(const uint16_t *x, float *xf, int convert, long M, long K, const int8_t *q,
                                 const uint16_t *scale, const uint16_t *bias, uint16_t *y, long N, long n0, long n1);
TIERLM_API void int8_linear_f32(const float *x, float *xf, int convert, long M, long K, const int8_t *q,
                                const float *scale, const float *bias, float *y, long N, long n0, long n1);
/* bf16 decode products over oneDNN's packed weight: column blocks nb0..nb1-1 (avx512_linear.c: blocks of 64, K
   summed in chunks of kc; amx_linear.c: blocks of 32) */
TIERLM_API void avx512_linear_bf16(const uint16_t *x, long M, long K, long lda, const uint16_t *W,
                                   const uint16_t *bias, uint16_t *y, long N, long kc, long nb0, long nb1);
TIERLM_API void amx_linear_bf16(const uint16_t *x, long M, long K, long lda, const uint16_t *W, const uint16_t *bias,
                                uint16_t *y, long N, long nb0, long nb1);
/* AMX: 1 once Linux granted this process the tile state, -1 where it refused (tile_state.c) */
TIERLM_API int amx_request_permission(void);

/* --- the library itself (registry.c) --- */

/* What this library was built with: its level's kernels, NULL where the level lacks the instructions. The torch ops
   call the kernels through it (linked into the same library, never handed over as addresses). */
typedef struct {
    const char *level; /* the CPU level the library was compiled for (TIERLM_LEVEL) */
    __typeof__(&paged_decode_step) decode_step;
    __typeof__(&blocked_attention_rows_bf16) blocked_rows_bf16;
    __typeof__(&avx512_linear_bf16) avx512_linear;
    __typeof__(&amx_linear_bf16) amx_linear;
    __typeof__(&f32_linear) f32;
    __typeof__(&f32_linear_bf16w) f32_bf16w;
    __typeof__(&f32_linear_f16w) f32_f16w;
} tierlm_kernel_table;

TIERLM_API const tierlm_kernel_table *tierlm_kernels(void);
/* the level's name, and its kernels' names separated by commas (what Python's plan reads) */
TIERLM_API const char *tierlm_library_level(void);
/* the vector width of its products: 512 (AVX-512), 256 (AVX2) or 0 (plain C) */
TIERLM_API int tierlm_vector_bits(void);
TIERLM_API const char *tierlm_kernel_names(void);

/* --- the torch ops (torch_ops.cpp) --- */

/* Registers the tierlm_native ops of this library with torch's dispatcher: called once per process, on the one
   library the process serves with (other levels' libraries may be loaded beside it by tests: they register
   nothing). 0 on success; -1 if they were registered before. */
TIERLM_API int tierlm_register_torch_ops(void);
/* the step record's fields in order, each followed by a comma (step_record.h) */
TIERLM_API const char *tierlm_step_record_fields(void);

#ifdef __cplusplus
}
#endif

#endif
