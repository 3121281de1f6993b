"""Decode-sized bf16 products with AVX512-BF16 dot products, read straight from oneDNN's packed weight (CPUs with
AVX512-BF16 and no AMX: AMD Zen 4/5, Cooper Lake).

Why: decode multiplies 1-32 activation rows by each weight, so a step's linears are a stream over the weights, and
oneDNN's avx512_core_bf16 kernel streams llama-small's 76 MiB of linears at ~14 GB/s on one core of the EPYC VM
where one core reads memory at ~28 GB/s; this kernel reads them at ~24 GB/s (one row: 5.5 -> 3.3 ms a step).

How: oneDNN packs a bf16 [N, K] weight for AVX512-BF16 as blocks of 64 output columns, each holding its K inputs in
pairs: [N/64][K/2][64][2], N padded to a multiple of 64 with zeros. One input pair of a block is four 16-column
vectors; ``vdpbf16ps`` adds the pair's two products to 16 float32 sums. Each activation row's pair is broadcast to
the four vectors; up to 6 rows share one pass over the block (24 sums in registers).

oneDNN's bits: its brgemm sums K in chunks, each chunk from zero, the chunk sums added in order (then the bias,
then one rounding to bf16), and the chunk size depends on the row count and K (measured: 512 at one row, 1024 at
two or more; K=896 in 512s), not on N or the thread count. That is oneDNN's choice, not a promise, so it is not
assumed: per K, a probe whose sums change with any other chunking (a 2^24 term carried from the first input to the
last, cancelled there) finds the chunk size that gives oneDNN's bits for each row count; a row count no candidate
matches keeps oneDNN's product. The layout is checked per weight (onednn_packed_weight.py).
``TIERLM_CPU_AVX512_LINEAR=0`` turns the kernel off.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from tierlm.backends.torch import c_kernel_build, onednn_packed_weight
from tierlm.backends.torch.c_kernel_build import KernelBuild, default_cache_dir
from tierlm.platforms.cpu_features import AVX512_LINEAR_ENV, CpuFeatures, avx512_linear_decision, find_c_compiler

log = logging.getLogger(__name__)

_SOURCE = c_kernel_build.BF16_C + r"""
/* Built only for levels with AVX512-BF16 (cpu_avx512_linear.py). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
""" + c_kernel_build.TO_BF16X16_C + r"""
/* Input pair k of a block (four 16-column vectors at wk, 256 bytes) into the sums of R rows (R <= 6): each row's
   pair broadcast to the four vectors, one vdpbf16ps each. The inner step of both kinds of pass below. */
static inline __attribute__((always_inline)) void pair_x_rows(
        const int R, const uint16_t *restrict x, long lda, long k, const uint16_t *restrict wk, __m512 acc[6][4]) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
    for (int r = 0; r < R; r++) {
        uint32_t pair;
        memcpy(&pair, x + r * lda + k, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
    }
}

/* R rows (R <= 6) x the 64 columns of one block: sums over K in chunks of kc inputs, each chunk from zero and added
   to the total in order (oneDNN's order); then the bias, then one rounding. The first pass over a block reads it
   from memory with no software prefetch: the hardware prefetcher follows that stream better (one row: 3.3-4.3 ms a
   step with 1-4 KB prefetched ahead, 2.9 without). A later pass reads the block from L2 while memory would idle,
   so it prefetches the next block into L2 (next_block: 7 rows 5.3 -> 4.9 ms, 8 rows 5.5 -> 5.2, 16 rows 7.7 -> 7.4;
   into L1: slower). */
static inline __attribute__((always_inline)) void rows_x_block(
        const int R, const int next_block, const uint16_t *restrict x, long lda, const uint16_t *restrict w, long K,
        long kc, const __m512 *b, const __mmask16 *cm, uint16_t *restrict y, long N) {
    __m512 acc[6][4], tot[6][4];
    for (long k0 = 0; k0 < K; k0 += kc) {
        const long k1 = k0 + kc < K ? k0 + kc : K;
        for (int r = 0; r < R; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (long k = k0; k < k1; k += 2) {
            const uint16_t *wk = w + k * 64;  /* one input pair of 64 columns: 256 bytes */
            if (next_block)
                for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)(wk + K * 64) + l, _MM_HINT_T1);
            pair_x_rows(R, x, lda, k, wk, acc);
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) tot[r][j] = k0 ? _mm512_add_ps(tot[r][j], acc[r][j]) : acc[r][j];
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            if (cm[j]) _mm256_mask_storeu_epi16(y + r * N + 16 * j, cm[j], to_bf16x16(_mm512_add_ps(tot[r][j], b[j])));
}

