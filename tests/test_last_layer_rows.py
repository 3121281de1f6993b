"""The last decoder layer runs only the rows whose logits are read (backends/torch/last_layer_rows.py).

What must hold: on every covered family (llama, qwen2, qwen3, mistral) the loader gives the last decoder layer, and
only it, the read-rows forward; in an eager step its MLP then sees just the read rows (one per request that samples,
plus prompt logprob rows; none in a chunk that is not a request's last), and those rows' logits equal the every-row
model's (bit for bit in bf16; in float32 MKL picks its kernel by row count, so within float32 rounding) in a fresh
prefill (the blocked attention computes the read queries alone), a batch of prefills, an extend over cached pages and
a step with prompt logprob rows; the K/V it writes are the same (every later step's logits are equal). The switch and
a layer class it does not cover keep every row, with the reason; a decode step (every row read) is unchanged.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tierlm.backends.base import ForwardBatch, SamplingBatch
from tierlm.backends.torch import last_layer_rows
from tierlm.backends.torch.backend import TorchBackend
from tierlm.backends.torch.cpu import blocked_attention
from tierlm.backends.torch.last_layer_rows import ReadRowsLayer

PAGE_SIZE = 4
FRESH = 70  # a fresh prefill long enough for two blocks of the blocked attention's query rows


def _backend(model_dir, dtype: str, read_rows: bool, monkeypatch) -> TorchBackend:
    monkeypatch.setenv(last_layer_rows.ENV, "1" if read_rows else "0")
    backend = TorchBackend(model_dir, dtype=dtype)
    backend.init_kv_pool(128, PAGE_SIZE)
    return backend


def _mlp_rows(backend: TorchBackend) -> list[int]:
    """Rows the last layer's MLP receives, one entry per forward."""
    seen: list[int] = []
    backend.model.model.layers[-1].mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    return seen


def _batch(ids, positions, q, kv, table, sample, **kw) -> ForwardBatch:
    return ForwardBatch(np.asarray(ids, np.int64), np.asarray(positions, np.int64), np.asarray(q, np.int32),
                        np.asarray(kv, np.int32), np.asarray(table, np.int32), np.asarray(sample, np.int64),
                        SamplingBatch.greedy(len(sample)), PAGE_SIZE, **kw)


