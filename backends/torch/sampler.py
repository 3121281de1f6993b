"""Batched next-token sampling for the torch backend.

One call samples one token for each of the S rows of ``logits`` with that row's settings in ``SamplingBatch``:
logit_bias, penalties (repetition: HF, over prompt + output; presence / frequency: OpenAI, over output only), then
greedy rows take the argmax and the others are sampled from softmax(logits / temperature) restricted by top_k, top_p
(renormalised after top_k) and min_p, in that order.

Sampling uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` per vocabulary entry draws a token
with probability ``probs`` and needs exactly one noise vector per row. A seeded row draws its vector from a
generator seeded by (seed, number of tokens generated so far), so the same seed at the same output position gives
the same token whatever else is in the batch.
"""
from __future__ import annotations

import numpy as np
import torch

from tierlm.backends.base import SamplingBatch, active_filters

GREEDY_TEMPERATURE = 1e-6  # at or below this a row is greedy (SamplingParams.is_greedy uses the same bound)
_MIN_NOISE = 1e-20  # keeps probs / E finite when Exp(1) rounds to 0


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) as int64 [S]. On CPU in float32 through numpy's vectorized argmax: torch's ran ~25x
    slower here (8 x 32000 logits: 501 vs 21 us; 8 x 151936: 2.4 vs 0.2 ms, 1-10 % of a decode step). Same answer:
    the first maximum of each row, the first NaN where a row has one."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64, copy=False))
    return torch.argmax(x, dim=-1)


def seeded_step_seed(seed: int, step: int) -> int:
    """The generator seed for a seeded request at output position ``step`` (same formula in the mlx sampler)."""
    return (int(seed) * 1_000_003 + int(step)) % (2**63)


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row of ``logits`` [S, V]; returns int64 [S] on the logits' device.

    ``generator`` drives the rows without a seed (None -> torch's default generator for the device).
    """
    if batch.logit_bias is not None:
        logits = apply_logit_bias(logits, batch.logit_bias)
    if batch.all_greedy and not batch.any_penalty:
        return row_argmax(logits)

    logits = logits.float()
    if batch.any_penalty:
        logits = apply_penalties(logits, batch)

    greedy_rows = (np.asarray(batch.temperature) <= GREEDY_TEMPERATURE) | (np.asarray(batch.top_k) == 1)
    if greedy_rows.all():
        return row_argmax(logits)

    sampled_rows = np.flatnonzero(~greedy_rows)
    if sampled_rows.size == logits.shape[0]:
        return _sample_rows(logits, batch, sampled_rows, generator)

    tokens = row_argmax(logits)
    rows_t = torch.from_numpy(sampled_rows).to(logits.device)
    tokens[rows_t] = _sample_rows(logits.index_select(0, rows_t), batch, sampled_rows, generator)
    return tokens


def apply_logit_bias(logits: torch.Tensor, bias: tuple[np.ndarray, np.ndarray, np.ndarray]) -> torch.Tensor:
    """float logits plus each row's logit_bias (the input is not modified); ids past the logits' width (ids the
    model cannot emit) carry no logit and are skipped."""
    rows, ids, values = bias
    keep = ids < logits.shape[1]
    out = logits.float().clone()
    device = out.device
    out.index_put_((torch.from_numpy(rows[keep]).to(device), torch.from_numpy(ids[keep]).to(device)),
                   torch.from_numpy(values[keep]).to(device), accumulate=True)
    return out


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return penalised float logits (the input is not modified)."""
    num_rows, vocab = logits.shape
    device = logits.device
    rep = np.asarray(batch.repetition_penalty, np.float32)
    presence = np.asarray(batch.presence_penalty, np.float32)
    frequency = np.asarray(batch.frequency_penalty, np.float32)

    if np.any(rep != 1.0):
        # HF RepetitionPenaltyLogitsProcessor: every token seen in prompt or output, once, sign-aware.
        seen = _token_counts(
            [_concat(p, o) for p, o in zip(batch.prompt_ids, batch.output_ids)], num_rows, vocab, device
        ) > 0
        penalty = torch.from_numpy(rep).to(device).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)

    if np.any(presence != 0.0) or np.any(frequency != 0.0):
        # OpenAI: logit -= presence * (count > 0) + frequency * count, counts over generated tokens only.
        counts = _token_counts(batch.output_ids, num_rows, vocab, device).to(logits.dtype)
        presence_t = torch.from_numpy(presence).to(device).unsqueeze(1)
        frequency_t = torch.from_numpy(frequency).to(device).unsqueeze(1)
        logits = logits - presence_t * (counts > 0).to(logits.dtype) - frequency_t * counts
    return logits


