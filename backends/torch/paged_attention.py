"""tierlm's attention for transformers models: K/V live in the paged pool, queries of a whole step are flat.

The model runs on one flattened sequence (batch 1, T tokens from R requests). transformers calls
``paged_attention`` once per layer; it writes the layer's new K/V into the pool and attends each request's
queries over that request's pages. The index tensors (slots, gathers, masks) are built once per step in
``StepMeta`` and shared by every layer. Requests are split in two groups so padding stays small: decode
tokens (one query each) and extend chunks (many queries each); each group is one batched SDPA call.

Per layer, transformers passes ``sliding_window`` (sliding layers of mistral, qwen2, gpt-oss: a query at p sees
keys at p-window+1..p, transformers' ``sliding_window_overlay``) and, for gpt-oss, ``s_aux`` (attention sinks:
one learned logit per head that joins the softmax and carries no value). The pool keeps every layer's K/V for
all positions, so a sliding layer always finds its window, whatever position a cached prefix ends at.

On CPU the groups' kernels read the pages in place where the model's CPU plan has them (``CURRENT.kernels``,
cpu/plan.py): decode rows through cpu/paged_decode.py's C kernel, extend groups of a few rows per request through
cpu/paged_extend.py's (bf16: AMX tiles, or AVX-512 where the blocked path runs; float32: AVX2 / AVX-512 code), bf16
prefill through cpu/blocked_attention.py.

``--attention-backend``: this file's SDPA over gathered pages is ``torch_native`` (the reference); with
``triton`` the same two groups go to the kernels of ``triton_attention.py``, which read the pages in place
(StepMeta then builds per-request lengths and page-table rows instead of masks and gathers).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tierlm.backends.torch import ops
from tierlm.backends.torch.cpu import blocked_attention, decode_step, paged_decode, paged_extend

ATTN_IMPLEMENTATION = "tierlm_paged"
# --attention-backend values of the torch backend: "torch_native" (this file: SDPA over gathered pages, the
# reference) and "triton" (triton_attention.py: kernels that read pages in place through the page table).
TORCH_NATIVE, TRITON = "torch_native", "triton"


@dataclass
class _TritonGroup:
    """One kernel launch's requests: decode (q_len 1) or extend (q_len >= 1), per-request int32 tensors."""
    decode: bool
    q_start: torch.Tensor  # [n] first flat row of each request's queries
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor  # [n, P]
    max_q_len: int
    max_kv_len: int


