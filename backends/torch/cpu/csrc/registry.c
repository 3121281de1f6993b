/* The library's level and its kernel table (kernels.h): which kernels this level's build has, from the same level
   macros (levels.h) that compile them in. Python reads the names (tierlm_kernel_names) instead of probing for
   symbols; the torch ops call through the table. */
#include "kernels.h"
#include "levels.h"

#include <stddef.h>

#ifndef TIERLM_LEVEL
#error "TIERLM_LEVEL names the CPU level this library is built for (CMakeLists.txt defines it)"
#endif

#if defined(TIERLM_AVX2) || defined(TIERLM_AVX512)
#define VECTOR_GEMV 1 /* f32_gemv.c and int8_gemv.c have vector code (a plain-C build is slower than torch's) */
#endif

static const tierlm_kernel_table table = {
    .level = TIERLM_LEVEL,
    .decode_step = paged_decode_step,
#if defined(TIERLM_AVX512_BF16)
    .blocked_rows_bf16 = blocked_attention_rows_bf16,
    .avx512_linear = avx512_linear_bf16,
#endif
#if defined(TIERLM_AMX)
    .amx_linear = amx_linear_bf16,
#endif
#if defined(VECTOR_GEMV)
    .f32 = f32_linear,
    .f32_bf16w = f32_linear_bf16w,
    .f32_f16w = f32_linear_f16w,
#endif
};

const tierlm_kernel_table *tierlm_kernels(void) { return &table; }

const char *tierlm_library_level(void) { return TIERLM_LEVEL; }

/* The vector width of the level's products (f32_gemv.c, int8_gemv.c): 512 (AVX-512), 256 (AVX2) or 0 (plain C) */
int tierlm_vector_bits(void) {
#if defined(TIERLM_AVX512)
    return 512;
#elif defined(TIERLM_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* The kernel families compiled in, as the CPU plan names them (backends/torch/cpu/library.py) */
const char *tierlm_kernel_names(void) {
    return "paged_decode,softmax_rows"
#if defined(TIERLM_TORCH_OPS)
           ",torch_ops"
#endif
#if defined(TIERLM_AVX512)
           ",paged_decode_avx512,paged_extend_bf16"
#endif
#if defined(TIERLM_AVX512_BF16)
           ",paged_decode_dp,blocked_attention,avx512_linear"
#endif
#if defined(TIERLM_AMX)
           ",paged_extend_amx,amx_linear"
#endif
#if defined(TIERLM_AVX2) || defined(TIERLM_AVX512)
           ",paged_extend_f32"
#endif
#if defined(VECTOR_GEMV)
           ",f32_gemv,int8_gemv"
#endif
        ;
}
