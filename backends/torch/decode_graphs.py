"""Decode steps on static, bucketed buffers, captured as CUDA graphs on a GPU.

A decode-only step (every request adds one token, no prompt logprob rows) with at most ``max_bs`` requests is
padded to the next batch-size bucket (1, 2, 4, 8, then steps of 8 up to ``--cuda-graph-max-bs``), and its
inputs are written in place into buffers allocated once: token ids, positions, the pool slots the new K/V go
to, per-request KV lengths and a page table as wide as the longest context. Padded rows decode token 0 at
position 0 into a scratch page that no request owns (the pool has one page more than the allocator hands out),
so they never touch a real request's KV, and their logits are dropped.

On CUDA with ``--attention-backend triton`` each bucket's forward is captured once at startup
(``torch.cuda.graph``) and a step is one ``replay()``: hundreds of kernel launches and all of transformers'
Python become one launch. Elsewhere (CPU, or the torch_native attention, whose shapes follow the longest
context of each step) the same bucketing and buffer filling run eagerly, which is what the CPU tests check
against the plain path; ``--disable-cuda-graph`` turns the whole path off. Mixed and prefill steps always run
eagerly. Hybrid models (recurrent state per request) are not captured.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch

from tierlm.backends.base import ForwardBatch
from tierlm.backends.torch import paged_attention
from tierlm.backends.torch.kv_pool import TorchKVPool
from tierlm.backends.torch.paged_attention import StepMeta, _TritonGroup

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 32  # SGLang's default capture range on small GPUs; --cuda-graph-max-bs raises it
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8


def bucket_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (which is always the last bucket)."""
    sizes = [b for b in SMALL_BUCKETS if b < max_bs] + list(range(BUCKET_STEP * 2, max_bs, BUCKET_STEP))
    return sorted(set(sizes + [max_bs]))


