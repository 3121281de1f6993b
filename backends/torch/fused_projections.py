"""CPU decoder layers with fewer eager ops: q/k/v as one linear, gate/up as one, torch's RMSNorm kernel.

At 1-8 rows a decode step is dominated by fixed per-call costs (docs/performance.md, issue 27): every linear call
and every eager op of transformers' layer glue pays dispatch and a oneDNN/MKL call whatever its size. At load time
(after the weights are in their serving dtype, before cpu/linear.py packs them) ``fuse_projections``:

- concatenates q_proj/k_proj/v_proj into one ``qkv_proj`` and gate_proj/up_proj into one ``gate_up_proj``
  (weights and biases along the output dim; the old modules are dropped, so memory stays the same) and gives the
  attention / MLP module tierlm's forward, which splits the product by views (no copies);
- for llama / qwen2 / mistral rotates q and k in one pass over the [q | k] part of that product (elementwise, so
  the same roundings as transformers' two calls);
- computes the family's RMSNorm as ``weight * F.rms_norm(x, eps)``: one kernel with transformers' math
  (float32 statistics, one rounding to the input dtype, then the weight product in that dtype).

Every change is bit-identical to transformers' modules (each output column of a GEMM is the same dot product
whatever the other columns are; measured with oneDNN-prepacked and plain bf16 and with float32 linears at 1-300
rows; tests/test_fused_projections.py asserts equal logits). F.rms_norm *with* its weight argument is not used:
it multiplies by the weight in float32 before rounding, where transformers rounds first (differs in bf16).

Covered: transformers' own attention, MLP and RMSNorm classes of llama, qwen2, qwen3 and mistral with plain
``nn.Linear`` projections on CPU; the projections in bf16/fp16 only (``FUSED_DTYPES``), the RMSNorm in any dtype.
Everything else keeps transformers' module, with the reason logged: other
families (gpt-oss, hybrids, remote code), quantized or adapted projections (torchao tensor subclasses,
compressed-tensors / int8 / int4 layers, anything with hooks), other devices. The loader fuses before the CPU
weight-only int8 / int4 quantization (model_loader.py), which then quantizes the fused linears: per output row or
group of a row, the same values as the unfused ones. The CPU plan's ``fused_projections=no`` turns it off
(benchmarks compare both).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.backends.torch import paged_attention

log = logging.getLogger(__name__)

# Where one wider product saves time: bf16/fp16 linears (oneDNN, packed or not) pay a fixed cost per call that
# dominates at decode's 1-8 rows. float32 (MKL sgemm) measured 0.87-1.06x fused vs separate on the llama-small and
# Qwen2.5-0.5B shapes (AVX512 EPYC, 1 and 8 rows), so float32 keeps its separate projections.
FUSED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Family:
    attention: str  # transformers' class names in transformers.models.<family>.modeling_<family>
    mlp: str
    norm: str
    window: Callable[[nn.Module], int | None] | None  # the family forward's sliding_window argument (llama: none)
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k before the rotation


_FAMILIES = {
    "llama": _Family("LlamaAttention", "LlamaMLP", "LlamaRMSNorm", None),
    "qwen2": _Family("Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm", lambda m: m.sliding_window),
    "qwen3": _Family("Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm", lambda m: m.sliding_window, qk_norm=True),
    "mistral": _Family("MistralAttention", "MistralMLP", "MistralRMSNorm",
                       lambda m: getattr(m.config, "sliding_window", None)),
}


@dataclass
class FusionReport:
    """What ``fuse_projections`` changed: module counts, linear calls per forward, and why anything was left."""
    attention: int = 0
    mlp: int = 0
    norms: int = 0
    linears_before: int = 0  # linear modules a forward calls (a decode step: once each)
    linears_after: int = 0
    left_unfused: dict[str, str] = field(default_factory=dict)  # module class -> why transformers' forward stays


def _family_of(module: nn.Module) -> tuple[_Family, str] | None:
    """(family, role) when ``module`` is transformers' own class of a covered family (not remote code)."""
    cls = type(module)
    for name, fam in _FAMILIES.items():
        if cls.__module__ != f"transformers.models.{name}.modeling_{name}":
            continue
        for role in ("attention", "mlp", "norm"):
            if cls.__name__ == getattr(fam, role):
                return fam, role
    return None