@dataclass
class _Group:
    rows_flat: torch.Tensor  # [G*Q] flat token rows of the group's queries (padded rows point at row 0)
    rows_np: np.ndarray
    valid_idx: torch.Tensor  # [n] positions in rows_flat that are real queries
    dst_rows: torch.Tensor  # [n] rows_flat[valid_idx]: where the outputs go
    all_valid: bool
    G: int
    Q: int
    L: int  # keys per request: whole pages, L = pages * page_size
    row_valid: torch.Tensor  # [G, Q] bool
    q_pos: torch.Tensor  # [G, Q] absolute positions of the queries
    kv_pages: torch.Tensor  # [G*P] pool pages holding positions 0..L-1 (padded with page 0, masked)
    kv_pos: torch.Tensor  # [L] 0..L-1
    window_masks: dict  # sliding window -> mask, built on first use
    page_rows: torch.Tensor  # [G, P] int32: each request's pages (cpu/paged_decode.py reads the pool through them)
    kv_lens: torch.Tensor  # [G] int32
    row_limits: np.ndarray  # [G, Q] int32: keys each query row sees (the mask's per-row length; padded rows: 1)
    max_kv_len: int  # kv_lens' maximum
    kv_page_run: slice | None = None  # kv_pages as one ascending run of pool pages: read as a view, no gather
    q_starts: torch.Tensor | None = None  # [G] int32: each request's first flat row (cpu/paged_extend.py)
    q_lens: torch.Tensor | None = None  # [G] int32

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[G, 1, Q, L] bool, causal and length-bounded; padded query rows always see position 0, so softmax never
        sees an all-masked row. Built on first use: a fresh prefill (SDPA's causal flag) and the blocked path
        (per-row limits) never read it, and at 2016 tokens it is 4M elements."""
        kv_pos = self.kv_pos
        m = (kv_pos[None, None, :] <= self.q_pos[:, :, None]) & (kv_pos[None, :] < self.kv_lens[:, None])[:, None, :]
        m |= (~self.row_valid)[:, :, None] & (kv_pos == 0)[None, None, :]
        return m[:, None]


class StepMeta:
    """Per-step index tensors for the pool writes and the two attention groups."""

    def __init__(self, q_lens: np.ndarray, kv_lens: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
                 page_size: int, device: torch.device, attention_backend: str = TORCH_NATIVE) -> None:
        self.device = device
        self.page_size = page_size
        self.attention_backend = attention_backend
        self.decode_step = False  # cpu/decode_step.DecodeStep | None once the first layer has asked
        # decode-only steps: (page rows [R, P] int32, kv_lens [R] int32, their max), what the one-call step reads
        self.decode_rows: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._groups: list[_Group] | None = None
        self.triton_groups: list[_TritonGroup] = []
        req_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        slots = page_table[req_of_token, positions // page_size].astype(np.int64) * page_size + positions % page_size
        self.slot_mapping = torch.from_numpy(slots).to(device)
        decode = q_lens == 1
        if attention_backend != TRITON and device.type == "cpu" and bool(decode.all()):
            # One query per request, rows in request order: the page rows now, the general path's group (~15
            # index tensors, ~100 us) only if a layer asks for it (cpu/decode_step.py serves most).
            self.single_fresh_prefill, self.identity_rows = False, True
            max_kv = int(kv_lens.max())
            pages = -(-max_kv // page_size)
            self.decode_rows = (torch.from_numpy(np.ascontiguousarray(page_table[:, :pages], np.int32)).to(device),
                                torch.from_numpy(np.ascontiguousarray(kv_lens, np.int32)).to(device), max_kv)
            self._lazy_decode = (q_lens, kv_lens, page_table)
            return
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)
        # A step that is one fresh prefill (no cached prefix) can attend over its own K/V directly.
        self.single_fresh_prefill = len(q_lens) == 1 and int(q_lens[0]) == int(kv_lens[0]) and q_lens[0] > 1
        self.groups = []
        if attention_backend == TRITON:  # no masks, no page gathers: per-request lengths and page-table rows
            for is_decode, sel in ((True, np.nonzero(decode)[0]), (False, np.nonzero(~decode)[0])):
                if len(sel):
                    self.triton_groups.append(self._triton_group(is_decode, sel, q_lens, kv_lens, starts, page_table))
            self.identity_rows = False
            return
        for sel in (np.nonzero(decode)[0], np.nonzero(~decode)[0]):
            if len(sel):
                self.groups.append(self._group(sel, q_lens, kv_lens, starts, page_table, page_size))
        # One group whose queries are exactly rows 0..T-1 in order (a pure decode step, or one prefill chunk):
        # queries and outputs need no gather/scatter.
        g0 = self.groups[0]
        self.identity_rows = len(self.groups) == 1 and g0.all_valid and g0.G * g0.Q == len(positions) and \
            bool((g0.rows_np == np.arange(len(positions))).all())

    @property
    def groups(self) -> list[_Group]:
        """The attention groups (decode rows, extend rows); a decode-only step builds its one group on first use."""
        if self._groups is None:
            q_lens, kv_lens, page_table = self._lazy_decode
            starts = np.arange(len(q_lens), dtype=np.int64)
            self._groups = [self._group(starts, q_lens, kv_lens, starts, page_table, self.page_size)]
        return self._groups

    @groups.setter
    def groups(self, value: list[_Group]) -> None:
        self._groups = value

    @classmethod
    def from_static_decode(cls, slot_mapping: torch.Tensor, group: _TritonGroup, page_size: int,
                           device: torch.device) -> "StepMeta":
        """A decode step's metadata made of tensors that live across steps (decode_graphs.py: a captured CUDA
        graph reads them at the same addresses every replay); Triton attention only."""
        meta = cls.__new__(cls)
        meta.device, meta.page_size, meta.attention_backend = device, page_size, TRITON
        meta.slot_mapping = slot_mapping
        meta.single_fresh_prefill, meta.identity_rows = False, False
        meta.decode_step, meta.decode_rows = None, None
        meta.groups, meta.triton_groups = [], [group]
        return meta

    def _triton_group(self, is_decode, sel, q_lens, kv_lens, starts, page_table) -> _TritonGroup:
        kl = kv_lens[sel]
        P = max(1, -(-int(kl.max()) // self.page_size))
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(self.device)  # noqa: E731
        return _TritonGroup(is_decode, t(starts[sel]), t(q_lens[sel]), t(kl), t(page_table[sel][:, :P]),
                            int(q_lens[sel].max()), int(kl.max()))

    def _group(self, sel, q_lens, kv_lens, starts, page_table, page_size) -> _Group:
        ql, kl, st = q_lens[sel], kv_lens[sel], starts[sel]
        G, Q = len(sel), int(ql.max())
        P = -(-int(kl.max()) // page_size)
        L = P * page_size
        qi = np.arange(Q)
        row_valid = qi[None, :] < ql[:, None]
        rows = np.where(row_valid, st[:, None] + qi[None, :], 0).reshape(-1)
        valid_idx = np.nonzero(row_valid.reshape(-1))[0]
        q_pos = (kl - ql)[:, None] + qi[None, :]
        kv_pos = np.arange(L)
        # Gather whole pages (one contiguous block each): much cheaper than gathering token slots.
        kv_pages = np.where(np.arange(P)[None, :] < -(-kl[:, None] // page_size), page_table[sel][:, :P], 0)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        flat = kv_pages.reshape(-1)
        # One request whose pages lie in one ascending run (the allocator hands them out so; a long-lived server's
        # free list can break it): its K/V are a slice of the pool, where a gather copies all of them once per layer
        # (2.4 ms of a 16-token extend over 2000 cached llama-small tokens).
        run = slice(int(flat[0]), int(flat[0]) + P) if G == 1 and bool((np.diff(flat) == 1).all()) else None
        return _Group(t(rows), rows, t(valid_idx), t(rows[valid_idx]), bool(row_valid.all()), G, Q, L, t(row_valid),
                      t(q_pos), t(flat.astype(np.int64)), t(kv_pos), {},
                      t(page_table[sel][:, :P].astype(np.int32)), t(kl.astype(np.int32)),
                      np.where(row_valid, q_pos + 1, 1).astype(np.int32), int(kl.max()), run,
                      t(st.astype(np.int32)), t(ql.astype(np.int32)))

    @staticmethod
    def window_mask(g: _Group, window: int) -> torch.Tensor:
        m = g.window_masks.get(window)
        if m is None:
            in_window = g.kv_pos[None, None, :] > (g.q_pos[:, :, None] - window)
            m = g.mask & in_window[:, None]
            m |= (~g.row_valid)[:, None, :, None] & (g.kv_pos == 0)[None, None, None, :]
            g.window_masks[window] = m
        return m


class _Current(threading.local):
    meta: StepMeta | None = None
    pool = None
    kernels = None  # the model's CpuKernels (cpu/plan.py) on CPU: which C kernels its steps run; None: torch's


CURRENT = _Current()


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                    s_aux: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D].

    ``s_aux`` [H]: attention sinks (gpt-oss), see ``attend``. ``out_rows`` [R] (last_layer_rows.py): every row's
    K/V are written, the output is [1, R, H, D], these rows' attention only.
    """
    if torch.compiler.is_compiling():  # a compiled step: the graph records one opaque op (ops.py)
        return ops.attention(module, query, key, value, scaling, sliding_window, s_aux), None
    out, only_read_rows = _attend(module, query, key, value, scaling, sliding_window, s_aux, out_rows)
    if out_rows is not None and not only_read_rows:
        out = out.index_select(1, out_rows)
    return out, None


