"""Sampler semantics (torch, and mlx where importable) against straightforward per-row references."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tierlm.backends.base import SamplingBatch
from tierlm.backends.torch.sampler import apply_penalties, sample

VOCAB = 64


def make_batch(n: int, **rows) -> SamplingBatch:
    """A batch of n requests; keyword arguments give per-row values (a scalar applies to every row)."""
    def column(name, default, dtype):
        value = rows.get(name, default)
        return np.asarray(value if np.ndim(value) else [value] * n, dtype)

    batch = SamplingBatch(
        temperature=column("temperature", 1.0, np.float32),
        top_p=column("top_p", 1.0, np.float32),
        top_k=column("top_k", -1, np.int32),
        min_p=column("min_p", 0.0, np.float32),
        presence_penalty=column("presence_penalty", 0.0, np.float32),
        frequency_penalty=column("frequency_penalty", 0.0, np.float32),
        repetition_penalty=column("repetition_penalty", 1.0, np.float32),
        seeds=list(rows.get("seeds", [None] * n)),
        output_ids=[list(x) for x in rows.get("output_ids", [[] for _ in range(n)])],
        prompt_ids=[list(x) for x in rows.get("prompt_ids", [[] for _ in range(n)])],
        all_greedy=False,
        any_penalty=False,
    )
    batch.all_greedy = bool(np.all((batch.temperature <= 1e-6) | (batch.top_k == 1)))
    batch.any_penalty = bool(np.any(batch.presence_penalty != 0) or np.any(batch.frequency_penalty != 0)
                             or np.any(batch.repetition_penalty != 1))
    return batch


def reference_penalties(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """HF repetition penalty over prompt + output, then OpenAI presence/frequency over output; one row at a time."""
    out = logits.astype(np.float64).copy()
    for r in range(out.shape[0]):
        p = float(batch.repetition_penalty[r])
        for tok in set(batch.prompt_ids[r]) | set(batch.output_ids[r]):
            out[r, tok] = out[r, tok] / p if out[r, tok] > 0 else out[r, tok] * p
        for tok in set(batch.output_ids[r]):
            count = batch.output_ids[r].count(tok)
            out[r, tok] -= batch.presence_penalty[r] + batch.frequency_penalty[r] * count
    return out


def reference_candidates(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Renormalised distribution after top_k, then top_p (on the top_k-renormalised probs), then min_p."""
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(probs.size, bool)
    k = probs.size if top_k <= 0 else min(top_k, probs.size)
    top = order[:k]
    mass = probs[top].sum()
    cumulative = 0.0
    for tok in top:
        if cumulative < top_p * mass or cumulative == 0.0:
            keep[tok] = True
        cumulative += probs[tok]
    keep &= probs >= min_p * probs.max()
    dist = np.where(keep, probs, 0.0)
    return dist / dist.sum()


def random_logits(n: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0, scale, (n, VOCAB)).astype(np.float32))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * counts.sum()
    nonzero = expected > 0
    assert counts[~nonzero].sum() == 0, "sampled a token whose probability is 0"
    return float((((counts - expected) ** 2)[nonzero] / expected[nonzero]).sum())


# 99.9% quantiles of chi-square(df), df = 1..9: a correct sampler fails with probability 1e-3 per check, and the
# fixed generator seeds make every run identical.
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88]


def test_all_greedy_is_argmax():
    logits = random_logits(7)
    out = sample(logits, SamplingBatch.greedy(7))
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))


def test_penalties_match_reference():
    rng = np.random.default_rng(1)
    n = 5
    batch = make_batch(
        n, temperature=0.0,
        repetition_penalty=[1.0, 1.3, 0.7, 2.0, 1.1],
        presence_penalty=[0.0, 0.5, -1.0, 1.5, 2.0],
        frequency_penalty=[0.0, 0.3, 0.8, -0.5, 1.0],
        prompt_ids=[rng.integers(0, VOCAB, 12).tolist() for _ in range(n)],
        output_ids=[rng.integers(0, 8, size).tolist() for size in (0, 3, 9, 20, 5)],  # repeats on purpose
    )
    logits = random_logits(n, seed=2)
    expected = reference_penalties(logits.numpy(), batch)
    penalised = apply_penalties(logits, batch)
    np.testing.assert_allclose(penalised.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(sample(logits, batch), torch.from_numpy(expected.argmax(-1)))


def test_penalties_change_the_greedy_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 2.0
    logits[0, 4] = 1.9
    batch = make_batch(1, temperature=0.0, frequency_penalty=0.2, output_ids=[[3]])
    assert int(sample(logits, batch)[0]) == 4
    batch = make_batch(1, temperature=0.0, repetition_penalty=1.2, prompt_ids=[[3]])
    assert int(sample(logits, batch)[0]) == 4  # 2.0 / 1.2 < 1.9


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = random_logits(6, seed=3)
    batch = make_batch(6, temperature=[0.0, 1.0, 0.0, 0.7, 1.0, 0.0], top_k=[-1, -1, -1, -1, 1, -1])
    out = sample(logits, batch, generator=torch.Generator().manual_seed(0))
    for row in (0, 2, 4, 5):
        assert int(out[row]) == int(logits[row].argmax())


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=5, top_p=1e-6)])
def test_filters_that_leave_one_token_give_the_argmax(filters):
    logits = random_logits(16, seed=4)
    batch = make_batch(16, temperature=1.5, **filters)
    out = sample(logits, batch, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, logits.argmax(-1))