/* 7-10 rows: two passes whose reading of memory and arithmetic take about as long, so they are overlapped span by
   span. Per span of SPAN inputs of the block (16 KB, in L1 after the first pass), each pass loads its rows' sums
   from acc, runs the span and stores them back (float32 sums kept exactly: the same bits), every pass prefetching
   two spans ahead into L2. All llama-small linears at 8 rows: 4.1-4.4 -> 3.3-3.5 ms, 7 rows 3.6 -> 3.5, 10 rows
   4.4 -> 4.1; from 11 rows the products are compute-bound and the reloaded sums cost 2-5 %, so whole-block passes
   serve those. */
#define SPAN 128
#define SPAN_AHEAD (2 * SPAN * 128)
static inline __attribute__((always_inline)) void rows_x_span(
        const int R, const uint16_t *restrict x, long lda, const uint16_t *restrict w, long s0, long s1,
        float *restrict acc) {
    __m512 a[6][4];
    for (int r = 0; r < R; r++) for (int j = 0; j < 4; j++) a[r][j] = _mm512_loadu_ps(acc + r * 64 + 16 * j);
    for (long k = s0; k < s1; k += 2) {
        const uint16_t *wk = w + k * 64;
        for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)wk + SPAN_AHEAD + l, _MM_HINT_T1);
        pair_x_rows(R, x, lda, k, wk, a);
    }
    for (int r = 0; r < R; r++) for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + r * 64 + 16 * j, a[r][j]);
}

/* The span-by-span product of one block for 7 <= M <= 12 rows (two passes): the same sums in the same order as
   rows_x_block (each K chunk from zero, chunk sums added in order, then the bias, one rounding). */
static void block_by_spans(const uint16_t *restrict x, long M, long K, long lda, const uint16_t *restrict w,
                           long kc, const __m512 *b, const __mmask16 *cm, uint16_t *restrict y, long N) {
    float acc[12 * 64] __attribute__((aligned(64))), tot[12 * 64] __attribute__((aligned(64)));
    const long first = M / 2;
    for (long k0 = 0; k0 < K; k0 += kc) {
        const long k1 = k0 + kc < K ? k0 + kc : K;
        /* zeroed inline: a memset call per block and chunk was ~1 % of a Qwen2.5-0.5B-shape 8-stream step */
        for (long e = 0; e < 64 * M; e += 16) _mm512_store_ps(acc + e, _mm512_setzero_ps());
        for (long s0 = k0; s0 < k1; s0 += SPAN) {
            const long s1 = s0 + SPAN < k1 ? s0 + SPAN : k1;
            for (int p = 0; p < 2; p++) {
                const long i = p ? first : 0, r = p ? M - first : first;
                const uint16_t *xi = x + i * lda;
                float *ai = acc + i * 64;
                switch (r) {  /* 3-6 rows a pass for 7-12 rows */
                    case 3: rows_x_span(3, xi, lda, w, s0, s1, ai); break;
                    case 4: rows_x_span(4, xi, lda, w, s0, s1, ai); break;
                    case 5: rows_x_span(5, xi, lda, w, s0, s1, ai); break;
                    default: rows_x_span(6, xi, lda, w, s0, s1, ai); break;
                }
            }
        }
        for (long e = 0; e < 64 * M; e += 16)
            _mm512_store_ps(tot + e, k0 ? _mm512_add_ps(_mm512_load_ps(tot + e), _mm512_load_ps(acc + e))
                                        : _mm512_load_ps(acc + e));
    }
    for (long r = 0; r < M; r++)
        for (int j = 0; j < 4; j++)
            if (cm[j]) _mm256_mask_storeu_epi16(y + r * N + 16 * j, cm[j],
                                                to_bf16x16(_mm512_add_ps(_mm512_load_ps(tot + r * 64 + 16 * j), b[j])));
}

/* y[M, N] = x[M, K] @ W.T (+ bias) for the 64-column blocks nb0..nb1-1 of W packed [Np/64][K/2][64][2]; M >= 1,
   K even, x rows lda elements apart, bias NULL or [N], kc the chunk of K summed from zero (even). 7-10 rows go span
   by span (block_by_spans); otherwise rows are split into passes of at most 6, as even as possible, later passes
   reading the block from L2. */
