"""float32 decode products on x86 CPUs: a few activation rows times a float32 [N, K] weight (a small C kernel).

Why: torch's float32 linear is MKL's, and on AMD CPUs MKL runs its generic code path for the one-row product
(``mkl_blas_def_xsgemv``: 88 % of a float32 llama-small decode step by perf on an EPYC). It streamed the weights at
10.7-19 GB/s on one core where the memory reads ~30, and oneDNN's packed float32 product did no better (12-19).
This kernel multiplies a tile of weight rows by every activation row (AVX-512: 4 x 4 rows a pass, 4 x 6 from
three rows; AVX2's 16 registers: 2 activation rows x 4 weight rows for one or two rows, 4 x 2 from three) and
prefetches the weight two tiles ahead into L2 (into L1 it gained less, without any prefetch it ran at MKL's
rate). On the EPYC, weights from DRAM, one core: 19-26 GB/s at one row (1.3-2.2x MKL; the AVX2 build 20-25,
1.2-2.1x), 12-16 GB/s at 8 rows (1.7-2.4x; the AVX2 build 10-13), before the AVX-512 4 x 6 tiles.
float32 is what ``--dtype auto`` serves on CPUs without native bf16 (AVX2-only x86), so this is their decode.
Two more entries, ``f32_linear_bf16w`` and ``f32_linear_f16w``, read a bf16- or fp16-held weight
(cpu_16bit_stored_weights.py: a 16-bit checkpoint's exact values in half the bytes) and widen it in registers (a
shift; F16C's conversion) before the same FMAs in the same order: the float32 weight's bits. The scalar tail is
written as explicit FMAs, so no compiler contracts one entry and not the other.

Numerics: float32 products and sums, in another order than MKL's (each output within float32 rounding of
``F.linear``), plus the bias; each row's sums in the same order whatever the row count. Only in decode steps
(``decode_step``: every request one token, up to ``MAX_ROWS`` of them): MKL's GEMM gives a prefill's rows the
same bits whatever the chunking (2-62 rows measured), so prefill chunks, extends after a cache hit and short
prompts keep it, and a hit or a chunk size never changes a token (an fp8 KV cache turns any difference in the
K/V into other tokens). MKL's one-row product differed from its GEMM already; decode rows took it.

Built by c_kernel_build.py for this CPU's level; where the build has neither AVX-512 nor AVX2 code (ARM, an old
x86) MKL / torch serves. ``TIERLM_CPU_F32_GEMV=0`` turns it off.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.backends.torch import c_kernel_build
from tierlm.backends.torch.c_kernel_build import KernelBuild, default_cache_dir
from tierlm.backends.torch.cpu_16bit_stored_weights import HELD_DTYPES, store_in_16bit, widened_product
from tierlm.backends.torch.cpu_threads import column_threads, split_columns
from tierlm.platforms.cpu_features import CpuFeatures

log = logging.getLogger(__name__)

ENV = "TIERLM_CPU_F32_GEMV"

_SOURCE = r"""
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The vector width of the code below: 512 (AVX-512), 256 (AVX2) or 0 (plain C). */
int f32_gemv_simd_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}

/* Weight element types: WT is 0 (float32), 1 (bf16, widened exactly: its bits are a float32's upper half) or 2
   (fp16, widened exactly); WB(WT) is the element's size in bytes. */
#define WB(WT) ((WT) == 0 ? 4 : 2)

