"""The input embedding held quantized on CPU, for the weight-only formats (``--torchao-config int8wo`` and
``int4wo-<group>``; weight_quant.py swaps it in after the linears).

As llama.cpp does (``token_embd`` is Q8_0 in a Q8_0 model), the embedding is one quantized table [V, H] and a
lookup dequantizes only the rows it reads. With tied embeddings that table IS the quantized lm_head
(quant_linear.py): one copy serves both, so no float embedding and no second copy of the largest matrix stay
resident. Untied, the embedding gets a table of its own, quantized with the same recipe as the linears.

Rows are dequantized exactly as the lm_head kernel sees them, then rounded once to the model dtype:
int8: ``q[row] * scale[row]``; int4: ``(q[row, k] - 8) * scale[g, row] + zero[g, row]`` (tinygemm's convention,
g = k // group). The int4 table is read straight from tinygemm's packed CPU layout (``_packed_int4_layout``);
where that layout is not one this file knows (another torch build), the rows are read from an unpacked copy of
the same 4-bit values instead (same numbers, one byte per value, with a warning).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from tierlm.backends.torch.weights.quant_linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear, int4_tinygemm_recipe

log = logging.getLogger(__name__)

QuantTable = Int8WeightOnlyLinear | Int4WeightOnlyLinear


@dataclass(frozen=True)
class _Int4Layout:
    """Where ``torch._convert_weight_to_int4pack_for_cpu`` puts q[n, k]: rows go in blocks of ``block`` (the last
    one may be shorter); a block is [K, rows / 2] bytes; a full block pairs row j with row j + block / 2 in one
    byte when ``half`` (AVX512: 64, AVX2: 32), else rows j and j + 1 (as every shorter last block does)."""
    block: int
    half: bool

    def nibbles(self, packed: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
        """q[rows, :] (int32 0..15, shape [*rows.shape, K]) from the packed [N, K / 2] bytes."""
        n_total = packed.shape[0]
        r = rows.reshape(-1).long()
        blk, j = r // self.block, r % self.block
        size = torch.clamp(n_total - blk * self.block, max=self.block)
        full = size == self.block
        if self.half:
            pos = torch.where(full, j % (self.block // 2), j // 2)
            shift = torch.where(full, (j >= self.block // 2).long() * 4, (j % 2) * 4)
        else:
            pos, shift = j // 2, (j % 2) * 4
        base = blk * (self.block * k // 2) + pos
        idx = base[:, None] + torch.arange(k)[None, :] * (size // 2)[:, None]
        q = (packed.reshape(-1)[idx].int() >> shift[:, None].int()) & 15
        return q.reshape(*rows.shape, k)


_CANDIDATES = (_Int4Layout(64, True), _Int4Layout(32, True), _Int4Layout(32, False), _Int4Layout(64, False))


@functools.cache
def _packed_int4_layout() -> _Int4Layout | None:
    """The layout this torch build packs int4 weights in, found by packing a probe (full blocks and a short last
    block for 32 and 64) and reading it back; None when no known layout reads it."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (208, 64), dtype=torch.int32, generator=g)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    rows = torch.arange(q.shape[0])
    for layout in _CANDIDATES:
        if torch.equal(layout.nibbles(packed, rows, q.shape[1]), q):
            return layout
    log.warning("int4 embedding: torch %s packs int4 weights in a layout tierlm does not read; the embedding keeps "
                "an unpacked copy of its 4-bit values (1 byte each, the same numbers)", torch.__version__)
    return None


