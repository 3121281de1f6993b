"""Turn the requests scheduled for one step into a ForwardBatch of flat numpy arrays."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from tierlm.backends.base import ForwardBatch, SamplingBatch
from tierlm.runtime.logprobs import samples
from tierlm.runtime.request import Req
from tierlm.runtime.sampling_params import SamplingParams


def build_forward_batch(items: list[tuple[Req, int]], page_size: int,
                        drafts: Mapping[Req, Sequence[int]] | None = None) -> tuple[ForwardBatch, list[Req]]:
    """``items``: (request, number of new tokens) pairs. Returns the batch and, per sampled row, its request.

    A request in ``drafts`` (speculative decoding) runs its last token and its draft tokens (n = 1 + drafts) and
    samples at every one of those rows, so it appears 1 + len(drafts) times in the returned list.
    """
    drafts = drafts or {}
    R = len(items)
    q_lens = np.fromiter((n for _, n in items), np.int32, R)
    kv_lens = np.fromiter((r.kv_len + n for r, n in items), np.int32, R)
    ids: list[int] = []
    for r, n in items:
        if r in drafts:
            ids.append(r.token_at(r.kv_len))
            ids.extend(drafts[r])
        else:
            ids.extend(r.tokens(r.kv_len, r.kv_len + n) if n > 1 else (r.token_at(r.kv_len),))
    input_ids = np.asarray(ids, np.int64)
    ends = np.cumsum(q_lens).astype(np.int64)
    # positions: kv_len - q_len + arange(q_len) per request, vectorised
    starts = ends - q_lens
    positions = np.arange(len(ids), dtype=np.int64) - np.repeat(starts, q_lens) + np.repeat(kv_lens - q_lens, q_lens)
    max_pages = max(len(r.pages) for r, _ in items)
    page_table = np.zeros((R, max_pages), np.int32)
    for i, (r, _) in enumerate(items):
        page_table[i, :len(r.pages)] = r.pages
    # A request samples when this step reaches its last token (not one that only wants prompt logprobs); one with
    # drafts samples at each of its rows.
    sampling_reqs: list[Req] = []
    rows: list[int] = []
    for (r, n), e, kl in zip(items, ends.tolist(), kv_lens.tolist()):
        if r in drafts:
            sampling_reqs.extend([r] * n)
            rows.extend(range(e - n, e))
        elif kl == r.seq_len and samples(r):
            sampling_reqs.append(r)
            rows.append(e - 1)
    sample_rows = np.asarray(rows, np.int64)
    batch = ForwardBatch(input_ids=input_ids, positions=positions, q_lens=q_lens, kv_lens=kv_lens,
                         page_table=page_table, sample_indices=sample_rows,
                         sampling=sampling_batch(sampling_reqs), page_size=page_size)
    if items[0][0].state_slot is not None:  # a hybrid model: every request runs in its state slot
        batch.state_slots = np.fromiter((r.state_slot for r, _ in items), np.int32, R)
        if any(r.snap_at for r, _ in items):  # snapshots (runtime/cache/state_snapshots.py): page-aligned, in this step
            batch.snapshot_at = np.fromiter((r.snap_at - r.kv_len if r.snap_at else -1 for r, _ in items), np.int32, R)
            batch.snapshot_dst = np.fromiter((r.snap_slot if r.snap_at else -1 for r, _ in items), np.int32, R)
    return batch, sampling_reqs


def sampling_batch(reqs: list[Req]) -> SamplingBatch:
    ps = [r.sampling_params for r in reqs]

    def f32(xs: Sequence[float]) -> np.ndarray:
        return np.asarray(xs, np.float32)

    temperature = f32([0.0 if p.is_greedy else p.temperature for p in ps])
    any_penalty = any(p.uses_penalties for p in ps)
    return SamplingBatch(
        temperature=temperature, top_p=f32([p.top_p for p in ps]),
        top_k=np.asarray([p.top_k for p in ps], np.int32), min_p=f32([p.min_p for p in ps]),
        presence_penalty=f32([p.presence_penalty for p in ps]), frequency_penalty=f32([p.frequency_penalty for p in ps]),
        # A penalty below float32's smallest normal would round to 0, and a banned (-inf) logit times 0 is NaN,
        # which argmax picks: the backends get it raised to that smallest value (the same effect, no NaN).
        repetition_penalty=np.maximum(f32([p.repetition_penalty for p in ps]), np.finfo(np.float32).tiny),
        seeds=[p.seed for p in ps],
        output_ids=[r.output_ids for r in reqs], prompt_ids=[r.input_ids for r in reqs],
        all_greedy=bool((temperature == 0).all()), any_penalty=any_penalty, logit_bias=logit_bias_arrays(ps),
    )


def logit_bias_arrays(ps: list[SamplingParams]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """SamplingBatch.logit_bias: (row, token id, bias) of every biased token of the rows, or None."""
    if not any(p.logit_bias for p in ps):
        return None
    entries = [(i, t, b) for i, p in enumerate(ps) for t, b in p.logit_bias.items()]
    rows, ids, biases = zip(*entries)
    return np.asarray(rows, np.int64), np.asarray(ids, np.int64), np.asarray(biases, np.float32)