static inline float f16_to_f32(uint16_t h) {  /* exact, as F16C's conversion (plain C: the tails, other builds) */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits;
    if (e == 0) {  /* zero or subnormal: m * 2^-24, exact in float32 */
        const float f = (float)m * 5.9604644775390625e-8f;
        __builtin_memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

static inline float w_at(const void *w, long idx, const int WT) {
    if (WT == 0) return ((const float *)w)[idx];
    const uint16_t h = ((const uint16_t *)w)[idx];
    if (WT == 2) return f16_to_f32(h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

#if defined(__AVX512F__)
static inline __m512 w_vec(const void *w, long idx, const int WT) {
    if (WT == 0) return _mm512_loadu_ps((const float *)w + idx);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + idx));
    if (WT == 2) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__)
static inline __m256 w_vec(const void *w, long idx, const int WT) {
    if (WT == 0) return _mm256_loadu_ps((const float *)w + idx);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx));
    if (WT == 2) return _mm256_cvtph_ps(h);  /* F16C: part of x86-64-v3, as AVX2 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* out[i * TR + j] = x[i, :] . w[j, :] for mr activation rows and nr <= TR weight rows (both row stride K); TR, mr
   and WT are constants where it is inlined, so the accumulators stay in registers. The weight stream is
   prefetched into L2 two tiles (2 * TR rows, contiguous) ahead: per 16 elements of each row consumed, the next
   TR * WB(WT) / 4 lines of that region. A bf16 or fp16 weight gives the same products and sums in the same order
   as its float32 widening, so the same bits. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int mr, const void *restrict w,
                                                        long K, int nr, int prefetch, float *restrict out,
                                                        const int TR, const int WT) {
    long k = 0;
    const char *ahead = (const char *)w + 2L * TR * K * WB(WT);
    const int lines = TR * WB(WT) / 4;
#if defined(__AVX512F__)
    __m512 acc[4][6];
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) acc[i][j] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        if (prefetch) for (int l = 0; l < lines; l++) _mm_prefetch(ahead + k * TR * WB(WT) + 64 * l, _MM_HINT_T1);
        __m512 wv[6];
        for (int j = 0; j < TR; j++) wv[j] = j < nr ? w_vec(w, j * K + k, WT) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * K + k);
            for (int j = 0; j < TR; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) out[i * TR + j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(__AVX2__)
    __m256 acc[4][4];
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) acc[i][j] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        if (prefetch && (k & 15) == 0)
            for (int l = 0; l < lines; l++) _mm_prefetch(ahead + k * TR * WB(WT) + 64 * l, _MM_HINT_T1);
        __m256 wv[4];
        for (int j = 0; j < TR; j++) wv[j] = j < nr ? w_vec(w, j * K + k, WT) : _mm256_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < TR; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        out[i * TR + j] = _mm_cvtss_f32(s);
    }
#else
    (void)ahead; (void)prefetch; (void)lines;
    for (int i = 0; i < mr; i++) for (int j = 0; j < TR; j++) out[i * TR + j] = 0.f;
#endif
    for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++) {  /* the columns past the last full vector */
        float s = 0.f;
        /* fused multiply-adds written out: a compiler contracts a * b + c or not as it likes, per build */
        for (long kk = k; kk < K; kk++) s = __builtin_fmaf(x[i * K + kk], w_at(w, j * K + kk, WT), s);
        out[i * TR + j] += s;
    }
}

/* Output columns n0..n1-1 in tiles of TR weight rows, RM activation rows per pass over a tile (the tile stays in
   L1/L2 between passes). The prefetch stops two tiles before n1: past it lie another thread's rows or the end. */
static inline __attribute__((always_inline)) void tiles(const float *restrict x, long M, long K,
                                                         const void *restrict w, const float *restrict bias,
                                                         float *restrict y, long N, long n0, long n1, const int RM,
                                                         const int TR, const int WT) {
    float out[24];
    for (long n = n0; n < n1; n += TR) {
        const int nr = n1 - n < TR ? (int)(n1 - n) : TR;
        const int prefetch = n + 3 * TR <= n1;
        const char *wn = (const char *)w + n * K * WB(WT);
        for (long m = 0; m < M; m += RM) {
            const int mr = M - m < RM ? (int)(M - m) : RM;
            switch (mr) {  /* constant row counts: the accumulators stay in registers */
            case 1: tile(x + m * K, 1, wn, K, nr, prefetch, out, TR, WT); break;
            case 2: tile(x + m * K, 2, wn, K, nr, prefetch, out, TR, WT); break;
            case 3: tile(x + m * K, 3, wn, K, nr, prefetch, out, TR, WT); break;
            default: tile(x + m * K, 4, wn, K, nr, prefetch, out, TR, WT); break;
            }
            for (int i = 0; i < mr; i++) for (int j = 0; j < nr; j++)
                y[(m + i) * N + n + j] = bias ? out[i * TR + j] + bias[n + j] : out[i * TR + j];
        }
    }
}

