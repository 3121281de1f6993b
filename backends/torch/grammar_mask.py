"""Structured output on the torch backend: mask the logits of grammar-constrained rows with xgrammar's packed
token bitmask (SamplingBatch.token_bitmask) before any sampling step, on CPU or CUDA."""
from __future__ import annotations

import numpy as np
import torch


def constrained_rows(bitmask: np.ndarray) -> np.ndarray:
    """Rows whose bitmask forbids anything (an unconstrained row is all ones)."""
    return np.flatnonzero((bitmask != -1).any(axis=1))


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray | None) -> torch.Tensor:
    """``logits`` [S, V] with every token the grammar forbids at -inf in the constrained rows; the input is not
    modified (logprobs are computed from the raw logits)."""
    if bitmask is None:
        return logits
    rows = constrained_rows(bitmask)
    if rows.size == 0:
        return logits
    import xgrammar as xgr  # a dependency of tierlm; imported when the first constrained request samples

    vocab = logits.shape[-1]
    covered = min(vocab, bitmask.shape[1] * 32)
    out = logits.float().contiguous().clone()
    mask = torch.from_numpy(np.ascontiguousarray(bitmask, np.int32)).to(out.device)
    xgr.apply_token_bitmask_inplace(out, mask, vocab_size=covered, indices=rows.tolist())
    if covered < vocab:  # logits wider than the grammar's vocabulary: those ids are never allowed
        out[torch.from_numpy(rows).to(out.device), covered:] = float("-inf")
    return out
