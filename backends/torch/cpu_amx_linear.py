"""Decode-sized bf16 products on AMX tiles, read straight from oneDNN's packed weight (CPUs with AMX-BF16).

Why: decode multiplies 1-32 activation rows by each weight, so a step's linears are a stream over the weights, and
oneDNN's AMX kernel streams them at ~4.7 GB/s on one core of the AMX Xeon VM (llama-small's 80 MB of linears:
17 ms a step at one row) where this kernel, the same tile products with the next weight blocks prefetched, reads
~8.4 GB/s (9.5 ms; 16 rows 16.7 -> 10.2 ms; 32 rows 25.4 -> 13.4 ms).

How: oneDNN packs a bf16 [N, K] weight for AMX as blocks of 32 output columns, each holding its K inputs in
pairs (VNNI): [N/32][K/2][32][2], N and K padded to multiples of 32 with zeros. One block's two 16-column halves
are the B tiles of a ``tdpbf16ps`` (16 input pairs x 16 columns, a 128-byte row stride); A is 16 activation rows x
32 inputs; C holds the float32 sums over the whole K, then the bias is added and the sum rounded once to bf16.
oneDNN's brgemm does the same products over the same blocks in the same order, so the outputs are the same bits
(tests/test_cpu_amx_linear.py; compiled graphs and cache hits are unaffected).

The layout is oneDNN's choice, not a promise: each weight is checked once, at packing, against the layout above
(``layout_matches``: the size, and 64 blocks spread over the weight byte for byte); a weight packed any other way
(another CPU, another oneDNN) keeps oneDNN's product. Rows past ``MAX_ROWS`` (prefill) keep oneDNN: it blocks over
rows, where this kernel would stream the weight again for every 32.
``TIERLM_CPU_AMX_LINEAR=0`` turns the kernel off.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from tierlm.backends.torch import c_kernel_build, onednn_packed_weight
from tierlm.backends.torch.c_kernel_build import KernelBuild, default_cache_dir
from tierlm.platforms.cpu_features import AMX_LINEAR_ENV, CpuFeatures, amx_linear_decision, find_c_compiler

log = logging.getLogger(__name__)

_SOURCE = c_kernel_build.BF16_C + r"""
/* Compiled with a function target attribute in AVX-512 builds whose compiler knows AMX (gcc 11, clang 12); called
   only where the CPU has AMX and Linux granted the tile state (cpu_amx_linear.py). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_cfg;

static int permitted = 0;
int amx_linear_request_permission(void) {  /* Linux hands AMX state to a process only on request */
    if (!permitted) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 1 : -1;
    return permitted;
}

/* Bytes ahead of the current weight block that are prefetched: 6 KB (three 32-input steps) measured best, 4.7 ->
   8.4 GB/s (none: 6.1 GB/s; 12 KB: 6.2; prefetching into L2 only or non-temporally: slower). */
#define AHEAD 6144

