"""tierlm's paged attention for mlx-lm models, without any per-family code and without global patches.

The model body runs on one flattened sequence (batch 1, T tokens from R requests), so embeddings, norms and
MLPs cost exactly T tokens. Each layer's ``self_attn`` of *our* model instance is wrapped by
``PagedAttention``, which regroups the flat rows into at most two padded batches (decode tokens: [G, 1];
prefill chunks: [G, Lmax]) and calls the original mlx-lm attention module unchanged on each, passing a
``GroupLayerCache`` as its ``cache``. The module then does its own projections, q/k norms and RoPE with
``offset=cache.offset`` (a per-request vector, which ``mx.fast.rope`` accepts), calls
``cache.update_and_fetch`` (we hand back the request's K/V gathered from the pool pages, with the new tokens
spliced in) and runs ``mx.fast.scaled_dot_product_attention`` with our boolean mask (causal, bounded by each
request's length, optionally windowed). The new K/V of all groups are scattered into the pool once per layer.
All index arrays are built once per step (``StepPlan``) and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tierlm.backends.base import ForwardBatch
from tierlm.backends.mlx.kv_pool import MLXKVPool


@dataclass
class AttentionGroup:
    """Requests attended together as one padded batch [B, Q] of queries over [B, K] gathered positions."""

    num_reqs: int  # B
    q_len: int  # Q, the longest chunk in the group
    rows: mx.array  # int32 [B*Q] flat token row of each padded query (padding -> row 0)
    real_rows: mx.array  # int32 [Tg] index into the B*Q padded rows of the group's real tokens
    rope_offsets: mx.array  # int32 [B] position of each request's first new token
    read_slots: mx.array  # int32 [B, K] pool slots of positions 0..K-1 (beyond kv_len -> slot 0, masked)
    new_req: mx.array  # int32 [Tg] request (0..B-1) of each real token
    new_pos: mx.array  # int32 [Tg] position of each real token
    write_slots: np.ndarray  # int64 [Tg] pool slot of each real token
    fresh: bool  # every request's chunk is its whole context: attend over the new K/V, no pool read
    _q_pos: np.ndarray = field(repr=False, default=None)  # [B, Q]
    _kv_valid: np.ndarray = field(repr=False, default=None)  # [B, K]
    _row_valid: np.ndarray = field(repr=False, default=None)  # [B, Q]
    _masks: dict = field(repr=False, default_factory=dict)  # window (None = full) -> bool [B, 1, Q, K]

    def mask(self, window: int | None) -> mx.array:
        m = self._masks.get(window)
        if m is None:
            kv_pos = np.arange(self._kv_valid.shape[1])[None, None, :]
            q_pos = self._q_pos[:, :, None]
            allowed = (kv_pos <= q_pos) & self._kv_valid[:, None, :]
            if window is not None:
                allowed &= kv_pos > q_pos - window
            # Padded query rows (discarded later) see position 0, so no softmax row is all-masked.
            allowed |= ~self._row_valid[:, :, None] & (kv_pos == 0)
            m = mx.array(allowed[:, None])
            self._masks[window] = m
        return m


class StepPlan:
    """Index arrays of one ForwardBatch: the two attention groups, the pool write slots, the un-padding."""

    def __init__(self, batch: ForwardBatch) -> None:
        q_lens = np.asarray(batch.q_lens, np.int64)
        kv_lens = np.asarray(batch.kv_lens, np.int64)
        page_table = np.asarray(batch.page_table, np.int64)
        positions = np.asarray(batch.positions, np.int64)
        ps = int(batch.page_size)
        if len(q_lens) == 0 or q_lens.min() < 1:
            raise ValueError("every request in a ForwardBatch needs at least one new token (q_lens >= 1)")
        if np.any(kv_lens < q_lens):
            raise ValueError("kv_lens must count the new tokens too (kv_lens >= q_lens)")
        if page_table.ndim != 2 or np.any(kv_lens > page_table.shape[1] * ps):
            raise ValueError(f"page_table {page_table.shape} cannot hold kv_lens {kv_lens.tolist()} "
                             f"at page_size {ps}; give every request ceil(kv_len / page_size) pages")
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        decode = q_lens == 1
        self.groups: list[AttentionGroup] = []
        unpad = np.zeros(int(q_lens.sum()), np.int64)
        write_slots = []
        base = 0
        for sel in (np.flatnonzero(decode), np.flatnonzero(~decode)):
            if len(sel) == 0:
                continue
            g, flat_rows, padded_idx = _build_group(sel, q_lens, kv_lens, starts, positions, page_table, ps)
            unpad[flat_rows] = base + padded_idx
            base += g.num_reqs * g.q_len
            write_slots.append(g.write_slots)
            self.groups.append(g)
        self.unpad = mx.array(unpad.astype(np.int32))
        self.write_slots = mx.array(np.concatenate(write_slots).astype(np.int32))


def _build_group(sel, q_lens, kv_lens, starts, positions, page_table, ps):
    ql, kl, st = q_lens[sel], kv_lens[sel], starts[sel]
    B, Q, K = len(sel), int(ql.max()), int(kl.max())
    qi = np.arange(Q)
    row_valid = qi[None, :] < ql[:, None]
    rows = np.where(row_valid, st[:, None] + qi[None, :], 0)
    q_pos = (kl - ql)[:, None] + qi[None, :]
    kv_pos = np.arange(K)
    kv_valid = kv_pos[None, :] < kl[:, None]
    page_idx = np.minimum(kv_pos // ps, page_table.shape[1] - 1)
    read_slots = np.where(kv_valid, page_table[sel][:, page_idx] * ps + kv_pos % ps, 0)
    new_req = np.repeat(np.arange(B), ql)
    new_pos = q_pos[row_valid]
    padded_idx = np.flatnonzero(row_valid.reshape(-1))
    i32 = lambda a: mx.array(np.ascontiguousarray(a).astype(np.int32))  # noqa: E731
    group = AttentionGroup(
        num_reqs=B, q_len=Q, rows=i32(rows.reshape(-1)), real_rows=i32(padded_idx),
        rope_offsets=i32(positions[st]), read_slots=i32(read_slots), new_req=i32(new_req), new_pos=i32(new_pos),
        write_slots=read_slots[new_req, new_pos], fresh=bool(np.all(ql == kl)), _q_pos=q_pos, _kv_valid=kv_valid,
        _row_valid=row_valid,
    )
    return group, rows[row_valid], padded_idx


class GroupLayerCache:
    """What mlx-lm attention modules expect of a KV cache (``offset``, ``update_and_fetch``), over the pool."""

    def __init__(self, pool: MLXKVPool, layer: int, group: AttentionGroup) -> None:
        self.pool, self.layer, self.group = pool, layer, group
        self.offset = group.rope_offsets  # per-request RoPE start; mx.fast.rope takes a [B] offset vector
        self.new_k: mx.array | None = None
        self.new_v: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys/values [B, Hkv, Q, D] of the new tokens -> [B, Hkv, K, D] over positions 0..K-1."""
        g = self.group
        B, H, Q, D = keys.shape
        self.new_k = keys.transpose(0, 2, 1, 3).reshape(B * Q, H, D)[g.real_rows]
        self.new_v = values.transpose(0, 2, 1, 3).reshape(B * Q, H, D)[g.real_rows]
        # Attention sees the new K/V as the pool stores them (fp8 / bf16 pages round them), so a later cache hit
        # on these pages reads the same numbers.
        pool = self.pool
        if g.fresh:
            return pool.as_stored(keys), pool.as_stored(values)
        # The pool still holds last step's contents here (the layer's write happens after all groups), so
        # the new tokens are spliced into the gathered context.
        ctx_k = pool.dequantize(pool.k[self.layer][g.read_slots], keys.dtype)  # [B, K, Hkv, D]
        ctx_v = pool.dequantize(pool.v[self.layer][g.read_slots], values.dtype)
        ctx_k[g.new_req, g.new_pos] = pool.as_stored(self.new_k)
        ctx_v[g.new_req, g.new_pos] = pool.as_stored(self.new_v)
        return ctx_k.transpose(0, 2, 1, 3), ctx_v.transpose(0, 2, 1, 3)


