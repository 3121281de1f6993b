"""A decode-only CPU step's attention in one C call per layer (backends/torch/cpu/decode_step.py) against the
general path of paged_attention.py (the C decode kernel per layer): the same outputs and the same pool bytes, bit
for bit; and the steps it must leave to the general path (among them, where the CPU plan has no decode kernel)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_paged_decode import decode_inputs, kernels_for, lib, needs_kernel

from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.cpu import decode_step, paged_decode
from tierlm.backends.torch.kv_pool import TorchKVPool


class _Layer:
    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


def _setup(heads, D, page_size, cached, dtype, seed=0, q_transposed=True):
    return decode_inputs(heads, D, page_size, cached, dtype, seed, layers=3, q_transposed=q_transposed,
                         k_transposed=True)


def _step(pool, meta, q, k, v, layers=(0, 2), kernels=None, **kw):
    """paged_attention of ``layers`` over one step with ``kernels`` (default: the plan of q's dtype and heads with
    the process's library, as the backend sets it): outputs per layer."""
    if kernels is None:
        kernels = kernels_for(q.dtype, heads=(q.shape[1], k.shape[1]), D=q.shape[-1])
    saved = pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels
    pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels = meta, pool, kernels
    try:
        return [pa.paged_attention(_Layer(layer), q, k, v, None, scaling=q.shape[-1] ** -0.5, **kw)[0]
                for layer in layers]
    finally:
        pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels = saved


def _both(monkeypatch, *setup_args, **setup_kw):
    """(general path's outputs and pool, one-call step's outputs and pool, the step's plan) on equal inputs."""
    pool_a, meta_a, q, k, v = _setup(*setup_args, **setup_kw)
    monkeypatch.setattr(decode_step, "ENABLED", False)
    decodes = []  # the general path's C decode kernel, one call per layer
    real_decode = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a: decodes.append(1) or real_decode(*a))
    ref = _step(pool_a, meta_a, q, k, v)
    assert meta_a.decode_step is None and len(decodes) == len(ref)
    monkeypatch.setattr(decode_step, "ENABLED", True)
    pool_b, meta_b, q, k, v = _setup(*setup_args, **setup_kw)
    runs = []
    real = decode_step.DecodeStep.run
    monkeypatch.setattr(decode_step.DecodeStep, "run", lambda *a: runs.append(1) or real(*a))
    got = _step(pool_b, meta_b, q, k, v)
    assert len(runs) == len(got)  # every layer took the one-call path
    return ref, pool_a, got, pool_b, meta_b.decode_step


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,D,page_size,cached,q_transposed", [
    ((8, 4), 64, 16, [3, 200, 17], True),     # llama-small's shape, three requests
    ((4, 4), 24, 1, [0, 9, 30], False),       # MHA, odd head dim, one token per page, contiguous queries
    ((14, 2), 64, 16, [1000], True),          # Qwen2.5-0.5B's grouping, one stream over a long context
    ((8, 2), 128, 4, [50, 0, 7, 31], True),   # 128 dims, a request with no cached token
])
def test_one_call_step_equals_the_general_path(heads, D, page_size, cached, q_transposed, dtype, monkeypatch):
    ref, pool_a, got, pool_b, plan = _both(monkeypatch, heads, D, page_size, cached, dtype,
                                           q_transposed=q_transposed)
    assert isinstance(plan, decode_step.DecodeStep)  # the step really took the one-call path
    for a, b in zip(ref, got):
        assert b.shape == a.shape == (1, len(cached), heads[0], D) and b.is_contiguous()
        assert torch.equal(a, b)
    # the new K/V rows landed in the same slots of the written layers, and nothing else moved
    assert torch.equal(pool_a.buffer, pool_b.buffer)


@needs_kernel
def test_new_rows_are_written_before_they_are_read(monkeypatch):
    """The new token attends to itself: its K/V must be in the pool before the kernel reads it, and in its slot."""
    pool, meta, q, k, v = _setup((8, 4), 64, 16, [5, 40], torch.bfloat16)
    before = pool.buffer.clone()
    _step(pool, meta, q, k, v, layers=(1,))
    slots = meta.slot_mapping
    assert torch.equal(pool.k[1][slots], k[0].transpose(0, 1))
    assert torch.equal(pool.v[1][slots], v[0].transpose(0, 1))
    changed = (pool.buffer != before).flatten(3).any(-1).nonzero()  # [layer, K/V, slot] of changed rows
    assert set(changed[:, 0].tolist()) == {1} and set(changed[:, 2].tolist()) <= set(slots.tolist())


