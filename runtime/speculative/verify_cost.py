"""What a verify forward costs on this backend: the time of one forward over 1 + k tokens of a request against a
1-token decode forward over the same cached context. Where weights are read once for any number of rows (GPUs,
bf16 on CPU) the ratio is near 1 and drafts are almost free; float32 matmuls on a CPU run a different kernel for
2+ rows and the ratio is near 2, so drafts must be accepted often to pay (runtime/speculative/speculator.py).
``tierlm bench spec`` times the same batches for k = 0..8."""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import numpy as np

from tierlm.backends.base import ForwardBatch, ModelBackend, SamplingBatch


def one_request_batch(start: int, q_len: int, pages: Sequence[int], page_size: int, token_ids: Sequence[int],
                      sample_rows: int) -> ForwardBatch:
    """A ForwardBatch of one request: ``q_len`` new tokens at positions start .. start + q_len - 1 over ``start``
    cached tokens, sampling (greedy) its last ``sample_rows`` rows: 1 for a decode or a prefill, 1 + k for a verify
    step with k drafts (the model's token at every drafted position)."""
    kv = start + q_len
    n_pages = -(-kv // page_size)
    table = np.asarray(pages[:n_pages], np.int32)[None]
    return ForwardBatch(input_ids=np.asarray(token_ids, np.int64), positions=np.arange(start, kv, dtype=np.int64),
                        q_lens=np.array([q_len], np.int32), kv_lens=np.array([kv], np.int32), page_table=table,
                        sample_indices=np.arange(q_len - sample_rows, q_len, dtype=np.int64),
                        sampling=SamplingBatch.greedy(sample_rows), page_size=page_size)


def measure_verify_cost(backend: ModelBackend, page_size: int, num_pages: int, drafts: int, runs: int = 3) -> float:
    """Median time ratio of a (1 + drafts)-token forward to a 1-token forward over a short cached context.

    Like the warm-up it bypasses the scheduler and writes garbage K/V into the first pages of the pool, which their
    next owner overwrites before reading."""
    ps, q = page_size, 1 + drafts
    ctx = max(0, min(64, num_pages * ps - q - 1))
    pages = list(range(-(-(ctx + q) // ps)))
    vocab = backend.info.vocab_size
    ids = [i % vocab for i in range(ctx + q)]

    def forward(start: int, n: int, sample_rows: int) -> float:
        batch = one_request_batch(start, n, pages, ps, ids[start:start + n], sample_rows)
        t0 = time.perf_counter()
        backend.forward(batch)
        return time.perf_counter() - t0

    if ctx:
        forward(0, ctx, 1)  # the context's K/V (positions 0..ctx-1), so both probes attend over the same cache
    ratios = []
    for _ in range(runs):  # interleaved, so a burst of other load hits both sides
        one, many = forward(ctx, 1, 1), forward(ctx, q, q)
        ratios.append(many / one)
    return float(statistics.median(ratios))
