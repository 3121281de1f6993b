"""Run a hybrid model's linear-attention / Mamba2 layers (mlx-lm modules) inside tierlm's flat packed step.

As backends/torch/linear_state.py: each linear mixer of the model instance is wrapped by ``LinearMixer``, which
calls the *original* mlx-lm module with ``StateCache``, a duck of mlx-lm's ``ArraysCache`` (``[0]`` conv state,
``[1]`` recurrent state, ``lengths`` None, ``advance``, truthy) holding states from ``MLXStatePool``:

- decode rows (one token continuing a state) go as one ``[G, 1, H]`` call with the states gathered by slot;
- prefill chunks run one call each (batch 1): from zeros when the chunk starts its request (kv_len == q_len),
  else from its slot. One call per segment: right padding would corrupt Nemotron-H's final SSM state (its
  ``ssm_update`` ignores lengths) and left padding would put zeros between a resumed conv state and new tokens.
- snapshots (prefix reuse, runtime/cache/state_snapshots.py): ``ForwardBatch.snapshot_at/dst`` ask for a request's state
  after some of its new tokens to be copied into another slot; a prefill segment is run as two calls split there,
  a decode row (or a segment whose end is the point) is copied after its call.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tierlm.backends.base import ForwardBatch, HostStatePool, StateGeometry, host_state_layer_bytes
from tierlm.backends.mlx.state_pool import MLXStatePool
from tierlm.backends.model_source.hybrid_layout import HybridLayout
from tierlm.backends.state_steps import StateStepSplit


class StateCache:
    """What an mlx-lm linear mixer reads and writes of its ArraysCache, for one call (None: zero state)."""

    lengths = None  # no padded rows: every row of a call is real

    def __init__(self, conv: mx.array | None, rec: mx.array | None) -> None:
        self.cache: list[Any] = [conv, rec]

    def __getitem__(self, i: int) -> Any:
        return self.cache[i]

    def __setitem__(self, i: int, value: Any) -> None:
        self.cache[i] = value

    def __bool__(self) -> bool:  # the mixers test `if cache:`
        return True

    def advance(self, n: int) -> None:
        pass


class StepPlan:
    """One step's split of the flat rows, shared by every linear layer: decode rows, prefill segments, and the
    permutation from [decode rows, segments...] back to flat row order."""

    def __init__(self, batch: ForwardBatch) -> None:
        s = StateStepSplit(batch)
        a = lambda v: mx.array(v.astype(np.int32))  # noqa: E731
        self.decode_rows = a(s.decode_rows) if len(s.decode_rows) else None
        self.decode_slots = a(s.decode_slots) if len(s.decode_slots) else None
        self.decode_snap = (a(s.snap_src), a(s.snap_dst)) if len(s.snap_src) else None
        self.prefills = s.prefills
        order = np.concatenate([s.decode_rows] + [np.arange(p[1], p[2]) for p in self.prefills]).astype(np.int64)
        self.in_order = bool((order == np.arange(len(order))).all())
        self.unpermute = None if self.in_order else mx.array(np.argsort(order).astype(np.int32))


class LinearMixer(nn.Module):
    """Wraps one linear mixer: per-request calls of the original module against the state pool."""

    def __init__(self, inner: nn.Module, linear_idx: int, state: "LinearState") -> None:
        super().__init__()
        self.inner = inner
        self._linear_idx = linear_idx
        self._state = state

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        plan, pool, i = self._state.plan, self._state.pool, self._linear_idx
        if plan is None or pool is None:
            raise RuntimeError("hybrid linear layer called outside MLXBackend.forward (no step plan / state pool)")
        flat = x[0]
        pieces = []
        if plan.decode_rows is not None:
            idx = plan.decode_slots
            c = StateCache(pool.conv[i][idx], pool.rec[i][idx])
            pieces.append(self.inner(flat[plan.decode_rows][:, None], mask=None, cache=c)[:, 0])
            pool.conv[i][idx] = c[0]
            pool.rec[i][idx] = c[1]
            if plan.decode_snap is not None:
                src, dst = plan.decode_snap
                pool.conv[i][dst] = pool.conv[i][src]
                pool.rec[i][dst] = pool.rec[i][src]
        for slot, start, end, fresh, at, dst in plan.prefills:
            c = StateCache(None, None) if fresh else \
                StateCache(pool.conv[i][slot:slot + 1], pool.rec[i][slot:slot + 1])
            if 0 < at < end - start:  # a snapshot inside the segment: run it as two calls, keep the state between
                pieces.append(self.inner(flat[start:start + at][None], mask=None, cache=c)[0])
                pool.conv[i][dst:dst + 1] = c[0]
                pool.rec[i][dst:dst + 1] = c[1]
                start, at = start + at, -1
            pieces.append(self.inner(flat[start:end][None], mask=None, cache=c)[0])
            pool.conv[i][slot:slot + 1] = c[0]
            pool.rec[i][slot:slot + 1] = c[1]
            if at > 0:  # the snapshot is the segment's end
                pool.conv[i][dst:dst + 1] = c[0]
                pool.rec[i][dst:dst + 1] = c[1]
        out = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
        return (out if plan.in_order else out[plan.unpermute])[None]


class LinearState:
    """The state side of a hybrid model on MLX: the layout, the pool and the step plan."""

    def __init__(self, layout: HybridLayout, geometry: StateGeometry) -> None:
        self.layout = layout
        self.geometry = geometry
        self.pool: MLXStatePool | None = None
        self.plan: StepPlan | None = None

    def init_pool(self, num_slots: int) -> None:
        self.pool = MLXStatePool(self.geometry, self.layout.kind, num_slots)

    def arrays(self) -> list[mx.array]:
        return self.pool.arrays() if self.pool is not None else []

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot ``src[i]`` -> ``dst[i]``, every linear layer (a snapshot into a live slot); evaluated at once so
        the pool holds no pending graph between steps."""
        s, d = mx.array(np.asarray(src, np.int32)), mx.array(np.asarray(dst, np.int32))
        for i in range(len(self.pool.conv)):
            self.pool.conv[i][d] = self.pool.conv[i][s]
            self.pool.rec[i][d] = self.pool.rec[i][s]
        mx.eval(self.pool.arrays())

    def to_host(self, slots: np.ndarray, host: HostStatePool, host_slots: np.ndarray) -> None:
        """Slots -> host slots in SHARED_STATE_LAYOUT (mlx-lm's conv state is already the last K-1 inputs
        channels-last; a gated DeltaNet recurrent state is transposed back to transformers' [Hv, Dk, Dv])."""
        g, n = self.geometry, len(slots)
        L, cb, rb = g.num_linear_layers, *host_state_layer_bytes(g)
        s = mx.array(np.asarray(slots, np.int32))
        rows = host.data.reshape(host.num_slots, L, cb + rb)
        idx = np.asarray(host_slots, np.int64)
        for i in range(L):
            conv = self.pool.conv[i][s]
            rec = self.pool.rec[i][s]
            if self.layout.kind == "gdn":
                rec = rec.swapaxes(-1, -2)
            rows[idx, i, :cb] = _raw(conv).reshape(n, cb)
            rows[idx, i, cb:] = _raw(rec).reshape(n, rb)

    def from_host(self, host: HostStatePool, host_slots: np.ndarray, slots: np.ndarray) -> None:
        """Host slots -> slots, evaluated at once (as copy_slots)."""
        g, n = self.geometry, len(slots)
        L, cb, rb = g.num_linear_layers, *host_state_layer_bytes(g)
        rows = host.data.reshape(host.num_slots, L, cb + rb)[np.asarray(host_slots, np.int64)]
        d = mx.array(np.asarray(slots, np.int32))
        for i in range(L):
            conv = _from_raw(rows[:, i, :cb], self.pool.conv[i].dtype).reshape(n, g.conv_kernel - 1, g.conv_dim)
            rec = _from_raw(rows[:, i, cb:], self.pool.rec[i].dtype).reshape(n, *g.rec_shape)
            if self.layout.kind == "gdn":
                rec = rec.swapaxes(-1, -2)
            self.pool.conv[i][d] = conv
            self.pool.rec[i][d] = rec
        mx.eval(self.pool.arrays())