def _why_not_plain(linears: list[nn.Module]) -> str | None:
    """Why these projections cannot be concatenated (None: they can)."""
    for lin in linears:
        if type(lin) is not nn.Linear:
            return f"projection is {type(lin).__name__}, not a plain nn.Linear (quantized or adapted layers)"
        if type(lin.weight.data) is not torch.Tensor:
            return f"weight is a {type(lin.weight.data).__name__} (a quantized tensor)"
        if lin._forward_hooks or lin._forward_pre_hooks:
            return "projection has forward hooks (an adapter)"
    w0 = linears[0].weight
    if w0.device.type != "cpu":
        return f"weights on {w0.device.type}: fused projections are a CPU path"
    if w0.dtype not in FUSED_DTYPES:
        return f"{str(w0.dtype).removeprefix('torch.')} weights: MKL's GEMM gains nothing from one wider product there"
    if any(lin.weight.dtype != w0.dtype or lin.in_features != linears[0].in_features for lin in linears):
        return "projections differ in dtype or input width"
    if len({lin.bias is None for lin in linears}) > 1:
        return "some projections have a bias and some do not"
    return None


def _concat(linears: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([lin.weight.detach() for lin in linears])
    b = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta", dtype=w.dtype)
    fused.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        fused.bias = nn.Parameter(b, requires_grad=False)
    return fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half (llama, qwen2, mistral share it)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class FusedQKVAttention(nn.Module):
    """transformers' attention forward (llama/qwen2/qwen3/mistral) over one q|k|v product, split by views.

    Mixed in front of the family's class (``isinstance`` with it still holds); the family's rotary function,
    eager attention and sliding window come from class attributes set in ``_fused_class``."""
    _qkv_sizes: tuple[int, int, int]
    _family: _Family
    _apply_rope: Callable
    _eager_attention: Callable
    takes_out_rows = True  # last_layer_rows.py: the queries of these rows only

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                out_rows: torch.Tensor | None = None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if cache is None:  # transformers' deprecated name for it
            cache = kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        qkv = self.qkv_proj(hidden_states)
        nq, nk, nv = self._qkv_sizes
        cos, sin = position_embeddings
        value_states = qkv[..., nq + nk:].view(hidden_shape).transpose(1, 2)
        if self._family.qk_norm or cos.shape[-1] != self.head_dim:
            query_states, key_states = qkv[..., :nq], qkv[..., nq:nq + nk]
            query_states, key_states = query_states.view(hidden_shape), key_states.view(hidden_shape)
            if self._family.qk_norm:
                query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
            query_states, key_states = self._apply_rope(query_states.transpose(1, 2), key_states.transpose(1, 2),
                                                        cos, sin)
        else:  # q and k heads rotated in one pass: the same elementwise ops as transformers' two calls
            qk = qkv[..., :nq + nk].view(hidden_shape).transpose(1, 2)  # [B, Hq + Hkv, T, D]
            qk = qk * cos.unsqueeze(1) + _rotate_half(qk) * sin.unsqueeze(1)
            heads = nq // self.head_dim
            query_states, key_states = qk[:, :heads], qk[:, heads:]
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    self._eager_attention)
        if self._family.window is not None:
            kwargs["sliding_window"] = self._family.window(self)
        rows_inside = out_rows is not None and self.config._attn_implementation == paged_attention.ATTN_IMPLEMENTATION
        if rows_inside:  # every row's K/V written, these rows' queries attended
            kwargs["out_rows"] = out_rows
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
        if out_rows is None:
            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        else:  # [1, R, H, D] -> [1, R, H * D], R may be 0 (a chunk whose rows nobody reads)
            if not rows_inside:
                attn_output = attn_output.index_select(1, out_rows)
            attn_output = attn_output.flatten(2).contiguous()
        return self.o_proj(attn_output), attn_weights


class FusedGateUpMLP(nn.Module):
    """down(act(gate) * up) over one gate|up product. Eager: SiLU and the product in place on it (no new tensors).
    Compiled: out of place, the same bf16 roundings. In place, inductor wrote SiLU back into the whole gate|up
    buffer under a column mask and multiplied in a second pass; out of place it is one loop over the gate half
    (Qwen2.5-0.5B shape, 8 streams, alternated in process: 59.9 -> 58.0 ms a step)."""
    _intermediate: int
    _silu: bool  # act_fn is SiLU (transformers' SiLUActivation or nn.SiLU): elementwise F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self._intermediate, dim=-1)
        if self._silu and torch.compiler.is_compiling():
            h = F.silu(gate) * up
        elif self._silu:
            h = F.silu(gate, inplace=True).mul_(up)
        else:
            h = self.act_fn(gate) * up
        return self.down_proj(h)