@needs_kernel
def test_steps_it_leaves_to_the_general_path(monkeypatch):
    # an extend step (several queries of one request)
    pool, _, q, k, v = _setup((8, 4), 64, 16, [30], torch.bfloat16)
    meta = pa.StepMeta(np.array([3]), np.array([33]), np.arange(30, 33), np.arange(3, dtype=np.int32)[None], 16,
                       torch.device("cpu"))
    assert decode_step.plan(meta, pool, torch.zeros(1, 8, 3, 64, dtype=torch.bfloat16), lib) is None
    # fp8 pages (their write quantizes) and a query dtype other than the pages'
    pool8, meta8, q8, _, _ = _setup((8, 4), 64, 16, [3, 9], torch.bfloat16)
    fp8 = TorchKVPool(3, pool8.num_pages, 16, 4, 64, torch.float8_e4m3fn, torch.device("cpu"))
    assert decode_step.plan(meta8, fp8, q8, lib) is None
    assert decode_step.plan(meta8, pool8, q8.float(), lib) is None
    # Triton's metadata
    meta_t = pa.StepMeta(np.ones(2, np.int64), np.array([4, 10]), np.array([3, 9]), meta8.groups[0].page_rows.numpy(),
                         16, torch.device("cpu"), pa.TRITON)
    assert decode_step.plan(meta_t, pool8, q8, lib) is None
    # a plan without the decode kernel (no library, or decode_attention=torch): no library to call
    assert isinstance(decode_step.plan(meta8, pool8, q8, lib), decode_step.DecodeStep)
    assert decode_step.plan(meta8, pool8, q8, None) is None
    pool_p, meta_p, q_p, k_p, v_p = _setup((8, 4), 64, 16, [3, 9], torch.bfloat16)
    _step(pool_p, meta_p, q_p, k_p, v_p, layers=(0,),
          kernels=kernels_for(torch.bfloat16, heads=(8, 4), D=64, plan="decode_attention=torch"))
    assert meta_p.decode_step is None
    # a sliding window or attention sinks: the general path serves the layer, and the result is its own
    pool, meta, q, k, v = _setup((8, 4), 64, 16, [3, 200], torch.bfloat16)
    calls = []
    monkeypatch.setattr(decode_step.DecodeStep, "run", lambda *a: calls.append(1))
    out = _step(pool, meta, q, k, v, layers=(0,), sliding_window=8)[0]
    assert not calls and out.shape == (1, 2, 8, 64)


@needs_kernel
def test_a_layer_whose_tensors_do_not_fit_takes_the_general_path(monkeypatch):
    """A plan made on the first layer is not applied to a layer of another head count or layout."""
    pool, meta, q, k, v = _setup((8, 4), 64, 16, [3, 20], torch.bfloat16)
    _step(pool, meta, q, k, v, layers=(0,))
    plan = meta.decode_step
    assert plan is not None and plan.fits(q, k, v)
    assert not plan.fits(q[:, :4], k, v)                        # fewer query heads
    assert not plan.fits(q, k, v.float())                       # another dtype
    assert not plan.fits(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)  # D not contiguous


def test_decode_only_metadata_is_the_general_groups_own():
    """A decode-only step keeps its page rows and lengths up front and builds the general group only when asked:
    both say the same; a step with an extend row has no decode rows."""
    table = np.random.default_rng(3).permutation(40)[:30].reshape(3, 10).astype(np.int32)
    kv_lens = np.array([5, 77, 33])
    meta = pa.StepMeta(np.ones(3, np.int64), kv_lens, kv_lens - 1, table, 16, torch.device("cpu"))
    page_rows, lens, max_len = meta.decode_rows
    assert meta._groups is None and meta.identity_rows and not meta.single_fresh_prefill
    g = meta.groups[0]  # built now
    assert len(meta.groups) == 1 and g.Q == 1 and g.G == 3
    assert torch.equal(page_rows, g.page_rows) and torch.equal(lens, g.kv_lens) and max_len == g.max_kv_len
    assert meta.slot_mapping.tolist() == [int(table[r, (n - 1) // 16]) * 16 + (n - 1) % 16
                                          for r, n in enumerate(kv_lens)]
    mixed = pa.StepMeta(np.array([1, 4]), np.array([5, 9]), np.array([4, 5, 6, 7, 8]), table[:2], 16,
                        torch.device("cpu"))
    assert mixed.decode_rows is None and len(mixed.groups) == 2
