"""The decode matmul of weight-only int8 layers on x86 CPUs: a few activation rows times an int8 [N, K] weight with
one scale per output row, read straight from the int8 weight (a small C kernel).

Why not torch's ``_weight_int8pack_mm``: decode multiplies 1-8 rows, so the matmul is a stream over the weight, and
torch's kernel streams int8 no faster than oneDNN streams bf16 (~15 G weights/s on one AVX-512 core here): int8
halved the bytes and gained nothing (docs/models.md). This kernel widens 4 weight rows at a time to float32 (16
lanes with AVX-512, 8 with AVX2), multiplies every activation row by them, and prefetches the weight rows two tiles
ahead: without the prefetch it ran at 10 GB/s, with it 25-31 GB/s, 1.9-2.3x oneDNN's bf16 GEMV and 1.7-5x
torch's int8 kernel per matrix of the Qwen2.5-0.5B shape (one thread, weights from DRAM). It takes bf16 and
float32 activations alike (torch's kernel is vectorized for bf16 only: float32 ran a scalar loop).

Numerics: float32 products and sums (the activations widened exactly), times the row's scale, plus the bias, one
rounding to the output dtype (torch's bf16 kernel rounds its product before it adds the bias, then again).

bf16 activations use it for at most ``MAX_ROWS`` rows: past that the float32 multiply-adds, not the bytes, set the
pace, and bf16 prefill is faster through oneDNN on the widened weight (cpu_quant_linear.py); float32 activations
use it for any count (it outran MKL's float32 GEMM on the widened weight at every count tried, up to 512 rows).
Built by c_kernel_build.py; where the build has neither AVX-512 nor AVX2 code (an ARM CPU, an old x86) torch's
kernel runs. ``TIERLM_CPU_INT8_GEMV=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import logging

import torch

from tierlm.backends.torch import c_kernel_build
from tierlm.backends.torch.c_kernel_build import KernelBuild, default_cache_dir
from tierlm.backends.torch.cpu_threads import column_threads, split_columns
from tierlm.platforms.cpu_features import CpuFeatures

log = logging.getLogger(__name__)

_SOURCE = c_kernel_build.BF16_C + r"""
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The vector width of the code below: 512 (AVX-512), 256 (AVX2) or 0 (plain C). */
int int8_gemv_simd_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}

#define NR 4  /* weight rows per tile */
#define MR 4  /* activation rows per pass over a tile */

/* out[i][j] = x[i, :] . q[j, :] for mr activation rows (float32, row stride K) and nr <= NR weight rows (int8,
   row stride K). The weight stream is prefetched two tiles (2 * NR rows) ahead: the hardware prefetcher alone
   left it at a third of DRAM speed. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int mr, const int8_t *restrict q,
                                                        long K, int nr, float out[MR][NR]) {
    long k = 0;
    const char *ahead = (const char *)(q + 2 * NR * K);
#if defined(__AVX512F__)
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; i++) for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        _mm_prefetch(ahead + k * NR, _MM_HINT_T0);  /* 64 bytes per 16 columns: the next tiles' 4 rows */
        __m512 w[NR];
        for (int j = 0; j < NR; j++)
            w[j] = j < nr ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j * K + k))))
                          : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * K + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(w[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) for (int j = 0; j < NR; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(__AVX2__)
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; i++) for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        if ((k & 15) == 0) _mm_prefetch(ahead + k * NR, _MM_HINT_T0);
        __m256 w[NR];
        for (int j = 0; j < NR; j++)
            w[j] = j < nr ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j * K + k))))
                          : _mm256_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(w[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) for (int j = 0; j < NR; j++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        out[i][j] = _mm_cvtss_f32(s);
    }
#else
    (void)ahead;
    for (int i = 0; i < mr; i++) for (int j = 0; j < NR; j++) out[i][j] = 0.f;
#endif
    for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {  /* the columns past the last full vector */
        float s = 0.f;
        for (long kk = k; kk < K; kk++) s += x[i * K + kk] * (float)q[j * K + kk];
        out[i][j] += s;
    }
}

/* y[M, N] = x[M, K] @ (q[N, K] * scale[N, None]).T (+ bias[N]) for output columns n0..n1-1 (threads split N).
   x arrives in T; with convert set it is widened into xf [M, K] first, else xf already holds it (the caller
   widened it once for all threads; float32 x is passed as xf itself). bias may be NULL. */