class FusedRMSNorm(nn.Module):
    """transformers' RMSNorm in one kernel: F.rms_norm without a weight computes in float32 and rounds once to the
    input dtype, as transformers does; the weight product then runs in that dtype, as transformers' does."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(hidden_states, (hidden_states.shape[-1],), None, self.variance_epsilon)


_CLASSES: dict[tuple[type, type], type] = {}


def _fused_class(cls: type, mixin: type, **attrs) -> type:
    """``cls`` with ``mixin``'s forward in front (one class per pair, made once)."""
    key = (cls, mixin)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"TierlmFused{cls.__name__}", (mixin, cls), dict(attrs))
    return _CLASSES[key]


def _fuse_attention(m: nn.Module, fam: _Family) -> str | None:
    projs = [m.q_proj, m.k_proj, m.v_proj]
    why = _why_not_plain(projs)
    if why:
        return why
    if fam.qk_norm and not (hasattr(m, "q_norm") and hasattr(m, "k_norm")):
        return "no q_norm/k_norm on a family that has them"
    family_module = sys.modules[type(m).__module__]
    m.qkv_proj = _concat(projs)
    for name in ("q_proj", "k_proj", "v_proj"):
        delattr(m, name)
    m._qkv_sizes = tuple(p.out_features for p in projs)
    m.__class__ = _fused_class(type(m), FusedQKVAttention, _family=fam,
                               _apply_rope=staticmethod(family_module.apply_rotary_pos_emb),
                               _eager_attention=staticmethod(family_module.eager_attention_forward))
    return None


def _fuse_mlp(m: nn.Module) -> str | None:
    why = _why_not_plain([m.gate_proj, m.up_proj]) or _why_not_plain([m.down_proj])
    if why:
        return why
    if m.gate_proj.out_features != m.up_proj.out_features:
        return "gate and up projections differ in width"
    m.gate_up_proj = _concat([m.gate_proj, m.up_proj])
    m._intermediate = m.gate_proj.out_features
    m._silu = type(m.act_fn).__name__ == "SiLUActivation" or isinstance(m.act_fn, nn.SiLU)
    del m.gate_proj, m.up_proj
    m.__class__ = _fused_class(type(m), FusedGateUpMLP)
    return None


def _linear_calls(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) or "Linear" in type(m).__name__ for m in model.modules())


def fuse_projections(model: nn.Module) -> FusionReport:
    """Give the covered attention / MLP / RMSNorm modules of ``model`` their fused forms (module docstring);
    returns what changed. Call after the weights are in their serving dtype and on their device, before
    cpu/linear.pack_linears or the CPU weight-only quantization (which then pack or quantize the fused weights);
    layers that are already quantized keep transformers' forward."""
    report = FusionReport(linears_before=_linear_calls(model))
    for m in list(model.modules()):
        found = _family_of(m)
        cls = type(m).__name__
        if found is None:
            looks_fusable = all(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj")) or \
                all(hasattr(m, n) for n in ("gate_proj", "up_proj"))
            if looks_fusable and not isinstance(m, (FusedQKVAttention, FusedGateUpMLP)):
                report.left_unfused.setdefault(cls, "not a module class tierlm's fused forward covers "
                                                    f"(transformers' {', '.join(_FAMILIES)})")
            continue
        fam, role = found
        if role == "norm":
            if hasattr(m, "variance_epsilon") and m.weight.device.type == "cpu":
                m.__class__ = _fused_class(type(m), FusedRMSNorm)
                report.norms += 1
            continue
        why = _fuse_attention(m, fam) if role == "attention" else _fuse_mlp(m)
        if why:
            report.left_unfused.setdefault(cls, why)
        elif role == "attention":
            report.attention += 1
        else:
            report.mlp += 1
    report.linears_after = _linear_calls(model)
    if report.attention or report.mlp:
        log.info("CPU decoder layers: q/k/v fused in %d attention modules, gate/up in %d MLPs, %d RMSNorms on "
                 "torch's kernel: %d linear calls per forward instead of %d", report.attention, report.mlp,
                 report.norms, report.linears_after, report.linears_before)
    for cls, why in report.left_unfused.items():
        log.info("CPU decoder layers: %s keeps transformers' forward: %s", cls, why)
    return report
