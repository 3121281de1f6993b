"""StepMeta and paged_attention (backends/torch/paged_attention.py): on torch's path (no C kernel in the step's CPU
plan) an extending request's cached K/V are read as a view of the pool when its pages lie in one ascending run (no
gather copy), with exactly what the gather gives when they do not, and the C extend kernels of the CPU plan
(backends/torch/cpu/plan.py), which read the pages through the page table, give the same either way; the attention
mask is built only by a path that reads it, and then as the causal, length-bounded mask and padded rows never
all-masked."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_paged_decode import kernels_for, run_step

from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.cpu import paged_extend
from tierlm.backends.torch.kv_pool import TorchKVPool

PAGE, HKV, H, D = 4, 2, 4, 16


def _extend(pages: np.ndarray, cached: int, new: int, dtype, monkeypatch, kernels=None):
    """One request extending ``cached`` tokens by ``new`` through ``pages`` with ``kernels`` (None: torch's path);
    the cached K/V are the same values whatever pages hold them."""
    g = torch.Generator().manual_seed(7)
    kv_len = cached + new
    keys = torch.randn(cached, HKV, D, generator=g).to(dtype)
    values = torch.randn(cached, HKV, D, generator=g).to(dtype)
    q = torch.randn(1, H, new, D, generator=g).to(dtype)
    k = torch.randn(1, HKV, new, D, generator=g).to(dtype)
    v = torch.randn(1, HKV, new, D, generator=g).to(dtype)
    pool = TorchKVPool(2, 40, PAGE, HKV, D, dtype, torch.device("cpu"))
    slots = torch.as_tensor(pages[np.arange(cached) // PAGE] * PAGE + np.arange(cached) % PAGE)
    pool.write(1, slots, keys, values)
    meta = pa.StepMeta(np.asarray([new]), np.asarray([kv_len]), np.arange(cached, kv_len), pages[None].astype(np.int32),
                       PAGE, torch.device("cpu"))
    calls = []
    real = paged_extend.paged_extend
    monkeypatch.setattr(paged_extend, "paged_extend", lambda *a: calls.append(1) or real(*a))
    out = run_step(meta, pool, q, k, v, D ** -0.5, monkeypatch, kernels)
    assert len(calls) == (0 if kernels is None or kernels.extend is None else 1)  # the path asked for
    return meta, out


@pytest.mark.parametrize("path", ["torch", "plan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_ascending_page_run_is_read_in_place_with_the_gathers_result(dtype, path, monkeypatch):
    cached, new = 37, 5
    n = -(-(cached + new) // PAGE)
    run = np.arange(6, 6 + n)
    scattered = np.random.default_rng(0).permutation(np.arange(20, 40))[:n]
    kernels = None if path == "torch" else kernels_for(dtype, heads=(H, HKV), D=D)  # plan: the C extend kernel
    if kernels is not None and kernels.extend is None:
        pytest.skip(f"no C extend kernel in this CPU's plan ({kernels.plan.extend_attention.why})")
    meta_run, out_run = _extend(run, cached, new, dtype, monkeypatch, kernels)
    meta_gather, out_gather = _extend(scattered, cached, new, dtype, monkeypatch, kernels)
    assert meta_run.groups[0].kv_page_run == slice(6, 6 + n)
    assert meta_gather.groups[0].kv_page_run is None
    assert torch.equal(out_run, out_gather)


def test_several_requests_in_one_group_still_gather():
    table = np.arange(8, dtype=np.int32).reshape(2, 4)  # ascending overall, but two requests
    meta = pa.StepMeta(np.asarray([3, 3]), np.asarray([12, 12]), np.concatenate([np.arange(9, 12)] * 2), table,
                       PAGE, torch.device("cpu"))
    assert meta.groups[0].kv_page_run is None


def test_the_mask_is_built_on_first_use_only_and_is_causal_and_length_bounded(monkeypatch):
    g = torch.Generator().manual_seed(3)
    T = 9
    pool = TorchKVPool(2, 8, PAGE, HKV, D, torch.float32, torch.device("cpu"))
    meta = pa.StepMeta(np.asarray([T]), np.asarray([T]), np.arange(T), np.arange(3, dtype=np.int32)[None], PAGE,
                       torch.device("cpu"))
    assert meta.single_fresh_prefill
    run_step(meta, pool, torch.randn(1, H, T, D, generator=g), torch.randn(1, HKV, T, D, generator=g),
             torch.randn(1, HKV, T, D, generator=g), D ** -0.5, monkeypatch, None)
    assert "mask" not in vars(meta.groups[0])  # SDPA's causal flag served: no T x T mask was built

    # two extends in one group: 3 new tokens over 5 cached, and 2 new over 1 cached (padded to 3 query rows)
    meta = pa.StepMeta(np.asarray([3, 2]), np.asarray([8, 3]), np.asarray([5, 6, 7, 1, 2]),
                       np.asarray([[0, 1], [2, 3]], np.int32), PAGE, torch.device("cpu"))
    mask = meta.groups[0].mask[:, 0]  # [G, Q, L]
    want = torch.zeros(2, 3, 2 * PAGE, dtype=torch.bool)
    for g, positions in enumerate([[5, 6, 7], [1, 2]]):
        for q, pos in enumerate(positions):
            want[g, q, :pos + 1] = True
    real = torch.tensor([[True, True, True], [True, True, False]])
    assert torch.equal(mask[real], want[real])
    assert mask[1, 2, 0]  # the padded row (its output is dropped) is never all-masked
