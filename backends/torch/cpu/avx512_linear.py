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
The C source is csrc/avx512_linear.c, in the AVX512-BF16 levels' libraries; the plan's ``decode_products`` chooses
it.
"""
from __future__ import annotations

import functools
import logging

import torch

from tierlm.backends.torch.cpu import onednn_packed_weight
from tierlm.backends.torch.cpu.library import KernelLibrary

log = logging.getLogger(__name__)

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


def expected_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as the kernel reads it: [Np/64, K/2, 64, 2], N zero-padded to a multiple of 64."""
    return onednn_packed_weight.expected_layout(weight, BLOCK)


def layout_matches(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN packed ``weight`` in the kernel's layout (onednn_packed_weight.layout_matches)."""
    return onednn_packed_weight.layout_matches(weight, packed, BLOCK)


def _product_at(lib: KernelLibrary, x: torch.Tensor, packed: torch.Tensor, n: int, kc: int) -> torch.Tensor:
    """The kernel's product over a packed weight with K chunked by ``kc`` (the probe's candidates)."""
    return onednn_packed_weight.run_product(lib.avx512_linear_bf16, x, torch.ops.mkldnn.data_ptr(packed), None, n,
                                            BLOCK, kc)


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
def chunk_sizes(lib: KernelLibrary, k: int, threads: int) -> tuple[int, ...]:
    """For each row count 0..MAX_ROWS, the K chunk that gives oneDNN's bits for inputs of width ``k`` at ``threads``
    intra-op threads (the current count: the probe runs under it), 0 where none does (oneDNN's product serves that
    count). Called with the current thread count, so a changed count probes again."""
    none = (0,) * (MAX_ROWS + 1)
    if not lib.has("avx512_linear"):
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
        found.append(next((c for c in candidates if torch.equal(_product_at(lib, xr, packed, w.shape[0], c), want)),
                          0))
    missing = [r for r in range(1, MAX_ROWS + 1) if not found[r]]
    log.info("AVX512-BF16 products, K=%d: oneDNN's K chunk by row count %s%s", k,
             sorted({(c, r) for r, c in enumerate(found) if c and (r == 1 or c != found[r - 1])}),
             f"; no chunking matched at {missing} rows: oneDNN serves those" if missing else "")
    return tuple(found)


def fast_rows(lib: KernelLibrary, weight: torch.Tensor, packed: torch.Tensor) -> int:
    """The most activation rows the kernel takes for this packed weight: ``MAX_ROWS`` where it runs here, the layout
    matches and N is a multiple of 64, else 0 (oneDNN's product at every row count). With a partial last block
    oneDNN's sums over several K chunks differed from the kernel's in about one output in 8000 (1056 x 1408 with a
    bias, 8 rows), so those widths (no model's projection we know of) keep oneDNN."""
    if not lib.has("avx512_linear") or weight.shape[0] % BLOCK or not layout_matches(weight, packed):
        return 0
    # probed once per K at load, not on the first request; no chunking matched at any row count: oneDNN's product
    return MAX_ROWS if any(chunk_sizes(lib, weight.shape[1], torch.get_num_threads())[1:]) else 0


def native_chunks(lib: KernelLibrary, k: int) -> list[int]:
    """What the C++ op takes besides the block: [the thread count now, the K chunk for 1 row, ..., for MAX_ROWS]
    (the op checks the count: another one goes to the Python op, which probes for it)."""
    threads = torch.get_num_threads()
    return [threads, *chunk_sizes(lib, k, threads)[1:]]


def product(lib: KernelLibrary, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
            out_features: int) -> torch.Tensor | None:
    """x [..., K] bf16 with at most ``MAX_ROWS`` rows over a weight ``fast_rows`` accepted -> [..., N], the same
    bits as ``torch.ops.mkldnn._linear_pointwise``; None when x's width is not the weight's K (oneDNN then says) or
    the probe found no chunking for this row count (the caller runs oneDNN)."""
    k = x.shape[-1]
    kc = chunk_sizes(lib, k, torch.get_num_threads())[x.numel() // k]
    address = onednn_packed_weight.address_if_fits(x, packed, out_features, BLOCK) if kc else 0
    if not address:
        return None
    return onednn_packed_weight.run_product(lib.avx512_linear_bf16, x, address, bias, out_features, BLOCK, kc)
