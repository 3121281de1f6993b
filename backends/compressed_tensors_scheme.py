"""The quantization schemes of a compressed-tensors checkpoint (what llm-compressor writes: config.json's
``quantization_config`` with ``quant_method`` "compressed-tensors"), read from config.json without torch.

Each config group names the bits, type and granularity of its weights and input activations; the label joins them
(``w8a8-int8``, ``w4a16-g128``, ``fp8-dynamic``, or the fields spelled out for other mixes), so the weight format,
and with it the L3 namespace, tells the schemes apart. ``refusal`` says which schemes the torch backend cannot serve.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

METHOD = "compressed-tensors"
# What the torch backend serves (backends/torch/weights/compressed_tensors.py): int8 per-channel weights (activations
# none, or int8 per token/tensor), int4 (symmetric) or int8 weights in groups or per channel with 16-bit
# activations, fp8 weights per channel or per tensor (activations none, dynamic per token, or static per tensor).
SUPPORTED = ("w8a8-int8 (llm-compressor W8A8/INT8)", "w4a16 / w8a16 (W4A16, W8A16; symmetric, per channel or "
             "group)", "fp8-dynamic (FP8_DYNAMIC)", "fp8 (FP8, static per tensor)")


def _args(a: Any) -> Mapping[str, Any] | None:
    return a if isinstance(a, Mapping) and a else None


def group_label(group: Mapping[str, Any]) -> str:
    """One config group's scheme as a short label: presets by their llm-compressor name, others spelled out."""
    w, a = _args(group.get("weights")), _args(group.get("input_activations"))
    if w is None:
        return "a-only"
    wt = "int" if w.get("type", "int") == "int" else "fp"
    bits, strategy = int(w.get("num_bits", 8)), str(w.get("strategy", "tensor"))
    gran = f"g{w.get('group_size')}" if strategy == "group" else strategy
    asym = "" if w.get("symmetric", True) else "-asym"
    if a is None:
        if wt == "fp" and bits == 8:
            return f"fp8-weight-only-{gran}"
        return f"w{bits}a16-{gran}{asym}" if wt == "int" else f"w{bits}fp-a16-{gran}"
    at, abits = ("int" if a.get("type", "int") == "int" else "fp"), int(a.get("num_bits", 8))
    mode = "dynamic" if a.get("dynamic") else "static"
    if (wt, bits, strategy, at, abits) == ("int", 8, "channel", "int", 8) and a.get("strategy") == "token" \
            and a.get("dynamic") and not asym:
        return "w8a8-int8"
    if (wt, bits, at, abits) == ("fp", 8, "fp", 8):  # the presets FP8_DYNAMIC and FP8 by name, others spelled out
        preset = {("channel", "token", "dynamic"): "fp8-dynamic", ("tensor", "tensor", "static"): "fp8-static"}
        return preset.get((strategy, a.get("strategy"), mode), f"fp8-{gran}-a{a.get('strategy')}-{mode}")
    return f"w{bits}{wt}-{gran}{asym}-a{abits}{at}-{a.get('strategy')}-{mode}"


def scheme_label(qcfg: Mapping[str, Any]) -> str:
    """The checkpoint's schemes, e.g. "w4a16-g128"; several groups joined with "+" (sorted, so stable)."""
    groups = qcfg.get("config_groups") or {}
    labels = sorted({group_label(g) for g in groups.values() if isinstance(g, Mapping)})
    return "+".join(labels) or "none"


def _group_refusal(name: str, group: Mapping[str, Any]) -> str | None:
    w, a = _args(group.get("weights")), _args(group.get("input_activations"))
    if _args(group.get("output_activations")):
        return f"group {name!r} quantizes output activations"
    if w is None:
        return f"group {name!r} quantizes activations only"
    wt, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 8)), w.get("strategy", "tensor")
    if w.get("dynamic"):
        return f"group {name!r} has dynamic weights"
    if w.get("actorder") in ("group", True):  # GPTQ act-order groups: a weight_g_idx permutation per layer
        return f"group {name!r}: GPTQ activation order 'group' (weight_g_idx); re-quantize with actorder 'static'"
    if wt == "int":
        if bits not in (4, 8) or strategy not in ("channel", "group"):
            return f"group {name!r}: int{bits} weights per {strategy}"
        if bits == 4 and not w.get("symmetric", True):
            # transformers 5.24 + compressed-tensors 0.20 size the zero points unpacked while the file packs them
            return (f"group {name!r}: asymmetric int4 weights (W4A16_ASYM): transformers cannot load their packed "
                    "zero points (a size mismatch); use a symmetric W4A16 checkpoint")
        if a is not None and not (bits == 8 and a.get("type", "int") == "int" and int(a.get("num_bits", 8)) == 8
                                  and a.get("strategy") in ("token", "tensor")):
            return f"group {name!r}: int{bits} weights with {a.get('type')}{a.get('num_bits')} activations"
        return None
    if wt == "float" and bits == 8 and strategy in ("channel", "tensor"):
        if a is not None and not (a.get("type") == "float" and int(a.get("num_bits", 8)) == 8
                                  and a.get("strategy") in ("token", "tensor")):
            return f"group {name!r}: fp8 weights with {a.get('type')}{a.get('num_bits')} per {a.get('strategy')}"
        return None
    return f"group {name!r}: {wt}{bits} weights per {strategy} (NVFP4/MXFP4/FP8-block are not served yet)"


def refusal(qcfg: Mapping[str, Any]) -> str | None:
    """Why the torch backend cannot serve this compressed-tensors checkpoint (None: it can)."""
    sparsity = qcfg.get("sparsity_config")
    if isinstance(sparsity, Mapping) and sparsity.get("format") not in (None, "dense"):
        return f"sparsity format {sparsity.get('format')!r}"
    transform = _args(qcfg.get("transform_config"))
    if transform and transform.get("config_groups"):
        return "rotation transforms (SpinQuant/QuIP)"
    groups = qcfg.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        return "no config_groups: it names no quantized layers"
    return next((r for n, g in groups.items() if (r := _group_refusal(n, g if isinstance(g, Mapping) else {}))),
                None)