def _attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
            sliding_window: int | None, s_aux: torch.Tensor | None,
            out_rows: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """(output [1, rows, H, D], whether those rows are only ``out_rows``): every row, except in a fresh prefill's
    blocked attention, which computes the read rows alone."""
    layer = module.layer_idx
    if sliding_window is None and s_aux is None:
        out = decode_step_attention(layer, query, key, value, scaling)
        if out is not None:
            return out, False
    meta, pool, kernels = CURRENT.meta, CURRENT.pool, CURRENT.kernels
    if meta is None:
        raise RuntimeError("tierlm paged attention called outside a tierlm forward step")
    k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1)
    pool.write(layer, meta.slot_mapping, k_new, v_new)

    q = query[0]  # [H, T, D]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    if meta.single_fresh_prefill and sliding_window is None and s_aux is None:
        # K/V as the pool holds them (fp8 / bf16 pages round them): a later hit on these pages reads the same.
        key, value = pool.as_stored(key), pool.as_stored(value)
        lib = kernels.blocked if kernels is not None else None
        if blocked_attention.usable(lib, q, key):
            if out_rows is None:
                limits = blocked_attention.causal_limits(q.shape[1])
            else:  # row i sees keys 0..i: only the read rows' queries
                q, limits = q.index_select(1, out_rows), (out_rows.numpy() + 1).astype(np.int32)[None, :]
            out = blocked_attention.blocked_attention(lib, q[None], key, value, limits, scaling,
                                                      kernels.plan.prefill_attention.value == "one_pass")
            return out.transpose(1, 2), out_rows is not None
        out = F.scaled_dot_product_attention(q[None], key, value, is_causal=True, scale=scaling,
                                             enable_gqa=q.shape[0] != key.shape[1])
        return out.transpose(1, 2), False

    H, D = q.shape[0], q.shape[2]
    out = torch.empty((q.shape[1], H, D), dtype=q.dtype, device=q.device)  # [T, H, D]
    if meta.attention_backend == TRITON:
        _triton_groups(meta, pool, layer, q.transpose(0, 1), out, scaling, sliding_window, s_aux)
        return out[None], False
    k_pages, v_pages = pool.k_pages[layer], pool.v_pages[layer]  # [pages, page_size, Hkv, D]
    extend_lib = kernels.extend if kernels is not None else None
    extend_kernel = kernels.plan.extend_kernel.value if extend_lib is not None else "none"
    decode_lib = kernels.decode if kernels is not None else None
    blocked_lib = kernels.blocked if kernels is not None else None
    for g in meta.groups:
        if g.Q > 1 and s_aux is None and sliding_window is None and \
                paged_extend.runs(extend_kernel, q, pool.kv_dtype, k_pages.shape[2], g.Q):
            # a few rows per request over cached pages, read in place: the outputs land in their rows of ``out``
            paged_extend.paged_extend(extend_lib, extend_kernel, q.transpose(0, 1), pool.k[layer], pool.v[layer],
                                      g.page_rows, g.kv_lens, g.q_starts, g.q_lens, pool.page_size, scaling,
                                      g.max_kv_len, out)
            continue
        qg = q if meta.identity_rows else q.index_select(1, g.rows_flat)
        qg = qg.view(H, g.G, g.Q, D).transpose(0, 1)  # [G, H, Q, D]
        if g.Q == 1 and s_aux is None and sliding_window is None and decode_lib is not None and \
                q.device.type == "cpu" and paged_decode.supported(q.dtype, pool.kv_dtype, H, k_pages.shape[2], D):
            # bf16/float32 decode reading the pages in place (no gathers, no copies), transformers' numerics
            og = paged_decode.paged_decode(decode_lib, qg[:, :, 0], pool.k[layer], pool.v[layer], g.page_rows,
                                           g.kv_lens, pool.page_size, scaling, g.max_kv_len)[:, :, None]
        else:
            if g.kv_page_run is not None:
                kg = pool.dequantize(k_pages[g.kv_page_run], q.dtype)
                vg = pool.dequantize(v_pages[g.kv_page_run], q.dtype)
            else:
                kg = pool.dequantize(k_pages.index_select(0, g.kv_pages), q.dtype)
                vg = pool.dequantize(v_pages.index_select(0, g.kv_pages), q.dtype)
            kg = kg.view(g.G, g.L, -1, D).transpose(1, 2)  # [G, Hkv, L, D]
            vg = vg.view(g.G, g.L, -1, D).transpose(1, 2)
            mask = g.mask if sliding_window is None else StepMeta.window_mask(g, sliding_window)
            if g.Q == 1 and s_aux is None and q.dtype in _EAGER_DECODE_DTYPES and q.device.type == "cpu":
                og = attend_decode_eager(qg, kg, vg, mask, scaling)
            elif s_aux is None and sliding_window is None and blocked_attention.usable(blocked_lib, qg, kg):
                og = blocked_attention.blocked_attention(blocked_lib, qg, kg, vg, g.row_limits, scaling,
                                                         kernels.plan.prefill_attention.value == "one_pass")
            else:
                og = attend(qg, kg, vg, mask, scaling, s_aux)  # [G, H, Q, D]
        og = og.transpose(1, 2).reshape(g.G * g.Q, H, D)
        if meta.identity_rows:
            return og[None], False
        if g.all_valid:
            out.index_copy_(0, g.rows_flat, og)
        else:
            out.index_copy_(0, g.dst_rows, og.index_select(0, g.valid_idx))
    return out[None], False