void avx512_linear_bf16(const uint16_t *restrict x, long M, long K, long lda, const uint16_t *restrict W,
                        const uint16_t *restrict bias, uint16_t *restrict y, long N, long kc, long nb0, long nb1) {
    const long passes = (M + 5) / 6;
    for (long nb = nb0; nb < nb1; nb++) {
        const uint16_t *w = W + nb * K * 64;
        const long n0 = nb * 64, nn = N - n0 < 64 ? N - n0 : 64;
        __mmask16 cm[4];
        __m512 b[4];
        for (int j = 0; j < 4; j++) {
            const long c = nn - 16 * j;
            cm[j] = c >= 16 ? 0xffff : c <= 0 ? 0 : (__mmask16)((1u << c) - 1);
            b[j] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(  /* bf16 bias -> float32: the bits shifted up */
                       _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cm[j], bias + n0 + 16 * j)), 16))
                        : _mm512_setzero_ps();
        }
        if (M >= 7 && M <= 10) {
            block_by_spans(x, M, K, lda, w, kc, b, cm, y + n0, N);
            continue;
        }
        for (long p = 0, i = 0; p < passes; p++) {
            const long r = (M - i) / (passes - p);
            const uint16_t *xi = x + i * lda;
            uint16_t *yi = y + i * N + n0;
            /* the last of several passes prefetches the next block of this slice, if any */
            const int next = passes > 1 && p == passes - 1 && nb + 1 < nb1;
#define PASS(R) (next ? rows_x_block(R, 1, xi, lda, w, K, kc, b, cm, yi, N) \
                      : rows_x_block(R, 0, xi, lda, w, K, kc, b, cm, yi, N))
            switch (r) {
                case 1: PASS(1); break;
                case 2: PASS(2); break;
                case 3: PASS(3); break;
                case 4: PASS(4); break;
                case 5: PASS(5); break;
                default: PASS(6); break;
            }
