"""Run a hybrid model's linear-attention / Mamba2 layers inside tierlm's flat packed step, their state in a pool.

tierlm runs a step as one flat sequence (batch 1, T rows of R requests, ``use_cache=False``), so transformers' own
mixers would see every request glued together and no state. ``install_linear_state`` replaces each linear mixer of
the loaded model with a ``LinearMixer`` that splits the rows per request and calls the *original* module (its
projections, conv, gated delta rule / SSD scan, norms: no model math is copied) with ``SegmentCache``, a duck of
the transformers cache holding that request's conv and recurrent state from ``TorchStatePool``:

- decode rows (one token, continuing a state) go as one ``[G, 1, H]`` call with the states gathered from their
  slots; transformers updates them (the conv state in place) and they are scattered back;
- prefill chunks run one call each (batch 1): from zeros when the chunk starts the request (kv_len == q_len),
  else from its slot. One call per segment avoids padding, which would corrupt a resumed conv state.
- snapshots (prefix reuse, runtime/cache/state_snapshots.py): ``ForwardBatch.snapshot_at/dst`` ask for a request's state
  after some of its new tokens to be copied into another slot; a prefill segment is run as two calls split there,
  a decode row (or a segment whose end is the point) is copied after its call.

Everything else in the decoder is already flat (MLPs, MoE) or paged (attention, paged_attention.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tierlm.backends.base import ForwardBatch, HostStatePool, StateGeometry, host_state_layer_bytes
from tierlm.backends.model_source.hybrid_layout import HybridLayout, hybrid_layout
from tierlm.backends.state_steps import StateStepSplit
from tierlm.backends.torch.state_pool import TorchStatePool


class SegmentCache:
    """What a transformers linear mixer reads and writes of its Cache, for one call. ``conv``/``rec`` None: a fresh
    request (zero state). After the call, ``conv_out``/``rec_out`` are the states to keep."""

    def __init__(self, conv: torch.Tensor | None, rec: torch.Tensor | None) -> None:
        self.conv, self.rec = conv, rec
        self.new_conv: torch.Tensor | None = None
        self.new_rec: torch.Tensor | None = None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.rec

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """transformers 5.25: intermediate states kept for its speculative decoding; tierlm keeps only the last."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers 5.25 counts tokens per state on an in-place decode update; tierlm's scheduler counts them."""

    def update_conv_state(self, x: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int = 0,
                          **kw) -> torch.Tensor:
        """As transformers' LinearAttentionLayer: the previous state followed by ``x`` (zero-padded on the left to
        K when fresh and short); the last K columns are the new state."""
        k = conv_kernel_size
        full = x if self.conv is None else torch.cat([self.conv, x], -1)
        if full.shape[-1] < k:
            full = F.pad(full, (k - full.shape[-1], 0))
        self.new_conv = full[..., -k:]
        return full

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, state_idx: int = 0, **kw) -> torch.Tensor:
        self.new_rec = state
        return state

    @property
    def conv_out(self) -> torch.Tensor:
        # decode updates the gathered conv state in place (causal_conv1d_update) and never calls update_conv_state
        return self.new_conv if self.new_conv is not None else self.conv

    @property
    def rec_out(self) -> torch.Tensor:
        # Mamba2's decode updates the recurrent state in place; the gated delta rule hands back a new one
        return self.new_rec if self.new_rec is not None else self.rec


class StepPlan:
    """One step's split of the flat rows, shared by every linear layer: decode rows and prefill segments."""

    def __init__(self, batch: ForwardBatch, device: torch.device) -> None:
        s = StateStepSplit(batch)
        t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        self.decode_rows = t(s.decode_rows) if len(s.decode_rows) else None
        self.decode_slots = t(s.decode_slots) if len(s.decode_slots) else None
        self.decode_snap = (t(s.snap_src), t(s.snap_dst)) if len(s.snap_src) else None
        self.prefills = s.prefills