#define INT8_LINEAR(NAME, T, LOAD, STORE)                                                                           \
void NAME(const T *restrict x, float *restrict xf, int convert, long M, long K, const int8_t *restrict q,           \
          const T *restrict scale, const T *restrict bias, T *restrict y, long N, long n0, long n1) {               \
    if (convert) for (long i = 0; i < M * K; i++) xf[i] = LOAD(x[i]);                                               \
    float out[MR][NR];                                                                                              \
    for (long n = n0; n < n1; n += NR) {                                                                            \
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;                                                            \
        for (long m = 0; m < M; m += MR) {  /* the tile's rows stay in L1 between passes */                         \
            const int mr = M - m < MR ? (int)(M - m) : MR;                                                          \
            switch (mr) {  /* constant row counts: the accumulators stay in registers */                            \
            case 1: tile(xf + m * K, 1, q + n * K, K, nr, out); break;                                              \
            case 2: tile(xf + m * K, 2, q + n * K, K, nr, out); break;                                              \
            case 3: tile(xf + m * K, 3, q + n * K, K, nr, out); break;                                              \
            default: tile(xf + m * K, MR, q + n * K, K, nr, out); break;                                            \
            }                                                                                                       \
            for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {                                             \
                float v = out[i][j] * LOAD(scale[n + j]);                                                           \
                if (bias) v += LOAD(bias[n + j]);                                                                   \
                y[(m + i) * N + n + j] = STORE(v);                                                                  \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
}
#define IDENTITY(v) (v)
INT8_LINEAR(int8_linear_bf16, uint16_t, bf, to_bf)
INT8_LINEAR(int8_linear_f32, float, IDENTITY, IDENTITY)
"""
CFLAGS = c_kernel_build.CFLAGS  # -ffast-math: the plain-C tail and the baseline build vectorize their sums
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# bf16 activation rows the kernel takes (decode batches); past 8 it ran no faster than torch's kernel (bound by the
# float32 multiply-adds).
MAX_ROWS = 8
# Below this many weights per thread a matmul stays on the calling thread (a hand-off costs ~30 us).
MIN_WEIGHTS_PER_THREAD = 1 << 20

_NAME = "int8_gemv"
_FALLBACK = "int8 weight-only decode rows use torch's _weight_int8pack_mm"


def _bind(lib: ctypes.CDLL) -> None:
    lib.int8_gemv_simd_bits.restype = ctypes.c_int
    lib.int8_gemv_simd_bits.argtypes = []
    for fn in (lib.int8_linear_bf16, lib.int8_linear_f32):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long] + \
            [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3


def _load(cpu: CpuFeatures) -> KernelBuild:
    # a plain-C (baseline) build is not used: torch's vectorized bf16 kernel is the faster one there
    return c_kernel_build.build_x86_vector_kernel(_NAME, _SOURCE, CFLAGS, _bind, cpu, default_cache_dir(),
                                                  "TIERLM_CPU_INT8_GEMV", _FALLBACK,
                                                  lambda lib: lib.int8_gemv_simd_bits())


_kernel = c_kernel_build.LoadOnce(_load, "CPU int8 weight-only decode kernel", _FALLBACK)


def load(cpu: CpuFeatures | None = None) -> ctypes.CDLL | None:
    """The kernel for this CPU, built on first use; None where it does not run (then torch's kernel)."""
    return _kernel(cpu)


def describe() -> dict[str, str | None]:
    """The kernel as loaded (for /server_info and doctor): the level built for and why, or why not."""
    return _kernel.describe()


def takes(rows: int, dtype: torch.dtype) -> bool:
    """Whether a matmul of ``rows`` activation rows in ``dtype`` goes to this kernel (built and loaded here):
    bf16 decode rows, and float32 at any count (torch's kernel runs a scalar loop for float32)."""
    if rows <= 0 or dtype not in KERNEL_DTYPES or (dtype == torch.bfloat16 and rows > MAX_ROWS):
        return False
    return load() is not None


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] contiguous (bf16 or float32, the dtype of ``scales`` and ``bias``), qweight int8 [N, K]
    contiguous, scales [N] -> [M, N] in x's dtype; call only where ``takes`` said yes."""
    lib = _kernel.lib
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    fn = lib.int8_linear_bf16 if bf16 else lib.int8_linear_f32
    xf = torch.empty((M, K), dtype=torch.float32) if bf16 else x
    args = (x.data_ptr(), xf.data_ptr())
    tail = (M, K, qweight.data_ptr(), scales.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), N)
    threads = column_threads(N * K, MIN_WEIGHTS_PER_THREAD)
    convert = int(bf16 and threads == 1)  # one thread widens x itself; for several it is widened once here
    if bf16 and not convert:
        xf.copy_(x)
    split_columns(lambda n0, n1: fn(*args, convert, *tail, n0, n1), N, threads)
    return y
