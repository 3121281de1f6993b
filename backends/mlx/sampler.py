"""Batched next-token sampling for the mlx backend; the same semantics as backends/torch/sampler.py.

logit_bias, then penalties (repetition: HF, over prompt + output; presence / frequency: OpenAI, over output only), then
greedy rows take the argmax and the others are sampled from softmax(logits / temperature) restricted by top_k,
top_p (renormalised after top_k) and min_p, via the exponential race ``argmax(probs / E)``, ``E ~ Exp(1)``. A seeded
row draws its noise from ``mx.random.key`` of (seed, number of tokens generated so far), so it is reproducible
whatever else is in the batch.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from tierlm.backends.base import SamplingBatch, active_filters

GREEDY_TEMPERATURE = 1e-6  # at or below this a row is greedy (SamplingParams.is_greedy uses the same bound)
_MIN_NOISE = 1e-20  # keeps probs / E finite when Exp(1) rounds to 0


def seeded_step_seed(seed: int, step: int) -> int:
    """The PRNG seed for a seeded request at output position ``step`` (same formula as the torch sampler)."""
    return (int(seed) * 1_000_003 + int(step)) % (2**63)


def sample(logits: mx.array, batch: SamplingBatch, key: mx.array | None = None) -> mx.array:
    """Sample one token per row of ``logits`` [S, V]; returns int64 [S].

    ``key`` drives the rows without a seed (None -> mlx's global PRNG state).
    """
    if batch.logit_bias is not None:
        logits = apply_logit_bias(logits, batch.logit_bias)
    if batch.all_greedy and not batch.any_penalty:
        return mx.argmax(logits, axis=-1).astype(mx.int64)

    logits = logits.astype(mx.float32)
    if batch.any_penalty:
        logits = apply_penalties(logits, batch)

    greedy_rows = (np.asarray(batch.temperature) <= GREEDY_TEMPERATURE) | (np.asarray(batch.top_k) == 1)
    greedy_tokens = mx.argmax(logits, axis=-1).astype(mx.int64)
    if greedy_rows.all():
        return greedy_tokens

    sampled_rows = np.flatnonzero(~greedy_rows)
    if sampled_rows.size == logits.shape[0]:
        return _sample_rows(logits, batch, sampled_rows, key)
    rows = mx.array(sampled_rows.astype(np.int32))
    sampled = _sample_rows(logits[rows], batch, sampled_rows, key)
    return mx.where(mx.array(~greedy_rows), mx.zeros_like(greedy_tokens).at[rows].add(sampled), greedy_tokens)


def apply_logit_bias(logits: mx.array, bias: tuple[np.ndarray, np.ndarray, np.ndarray]) -> mx.array:
    """float32 logits plus each row's logit_bias; ids past the logits' width carry no logit and are skipped."""
    rows, ids, values = bias
    keep = ids < logits.shape[1]
    at = (mx.array(rows[keep].astype(np.int32)), mx.array(ids[keep].astype(np.int32)))
    return logits.astype(mx.float32).at[at].add(mx.array(values[keep]))


def apply_penalties(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """Return penalised float32 logits."""
    num_rows, vocab = logits.shape
    rep = np.asarray(batch.repetition_penalty, np.float32)
    presence = np.asarray(batch.presence_penalty, np.float32)
    frequency = np.asarray(batch.frequency_penalty, np.float32)

    if np.any(rep != 1.0):
        seen = _token_counts(
            [_concat(p, o) for p, o in zip(batch.prompt_ids, batch.output_ids)], num_rows, vocab
        ) > 0
        penalty = mx.array(rep)[:, None]
        penalised = mx.where(logits > 0, logits / penalty, logits * penalty)
        logits = mx.where(seen, penalised, logits)

    if np.any(presence != 0.0) or np.any(frequency != 0.0):
        counts = _token_counts(batch.output_ids, num_rows, vocab)
        logits = logits - mx.array(presence)[:, None] * (counts > 0) - mx.array(frequency)[:, None] * counts
    return logits


def _concat(a, b) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.int64).reshape(-1), np.asarray(b, np.int64).reshape(-1)])


def _token_counts(seqs, num_rows: int, vocab: int) -> mx.array:
    """[num_rows, vocab] float32 counts of each token id in each row's sequence, via one scatter-add."""
    arrays = [np.asarray(s, np.int64).reshape(-1) for s in seqs]
    lengths = np.fromiter((a.size for a in arrays), np.int64, count=len(arrays))
    counts = mx.zeros((num_rows * vocab,), dtype=mx.float32)
    if lengths.sum() == 0:
        return counts.reshape(num_rows, vocab)
    tokens = np.concatenate(arrays)
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), lengths)
    in_vocab = (tokens >= 0) & (tokens < vocab)  # ids the model cannot emit carry no logit
    flat = mx.array(rows[in_vocab] * vocab + tokens[in_vocab])
    return counts.at[flat].add(1.0).reshape(num_rows, vocab)


