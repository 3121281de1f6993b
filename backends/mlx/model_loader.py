"""Load a local Hugging Face model folder with mlx-lm's model classes (no hub access), in the asked dtype."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def resolve_dtype(dtype: str, config: dict[str, Any]) -> mx.Dtype:
    """auto -> float32 on CPU (exact match with the float32 reference); on Metal the checkpoint's half dtype."""
    if dtype == "auto":
        if mx.default_device() == mx.cpu:
            return mx.float32
        stored = config.get("torch_dtype") or config.get("dtype")
        return DTYPES.get(stored, mx.float32) if stored in ("bfloat16", "float16") else mx.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported by the mlx backend; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Config keys mlx-lm's ModelArgs read at the top level but transformers >= 5 nests in rope_parameters.

    Without this, llama/qwen2 ModelArgs silently fall back to their default rope_theta for such folders.
    """
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    out: dict[str, Any] = {}
    if "rope_theta" not in config and "rope_theta" in params:
        out["rope_theta"] = params["rope_theta"]
    if config.get("rope_scaling") is None and params.get("rope_type", "default") != "default":
        out["rope_scaling"] = params
    return out


def load_mlx_model(model_dir: Path, dtype: str) -> tuple[nn.Module, dict[str, Any], mx.Dtype]:
    """Return (model, config, dtype) for the folder; weights are cast to ``dtype`` (quantized ones kept)."""
    from mlx_lm.utils import load_model

    model_dir = Path(model_dir)
    config = read_json(model_dir / "config.json")
    if not config:
        raise FileNotFoundError(f"{model_dir} has no readable config.json; pass a Hugging Face model folder")
    overrides = config_overrides(config)
    model, config = load_model(model_dir, lazy=True, model_config=overrides)
    target = resolve_dtype(dtype, config)
    # set_dtype only touches floating parameters, so quantized weights stay packed.
    model.set_dtype(target)
    mx.eval(model.parameters())
    log.info("mlx model %s loaded as %s on %s%s", model_dir, target, mx.default_device(),
             f" (config overrides {sorted(overrides)})" if overrides else "")
    return model, config, target


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
