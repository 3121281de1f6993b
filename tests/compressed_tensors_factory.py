"""Tiny compressed-tensors checkpoints, written the way llm-compressor's data-free ``oneshot`` writes them.

llm-compressor itself is not used: 0.14 pins transformers <= 5.17 and compressed-tensors 0.19 and pulls datasets,
accelerate and auto-round. Its W8A8, W4A16 and FP8_DYNAMIC schemes need no calibration data (weights: min/max
per channel or group; activations: dynamic), so its steps are repeated here with compressed-tensors' own API:
``apply_quantization_config`` with the preset scheme (lm_head ignored, as llm-compressor's recipes do), the
memoryless min/max weight observer (``calculate_qparams``), ``ModelCompressor.compress_model``, save_pretrained and
``update_config``: the same config.json block and tensors (int8 ``weight``, int32 ``weight_packed``, float8
``weight``, ``weight_scale``).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from model_factory import build_tiny_model

# Hidden 128 so W4A16's group of 128 (the preset) is a real group; 256 for the MLP.
SHAPE = dict(hidden_size=128, intermediate_size=256)
SCHEMES = ("W8A8", "W4A16", "FP8_DYNAMIC", "FP8")


def build_compressed_tensors_model(family: str, scheme: str, out_dir: Path, base_dir: Path) -> Path:
    """Write ``family``'s tiny model (built in ``base_dir``) quantized with llm-compressor's preset ``scheme`` to
    ``out_dir`` as a compressed-tensors checkpoint; returns ``out_dir``."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    return quantize_folder(build_tiny_model(family, Path(base_dir), **SHAPE), scheme, out_dir)


def quantize_folder(base: Path, scheme: str, out_dir: Path, dtype: str = "float32") -> Path:
    """Write the model in ``base`` quantized with llm-compressor's preset ``scheme`` to ``out_dir`` (weights and
    scales in ``dtype``: llm-compressor keeps the model's own)."""
    import torch
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, QuantizationStrategy,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    base, out_dir = Path(base), Path(out_dir)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        qscheme = getattr(module, "quantization_scheme", None)
        if qscheme is None:
            continue
        w, args = module.weight.detach(), qscheme.weights
        if args.strategy == QuantizationStrategy.GROUP:
            g = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == QuantizationStrategy.CHANNEL:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zp = calculate_qparams(lo, hi, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        module.weight_zero_point.data = zp.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)
        if qscheme.input_activations is not None and not qscheme.input_activations.dynamic:
            # static activation scale (FP8): what calibration on a typical input would give for these layers
            module.input_scale.data.fill_(4.0 / 448.0)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(out_dir)
    for f in base.iterdir():  # the tokenizer files
        if f.is_file() and not (out_dir / f.name).exists():
            shutil.copy(f, out_dir / f.name)
    return out_dir