""" + c_kernel_build.TO_BF16X16_C + r"""
/* y[M, N] = x[M, K] @ W.T (+ bias) for the 32-column blocks nb0..nb1-1 of W packed [Np/32][K/2][32][2];
   M <= 32, K a multiple of 32, x rows lda elements apart (a split's half: no copy), bias NULL or [N]. Tiles: 0-1
   C of rows 0-15 (columns 0-15, 16-31), 2-3 C of rows 16-31, 4-5 A of those rows, 6-7 B (the block's two column
   halves). The sums are rounded 16 columns at a time (a scalar loop cost ~0.6 ms of an 8-row llama-small step). */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl"))) void amx_linear_bf16(
        const uint16_t *restrict x, long M, long K, long lda, const uint16_t *restrict W,
        const uint16_t *restrict bias, uint16_t *restrict y, long N, long nb0, long nb1) {
    /* torch's brgemm remembers per thread which configuration it loaded: the caller's is loaded again after */
    tile_cfg saved, cfg;
    _tile_storeconfig(&saved);
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int m0 = M < 16 ? (int)M : 16, m1 = M > 16 ? (int)M - 16 : 0;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)m0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(m1 ? m1 : 1);
    cfg.rows[6] = cfg.rows[7] = 16;
    _tile_loadconfig(&cfg);
    float c[32][32];
    for (long nb = nb0; nb < nb1; nb++) {
        const uint16_t *w = W + nb * K * 32;
        _tile_zero(0); _tile_zero(1);
        if (m1) { _tile_zero(2); _tile_zero(3); }
        for (long k = 0; k < K; k += 32) {
            const char *b = (const char *)(w + k * 32);  /* 16 pairs x 32 columns: 2 KB */
            for (int l = 0; l < 2048; l += 64) _mm_prefetch(b + AHEAD + l, _MM_HINT_T0);
            _tile_loadd(4, x + k, lda * 2);
            _tile_loadd(6, b, 128);
            _tile_loadd(7, b + 64, 128);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (m1) {
                _tile_loadd(5, x + 16 * lda + k, lda * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, &c[0][0], 128);
        _tile_stored(1, &c[0][16], 128);
        if (m1) { _tile_stored(2, &c[16][0], 128); _tile_stored(3, &c[16][16], 128); }
        __asm__ volatile("" ::: "memory");  /* gcc's tile stores are asm without memory operands */
        const long n0 = nb * 32, nn = N - n0 < 32 ? N - n0 : 32;
        const __mmask16 cm0 = nn >= 16 ? 0xffff : (__mmask16)((1u << nn) - 1);
        const __mmask16 cm1 = nn <= 16 ? 0 : nn >= 32 ? 0xffff : (__mmask16)((1u << (nn - 16)) - 1);
        __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        if (bias) {  /* bf16 bias -> float32: the bits shifted up */
            b0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cm0, bias + n0)), 16));
            b1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cm1, bias + n0 + 16)), 16));
        }
        for (long i = 0; i < M; i++) {
            __m512 v0 = _mm512_loadu_ps(&c[i][0]), v1 = _mm512_loadu_ps(&c[i][16]);
            if (bias) { v0 = _mm512_add_ps(v0, b0); v1 = _mm512_add_ps(v1, b1); }
            _mm256_mask_storeu_epi16(y + i * N + n0, cm0, to_bf16x16(v0));
            if (cm1) _mm256_mask_storeu_epi16(y + i * N + n0 + 16, cm1, to_bf16x16(v1));
        }
    }
    if (saved.palette) _tile_loadconfig(&saved);
    else _tile_release();
}
#endif
"""
CFLAGS = c_kernel_build.CFLAGS
# Activation rows the kernel takes: decode batches and short extends (the compiled steps' limit too).
MAX_ROWS = 32
BLOCK = 32  # output columns per packed block, and the input multiple
NAME = "AMX"  # in logs and reports
ENV = AMX_LINEAR_ENV

_NAME = "amx_linear"
_FALLBACK = "decode-sized bf16 products use oneDNN's packed kernel"


def _bind(lib: ctypes.CDLL) -> None:
    if not hasattr(lib, "amx_linear_bf16"):  # a build without AVX-512 or an AMX-aware compiler
        return
    lib.amx_linear_request_permission.restype = ctypes.c_int
    lib.amx_linear_request_permission.argtypes = []
    lib.amx_linear_bf16.restype = None
    lib.amx_linear_bf16.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]


def _load(cpu: CpuFeatures) -> KernelBuild:
    ok, why = amx_linear_decision(cpu, os.environ)
    if not ok:
        return KernelBuild(None, None, f"{why}; {_FALLBACK}")
    cc = find_c_compiler(os.environ)
    if cc is None:
        return KernelBuild(None, None, f"no C compiler (cc/gcc/clang); {_FALLBACK}")
    build = c_kernel_build.build_for_cpu(_NAME, _SOURCE, CFLAGS, _bind, cpu, cc, default_cache_dir(), _FALLBACK)
    if build.lib is None:
        return build
    if not hasattr(build.lib, "amx_linear_bf16"):
        return KernelBuild(None, None, f"{build.level} build has no AMX code (needs AVX-512 and gcc >= 11 or "
                                       f"clang >= 12); {_FALLBACK}")
    if build.lib.amx_linear_request_permission() != 1:
        return KernelBuild(None, None, f"Linux refused the AMX tile state (arch_prctl); {_FALLBACK}")
    return build


_kernel = c_kernel_build.LoadOnce(_load, "CPU bf16 decode products on AMX tiles", _FALLBACK, warn_when_missing=False)


def load(cpu: CpuFeatures | None = None) -> ctypes.CDLL | None:
    """The kernel for this CPU, built on first use; None where it does not run (then oneDNN's product)."""
    return _kernel(cpu)


def describe() -> dict[str, str | None]:
    """The kernel as loaded (for /server_info and doctor): the level built for and why, or why not."""
    return _kernel.describe()


def expected_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as the kernel reads it: [Np/32, Kp/2, 32, 2], zero-padded to multiples of 32."""
    return onednn_packed_weight.expected_layout(weight, BLOCK)


def layout_matches(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN packed ``weight`` in the kernel's layout (onednn_packed_weight.layout_matches)."""
    return onednn_packed_weight.layout_matches(weight, packed, BLOCK)


def fast_rows(weight: torch.Tensor, packed: torch.Tensor) -> int:
    """The most activation rows the kernel takes for this packed weight: ``MAX_ROWS`` where it runs here and the
    layout matches, else 0 (oneDNN's product at every row count)."""
    if load() is None or not layout_matches(weight, packed):
        return 0
    return MAX_ROWS


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
            ) -> torch.Tensor | None:
    """x [..., K] bf16 with at most ``MAX_ROWS`` rows over a weight ``fast_rows`` accepted -> [..., N], the same
    bits as ``torch.ops.mkldnn._linear_pointwise``; None when x's width is not the weight's K (oneDNN then says).
    Lean: ~40 calls a decode step."""
    address = onednn_packed_weight.address_if_fits(x, packed, out_features, BLOCK)
    if not address:
        return None
    return onednn_packed_weight.run_product(_kernel.lib.amx_linear_bf16, x, address, bias, out_features, BLOCK)