def _sample_counts(logits_row: torch.Tensor, n: int, seed: int, **settings) -> np.ndarray:
    batch = make_batch(n, **settings)
    out = sample(logits_row.expand(n, -1).contiguous(), batch, generator=torch.Generator().manual_seed(seed))
    return np.bincount(out.numpy(), minlength=logits_row.shape[-1])


DIST_LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, top_k=4, top_p=0.7),
    dict(temperature=0.9, min_p=0.2),
    dict(temperature=1.0, top_k=6, top_p=0.9, min_p=0.1),
])
def test_sampled_distribution_matches_the_filtered_softmax(settings):
    counts = _sample_counts(DIST_LOGITS, 8000, seed=11, **settings)
    probs = softmax(DIST_LOGITS[0].numpy().astype(np.float64) / settings["temperature"])
    expected = reference_candidates(probs, settings.get("top_k", -1), settings.get("top_p", 1.0),
                                    settings.get("min_p", 0.0))
    support = int((expected > 0).sum())
    assert support >= 2, "the case must leave a choice to be a distribution test"
    assert chi_square(counts, expected) < CHI2_999[support - 2]


def test_seeded_rows_are_reproducible_whatever_the_batch():
    logits = torch.zeros(1, VOCAB)  # uniform: the token depends on the noise only
    target = dict(seed=1234, output_ids=[5, 6, 7])

    alone = sample(logits, make_batch(1, seeds=[target["seed"]], output_ids=[target["output_ids"]]),
                   generator=torch.Generator().manual_seed(0))
    others = random_logits(4, seed=5)
    mixed_logits = torch.cat([others[:2], logits, others[2:]])
    mixed = make_batch(5, temperature=[0.0, 0.8, 1.0, 1.0, 1.0], top_k=[-1, 10, -1, -1, 3],
                       seeds=[None, 7, target["seed"], None, 99],
                       output_ids=[[1], [2, 3], target["output_ids"], [], [4]])
    in_batch = sample(mixed_logits, mixed, generator=torch.Generator().manual_seed(12345))
    assert int(in_batch[2]) == int(alone[0])


def test_seeded_tokens_vary_with_seed_and_position():
    logits = torch.zeros(1, VOCAB)
    by_position = [int(sample(logits, make_batch(1, seeds=[3], output_ids=[[0] * step]))[0]) for step in range(12)]
    by_seed = [int(sample(logits, make_batch(1, seeds=[seed], output_ids=[[]]))[0]) for seed in range(12)]
    assert len(set(by_position)) > 3 and len(set(by_seed)) > 3