def _concat(a, b) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.int64).reshape(-1), np.asarray(b, np.int64).reshape(-1)])


def _token_counts(seqs, num_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] int64 counts of each token id in each row's sequence, via one bincount."""
    arrays = [np.asarray(s, np.int64).reshape(-1) for s in seqs]
    lengths = np.fromiter((a.size for a in arrays), np.int64, count=len(arrays))
    if lengths.sum() == 0:
        return torch.zeros((num_rows, vocab), dtype=torch.int64, device=device)
    tokens = np.concatenate(arrays)
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), lengths)
    in_vocab = (tokens >= 0) & (tokens < vocab)  # ids the model cannot emit (tokenizer extras) carry no logit
    flat = torch.from_numpy(rows[in_vocab] * vocab + tokens[in_vocab]).to(device)
    return torch.bincount(flat, minlength=num_rows * vocab).view(num_rows, vocab)


def _sample_rows(logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray, generator) -> torch.Tensor:
    """Sample the non-greedy ``rows`` of the batch; ``logits`` holds exactly those rows, in that order."""
    device = logits.device
    temperature = torch.from_numpy(np.asarray(batch.temperature, np.float32)[rows]).to(device)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)

    threshold = _keep_threshold(
        probs,
        np.asarray(batch.top_k, np.int64)[rows],
        np.asarray(batch.top_p, np.float32)[rows],
        np.asarray(batch.min_p, np.float32)[rows],
    )
    noise = _exponential_noise(probs.shape, device, [batch.seeds[r] for r in rows],
                               [len(batch.output_ids[r]) for r in rows], generator)
    score = probs / noise.clamp_min_(_MIN_NOISE)
    if threshold is not None:
        score = score.masked_fill(probs < threshold.unsqueeze(1), -1.0)
    return row_argmax(score)


def _keep_threshold(probs: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray):
    """Per-row probability a token needs to stay a candidate, or None when no row filters.

    top_k, top_p and min_p each keep a prefix of the tokens sorted by probability, so together they keep the
    shortest of the three prefixes: one threshold per row (ties at the threshold stay, as in HF's top_k).
    """
    num_rows, vocab = probs.shape
    active = active_filters(top_k, top_p, min_p, vocab)
    if active is None:
        return None
    topk_on, topp_on, minp_on = active

    device = probs.device
    k = torch.from_numpy(np.where(topk_on, top_k, vocab)).to(device)
    threshold = torch.zeros(num_rows, dtype=probs.dtype, device=device)
    if topp_on.any():
        sorted_probs = torch.sort(probs, dim=-1, descending=True).values
        in_top_k = torch.arange(vocab, device=device).unsqueeze(0) < k.unsqueeze(1)
        top_k_probs = sorted_probs * in_top_k
        cumulative = torch.cumsum(top_k_probs, dim=-1)
        top_k_mass = cumulative[:, -1:]
        p = torch.from_numpy(top_p).to(device).unsqueeze(1)
        # A token survives top_p when the (top_k-renormalised) mass ranked above it is still below top_p.
        survives = ((cumulative - top_k_probs) < p * top_k_mass) & in_top_k
        keep = torch.where(torch.from_numpy(topp_on).to(device), survives.sum(-1).clamp_min(1), k)
        threshold = sorted_probs.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
    elif topk_on.any():
        k_max = int(top_k[topk_on].max())
        top_values = torch.topk(probs, k_max, dim=-1).values  # sorted, descending
        kth = top_values.gather(1, (k.clamp_max(k_max) - 1).unsqueeze(1)).squeeze(1)
        threshold = torch.where(torch.from_numpy(topk_on).to(device), kth, threshold)
    if minp_on.any():
        min_p_t = torch.from_numpy(min_p).to(device)
        threshold = torch.maximum(threshold, min_p_t * probs.max(dim=-1).values)
    return threshold


def _exponential_noise(shape, device, seeds: list, steps: list[int], generator) -> torch.Tensor:
    """Exp(1) noise [R, V]: seeded rows from their own (seed, step) generator, the rest from ``generator``."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    if len(seeded) < len(seeds):
        unseeded = [i for i, s in enumerate(seeds) if s is None]
        draw = torch.empty((len(unseeded), shape[1]), dtype=torch.float32, device=device)
        draw.exponential_(generator=generator)
        if len(unseeded) == len(seeds):
            return draw
        noise[torch.tensor(unseeded, device=device)] = draw
    for i in seeded:
        row_generator = torch.Generator(device=device)
        row_generator.manual_seed(seeded_step_seed(seeds[i], steps[i]))
        noise[i].exponential_(generator=row_generator)
    return noise