_RAW = {mx.float32: (mx.uint32, np.uint32), mx.float16: (mx.uint16, np.uint16), mx.bfloat16: (mx.uint16, np.uint16)}


def _raw(x: mx.array) -> np.ndarray:
    """The little-endian bytes of ``x`` (numpy has no bfloat16: go through an unsigned view)."""
    return np.ascontiguousarray(np.array(x.view(_RAW[x.dtype][0]))).view(np.uint8)


def _from_raw(raw: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(np.ascontiguousarray(raw).view(_RAW[dtype][1])).view(dtype)


def install_linear_state(layers: list, layout: HybridLayout, dtype: str) -> LinearState:
    """Wrap every linear mixer of a loaded hybrid model's layers."""
    geometry = StateGeometry(len(layout.linear_layers), layout.conv_dim, layout.conv_kernel, layout.rec_shape,
                             conv_dtype=dtype)
    state = LinearState(layout, geometry)
    for linear_idx, layer_idx in enumerate(layout.linear_layers):
        layer = layers[layer_idx]
        inner = getattr(layer, layout.mixer_attribute, None)
        if inner is None or not hasattr(inner, "conv1d"):
            raise RuntimeError(f"layer {layer_idx} of this {layout.model_type} model has no linear mixer at "
                               f".{layout.mixer_attribute} (found {type(inner).__name__})")
        setattr(layer, layout.mixer_attribute, LinearMixer(inner, linear_idx, state))
    return state