def decode_step_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          scaling: float | None) -> torch.Tensor | None:
    """A decode-only CPU step's layer in one C call (cpu/decode_step.py): the new K/V stored, [1, R, H, D]
    returned; None when the step or this layer's tensors take the general path. No window, no sinks: the caller."""
    meta = CURRENT.meta
    if meta is None:
        return None
    step = meta.decode_step
    if step is False:  # not looked at yet: decided on the step's first layer
        kernels = CURRENT.kernels
        step = meta.decode_step = decode_step.plan(meta, CURRENT.pool, query,
                                                   kernels.decode if kernels is not None else None)
    if step is None or not step.fits(query, key, value):
        return None
    return step.run(layer, query, key, value, query.shape[-1] ** -0.5 if scaling is None else scaling)


_ta = None  # backends/torch/triton_attention.py, once imported


def _triton_groups(meta: StepMeta, pool, layer: int, q: torch.Tensor, out: torch.Tensor, scale: float,
                   sliding_window: int | None, sinks: torch.Tensor | None) -> None:
    """One Triton launch per group over the pool's pages in place: q [T, H, D] (a view), out [T, H, D]."""
    global _ta
    if _ta is None:  # imported on first use: triton is optional, and torch_native never needs it
        from tierlm.backends.torch import triton_attention
        _ta = triton_attention
    ta = _ta
    k, v = pool.k[layer], pool.v[layer]  # [slots, Hkv, D] as stored
    if q.stride(-1) != 1:
        q = q.contiguous()
    if sinks is not None:
        sinks = sinks.contiguous()
    for g in meta.triton_groups:
        if g.decode:
            ta.decode(q, k, v, out, g.q_start, g.kv_lens, g.page_table, meta.page_size, g.max_kv_len, scale,
                      pool.kv_dtype, sliding_window, sinks)
        else:
            ta.extend(q, k, v, out, g.q_start, g.q_lens, g.kv_lens, g.page_table, meta.page_size, g.max_q_len,
                      scale, pool.kv_dtype, sliding_window, sinks)


