"""mlx-lm glue for the hybrid families (backends/model_source/hybrid_layout.py): what makes mlx-lm build them
from a transformers folder and match transformers, and where each model keeps its body, layers and head.

- ``qwen3_5_text`` has no mlx-lm module: ``mlx_lm.models.qwen3_5`` takes the flat text config.
- mlx-lm's Qwen3.5 / Qwen3-Next place attention every ``full_attention_interval`` layers; transformers lists
  ``layer_types``, so the interval is derived and a pattern that is not periodic is refused.
- ``rope_theta`` / ``partial_rotary_factor`` are lifted out of transformers 5's ``rope_parameters``.
- Granite-4.0-H: ``layer_types`` back to mamba/attention, ``position_embedding_type`` None is *no RoPE* ("nope";
  mlx-lm would apply RoPE), ``time_step_limit``'s JSON infinity becomes a float; its head divides by
  ``logits_scaling`` (the backend runs the head itself).
- Nemotron-H keeps its body in ``model.backbone`` with ``embeddings``.
"""
from __future__ import annotations

from typing import Any

import mlx.nn as nn

from tierlm.backends.model_source.hybrid_layout import ATTENTION, LINEAR, HybridLayout

GDN_TYPES = ("qwen3_5_text", "qwen3_next")


def hybrid_overrides(config: dict[str, Any], layout: HybridLayout | None) -> dict[str, Any]:
    """Config keys to override before mlx-lm builds a hybrid model ({} for any other model)."""
    if layout is None:
        return {}
    out: dict[str, Any] = {}
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in config and key in rope:
            out[key] = rope[key]
    if layout.model_type in GDN_TYPES:
        out["full_attention_interval"] = _full_attention_interval(layout)
    elif layout.model_type == "granitemoehybrid":
        out["layer_types"] = [{LINEAR: "mamba", ATTENTION: "attention"}[t] for t in layout.layer_types]
        out["position_embedding_type"] = "rope" if config.get("position_embedding_type") == "rope" else "nope"
        limit = config.get("time_step_limit") or [0.0, float("inf")]
        out["time_step_limit"] = tuple(float("inf") if isinstance(v, dict) else float(v) for v in limit)
    return out


def _full_attention_interval(layout: HybridLayout) -> int:
    kv = layout.kv_layers
    if not kv:
        raise ValueError(f"{layout.model_type}: no full-attention layer in layer_types")
    interval = kv[0] + 1
    periodic = tuple(ATTENTION if (i + 1) % interval == 0 else LINEAR for i in range(len(layout.layer_types)))
    if periodic != layout.layer_types:
        raise ValueError(f"{layout.model_type}: mlx-lm places full attention every N layers, but layer_types "
                         f"{list(layout.layer_types)} is not periodic; serve this model on the torch backend")
    return interval


def hybrid_model_classes(config: dict[str, Any]) -> tuple[type, type] | None:
    """(Model, ModelArgs) where mlx-lm's own lookup by model_type has none."""
    if config.get("model_type") == "qwen3_5_text":
        from mlx_lm.models import qwen3_5

        return qwen3_5.Model, qwen3_5.ModelArgs
    return None


class ModelParts:
    """Where an mlx-lm model keeps the pieces MLXBackend runs: the body (embeddings .. final norm), its layers,
    the head and the embeddings (tied heads)."""

    def __init__(self, model: nn.Module) -> None:
        self.body = model.backbone if hasattr(model, "backbone") else model.model
        self.layers = self.body.layers
        self.embed = getattr(self.body, "embed_tokens", None)
        if self.embed is None:
            self.embed = getattr(self.body, "embeddings", None)
        owner = getattr(model, "language_model", model)  # qwen3_5 wraps its text model
        self.lm_head = getattr(owner, "lm_head", None)
        self.logits_scaling = float(getattr(model, "logits_scaling", 1.0) or 1.0)
        if self.embed is None:
            raise NotImplementedError(f"{type(model).__module__}.Model has no embeddings the mlx backend can find")

    def head(self, hidden):
        logits = self.lm_head(hidden) if self.lm_head is not None else self.embed.as_linear(hidden)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits


def attention_attributes(layout: HybridLayout | None, num_layers: int) -> dict[int, str]:
    """Layer index -> attribute of its attention module (all ``self_attn`` for attention-only models)."""
    if layout is None:
        return {i: "self_attn" for i in range(num_layers)}
    attr = "mixer" if layout.model_type == "nemotron_h" else "self_attn"
    return {i: attr for i in layout.kv_layers}
