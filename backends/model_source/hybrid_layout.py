"""Which layers of a hybrid model keep a recurrent state, and the shape of that state, from config.json alone.

Hybrids (Qwen3.5 / Qwen3-Next gated DeltaNet, Granite-4.0-H / Nemotron-H Mamba2) have linear-attention or Mamba
layers next to attention layers. Each linear layer keeps, per request, a conv state (the last inputs of its causal
conv1d, ``[conv_dim, conv_kernel]`` in the model's dtype) and a recurrent state (``rec_shape``, float32, in
transformers' orientation). Both backends size their state pools from this one table, and the memory plan from
``StateGeometry`` (backends/base.py). ``hybrid_layout`` is None for a model without such layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> the decoder layer's attribute holding the linear mixer (what both backends wrap)
MIXER_ATTRIBUTES = {"qwen3_5_text": "linear_attn", "qwen3_next": "linear_attn", "granitemoehybrid": "mamba",
                    "nemotron_h": "mixer"}
LINEAR, ATTENTION = "linear_attention", "full_attention"
# transformers 5 writes linear_attention/full_attention; checkpoints on the Hub name the same layers otherwise
_LAYER_NAMES = {"linear_attention": LINEAR, "mamba": LINEAR, "full_attention": ATTENTION, "attention": ATTENTION}
# NemotronH's hybrid_override_pattern: one character per block
_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


class HybridLayoutError(ValueError):
    """config.json of a hybrid model that tierlm cannot read a state layout from; the message says why."""


@dataclass(frozen=True)
class HybridLayout:
    """The recurrent-state layout of a hybrid model."""

    model_type: str
    kind: str  # "gdn" (gated DeltaNet) | "mamba2"
    mixer_attribute: str  # decoder layer attribute of the linear mixer
    layer_types: tuple[str, ...]  # per decoder layer: linear_attention | full_attention | mlp | moe
    conv_dim: int  # channels of the causal conv1d
    conv_kernel: int  # its kernel width K
    rec_shape: tuple[int, ...]  # recurrent state per request: gdn [Hv, Dk, Dv], mamba2 [H, head_dim, d_state]

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Decoder layer indices with a recurrent state, in order (state pool layer i is linear_layers[i])."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Decoder layer indices with attention (K/V in the paged pool)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)


def hybrid_layout(config: dict[str, Any]) -> HybridLayout | None:
    """The state layout of config.json's model, or None when it has no layers with a recurrent state (or is a
    model_type tierlm has no table for; verified_architectures refuses those)."""
    model_type = config.get("model_type")
    if model_type not in MIXER_ATTRIBUTES:
        return None
    try:
        if model_type in ("qwen3_5_text", "qwen3_next"):
            return _gated_delta_net(config, model_type)
        if model_type == "granitemoehybrid":
            return _granite(config)
        return _nemotron_h(config)
    except (KeyError, TypeError) as e:
        raise HybridLayoutError(f"config.json of this {model_type} model lacks the state field {e}") from e


def _layer_types(names: list[str], model_type: str) -> tuple[str, ...]:
    out = tuple(_LAYER_NAMES.get(n, n) for n in names)
    if LINEAR not in out:
        raise HybridLayoutError(f"{model_type}: no linear-attention/mamba layer in {names}")
    return out


def _gated_delta_net(c: dict[str, Any], model_type: str) -> HybridLayout:
    nk, nv = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
    dk, dv = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
    return HybridLayout(model_type, "gdn", MIXER_ATTRIBUTES[model_type], _layer_types(c["layer_types"], model_type),
                        conv_dim=2 * nk * dk + nv * dv, conv_kernel=int(c["linear_conv_kernel_dim"]),
                        rec_shape=(nv, dk, dv))


def _granite(c: dict[str, Any]) -> HybridLayout:
    intermediate = int(c.get("mamba_expand", 2) * c["hidden_size"])
    d_state, groups = int(c["mamba_d_state"]), int(c["mamba_n_groups"])
    return HybridLayout("granitemoehybrid", "mamba2", "mamba", _layer_types(c["layer_types"], "granitemoehybrid"),
                        conv_dim=intermediate + 2 * groups * d_state, conv_kernel=int(c["mamba_d_conv"]),
                        rec_shape=(int(c["mamba_n_heads"]), int(c["mamba_d_head"]), d_state))


def _nemotron_h(c: dict[str, Any]) -> HybridLayout:
    blocks = c.get("layers_block_type") or c.get("layer_types")
    if not blocks and isinstance(c.get("hybrid_override_pattern"), str):
        blocks = [_NEMOTRON_PATTERN[ch] for ch in c["hybrid_override_pattern"]]
    if not blocks:
        raise HybridLayoutError("nemotron_h: config.json has no layers_block_type or hybrid_override_pattern")
    heads, head_dim = int(c["mamba_num_heads"]), int(c["mamba_head_dim"])
    d_state, groups = int(c["ssm_state_size"]), int(c["n_groups"])
    return HybridLayout("nemotron_h", "mamba2", "mixer", _layer_types(list(blocks), "nemotron_h"),
                        conv_dim=heads * head_dim + 2 * groups * d_state, conv_kernel=int(c["conv_kernel"]),
                        rec_shape=(heads, head_dim, d_state))