def _sample_rows(logits: mx.array, batch: SamplingBatch, rows: np.ndarray, key) -> mx.array:
    """Sample the non-greedy ``rows`` of the batch; ``logits`` holds exactly those rows, in that order."""
    temperature = mx.array(np.asarray(batch.temperature, np.float32)[rows])
    probs = mx.softmax(logits / temperature[:, None], axis=-1)
    threshold = _keep_threshold(
        probs,
        np.asarray(batch.top_k, np.int64)[rows],
        np.asarray(batch.top_p, np.float32)[rows],
        np.asarray(batch.min_p, np.float32)[rows],
    )
    noise = _exponential_noise(probs.shape, [batch.seeds[r] for r in rows],
                               [len(batch.output_ids[r]) for r in rows], key)
    score = probs / mx.maximum(noise, _MIN_NOISE)
    if threshold is not None:
        score = mx.where(probs < threshold[:, None], -1.0, score)
    return mx.argmax(score, axis=-1).astype(mx.int64)


def _keep_threshold(probs: mx.array, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray):
    """Per-row probability a token needs to stay a candidate, or None when no row filters.

    top_k, top_p and min_p each keep a prefix of the tokens sorted by probability, so together they keep the
    shortest prefix: one threshold per row (ties at the threshold stay, as in HF's top_k).
    """
    num_rows, vocab = probs.shape
    active = active_filters(top_k, top_p, min_p, vocab)
    if active is None:
        return None
    topk_on, topp_on, minp_on = active

    threshold = mx.zeros((num_rows,), dtype=mx.float32)
    if topk_on.any() or topp_on.any():
        k = mx.array(np.where(topk_on, top_k, vocab).astype(np.int32))
        sorted_probs = -mx.sort(-probs, axis=-1)  # descending
        in_top_k = mx.arange(vocab)[None, :] < k[:, None]
        top_k_probs = mx.where(in_top_k, sorted_probs, 0.0)
        cumulative = mx.cumsum(top_k_probs, axis=-1)
        top_k_mass = cumulative[:, -1:]
        # A token survives top_p when the (top_k-renormalised) mass ranked above it is still below top_p.
        survives = ((cumulative - top_k_probs) < mx.array(top_p)[:, None] * top_k_mass) & in_top_k
        keep = mx.where(mx.array(topp_on), mx.maximum(survives.sum(axis=-1), 1), k).astype(mx.int32)
        threshold = mx.take_along_axis(sorted_probs, (keep - 1)[:, None], axis=-1)[:, 0]
    if minp_on.any():
        threshold = mx.maximum(threshold, mx.array(min_p) * probs.max(axis=-1))
    return threshold


def _exponential_noise(shape, seeds: list, steps: list[int], key) -> mx.array:
    """Exp(1) noise [R, V] as -log(U): seeded rows from their own (seed, step) key, the rest from ``key``."""
    num_rows, vocab = shape
    uniform = mx.random.uniform(shape=(num_rows, vocab), key=key)
    if any(s is not None for s in seeds):
        per_row = [
            mx.random.uniform(shape=(vocab,), key=mx.random.key(seeded_step_seed(s, step))) if s is not None
            else uniform[i]
            for i, (s, step) in enumerate(zip(seeds, steps))
        ]
        uniform = mx.stack(per_row)
    return -mx.log1p(-uniform)  # U in [0, 1) -> E in [0, inf)
