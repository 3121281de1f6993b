"""oneDNN's packed bf16 weight as tierlm's own decode-product kernels read it (amx_linear.py: blocks of 32
columns; avx512_linear.py: blocks of 64): the bytes, their layout and its check, and the calls both make.

oneDNN packs a bf16 [N, K] weight as blocks of B output columns, each holding its K inputs in pairs (VNNI):
[N/B][K/2][B][2], N (and for AMX, K) padded to multiples of 32 or 64 with zeros. That layout is oneDNN's choice for
the CPU it runs on, not a promise, so each weight is checked once at packing (``layout_matches``) before a kernel
reads it; any other layout keeps oneDNN's product.
"""
from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch

from tierlm.backends.torch.cpu.threads import helper_threads

K_MULTIPLE = 32  # the kernels read inputs 32 at a time (AMX A tiles) or in pairs; every model's widths qualify
CHECKED_BLOCKS = 64  # blocks of a weight compared with the expected layout at packing
# Below this many weights per thread a product stays on the calling thread (a hand-off costs ~30 us).
MIN_WEIGHTS_PER_THREAD = 1 << 20


def expected_layout(weight: torch.Tensor, block: int) -> torch.Tensor:
    """``weight`` [N, K] as [Np/block, Kp/2, block, 2], zero-padded to Np a multiple of ``block``, Kp of 32."""
    n, k = weight.shape
    np_, kp = -(-n // block) * block, -(-k // K_MULTIPLE) * K_MULTIPLE
    padded = torch.nn.functional.pad(weight, (0, kp - k, 0, np_ - n))
    return padded.view(np_ // block, block, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def packed_bytes_view(packed: torch.Tensor) -> torch.Tensor:
    """The bytes of oneDNN's packed (opaque) tensor as a flat bf16 tensor sharing its memory."""
    ptr, nbytes = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
    buf = (ctypes.c_uint16 * (nbytes // 2)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.bfloat16)


def layout_matches(weight: torch.Tensor, packed: torch.Tensor, block: int) -> bool:
    """Whether oneDNN packed ``weight`` as blocks of ``block`` columns and K suits the kernels: the packed size,
    then ``CHECKED_BLOCKS`` blocks spread over the weight (the first and the last, padding included) byte for byte
    (all of them for a smaller weight). A Qwen2.5-0.5B lm_head: 14 ms; comparing all of it took 1.1 s, 4.5x its
    reorder."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.shape[1] % K_MULTIPLE:
        return False
    n, k = weight.shape
    blocks = -(-n // block)
    if torch.ops.mkldnn._nbytes(packed) != blocks * block * k * 2:
        return False
    raw = packed_bytes_view(packed).view(torch.int16).view(blocks, block * k)
    picked = sorted({round(i * (blocks - 1) / (CHECKED_BLOCKS - 1)) for i in range(CHECKED_BLOCKS)}) \
        if blocks > CHECKED_BLOCKS else range(blocks)
    w = weight.detach()
    return all(torch.equal(raw[b], expected_layout(w[b * block:(b + 1) * block], block).view(-1).view(torch.int16))
               for b in picked)


# (id(packed), block) -> (a weak reference to it, its data address, its K): the two oneDNN queries cost ~6 us of a
# ~16 us call, and a decode step makes ~40 of them over the same weights. The reference tells a reused id apart.
_geometry: dict[tuple[int, int], tuple[weakref.ref, int, int]] = {}


def packed_geometry(packed: torch.Tensor, out_features: int, block: int) -> tuple[int, int]:
    """(data address, K) of a packed weight; K is 0 when its size is not N (padded to ``block``) x K x 2 bytes."""
    key = (id(packed), block)
    g = _geometry.get(key)
    if g is None or g[0]() is not packed:
        n_pad = (out_features + block - 1) // block * block
        nbytes = torch.ops.mkldnn._nbytes(packed)
        k = nbytes // (2 * n_pad) if nbytes % (2 * n_pad) == 0 else 0

        def forget(ref: weakref.ref, key: tuple[int, int] = key) -> None:  # the weight is gone: drop its entry only
            if _geometry.get(key, (None,))[0] is ref:
                del _geometry[key]

        g = _geometry[key] = (weakref.ref(packed, forget), torch.ops.mkldnn.data_ptr(packed), k)
    return g[1], g[2]


def address_if_fits(x: torch.Tensor, packed: torch.Tensor, out_features: int, block: int) -> int:
    """The packed weight's data address when x's width is its K, else 0 (the kernels trust K; a wrong width goes
    to oneDNN, which says)."""
    k = x.shape[-1]
    if k % K_MULTIPLE:
        return 0
    address, packed_k = packed_geometry(packed, out_features, block)
    return address if packed_k == k else 0


def rows_in_place(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, the element distance between its rows) for a kernel that reads rows a fixed stride apart: gate|up's gate
    half after the activation is read where it is; other layouts are made contiguous first."""
    k = x.shape[-1]
    if x.is_contiguous():
        return x, k
    if x.stride(-1) == 1 and (x.dim() == 2 or x.dim() == 3 and (x.shape[0] == 1 or
                                                                x.stride(0) == x.shape[1] * x.stride(1))):
        return x, x.stride(-2)
    return x.contiguous(), k


def run_product(kernel: Callable[..., None], x: torch.Tensor, address: int, bias: torch.Tensor | None,
                out_features: int, block: int, *extra: int) -> torch.Tensor:
    """y = x @ W.T (+ bias) by ``kernel(x, M, K, lda, W, bias, y, N, *extra, first_block, end_block)`` over the
    packed weight at ``address`` (blocks of ``block`` columns): x's rows read in place, the blocks split between
    threads. The calling convention both kernels share."""
    k, n = x.shape[-1], out_features
    x, lda = rows_in_place(x)
    y = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    args = (x.data_ptr(), y.numel() // n, k, lda, address, None if bias is None else bias.data_ptr(), y.data_ptr(), n,
            *extra)
    run_in_block_slices(kernel, args, -(-n // block), n * k)
    return y


def run_in_block_slices(kernel: Callable[..., None], args: tuple, blocks: int, weights: int) -> None:
    """``kernel(*args, first_block, end_block)`` over ``blocks`` column blocks, split in slices of whole blocks
    between torch's intra-op thread count (the caller running the first) when ``weights`` is large enough."""
    threads = min(torch.get_num_threads(), weights // MIN_WEIGHTS_PER_THREAD, blocks)
    if threads <= 1:
        kernel(*args, 0, blocks)
        return
    cuts = [blocks * t // threads for t in range(threads)] + [blocks]
    futures = [helper_threads(threads - 1).submit(kernel, *args, cuts[t], cuts[t + 1]) for t in range(1, threads)]
    kernel(*args, cuts[0], cuts[1])
    for f in futures:
        f.result()
