"""Structured output on the MLX backend: mask the logits of grammar-constrained rows with xgrammar's packed token
bitmask (SamplingBatch.token_bitmask, filled on the CPU by the matchers) using mx ops, before any sampling step."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

_BIT = None


def apply_token_bitmask(logits: mx.array, bitmask: np.ndarray | None) -> mx.array:
    """``logits`` [S, V] with every token the grammar forbids at -inf (an unconstrained row is all ones, so it is
    unchanged)."""
    if bitmask is None or not (bitmask != -1).any():
        return logits
    global _BIT
    if _BIT is None:
        _BIT = mx.arange(32, dtype=mx.uint32)
    rows, vocab = logits.shape
    words = mx.array(np.ascontiguousarray(bitmask, np.int32).view(np.uint32))  # [S, W]
    allowed = ((words[:, :, None] >> _BIT) & 1).reshape(rows, -1)  # [S, 32 W]: bit j of word w -> id 32 w + j
    width = allowed.shape[1]
    if width >= vocab:
        allowed = allowed[:, :vocab]
    else:  # logits wider than the grammar's vocabulary: those ids are never allowed
        allowed = mx.concatenate([allowed, mx.zeros((rows, vocab - width), dtype=allowed.dtype)], axis=1)
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-np.inf, dtype=logits.dtype))