# CPU decode in half precision: torch's fused SDPA kernels run one-query bf16/fp16 attention ~10x slower than
# two matmuls and a softmax (measured on AVX512-BF16 at 144 and 2032 keys), so decode rows take transformers'
# eager math instead; float32 keeps SDPA (the reference tests' numbers).
_EAGER_DECODE_DTYPES = (torch.bfloat16, torch.float16)


def attend_decode_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """One query per request, as transformers' eager attention computes it: q [G, H, 1, D], k/v [G, Hkv, L, D],
    mask [G, 1, 1, L] -> [G, H, 1, D]. Scores in the model's dtype, softmax in float32. GQA without repeating
    K/V: the H/Hkv query heads of one KV head become that head's query rows."""
    G, H, _, D = q.shape
    Hkv = k.shape[1]
    scores = torch.matmul(q.reshape(G, Hkv, H // Hkv, D), k.transpose(-1, -2)) * scale  # [G, Hkv, H/Hkv, L]
    scores = scores.masked_fill(~mask, float("-inf"))  # mask broadcasts over KV heads and their query rows
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).view(G, H, 1, D)


# Extra q/k features that carry the sink shift; 8 keeps the head dim a multiple of 8 for fused SDPA kernels.
_SINK_FEATURES = 8


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over q [G, H, Q, D], k/v [G, Hkv, L, D] with a bool mask [G, 1, Q, L]; optional sinks [H].

    With sinks, each head's softmax also runs over one extra logit ``sinks[h]`` whose value is zero (transformers'
    eager gpt-oss attention: softmax over [scores, sink], sink column dropped). SDPA takes one mask for all heads,
    so the per-head constant goes into the dot product instead: every real key gets an extra feature 1 and the
    query gets ``-sinks[h] / scale`` there, shifting head h's real logits by ``-sinks[h]``; a zero key (logit 0,
    value 0) is appended. Softmax is shift-invariant, so exp(s_i - sink) / (sum_j exp(s_j - sink) + exp(0)) equals
    exp(s_i) / (sum_j exp(s_j) + exp(sink)): the eager result, in one fused SDPA call without a per-head mask.
    """
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    G, H, Q, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    q_extra = q.new_zeros((G, H, Q, _SINK_FEATURES))
    q_extra[..., 0] = (-sinks.to(q.dtype) / scale)[None, :, None]
    k_extra = k.new_zeros((G, Hkv, L, _SINK_FEATURES))
    k_extra[..., 0] = 1
    q_aug = torch.cat([q, q_extra], dim=-1)
    k_aug = F.pad(torch.cat([k, k_extra], dim=-1), (0, 0, 0, 1))  # + the all-zero sink key at position L
    v_aug = F.pad(v, (0, _SINK_FEATURES, 0, 1))  # same head dim as q/k (fused kernels want it); sink value 0
    mask_aug = F.pad(mask, (0, 1), value=True)  # every query sees the sink
    out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, attn_mask=mask_aug, scale=scale, enable_gqa=gqa)
    return out[..., :D]


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


class _Layer:
    """What paged_attention reads of transformers' attention module."""

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


def _python_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
               sliding_window: int, s_aux: torch.Tensor | None) -> torch.Tensor:
    """``tierlm::paged_attention``: ``paged_attention`` as one opaque op of a compiled step; it writes this layer's
    K/V into the pool (state outside the graph, reached through ``CURRENT``) and returns [1, T, H, D]."""
    out, _ = paged_attention(_Layer(layer), query, key, value, None, scaling=scaling,
                             sliding_window=sliding_window or None, s_aux=s_aux)
    return out.contiguous()


ops.implement("paged_attention", _python_op,
              lambda query, key, value, layer, scaling, sliding_window, s_aux:
              query.new_empty((1, query.shape[2], query.shape[1], query.shape[3])))