def test_unseeded_rows_follow_the_generator():
    logits = torch.zeros(8, VOCAB)
    batch = make_batch(8)
    a = sample(logits, batch, generator=torch.Generator().manual_seed(5))
    b = sample(logits, batch, generator=torch.Generator().manual_seed(5))
    c = sample(logits, batch, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_tokens_outside_the_vocab_in_history_are_ignored():
    logits = random_logits(1, seed=6)
    batch = make_batch(1, temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.5,
                       prompt_ids=[[VOCAB + 3]], output_ids=[[VOCAB + 10, 2]])
    expected = logits.clone()
    expected[0, 2] = (expected[0, 2] / 1.5 if expected[0, 2] > 0 else expected[0, 2] * 1.5) - 1.0
    torch.testing.assert_close(apply_penalties(logits, batch), expected)


# --- mlx: the same semantics -------------------------------------------------------------------------------

def _mlx():
    import mlx.core as mx

    from tierlm.backends.mlx import sampler as mlx_sampler
    return mx, mlx_sampler


@pytest.mark.mlx
def test_mlx_greedy_and_penalties_agree_with_torch():
    mx, mlx_sampler = _mlx()
    rng = np.random.default_rng(7)
    n = 6
    batch = make_batch(
        n, temperature=0.0,
        repetition_penalty=[1.0, 1.3, 0.7, 2.0, 1.1, 1.0],
        presence_penalty=[0.0, 0.5, -1.0, 1.5, 2.0, 0.0],
        frequency_penalty=[0.0, 0.3, 0.8, -0.5, 1.0, 0.0],
        prompt_ids=[rng.integers(0, VOCAB, 10).tolist() for _ in range(n)],
        output_ids=[rng.integers(0, 8, size).tolist() for size in (0, 3, 9, 20, 5, 2)],
    )
    logits = random_logits(n, seed=8)
    np.testing.assert_allclose(np.array(mlx_sampler.apply_penalties(mx.array(logits.numpy()), batch)),
                               apply_penalties(logits, batch).numpy(), rtol=1e-5, atol=1e-5)
    out = np.array(mlx_sampler.sample(mx.array(logits.numpy()), batch))
    assert out.tolist() == sample(logits, batch).tolist()
    greedy = np.array(mlx_sampler.sample(mx.array(logits.numpy()), SamplingBatch.greedy(n)))
    assert greedy.tolist() == logits.argmax(-1).tolist()


@pytest.mark.mlx
@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_mlx_filters_that_leave_one_token_give_the_argmax(filters):
    mx, mlx_sampler = _mlx()
    logits = random_logits(16, seed=9)
    out = np.array(mlx_sampler.sample(mx.array(logits.numpy()), make_batch(16, temperature=1.5, **filters),
                                      key=mx.random.key(0)))
    assert out.tolist() == logits.argmax(-1).tolist()


@pytest.mark.mlx
@pytest.mark.parametrize("settings", [dict(temperature=0.8), dict(temperature=1.0, top_k=4, top_p=0.7, min_p=0.1)])
def test_mlx_sampled_distribution_matches_the_filtered_softmax(settings):
    mx, mlx_sampler = _mlx()
    n = 8000
    batch = make_batch(n, **settings)
    logits = mx.array(np.repeat(DIST_LOGITS.numpy(), n, axis=0))
    counts = np.bincount(np.array(mlx_sampler.sample(logits, batch, key=mx.random.key(3))), minlength=8)
    probs = softmax(DIST_LOGITS[0].numpy().astype(np.float64) / settings["temperature"])
    expected = reference_candidates(probs, settings.get("top_k", -1), settings.get("top_p", 1.0),
                                    settings.get("min_p", 0.0))
    assert chi_square(counts, expected) < CHI2_999[int((expected > 0).sum()) - 2]


@pytest.mark.mlx
def test_mlx_seeded_rows_are_reproducible_whatever_the_batch():
    mx, mlx_sampler = _mlx()
    uniform = np.zeros((1, VOCAB), np.float32)
    alone = mlx_sampler.sample(mx.array(uniform), make_batch(1, seeds=[77], output_ids=[[1, 2]]))
    mixed_logits = np.concatenate([random_logits(2, seed=10).numpy(), uniform])
    mixed = make_batch(3, temperature=[1.0, 0.0, 1.0], seeds=[None, None, 77], output_ids=[[], [3], [1, 2]])
    in_batch = mlx_sampler.sample(mx.array(mixed_logits), mixed, key=mx.random.key(1))
    assert int(np.array(in_batch)[2]) == int(np.array(alone)[0])
    by_step = {int(np.array(mlx_sampler.sample(mx.array(uniform), make_batch(1, seeds=[77], output_ids=[[0] * s])))[0])
               for s in range(12)}
    assert len(by_step) > 3


def test_row_argmax_equals_torch_argmax_on_every_row_kind():
    """row_argmax (numpy's argmax on CPU float32 rows) gives torch.argmax's answer: ties, NaN, all -inf rows,
    inference mode, strided rows; other dtypes keep torch's own."""
    from tierlm.backends.torch.sampler import row_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, [3, 700]] = 50.0  # a tie: the first one wins
    x[2, 10], x[2, 20] = float("nan"), float("nan")  # NaN wins, the first one
    x[3] = float("-inf")  # everything masked
    x[4, 999] = float("inf")
    x[5] = 0.0  # all equal
    with torch.inference_mode():
        y = x.clone()
        for rows in (y, y[:, ::2], y[::2]):
            got = row_argmax(rows)
            assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(rows, dim=-1))
    assert row_argmax(x).tolist()[:6] == [int(torch.argmax(x[0])), 3, 10, 0, 999, 0]
    # other dtypes and devices keep torch's own argmax
    b = x.bfloat16()
    b[2] = 0  # no NaN compare quirks in bf16 for this check
    assert torch.equal(row_argmax(b), torch.argmax(b, dim=-1))