/* Tiles: AVX-512 4 rows x 4 weight rows for one or two rows, 4 x 6 from three (24 of 32 registers for sums, 6
   weight vectors and a row's vector: each weight vector serves 4 multiply-adds, each row's vector 6; 1.2-1.4x at
   4-8 rows, measured; one or two rows are memory-bound and gained nothing); AVX2 (16 registers) 2 x 4 for one or
   two rows, 4 x 2 from three (the weight read once per 4 rows: +15-35 % at 8 rows, measured; 4 x 3 ran the same). */
static inline __attribute__((always_inline)) void linear(const float *restrict x, long M, long K,
                                                          const void *restrict w, const float *restrict bias,
                                                          float *restrict y, long N, long n0, long n1, const int WT) {
#if defined(__AVX512F__)
    if (M >= 3) tiles(x, M, K, w, bias, y, N, n0, n1, 4, 6, WT);
    else tiles(x, M, K, w, bias, y, N, n0, n1, 4, 4, WT);
#else
    if (M >= 3) tiles(x, M, K, w, bias, y, N, n0, n1, 4, 2, WT);
    else tiles(x, M, K, w, bias, y, N, n0, n1, 2, 4, WT);
#endif
}

/* y[M, N] = x[M, K] @ w[N, K].T (+ bias[N]) for output columns n0..n1-1 (threads split N at multiples of 4);
   bias may be NULL. w float32. */
void f32_linear(const float *restrict x, long M, long K, const float *restrict w, const float *restrict bias,
                float *restrict y, long N, long n0, long n1) {
    linear(x, M, K, w, bias, y, N, n0, n1, 0);
}

/* The same with w stored as bf16 (half the bytes to read; the same bits as its float32 widening). */
void f32_linear_bf16w(const float *restrict x, long M, long K, const uint16_t *restrict w,
                      const float *restrict bias, float *restrict y, long N, long n0, long n1) {
    linear(x, M, K, w, bias, y, N, n0, n1, 1);
}

