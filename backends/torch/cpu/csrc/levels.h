/* Which instructions this translation unit is compiled for, named once for every kernel file.

   The build compiles each kernel file once per CPU level (CMakeLists.txt: x86-64, avx2, avx512, avx512_bf16, amx;
   aarch64: neon, dotprod, bf16, sve, sve2) with exactly that level's target flags, never -march=native. A kernel
   is compiled in where its level macro is set, and registry.c lists the kernels of the level from the same macros,
   so what a library says it has is what it was built with. */
#ifndef TIERLM_LEVELS_H
#define TIERLM_LEVELS_H

#if defined(__AVX2__) && defined(__FMA__)
#define TIERLM_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  /* x86-64-v4 */
#define TIERLM_AVX512 1
#endif
#if defined(TIERLM_AVX512) && defined(__AVX512BF16__)
#define TIERLM_AVX512_BF16 1
#endif
#if defined(TIERLM_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TIERLM_AMX 1
#endif

#endif
