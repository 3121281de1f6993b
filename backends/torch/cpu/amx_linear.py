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
The C source is csrc/amx_linear.c, in the amx level's library; the plan's ``decode_products`` chooses it.
"""
from __future__ import annotations

import torch

from tierlm.backends.torch.cpu import onednn_packed_weight
from tierlm.backends.torch.cpu.library import KernelLibrary

# Activation rows the kernel takes: decode batches and short extends (the compiled steps' limit too).
MAX_ROWS = 32
BLOCK = 32  # output columns per packed block, and the input multiple
NAME = "AMX"  # in logs and reports


def expected_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as the kernel reads it: [Np/32, Kp/2, 32, 2], zero-padded to multiples of 32."""
    return onednn_packed_weight.expected_layout(weight, BLOCK)


def layout_matches(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN packed ``weight`` in the kernel's layout (onednn_packed_weight.layout_matches)."""
    return onednn_packed_weight.layout_matches(weight, packed, BLOCK)


def fast_rows(lib: KernelLibrary, weight: torch.Tensor, packed: torch.Tensor) -> int:
    """The most activation rows the kernel takes for this packed weight: ``MAX_ROWS`` where the layout matches, else 0
    (oneDNN's product at every row count)."""
    return MAX_ROWS if lib.has("amx_linear") and layout_matches(weight, packed) else 0


def native_chunks(lib: KernelLibrary, k: int) -> list[int]:
    """What the C++ op takes besides the block: nothing (the tiles sum the whole K)."""
    return []


def product(lib: KernelLibrary, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
            ) -> torch.Tensor | None:
    """x [..., K] bf16 with at most ``MAX_ROWS`` rows over a weight ``fast_rows`` accepted -> [..., N], the same
    bits as ``torch.ops.mkldnn._linear_pointwise``; None when x's width is not the weight's K (oneDNN then says).
    Lean: ~40 calls a decode step."""
    address = onednn_packed_weight.address_if_fits(x, packed, out_features, BLOCK)
    if not address:
        return None
    return onednn_packed_weight.run_product(lib.amx_linear_bf16, x, address, bias, out_features, BLOCK)
