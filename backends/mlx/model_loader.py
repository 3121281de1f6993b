"""Load a local Hugging Face model folder with mlx-lm's model classes (no hub access), in the asked dtype."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tierlm.backends.dtypes import serving_dtype
from tierlm.backends.mlx.hybrid_families import hybrid_model_classes, hybrid_overrides
from tierlm.backends.mlx.weight_quant import quantize_model
from tierlm.backends.model_source.hybrid_layout import hybrid_layout
from tierlm.backends.model_source.model_folder import ModelFolder, as_model_folder
from tierlm.backends.weight_format import WeightQuant, check_backend_kind, check_checkpoint

log = logging.getLogger(__name__)

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
DTYPE_NAMES_BY_VALUE = {v: k for k, v in DTYPES.items()}


def resolve_dtype(dtype: str, config: dict[str, Any]) -> mx.Dtype:
    """The mlx dtype for ``--dtype`` (auto: backends/dtypes.serving_dtype for the device MLX runs on)."""
    device = "cpu" if mx.default_device() == mx.cpu else "metal"
    dtype = serving_dtype(dtype, device, config.get("torch_dtype") or config.get("dtype"))
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


def load_mlx_model(folder: ModelFolder | Path, dtype: str,
                   quant: WeightQuant | None = None) -> tuple[nn.Module, dict[str, Any], mx.Dtype]:
    """Return (model, config, dtype) for the folder; weights are cast to ``dtype`` (quantized ones kept: an
    mlx-lm quantized checkpoint loads as it is), then quantized with ``quant`` (--quantization q4|q8) if given.
    mlx-lm reads config.json again itself (it has no way to take the parsed dict); the overrides are computed
    from ours."""
    from mlx_lm.utils import load_model

    folder = as_model_folder(folder)
    model_dir, config = folder.path, folder.config
    if not config:
        raise FileNotFoundError(f"{model_dir} has no readable config.json; pass a Hugging Face model folder")
    check_backend_kind(quant, "mlx")
    check_checkpoint(config, "mlx", quant)  # before mlx-lm reads the weights
    overrides = {**config_overrides(config), **hybrid_overrides(config, hybrid_layout(config))}
    model, config = load_model(model_dir, lazy=True, model_config=overrides, get_model_classes=model_classes)
    target = resolve_dtype(dtype, config)
    # set_dtype only touches floating parameters, so quantized weights stay packed.
    model.set_dtype(target)
    if quant is not None:
        quantize_model(model, quant)
    _check_cpu_expert_dtype(model, target, model_dir)
    mx.eval(model.parameters(), _private_arrays(model))
    log.info("mlx model %s loaded as %s on %s%s", model_dir, target, mx.default_device(),
             f" (config overrides {sorted(overrides)})" if overrides else "")
    return model, config, target


def _check_cpu_expert_dtype(model: nn.Module, dtype: mx.Dtype, model_dir: Path) -> None:
    """MLX on CPU multiplies unquantized mixture-of-experts weights (``gather_mm``) in float32 only; a half dtype
    would fail on the first request ("[GatherMM::eval] Currently only supports float32"), so refuse it here."""
    if dtype == mx.float32 or mx.default_device() != mx.cpu:
        return
    from mlx_lm.models.switch_layers import SwitchLinear

    if any(isinstance(m, SwitchLinear) for m in model.modules()):
        raise ValueError(
            f"{model_dir} has unquantized expert weights, which MLX on CPU runs in float32 only; use --dtype "
            f"float32 (or auto) instead of {DTYPE_NAMES_BY_VALUE.get(dtype, dtype)}, or an MXFP4 checkpoint")


def _private_arrays(model: nn.Module) -> list[mx.array]:
    """Arrays modules keep outside ``parameters()`` (RoPE frequencies such as YaRN's ``_freqs``), built lazily.

    A lazy graph belongs to the stream of the thread that built it; the engine runs the model on its scheduler
    thread, where evaluating such a graph fails ("There is no Stream(cpu, 0) in current thread"). So they are
    evaluated here, on the loading thread.
    """
    return [v for m in model.modules() for k, v in m.items() if k.startswith("_") and isinstance(v, mx.array)]


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) for the config; gpt_oss gets tierlm's transformers-exact variant."""
    from mlx_lm.utils import _get_classes

    if config.get("model_type") == "gpt_oss":
        from tierlm.backends.mlx import gpt_oss

        return gpt_oss.Model, gpt_oss.ModelArgs
    return hybrid_model_classes(config) or _get_classes(config)