class LinearMixer(torch.nn.Module):
    """Wraps one linear mixer: per-request calls of the original module against the state pool."""

    def __init__(self, inner: torch.nn.Module, linear_idx: int, state: "LinearState") -> None:
        super().__init__()
        self.inner = inner
        self.linear_idx = linear_idx
        self.state = state

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        plan, pool = self.state.plan, self.state.pool
        assert plan is not None and pool is not None, "LinearState.begin(batch) and init_pool() first"
        conv_pool, rec_pool = pool.conv[self.linear_idx], pool.rec[self.linear_idx]
        x = hidden_states[0]
        out = torch.empty_like(x)
        if plan.decode_rows is not None:
            idx = plan.decode_slots
            cache = SegmentCache(conv_pool.index_select(0, idx), rec_pool.index_select(0, idx))
            o = self.inner(x.index_select(0, plan.decode_rows)[:, None], cache=cache, attention_mask=None)
            conv_pool.index_copy_(0, idx, cache.conv_out.to(conv_pool.dtype))
            rec_pool.index_copy_(0, idx, cache.rec_out.to(rec_pool.dtype))
            out.index_copy_(0, plan.decode_rows, o[:, 0])
            if plan.decode_snap is not None:
                src, dst = plan.decode_snap
                conv_pool.index_copy_(0, dst, conv_pool.index_select(0, src))
                rec_pool.index_copy_(0, dst, rec_pool.index_select(0, src))
        for slot, start, end, fresh, at, dst in plan.prefills:
            conv, rec = (None, None) if fresh else (conv_pool[slot:slot + 1], rec_pool[slot:slot + 1])
            if 0 < at < end - start:  # a snapshot inside the segment: run it as two calls, keep the state between
                out[start:start + at], conv, rec = self._segment(x[start:start + at], conv, rec)
                conv, rec = conv.to(conv_pool.dtype), rec.to(rec_pool.dtype)
                conv_pool[dst] = conv[0]
                rec_pool[dst] = rec[0]
                start, at = start + at, -1
            out[start:end], conv, rec = self._segment(x[start:end], conv, rec)
            conv_pool[slot] = conv[0]
            rec_pool[slot] = rec[0]
            if at > 0:  # the snapshot is the segment's end
                conv_pool[dst] = conv_pool[slot]
                rec_pool[dst] = rec_pool[slot]
        return out[None]

    def _segment(self, x: torch.Tensor, conv: torch.Tensor | None, rec: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's consecutive rows ``x`` [n, H] from state (conv, rec) (None: zeros): (output, new states)."""
        cache = SegmentCache(conv, rec)
        o = self.inner(x[None], cache=cache, attention_mask=None)[0]
        if cache.conv_out is None or cache.rec_out is None:
            raise RuntimeError(f"{type(self.inner).__name__} did not hand its state to the cache on prefill")
        return o, cache.conv_out, cache.rec_out


class LinearState:
    """The state side of a hybrid model on torch: the layout, the wrapped mixers, the pool and the step plan."""

    def __init__(self, layout: HybridLayout, geometry: StateGeometry, device: torch.device) -> None:
        self.layout = layout
        self.geometry = geometry
        self.device = device
        self.pool: TorchStatePool | None = None
        self.plan: StepPlan | None = None

    def init_pool(self, num_slots: int) -> None:
        self.pool = TorchStatePool(self.geometry, num_slots, self.device)

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot ``src[i]`` -> ``dst[i]``, every linear layer (a snapshot into a live slot)."""
        s = torch.from_numpy(np.asarray(src, np.int64)).to(self.device)
        d = torch.from_numpy(np.asarray(dst, np.int64)).to(self.device)
        self.pool.conv.index_copy_(1, d, self.pool.conv.index_select(1, s))
        self.pool.rec.index_copy_(1, d, self.pool.rec.index_select(1, s))

    def to_host(self, slots: np.ndarray, host: HostStatePool, host_slots: np.ndarray) -> None:
        """Slots -> host slots in SHARED_STATE_LAYOUT: the conv's last K-1 columns channels-last (the oldest column
        never reaches an output: the next update shifts it out), the recurrent state as is (transformers')."""
        g, n = self.geometry, len(slots)
        L, cb, rb = g.num_linear_layers, *host_state_layer_bytes(g)
        s = torch.from_numpy(np.asarray(slots, np.int64)).to(self.device)
        conv = self.pool.conv.index_select(1, s)[..., 1:].transpose(-1, -2).contiguous()  # [L, n, K-1, C]
        rec = self.pool.rec.index_select(1, s).contiguous()
        conv_b = conv.cpu().view(torch.uint8).numpy().reshape(L, n, cb)
        rec_b = rec.cpu().view(torch.uint8).numpy().reshape(L, n, rb)
        rows = host.data.reshape(host.num_slots, L, cb + rb)
        idx = np.asarray(host_slots, np.int64)
        rows[idx, :, :cb] = conv_b.transpose(1, 0, 2)
        rows[idx, :, cb:] = rec_b.transpose(1, 0, 2)

    def from_host(self, host: HostStatePool, host_slots: np.ndarray, slots: np.ndarray) -> None:
        """Host slots -> slots; the conv's oldest column (never read, see to_host) comes back as zeros."""
        g, n = self.geometry, len(slots)
        L, cb, rb = g.num_linear_layers, *host_state_layer_bytes(g)
        rows = host.data.reshape(host.num_slots, L, cb + rb)[np.asarray(host_slots, np.int64)]  # a copy
        conv = torch.from_numpy(np.ascontiguousarray(rows[:, :, :cb])).view(self.pool.conv.dtype)
        conv = conv.view(n, L, g.conv_kernel - 1, g.conv_dim).permute(1, 0, 3, 2)  # [L, n, C, K-1]
        conv = torch.cat([torch.zeros_like(conv[..., :1]), conv], -1).to(self.device)
        rec = torch.from_numpy(np.ascontiguousarray(rows[:, :, cb:])).view(self.pool.rec.dtype)
        rec = rec.view(n, L, *g.rec_shape).transpose(0, 1).to(self.device)
        d = torch.from_numpy(np.asarray(slots, np.int64)).to(self.device)
        self.pool.conv.index_copy_(1, d, conv)
        self.pool.rec.index_copy_(1, d, rec)

    def begin(self, batch: ForwardBatch) -> None:
        """Split this step's rows once for every linear layer."""
        self.plan = StepPlan(batch, self.device)


def install_linear_state(model: torch.nn.Module, config: dict[str, Any], dtype: str, device: torch.device
                         ) -> LinearState | None:
    """Wrap every linear mixer of a loaded hybrid model (None, untouched, for an attention-only model);
    ``config``: the folder's text config (ModelFolder.text_config)."""
    layout = hybrid_layout(config)
    if layout is None:
        return None
    geometry = StateGeometry(len(layout.linear_layers), layout.conv_dim, layout.conv_kernel, layout.rec_shape,
                             conv_dtype=dtype)
    state = LinearState(layout, geometry, device)
    layers = model.model.layers
    for linear_idx, layer_idx in enumerate(layout.linear_layers):
        layer = layers[layer_idx]
        inner = getattr(layer, layout.mixer_attribute, None)
        conv = getattr(inner, "conv1d", None)
        if conv is None or conv.in_channels != layout.conv_dim or conv.kernel_size[0] != layout.conv_kernel:
            raise RuntimeError(
                f"layer {layer_idx} of this {layout.model_type} model is not the linear mixer config.json describes "
                f"(expected {layout.mixer_attribute}.conv1d with {layout.conv_dim} channels, kernel "
                f"{layout.conv_kernel}; found {type(inner).__name__})")
        setattr(layer, layout.mixer_attribute, LinearMixer(inner, linear_idx, state))
    return state