class StepContext:
    """The current step's plan and pool, shared by the wrapped layers of one model instance."""

    def __init__(self) -> None:
        self.plan: StepPlan | None = None
        self.pool: MLXKVPool | None = None


class PagedAttention(nn.Module):
    """Wraps one layer's mlx-lm attention module; the model body sees an ordinary attention module."""

    def __init__(self, inner: nn.Module, layer: int, window: int | None, ctx: StepContext) -> None:
        super().__init__()
        self.inner = inner
        self._layer = layer
        self._window = window
        self._ctx = ctx

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        plan, pool = self._ctx.plan, self._ctx.pool
        if plan is None or pool is None:
            raise RuntimeError("tierlm paged attention called outside MLXBackend.forward (no step plan / pool)")
        hidden = x.shape[-1]
        flat = x.reshape(-1, hidden)
        outs, new_k, new_v = [], [], []
        for g in plan.groups:
            layer_cache = GroupLayerCache(pool, self._layer, g)
            xg = flat[g.rows].reshape(g.num_reqs, g.q_len, hidden)
            out = self.inner(xg, mask=g.mask(self._window), cache=layer_cache)
            outs.append(out.reshape(g.num_reqs * g.q_len, -1))
            new_k.append(layer_cache.new_k)
            new_v.append(layer_cache.new_v)
        cat = (lambda a: a[0]) if len(outs) == 1 else mx.concatenate  # noqa: E731
        pool.write(self._layer, plan.write_slots, cat(new_k), cat(new_v))
        return cat(outs)[plan.unpad][None]


def sliding_windows(config: dict[str, Any], num_layers: int) -> list[int | None]:
    """Per-layer attention window as transformers applies it (None = full attention)."""
    window = config.get("sliding_window")
    if not window:
        return [None] * num_layers
    layer_types = config.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if config.get("model_type") == "mistral":  # Mistral applies its window on every layer
        return [window] * num_layers
    if config.get("use_sliding_window"):
        first = int(config.get("max_window_layers", num_layers))
        return [window if i >= first else None for i in range(num_layers)]
    return [None] * num_layers


def install_paged_attention(model: nn.Module, ctx: StepContext, windows: list[int | None],
                            layers: list | None = None, attention: dict[int, str] | None = None) -> None:
    """Wrap every layer's ``self_attn`` of this model instance (other mlx-lm models are untouched). Hybrids pass
    their ``layers`` and ``attention`` (layer index -> attribute of its attention module; hybrid_families.py):
    only those are wrapped, each writing the pool's entry of its own layer index."""
    layers = model.layers if layers is None else layers
    if len(windows) != len(layers):
        raise ValueError(f"{len(windows)} window entries for {len(layers)} layers")
    attention = {i: "self_attn" for i in range(len(layers))} if attention is None else attention
    for i, attr in attention.items():
        layer = layers[i]
        attn = getattr(layer, attr, None)
        if attn is None:
            raise NotImplementedError(
                f"layer {i} of {type(model).__module__} has no {attr}; the mlx backend supports "
                "attention-only decoder families (llama, mistral, qwen2, qwen3) and the verified hybrids")
        if not isinstance(attn, PagedAttention):
            setattr(layer, attr, PagedAttention(attn, i, windows[i], ctx))