class DecodeGraphs:
    """The static decode path of one TorchBackend (see the module docstring).

    ``run_model(input_ids, positions, keep)`` runs the model over [1, b] inputs and returns logits [b, V];
    ``capture``: record one CUDA graph per bucket (CUDA + triton attention only).
    """

    def __init__(self, pool: TorchKVPool, scratch_page: int, max_bs: int, max_context_len: int, vocab_size: int,
                 device: torch.device, attention_backend: str, run_model: Callable[..., torch.Tensor],
                 capture: bool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.scratch_page = scratch_page
        self.buckets = bucket_sizes(max_bs)
        self.max_bs = self.buckets[-1]
        self.max_pages = -(-max_context_len // self.page_size)
        self.device = device
        self.attention_backend = attention_backend
        self.run_model = run_model
        B, P = self.max_bs, self.max_pages
        # Device buffers every step writes in place (a captured graph reads exactly these addresses).
        self.input_ids = torch.zeros((1, B), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, B), dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(B, dtype=torch.long, device=device)
        self.kv_lens = torch.ones(B, dtype=torch.int32, device=device)
        self.page_table = torch.full((B, P), scratch_page, dtype=torch.int32, device=device)
        self.q_start = torch.arange(B, dtype=torch.int32, device=device)
        self.q_lens = torch.ones(B, dtype=torch.int32, device=device)
        self.keep = torch.arange(B, dtype=torch.long, device=device)
        # Host staging of the same, filled with numpy and sent with one copy per buffer.
        self._ids = np.zeros(B, np.int64)
        self._pos = np.zeros(B, np.int64)
        self._slots = np.zeros(B, np.int64)
        self._kv = np.ones(B, np.int32)
        self._table = np.full((B, P), scratch_page, np.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}
        self.steps = {"static": 0, "replayed": 0}
        self.capture_error: str | None = None
        if capture:
            try:
                self._capture_all(vocab_size)
            except Exception as e:  # noqa: BLE001 - a model whose forward cannot be captured still serves
                self.graphs.clear()
                self.graph_logits.clear()
                self.capture_error = f"{type(e).__name__}: {e}"
                log.warning("CUDA graphs: capture failed (%s); decode steps run on the static buffers without "
                            "graphs (--disable-cuda-graph turns the path off)", self.capture_error)

    # --- which steps ---
    def accepts(self, batch: ForwardBatch) -> bool:
        R = len(batch.q_lens)
        return (0 < R <= self.max_bs and batch.num_logprob_rows == 0 and batch.state_slots is None
                and len(batch.input_ids) == R and bool((batch.q_lens == 1).all())
                and int(batch.kv_lens.max()) <= self.max_pages * self.page_size
                and len(batch.sample_indices) == R and bool((batch.sample_indices == np.arange(R)).all()))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # --- one step ---
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, V] of a step ``accepts`` took, through the bucket's graph or its static buffers."""
        R = len(batch.q_lens)
        b = self.bucket(R)
        self._fill(batch, R, b)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            self.steps["replayed"] += 1
            return self.graph_logits[b][:R]
        self.steps["static"] += 1
        meta = self._meta(b, eager=True)
        paged_attention.CURRENT.meta, paged_attention.CURRENT.pool = meta, self.pool
        try:
            return self.run_model(self.input_ids[:, :b], self.positions[:, :b], self.keep[:b])[:R]
        finally:
            paged_attention.CURRENT.meta = None

    def _fill(self, batch: ForwardBatch, R: int, b: int) -> None:
        """Real rows from the batch, rows R..b-1 as padding: token 0 at position 0 in the scratch page."""
        ps, width = self.page_size, batch.page_table.shape[1]
        pos = batch.positions.astype(np.int64)
        self._ids[:R], self._ids[R:b] = batch.input_ids, 0
        self._pos[:R], self._pos[R:b] = pos, 0
        pages = batch.page_table[np.arange(R), pos // ps].astype(np.int64)
        self._slots[:R], self._slots[R:b] = pages * ps + pos % ps, self.scratch_page * ps
        self._kv[:R], self._kv[R:b] = batch.kv_lens, 1
        used = min(width, self.max_pages)
        self._table[:R, :used] = batch.page_table[:, :used]
        self._table[:R, used:] = self.scratch_page
        self._table[R:b] = self.scratch_page
        nb = self.device.type != "cpu"  # to a GPU: asynchronous from the (pageable) staging arrays is still safe
        self.input_ids[0, :b].copy_(torch.from_numpy(self._ids[:b]), non_blocking=nb)
        self.positions[0, :b].copy_(torch.from_numpy(self._pos[:b]), non_blocking=nb)
        self.slot_mapping[:b].copy_(torch.from_numpy(self._slots[:b]), non_blocking=nb)
        self.kv_lens[:b].copy_(torch.from_numpy(self._kv[:b]), non_blocking=nb)
        self.page_table[:b].copy_(torch.from_numpy(self._table[:b]), non_blocking=nb)

    def _meta(self, b: int, eager: bool) -> StepMeta:
        """The attention metadata of bucket ``b``: from the padded host arrays when run eagerly with torch_native
        attention (its masks follow the step's longest context), else views of the static device buffers."""
        if eager and self.attention_backend != paged_attention.TRITON:
            return StepMeta(np.ones(b, np.int32), self._kv[:b].copy(), self._pos[:b].copy(), self._table[:b].copy(),
                            self.page_size, self.device, self.attention_backend)
        return StepMeta.from_static_decode(
            self.slot_mapping[:b], _TritonGroup(True, self.q_start[:b], self.q_lens[:b], self.kv_lens[:b],
                                                self.page_table[:b], 1, self.max_pages * self.page_size),
            self.page_size, self.device)

    # --- CUDA graphs ---
    def _capture_all(self, vocab_size: int) -> None:
        """One graph per bucket, largest first (smaller ones reuse its memory pool)."""
        mempool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            self._table[:b] = self.scratch_page  # capture on padding only: no real page is written
            self._kv[:b], self._pos[:b], self._ids[:b], self._slots[:b] = 1, 0, 0, self.scratch_page * self.page_size
            self.page_table[:b].fill_(self.scratch_page)
            self.kv_lens[:b].fill_(1)
            self.slot_mapping[:b].fill_(self.scratch_page * self.page_size)
            meta = self._meta(b, eager=False)
            paged_attention.CURRENT.meta, paged_attention.CURRENT.pool = meta, self.pool
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside the graph: Triton compiles, allocators settle
                    self.run_model(self.input_ids[:, :b], self.positions[:, :b], self.keep[:b])
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    self.graph_logits[b] = self.run_model(self.input_ids[:, :b], self.positions[:, :b], self.keep[:b])
                self.graphs[b] = graph
            finally:
                paged_attention.CURRENT.meta = None
        torch.cuda.synchronize()
        log.info("CUDA graphs: decode captured for batch sizes %s (vocab %d)", self.buckets, vocab_size)

    def info(self) -> dict[str, Any]:
        return {"buckets": self.buckets, "captured": sorted(self.graphs), "max_context_pages": self.max_pages,
                "capture_error": self.capture_error, **self.steps}