def _steps(backend: TorchBackend) -> list[torch.Tensor]:
    """Logits of: a batch of three prefills (the second in three chunks: the first two read no row), a fresh prefill,
    an extend over that request's cached pages with prompt logprob rows, then decode steps of all four."""
    rng = np.random.default_rng(0)
    table = np.arange(128, dtype=np.int32).reshape(4, 32)
    p = [rng.integers(3, 90, n) for n in (7, 9, 5)]
    out = []
    # request 0 whole, request 1's first 5 tokens (a chunk: no row read), request 2 whole
    ids = np.concatenate([p[0], p[1][:5], p[2]])
    pos = np.concatenate([np.arange(7), np.arange(5), np.arange(5)])
    out.append(backend.forward_logits(_batch(ids, pos, [7, 5, 5], [7, 5, 5], table[:3], [6, 16])))
    # request 1's next 2 tokens alone (a chunk: no row read, the step's logits have none), then its last 2
    out.append(backend.forward_logits(_batch(p[1][5:7], np.arange(5, 7), [2], [7], table[1:2], [])))
    out.append(backend.forward_logits(_batch(p[1][7:], np.arange(7, 9), [2], [9], table[1:2], [1])))
    fresh = rng.integers(3, 90, FRESH)
    out.append(backend.forward_logits(_batch(fresh, np.arange(FRESH), [FRESH], [FRESH], table[3:], [FRESH - 1])))
    # 6 more tokens of request 3 over its cached pages; rows 1 and 3 scored for prompt logprobs
    more = rng.integers(3, 90, 6)
    out.append(backend.forward_logits(_batch(more, np.arange(FRESH, FRESH + 6), [6], [FRESH + 6], table[3:], [5],
                                             logprob_indices=np.asarray([1, 3], np.int64),
                                             logprob_targets=np.asarray([4, 5], np.int64))))
    kv = np.asarray([7, 9, 5, FRESH + 6])
    for token in (3, 17):  # decode: every row read
        kv = kv + 1
        out.append(backend.forward_logits(_batch(np.full(4, token), kv - 1, [1] * 4, kv, table, np.arange(4))))
    return [o.clone() for o in out]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_read_rows_give_the_every_row_logits_and_kv(tiny_model, dtype, monkeypatch):
    every = _backend(tiny_model, dtype, False, monkeypatch)
    read = _backend(tiny_model, dtype, True, monkeypatch)
    layers = read.model.model.layers
    assert isinstance(layers[-1], ReadRowsLayer) and not any(isinstance(m, ReadRowsLayer) for m in layers[:-1])
    assert read.kernels()["last_layer"] == "read rows only"
    assert not isinstance(every.model.model.layers[-1], ReadRowsLayer)
    rows_every, rows_read = _mlp_rows(every), _mlp_rows(read)
    want = _steps(every)
    queries: list[int] = []  # query rows of each blocked-attention call (bf16 fresh prefills, where it runs)
    blocked = blocked_attention.blocked_attention
    monkeypatch.setattr(blocked_attention, "blocked_attention",
                        lambda lib, q, *args: queries.append(q.shape[2]) or blocked(lib, q, *args))
    got = _steps(read)
    # where the model's CPU plan has the blocked path (bf16, a library loaded, no AMX or prefill_attention=blocked)
    if read.cpu_kernels is not None and read.cpu_kernels.blocked is not None and read.dtype == torch.bfloat16:
        # the fresh prefill's last layer: the read query alone
        assert queries.count(FRESH) == read.info.num_layers - 1 and queries.count(1) == 1
    else:
        assert not queries
    assert rows_every == [17, 2, 2, FRESH, 6, 4, 4]
    assert rows_read == [2, 0, 1, 1, 3, 4, 4]  # request 1's chunks read none; decode reads every row
    for a, b in zip(want, got):
        assert a.shape == b.shape
        if dtype == "bfloat16":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    last = read.info.num_layers - 1  # the last layer's K/V of every row, the chunk's rows included
    assert torch.equal(every.pool.k[last], read.pool.k[last]) and torch.equal(every.pool.v[last], read.pool.v[last])


def test_the_switch_and_an_uncovered_layer_keep_every_row(tiny_llama, monkeypatch, caplog):
    from transformers import AutoConfig, AutoModelForCausalLM

    every = _backend(tiny_llama, "bfloat16", False, monkeypatch)
    assert every.kernels()["last_layer"] == f"every row ({last_layer_rows.ENV}=0)"
    assert not every.last_layer_read_rows
    monkeypatch.setenv(last_layer_rows.ENV, "1")
    cfg = AutoConfig.for_model("gemma", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    gemma = AutoModelForCausalLM.from_config(cfg)
    with caplog.at_level("INFO", logger=last_layer_rows.__name__):
        why = last_layer_rows.install(gemma)
    assert why.startswith("every row (GemmaDecoderLayer is not a layer class it covers")
    assert why in caplog.text and not last_layer_rows.installed(gemma)


def test_outside_a_read_rows_step_the_layer_is_transformers_own(tiny_llama, monkeypatch):
    """The model called directly (tests' references, a compiled step's trace) gets every row's hidden state."""
    read = _backend(tiny_llama, "float32", True, monkeypatch)
    every = _backend(tiny_llama, "float32", False, monkeypatch)
    from tierlm.backends.torch import paged_attention

    ids = torch.tensor([[5, 9, 13, 2, 7]])
    batch = _batch(ids[0].numpy(), np.arange(5), [5], [5], np.arange(16).reshape(1, 16), [4])
    outs = []
    current = paged_attention.CURRENT
    for backend in (every, read):
        saved = current.meta, current.pool, current.kernels
        current.meta = paged_attention.StepMeta(batch.q_lens, batch.kv_lens, batch.positions, batch.page_table,
                                                PAGE_SIZE, torch.device("cpu"))
        current.pool, current.kernels = backend.pool, backend.cpu_kernels  # as the backend's own steps set them
        try:
            with torch.inference_mode():
                outs.append(backend.model.model(input_ids=ids, position_ids=torch.arange(5)[None]).last_hidden_state)
        finally:
            current.meta, current.pool, current.kernels = saved
    assert outs[1].shape == (1, 5, outs[1].shape[-1]) and torch.equal(outs[0], outs[1])
