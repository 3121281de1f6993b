"""Backend-neutral numpy steps of the logprob outputs (docs/logprobs.md), shared by the torch and MLX backends."""
from __future__ import annotations

import numpy as np

from tierlm.backends.base import ForwardOutput


def sort_top(ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] top lists sorted by logprob descending, ties by token id (so both backends list ties alike)."""
    order = np.lexsort((ids, -vals), axis=-1)
    return (np.take_along_axis(ids, order, -1).astype(np.int64),
            np.take_along_axis(vals, order, -1).astype(np.float32))


def split_into(out: ForwardOutput, S: int, chosen: np.ndarray, top_ids: np.ndarray | None,
               top_vals: np.ndarray | None) -> None:
    """Scored rows 0..S-1 are the sampled rows' (S = 0 when they were not asked for), the rest the prompt rows'."""
    chosen = np.asarray(chosen, np.float32)
    if S:
        out.logprobs = chosen[:S]
        if top_ids is not None:
            out.top_ids, out.top_logprobs = top_ids[:S], top_vals[:S]
    if len(chosen) > S:
        out.prompt_logprobs = chosen[S:]
        if top_ids is not None:
            out.prompt_top_ids, out.prompt_top_logprobs = top_ids[S:], top_vals[S:]
