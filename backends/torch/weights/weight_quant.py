"""Load-time weight quantization on the torch backend: torchao's ``quantize_`` (its kernels), except the
weight-only int8/int4 formats on CPU, which run torch's own weight-only kernels (quant_linear.py) on weights
quantized with torchao's recipes.

What runs where (torchao 0.18, checked on torch 2.13):
- int8wo: CPU: quant_linear.Int8WeightOnlyLinear (decode rows through tierlm's C kernel, cpu/int8_gemv.py,
  on x86; bf16 prefill through oneDNN on the widened weight; else ``torch._weight_int8pack_mm``), and the input
  embedding int8 too (quant_embedding.py; a tied lm_head and the embedding share one table); torchao's own
  CPU path converts the int8 weight to the activation dtype inside every matmul (4-5x slower than float32 decode;
  it still serves with TIERLM_CPU_QUANT_LINEAR=0, for comparison, embedding in the model dtype). Other devices:
  torchao.
- int8dq (SGLang's w8a8_int8): any device; activations quantized per token, int8 x int8 matmul (torch._int_mm).
- int4wo-<group>: CPU: ``torch._weight_int4pack_mm_for_cpu`` (quant_linear.Int4WeightOnlyLinear), the input
  embedding int4 in the same groups (read from the packed table: one table when tied); CUDA: torchao's int4
  weight-only kernels.
- fp8wo, fp8dq-per_row (SGLang's fp8): CUDA with compute capability 8.9+ (torchao's float8 matmuls).
"""
from __future__ import annotations

import logging
import os

import torch

from tierlm.backends.torch.weights.quant_embedding import quantize_embedding, tied_lm_head
from tierlm.backends.torch.weights.quant_linear import quantize_linears, use_kernel
from tierlm.backends.weight_format import NATIVE_ENV, WeightFormatError, WeightQuant, cpu_weight_only, device_refusal

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tierlm[quant]' (torchao)"


def native_cpu(quant: WeightQuant, device: torch.device) -> bool:
    """Whether ``quant`` runs torch's CPU weight-only kernels (quant_linear.py) rather than torchao's."""
    return cpu_weight_only(quant, device.type, os.environ)


def check_device(quant: WeightQuant, device: torch.device) -> None:
    """Refuse, before any weights load, what this device cannot run; the message names the flag and what to use."""
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    refusal = device_refusal(quant, device.type, cc)
    if refusal:
        raise WeightFormatError(refusal)
    if native_cpu(quant, device):
        return  # torch's own kernels: torchao is not needed
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


def quantize_model(model: torch.nn.Module, quant: WeightQuant, kernels=None) -> None:
    """Replace every nn.Linear weight (lm_head included) with torchao's quantized tensor, or on CPU for the
    weight-only formats every nn.Linear with quant_linear's layer, in place (their int8 decode rows on tierlm's
    kernel where ``kernels``, the model's CpuKernels, plans it)."""
    param = next(model.parameters())
    if native_cpu(quant, param.device):
        _quantize_native(model, quant, param.dtype, kernels)
        return
    from torchao.quantization import quantize_

    quantize_(model, torchao_config(quant))
    if quant.name == "int8wo" and next(model.parameters()).device.type == "cpu":
        log.warning("%s on CPU through torchao (%s=0): torchao dequantizes int8 weights inside every matmul; memory "
                    "drops but decode is slower than float32", quant.flag, NATIVE_ENV)
    log.info("weights quantized with torchao %s (%s)", quant.name, quant.flag)


def _quantize_native(model: torch.nn.Module, quant: WeightQuant, dtype: torch.dtype, kernels) -> None:
    tied = tied_lm_head(model)  # read before the swap gives lm_head a weight of its own
    swapped, kept = quantize_linears(model, quant.bits, quant.group_size)
    if not swapped:
        raise WeightFormatError(f"{quant.flag}: no linear layer of this model fits torch's CPU weight-only kernel "
                                f"({'; '.join(kept[:3])}); use --torchao-config int8dq or no quantization")
    # The embedding too (llama.cpp's token_embd), over the lm_head's own table when they are tied.
    dense_embedding = quantize_embedding(model, quant.bits, quant.group_size, tied)
    if dense_embedding:
        log.warning("%s: the input embedding stays %s (%s)", quant.flag, dtype, dense_embedding)
    if kept:
        log.warning("%s: %d linear layers stay %s (the kernel cannot take their shape: %s)", quant.flag, len(kept),
                    dtype, "; ".join(kept[:3]) + ("; ..." if len(kept) > 3 else ""))
    own_kernel = quant.bits == 8 and use_kernel(model, kernels) > 0  # float32 and bf16 alike
    if dtype != torch.bfloat16 and not own_kernel:
        log.warning("%s on CPU with %s activations: torch's weight-only kernels are vectorized for bfloat16 only; "
                    "--dtype bfloat16 decodes several times faster", quant.flag, dtype)
    kernel = "tierlm's int8 streaming kernel for decode rows" if own_kernel else "torch's CPU weight-only kernel"
    log.info("weights quantized to %s: %d linear layers run %s (%s)", quant.name, swapped, kernel, quant.flag)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds, a torchao tensor subclass as the sum of its inner tensors (qdata, scales, ...)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return t.numel() * t.element_size()
    names, _ = flatten()
    return sum(tensor_bytes(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
