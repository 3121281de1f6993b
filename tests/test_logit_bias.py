"""logit_bias (OpenAI, vLLM and SGLang take it) on both backends: the bias moves the choice the way the logits say,
in the engine of each backend and through the HTTP API with the openai client; bad keys and values are 400s."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_harness import greedy, run, start_engine

from tierlm.backends.base import SamplingBatch
from tierlm.runtime.batch_builder import logit_bias_arrays
from tierlm.runtime.sampling_params import SamplingParams, SamplingParamsError

PROMPT = list(range(5, 30))


def test_the_samplers_add_the_bias_before_the_greedy_argmax_and_sampling(backend_name):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    best = logits.argmax(-1)
    runner_up = np.argsort(logits, -1)[:, -2]
    ps = [SamplingParams(temperature=0.0, logit_bias={int(best[0]): -100.0}).normalize(),  # banned: next best wins
          SamplingParams(temperature=0.0).normalize(),  # no bias: unchanged
          SamplingParams(temperature=1.0, seed=3, logit_bias={7: 100.0}).normalize()]  # forced even when sampled
    batch = SamplingBatch.greedy(3)
    batch.temperature = np.asarray([0.0, 0.0, 1.0], np.float32)
    batch.seeds = [None, None, 3]
    batch.all_greedy = False
    batch.logit_bias = logit_bias_arrays(ps)
    if backend_name == "torch":
        from tierlm.backends.torch.sampler import sample

        tokens = sample(torch.from_numpy(logits), batch).tolist()
    else:
        import mlx.core as mx

        from tierlm.backends.mlx.sampler import sample

        tokens = np.asarray(sample(mx.array(logits), batch)).tolist()
    assert tokens == [int(runner_up[0]), int(best[1]), 7]


def test_logit_bias_is_checked():
    with pytest.raises(SamplingParamsError, match="in \\[-100, 100\\]"):
        SamplingParams(logit_bias={3: 101.0}).normalize()
    with pytest.raises(SamplingParamsError, match="in \\[-100, 100\\]"):
        SamplingParams(logit_bias={3: float("nan")}).normalize()
    with pytest.raises(SamplingParamsError, match="token ids"):
        SamplingParams(logit_bias={-1: 1.0}).normalize()
    assert logit_bias_arrays([SamplingParams().normalize()]) is None


def test_engine_follows_the_bias_on_each_backend(tiny_llama, backend_name):
    engine = start_engine(tiny_llama, backend=backend_name)
    try:
        (plain,) = run(engine, [PROMPT], greedy(6))
        banned = plain.token_ids[0]
        (without,) = run(engine, [PROMPT], greedy(6, logit_bias={banned: -100.0}))
        assert without.token_ids[0] != banned and banned not in without.token_ids
        forced = (banned + 1) % 100
        (only,) = run(engine, [PROMPT], greedy(6, logit_bias={forced: 100.0}))
        assert only.token_ids == [forced] * 6
        (batched_plain, batched_forced) = run(engine, [PROMPT, PROMPT],
                                              [greedy(6), greedy(6, logit_bias={forced: 100.0})])
        assert batched_plain.token_ids == plain.token_ids and batched_forced.token_ids == [forced] * 6
    finally:
        engine.shutdown()