/* The same with w stored as fp16 (F16C's exact widening). */
void f32_linear_f16w(const float *restrict x, long M, long K, const uint16_t *restrict w,
                     const float *restrict bias, float *restrict y, long N, long n0, long n1) {
    linear(x, M, K, w, bias, y, N, n0, n1, 2);
}
"""
CFLAGS = ("-O3", "-fPIC", "-fno-semantic-interposition")  # no -ffast-math: the sums stay in the order written
# Activation rows the kernel takes: decode steps up to 8 streams (past that MKL's GEMM is compute-bound and fast).
MAX_ROWS = 8
# Below this many weights per thread a product stays on the calling thread (a hand-off costs ~30 us).
MIN_WEIGHTS_PER_THREAD = 1 << 20

_NAME = "f32_gemv"
_FALLBACK = "float32 decode products use torch's F.linear (MKL)"


def _bind(lib: ctypes.CDLL) -> None:
    lib.f32_gemv_simd_bits.restype = ctypes.c_int
    lib.f32_gemv_simd_bits.argtypes = []
    for fn in (lib.f32_linear, lib.f32_linear_bf16w, lib.f32_linear_f16w):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p] + [ctypes.c_long] * 3


def _load(cpu: CpuFeatures) -> KernelBuild:
    return c_kernel_build.build_x86_vector_kernel(_NAME, _SOURCE, CFLAGS, _bind, cpu, default_cache_dir(), ENV,
                                                  _FALLBACK, lambda lib: lib.f32_gemv_simd_bits())


_kernel = c_kernel_build.LoadOnce(_load, "CPU float32 decode-product kernel", _FALLBACK)


def load(cpu: CpuFeatures | None = None) -> ctypes.CDLL | None:
    """The kernel for this CPU, built on first use; None where it does not run (then MKL's F.linear)."""
    return _kernel(cpu)


def describe() -> dict[str, str | None]:
    """The kernel as loaded (for /server_info and doctor): the level built for and why, or why not."""
    return _kernel.describe()


class _Step(threading.local):
    decode = False


_STEP = _Step()
# Also told of each step's kind: the C++ op of compiled steps (cpu_product_op.py), which has no thread-local.
_STEP_LISTENERS: list[Callable[[bool], None]] = []


def on_decode_step(listener: Callable[[bool], None]) -> None:
    """``listener(decode)`` is called as each ``decode_step`` block begins and ends (once per listener)."""
    if listener not in _STEP_LISTENERS:
        _STEP_LISTENERS.append(listener)


@contextlib.contextmanager
def decode_step(decode: bool = True) -> Iterator[None]:
    """Within this block the products are a decode step's (every request one token): the kernel takes them."""
    before, _STEP.decode = _STEP.decode, decode
    for listener in _STEP_LISTENERS:
        listener(decode)
    try:
        yield
    finally:
        _STEP.decode = before
        for listener in _STEP_LISTENERS:
            listener(before)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) in float32, weight float32, bf16 or fp16 (cpu_16bit_stored_weights.py):
    the kernel for 1..MAX_ROWS rows of a decode step where it loaded, else F.linear (on the 16-bit weight
    widened)."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    lib = _kernel.lib if _STEP.decode and 0 < rows <= MAX_ROWS else None
    if lib is None or x.dtype != torch.float32 or not weight.is_contiguous():
        if weight.dtype in HELD_DTYPES and x.dtype == torch.float32:
            return widened_product(x, weight, bias)
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    N = weight.shape[0]
    y = torch.empty((rows, N), dtype=torch.float32)
    args = (x2.data_ptr(), rows, K, weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), N)
    fn = lib.f32_linear_bf16w if weight.dtype == torch.bfloat16 else \
        lib.f32_linear_f16w if weight.dtype == torch.float16 else lib.f32_linear
    split_columns(lambda n0, n1: fn(*args, n0, n1), N, column_threads(N * K, MIN_WEIGHTS_PER_THREAD))
    return y.view(*x.shape[:-1], N)


class F32GemvLinear(nn.Linear):
    """``nn.Linear`` (same weight, same state dict) whose decode-sized float32 products run on the kernel; its
    weight float32, or bf16 / fp16 where cpu_16bit_stored_weights.py holds it so (the products still float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the graph records one opaque op (compiled_decode.py)
            from tierlm.backends.torch.compiled_decode import f32_linear_op

            return f32_linear_op(x, self.weight, self.bias)
        return product(x, self.weight, self.bias)


def use_for_linears(model: nn.Module) -> int:
    """Give every float32 CPU ``nn.Linear`` of ``model`` (exactly that class: quantized or adapted subclasses keep
    their forward) the kernel's forward, in place; returns how many (0 where the kernel does not load here)."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32
               and m.weight.device.type == "cpu" and m.weight.is_contiguous()]
    if not linears:
        return 0
    if load() is None:
        log.info("CPU float32 linear layers: %s", describe()["why"])
        return 0
    for m in linears:
        m.__class__ = F32GemvLinear
    log.info("CPU float32: %d linear layers run products of up to %d rows on tierlm's kernel (%s)", len(linears),
             MAX_ROWS, describe()["why"])
    store_in_16bit(model, linears)  # a bf16 / fp16 checkpoint's weights: half the bytes, the same values
    return len(linears)
