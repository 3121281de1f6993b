"""Warm-up: a few forwards straight through the backend (allocations, first-call overheads) before serving."""
from __future__ import annotations

import os

import numpy as np
from tqdm import tqdm

from tierlm.backends.base import ForwardBatch, ModelBackend, SamplingBatch


def warm_up(backend: ModelBackend, page_size: int, num_pages: int) -> None:
    """One prefill and one decode step on pages 0.. of the pool.

    It bypasses the scheduler, so no request, cache entry or metric is left behind; the pages it wrote hold
    garbage K/V that the next owner of those pages overwrites before reading.
    """
    ps = page_size
    n = min(2 * ps, num_pages * ps - 1, 32)
    pages = np.arange(-(-(n + 1) // ps), dtype=np.int32)[None]
    steps = [(np.arange(n), n), (np.array([n]), n + 1)]  # one prefill, one decode
    for ids, kv in tqdm(steps, desc="warm-up", disable=os.environ.get("TIERLM_NO_PROGRESS") == "1"):
        q = len(ids)
        batch = ForwardBatch(input_ids=(ids % backend.info.vocab_size).astype(np.int64),
                             positions=np.arange(kv - q, kv, dtype=np.int64), q_lens=np.array([q], np.int32),
                             kv_lens=np.array([kv], np.int32), page_table=pages,
                             sample_indices=np.array([q - 1], np.int64), sampling=SamplingBatch.greedy(1),
                             page_size=ps)
        if backend.info.state is not None:  # a hybrid model: slot 0, which its next owner starts from zeros
            batch.state_slots = np.zeros(1, np.int32)
        backend.forward(batch)