#undef PASS
            i += r;
        }
    }
}
#endif
"""
CFLAGS = c_kernel_build.CFLAGS
# Activation rows the kernel takes: decode batches and short extends (the compiled steps' limit too).
MAX_ROWS = 32
BLOCK = 64  # output columns per packed block
# Chunk sizes tried by the probe, after "all of K in one chunk": oneDNN's choices first.
CHUNK_CANDIDATES = (512, 1024, 256, 768, 1536, 2048, 128, 384, 640, 896, 1280, 4096)
# The probe's width: at least 64 per intra-op thread, doubled until oneDNN packs it in the kernel's layout (oneDNN
# picks narrower blocks for a weight with few columns per thread: 128 columns at 3 threads, 512 at 16).
PROBE_COLUMNS = 128
MAX_PROBE_COLUMNS = 8192
NAME = "AVX512-BF16"  # in logs and reports
ENV = AVX512_LINEAR_ENV

_NAME = "avx512_linear"
_FALLBACK = "decode-sized bf16 products use oneDNN's packed kernel"


def _bind(lib: ctypes.CDLL) -> None:
    if not hasattr(lib, "avx512_linear_bf16"):  # a build for a level without AVX512-BF16
        return
    lib.avx512_linear_bf16.restype = None
    lib.avx512_linear_bf16.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                                       ctypes.c_long, ctypes.c_long, ctypes.c_long]


def _load(cpu: CpuFeatures) -> KernelBuild:
    ok, why = avx512_linear_decision(cpu, os.environ)
    if not ok:
        return KernelBuild(None, None, f"{why}; {_FALLBACK}")
    cc = find_c_compiler(os.environ)
    if cc is None:
        return KernelBuild(None, None, f"no C compiler (cc/gcc/clang); {_FALLBACK}")
    build = c_kernel_build.build_for_cpu(_NAME, _SOURCE, CFLAGS, _bind, cpu, cc, default_cache_dir(), _FALLBACK)
    if build.lib is not None and not hasattr(build.lib, "avx512_linear_bf16"):
        return KernelBuild(None, None, f"the {build.level} build has no AVX512-BF16 code; {_FALLBACK}")
    return build


_kernel = c_kernel_build.LoadOnce(_load, "CPU bf16 decode products with AVX512-BF16", _FALLBACK,
                                  warn_when_missing=False)


def load(cpu: CpuFeatures | None = None) -> ctypes.CDLL | None:
    """The kernel for this CPU, built on first use; None where it does not run (then oneDNN's product)."""
    return _kernel(cpu)


def describe() -> dict[str, str | None]:
    """The kernel as loaded (for /server_info and doctor): the level built for and why, or why not."""
    return _kernel.describe()


def expected_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as the kernel reads it: [Np/64, K/2, 64, 2], N zero-padded to a multiple of 64."""
    return onednn_packed_weight.expected_layout(weight, BLOCK)


def layout_matches(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN packed ``weight`` in the kernel's layout (onednn_packed_weight.layout_matches)."""
    return onednn_packed_weight.layout_matches(weight, packed, BLOCK)


def _product_at(x: torch.Tensor, packed: torch.Tensor, n: int, kc: int) -> torch.Tensor:
    """The kernel's product over a packed weight with K chunked by ``kc`` (the probe's candidates)."""
    return onednn_packed_weight.run_product(_kernel.lib.avx512_linear_bf16, x, torch.ops.mkldnn.data_ptr(packed),
                                            None, n, BLOCK, kc)


def _probe(k: int, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(x [MAX_ROWS, k], w [n, k], w packed) for the chunk probe, n the narrowest width from PROBE_COLUMNS that oneDNN
    packs in the kernel's layout at ``threads`` threads; None if none up to MAX_PROBE_COLUMNS does. Every output sums
    a 2^24 term at the first input and its negative at the last, so the small products between are rounded at
    different places under any other chunking and the bf16 outputs differ (a plain random probe left several
    chunkings equal)."""
    n = max(PROBE_COLUMNS, BLOCK * threads)
    while n <= MAX_PROBE_COLUMNS:
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(MAX_ROWS, k, generator=gen)
        w = torch.randn(n, k, generator=gen)
        w[:, 0], w[:, -1], x[:, 0], x[:, -1] = 2.0 ** 24, -2.0 ** 24, 1.0, 1.0
        w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        if layout_matches(w, packed):
            return x, w, packed
        n *= 2
    return None


@functools.lru_cache(maxsize=None)
def chunk_sizes(k: int, threads: int) -> tuple[int, ...]:
    """For each row count 0..MAX_ROWS, the K chunk that gives oneDNN's bits for inputs of width ``k`` at ``threads``
    intra-op threads (the current count: the probe runs under it), 0 where none does (oneDNN's product serves that
    count). Called with the current thread count, so a changed count probes again."""
    none = (0,) * (MAX_ROWS + 1)
    if load() is None:
        return none
    probe = _probe(k, threads)
    if probe is None:
        log.info("AVX512-BF16 products, K=%d: oneDNN packs no probe of up to %d columns in the kernel's layout at %d "
                 "threads; oneDNN serves these products", k, MAX_PROBE_COLUMNS, threads)
        return none
    x, w, packed = probe
    candidates = [k] + [c for c in CHUNK_CANDIDATES if c < k]
    found = [0]
    for rows in range(1, MAX_ROWS + 1):
        xr = x[:rows]
        want = torch.ops.mkldnn._linear_pointwise(xr, packed, None, "none", [], "")
        found.append(next((c for c in candidates if torch.equal(_product_at(xr, packed, w.shape[0], c), want)), 0))
    missing = [r for r in range(1, MAX_ROWS + 1) if not found[r]]
    log.info("AVX512-BF16 products, K=%d: oneDNN's K chunk by row count %s%s", k,
             sorted({(c, r) for r, c in enumerate(found) if c and (r == 1 or c != found[r - 1])}),
             f"; no chunking matched at {missing} rows: oneDNN serves those" if missing else "")
    return tuple(found)


def fast_rows(weight: torch.Tensor, packed: torch.Tensor) -> int:
    """The most activation rows the kernel takes for this packed weight: ``MAX_ROWS`` where it runs here, the layout
    matches and N is a multiple of 64, else 0 (oneDNN's product at every row count). With a partial last block
    oneDNN's sums over several K chunks differed from the kernel's in about one output in 8000 (1056 x 1408 with a
    bias, 8 rows), so those widths (no model's projection we know of) keep oneDNN."""
    if load() is None or weight.shape[0] % BLOCK or not layout_matches(weight, packed):
        return 0
    # probed once per K at load, not on the first request; no chunking matched at any row count: oneDNN's product
    return MAX_ROWS if any(chunk_sizes(weight.shape[1], torch.get_num_threads())[1:]) else 0


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
            ) -> torch.Tensor | None:
    """x [..., K] bf16 with at most ``MAX_ROWS`` rows over a weight ``fast_rows`` accepted -> [..., N], the same
    bits as ``torch.ops.mkldnn._linear_pointwise``; None when x's width is not the weight's K (oneDNN then says) or
    the probe found no chunking for this row count (the caller runs oneDNN)."""
    k = x.shape[-1]
    kc = chunk_sizes(k, torch.get_num_threads())[x.numel() // k]
    address = onednn_packed_weight.address_if_fits(x, packed, out_features, BLOCK) if kc else 0
    if not address:
        return None
    return onednn_packed_weight.run_product(_kernel.lib.avx512_linear_bf16, x, address, bias, out_features, BLOCK, kc)
