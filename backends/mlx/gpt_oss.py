"""mlx-lm's gpt_oss, adjusted to compute what transformers' GptOssForCausalLM computes.

mlx-lm's ``gpt_oss.Model`` already has attention sinks (``mx.fast.scaled_dot_product_attention(sinks=...)``),
alternating sliding/full layers from ``layer_types`` and native MXFP4 experts (``*_blocks``/``*_scales`` load
as ``QuantizedSwitchLinear`` in mode "mxfp4"). Three things differ from transformers, fixed here:

- Unquantized checkpoints written by transformers (``experts.gate_up_proj`` [E, in, 2*I], gate/up interleaved;
  ``experts.down_proj`` [E, I, out]) are not understood by mlx-lm's ``sanitize``; they are transposed to the
  [E, out, in] layout it expects before its own renaming runs.
- YaRN RoPE with ``truncate: false`` (the released gpt-oss configs): transformers uses the exact correction
  range, mlx-lm's ``YarnRoPE`` always rounds it to whole dims, which changes a few frequencies. The frequencies
  are recomputed without rounding.
- ``swiglu_alpha`` / ``swiglu_limit`` are read from the config (mlx-lm hard-codes gpt-oss's 1.702 / 7.0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import gpt_oss


@dataclass
class ModelArgs(gpt_oss.ModelArgs):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class Model(gpt_oss.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        freqs = yarn_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
        for layer in self.model.layers:
            if freqs is not None:
                layer.self_attn.rope._freqs = freqs
            layer.mlp.experts.activation._alpha = args.swiglu_alpha
            layer.mlp.experts.activation._limit = args.swiglu_limit

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        converted = {}
        for k, v in weights.items():
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):  # transformers' [E, in, out] layout
                k, v = k + ".weight", v.swapaxes(1, 2)
            converted[k] = v
        return super().sanitize(converted)


def yarn_frequencies(dims: int, base: float, scaling: dict[str, Any] | None) -> mx.array | None:
    """mlx ``rope`` frequencies (1 / inv_freq) of transformers' YaRN when ``truncate`` is false, else None."""
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) != "yarn" or scaling.get("truncate", True):
        return None
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(correction_dim(beta_fast), 0), min(correction_dim(beta_slow), dims - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # share of the original frequency per dim pair
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return 1 / inv_freq
