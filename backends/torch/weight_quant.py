"""Load-time weight quantization on the torch backend through torchao's ``quantize_`` (its kernels, none of ours).

What runs where (torchao 0.18, checked on torch 2.13):
- int8wo: any device. On CPU torchao's weight-only path converts the int8 weight to the activation dtype inside
  every matmul (a dense copy per call), so it saves memory but decodes slower than float32 (docs/models.md).
- int8dq (SGLang's w8a8_int8): any device; activations quantized per token, int8 x int8 matmul (torch._int_mm).
- int4wo-<group>: CUDA only (torchao's int4 weight-only kernels; its CPU layout is a prototype).
- fp8wo, fp8dq-per_row (SGLang's fp8): CUDA with compute capability 8.9+ (torchao's float8 matmuls).
"""
from __future__ import annotations

import logging

import torch

from tierlm.backends.weight_format import WeightFormatError, WeightQuant, device_refusal

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tierlm[quant]' (torchao)"


def check_device(quant: WeightQuant, device: torch.device) -> None:
    """Refuse, before any weights load, what this device cannot run; the message names the flag and what to use."""
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    refusal = device_refusal(quant, device.type, cc)
    if refusal:
        raise WeightFormatError(refusal)
    # On a CPU build of torch, torchao's CUDA-only extensions fail to load with one warning each: expected there.
    ao_log = logging.getLogger("torchao")
    level = ao_log.level
    if device.type != "cuda":
        ao_log.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    except ImportError as e:
        raise WeightFormatError(f"{quant.flag}: torchao is not installed ({e}); {INSTALL_HINT}") from e
    finally:
        ao_log.setLevel(level)


def torchao_config(quant: WeightQuant):
    """torchao's config object for the canonical name."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, PerRow

    if quant.name == "int8wo":
        return Int8WeightOnlyConfig()
    if quant.name == "int8dq":
        return Int8DynamicActivationInt8WeightConfig()
    if quant.name == "fp8wo":
        return Float8WeightOnlyConfig()
    if quant.name == "fp8dq-per_row":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    return Int4WeightOnlyConfig(group_size=quant.group_size)


def quantize_model(model: torch.nn.Module, quant: WeightQuant) -> None:
    """Replace every nn.Linear weight (lm_head included) with torchao's quantized tensor, in place."""
    from torchao.quantization import quantize_

    quantize_(model, torchao_config(quant))
    if quant.name == "int8wo" and next(model.parameters()).device.type == "cpu":
        log.warning("%s on CPU: torchao dequantizes int8 weights inside every matmul; memory drops but decode is "
                    "slower than float32 (--torchao-config int8dq runs int8 matmuls)", quant.flag)
    log.info("weights quantized with torchao %s (%s)", quant.name, quant.flag)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds, a torchao tensor subclass as the sum of its inner tensors (qdata, scales, ...)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return t.numel() * t.element_size()
    names, _ = flatten()
    return sum(tensor_bytes(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