LOOKUP_CHUNK = 256  # ids dequantized per slice of a long lookup


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` over a quantized table (an int8 or int4 weight-only layer whose output channels are the
    vocabulary): a lookup dequantizes the rows it reads to ``dtype``. With tied embeddings the table is the lm_head
    layer itself, so its tensors are held once."""

    def __init__(self, table: QuantTable, dtype: torch.dtype, padding_idx: int | None = None,
                 unpacked: torch.Tensor | None = None, shared: bool = False) -> None:
        """``unpacked``: int4 only, where ``_packed_int4_layout()`` is None: the table's q [N, K] (0..15, uint8).
        ``shared``: the table is the model's (tied) lm_head, registered there only."""
        super().__init__()
        if shared:  # not a submodule: the lm_head keeps its name and its tensors are listed (and counted) once
            self.__dict__["table"] = table
        else:
            self.table = table
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self._layout = _packed_int4_layout() if isinstance(table, Int4WeightOnlyLinear) else None
        if self._layout is None and isinstance(table, Int4WeightOnlyLinear) and unpacked is None:
            raise ValueError("an int4 table in a packed layout tierlm does not read needs its unpacked values")
        self.unpacked = None if unpacked is None else nn.Parameter(unpacked.to(torch.uint8), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.numel() <= LOOKUP_CHUNK:
            return self.rows(input_ids).to(self.dtype)
        # A long prefill chunk in slices: an int4 lookup's temporaries take ~28 bytes per value (8192 tokens x 4096
        # would be ~0.9 GB that no pool sizing accounts for); 256 rows keep them at a few MB.
        flat = input_ids.reshape(-1)
        out = torch.empty((flat.numel(), self.embedding_dim), dtype=self.dtype)
        for s in range(0, flat.numel(), LOOKUP_CHUNK):
            out[s:s + LOOKUP_CHUNK] = self.rows(flat[s:s + LOOKUP_CHUNK])
        return out.view(*input_ids.shape, self.embedding_dim)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows [*ids.shape, H] as the lm_head kernel computes with them (int8: in the table's
        scale dtype, exact; int4: float32)."""
        t = self.table
        if isinstance(t, Int8WeightOnlyLinear):
            return t.qweight[ids].to(t.scales.dtype) * t.scales[ids].unsqueeze(-1)
        k, group = t.in_features, t.group_size
        if self.unpacked is not None:
            q = self.unpacked[ids].int()
        else:
            q = self._layout.nibbles(t.qweight, ids, k)
        sz = t.scales_and_zeros[:, ids].float()  # [K / group, *ids.shape, 2]
        scale = sz[..., 0].movedim(0, -1).repeat_interleave(group, dim=-1)
        zero = sz[..., 1].movedim(0, -1).repeat_interleave(group, dim=-1)
        return (q - 8).float() * scale + zero

    def dequantized(self) -> torch.Tensor:
        """The float32 table [V, H] a lookup reads from (tests, debugging)."""
        return self.rows(torch.arange(self.num_embeddings)).float()

    def extra_repr(self) -> str:
        bits = "int8" if isinstance(self.table, Int8WeightOnlyLinear) else f"int4 group {self.table.group_size}"
        return f"{self.num_embeddings}, {self.embedding_dim}, {bits} rows dequantized to " \
               f"{str(self.dtype).removeprefix('torch.')}"


def tied_lm_head(model: nn.Module) -> bool:
    """Whether the output layer shares the input embedding's weight (read before the linears are swapped)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return False
    emb, head = get_in(), get_out()
    return emb is not None and head is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0)


def quantize_embedding(model: nn.Module, bits: int, group_size: int | None, tied: bool) -> str | None:
    """Swap ``model``'s input embedding for a QuantizedEmbedding: tied (``tied``, and the lm_head was quantized):
    over the lm_head's own table; else a table of its own, quantized like the linears (int8 per row, or int4 in
    groups). Returns why the embedding stays in the model dtype (None: it was swapped)."""
    get_in = getattr(model, "get_input_embeddings", None)
    emb = get_in() if get_in is not None else None
    if type(emb) is not nn.Embedding:  # subclasses (scaled embeddings, ...) compute more than a lookup
        return f"the input embedding is a {type(emb).__name__}, not a plain nn.Embedding"
    if emb.weight.device.type != "cpu" or not emb.weight.is_floating_point():
        return "the input embedding is not a floating-point CPU tensor"
    dtype = emb.weight.dtype
    head = model.get_output_embeddings() if tied else None
    shared = isinstance(head, (Int8WeightOnlyLinear, Int4WeightOnlyLinear))
    if shared:
        table = head
    else:
        dense = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False, device="meta")  # no [V, H] init
        dense.weight = emb.weight
        why = Int8WeightOnlyLinear.shape_supported(*emb.weight.shape) if bits == 8 else \
            Int4WeightOnlyLinear.shape_supported(*emb.weight.shape, group_size)
        if why:
            return f"the input embedding's row length: {why}"
        table = Int8WeightOnlyLinear.from_linear(dense) if bits == 8 else \
            Int4WeightOnlyLinear.from_linear(dense, group_size)
    unpacked = None
    if isinstance(table, Int4WeightOnlyLinear) and _packed_int4_layout() is None:
        unpacked = int4_tinygemm_recipe(emb.weight.detach(), group_size)[0]  # the very values packed in the table
    model.set_input_embeddings(QuantizedEmbedding(table, dtype, emb.padding_idx, unpacked, shared))
    return None
