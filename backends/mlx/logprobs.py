"""Log-probabilities for the MLX backend (docs/logprobs.md); the same numbers as backends/torch/logprobs.py:
log-softmax of the raw float32 logits, before any sampling transform, in one batched pass."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from tierlm.backends.base import ForwardBatch, ForwardOutput
from tierlm.backends.logprob_rows import sort_top, split_into


def raw_logprobs(logits: mx.array, batch: ForwardBatch) -> mx.array | None:
    """float32 [rows, V] log-softmax of the S sampled rows (when ``batch.sample_logprobs``) then the P prompt
    rows; None when no row asks."""
    S = len(batch.sample_indices)
    if not batch.sample_logprobs and not batch.num_logprob_rows:
        return None
    rows = (logits if batch.sample_logprobs else logits[S:]).astype(mx.float32)
    return rows - mx.logsumexp(rows, axis=-1, keepdims=True)


def fill_logprobs(out: ForwardOutput, lp: mx.array, tokens: mx.array, batch: ForwardBatch) -> None:
    """Chosen-token logprobs and sorted top-K lists (numpy) into ``out``; evaluates ``lp``."""
    S = len(batch.sample_indices) if batch.sample_logprobs else 0
    if lp.shape[0] == 0:
        return
    targets = [tokens.reshape(-1).astype(mx.int32)] if S else []
    if batch.num_logprob_rows:
        targets.append(mx.array(np.asarray(batch.logprob_targets, np.int32)))
    chosen = mx.take_along_axis(lp, mx.concatenate(targets)[:, None], axis=-1)[:, 0]
    K = min(int(batch.logprob_top_k), lp.shape[-1])
    if K > 0:
        ids = mx.argpartition(-lp, kth=K - 1, axis=-1)[:, :K]
        vals = mx.take_along_axis(lp, ids, axis=-1)
        mx.eval(chosen, ids, vals)
        top_ids, top_vals = sort_top(np.array(ids).astype(np.int64), np.array(vals))
        split_into(out, S, np.array(chosen), top_ids, top_vals)
    else:
        mx.eval(chosen)
        split_into(out, S, np.array(chosen), None, None)
