"""Load a Hugging Face causal LM with transformers' modeling classes, wired to tierlm's paged attention."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from tierlm.backends.dtypes import serving_dtype
from tierlm.backends.torch import paged_attention
from tierlm.backends.torch.cpu import f32_gemv
from tierlm.backends.torch.cpu.linear import pack_linears
from tierlm.backends.torch.cpu.plan import CpuKernels
from tierlm.backends.torch.fused_projections import fuse_projections
from tierlm.backends.torch.weights import compressed_tensors
from tierlm.backends.torch.weights.mxfp4_experts import packed_model_class
from tierlm.backends.torch.weights.quant_linear import use_kernel
from tierlm.backends.torch.weights.weight_quant import check_device, native_cpu, quantize_model
from tierlm.backends.weight_format import WeightQuant, check_backend_kind, check_checkpoint, mxfp4_experts_mode

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype for ``--dtype`` on ``device`` (auto: backends/dtypes.serving_dtype)."""
    return DTYPES[serving_dtype(dtype, device.type)]


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
               quant: WeightQuant | None = None, kernels: CpuKernels | None = None):
    """``quant``: a load-time quantization (--torchao-config / --quantization), applied after the weights load.
    ``kernels``: on CPU, the model's plan and kernel library (cpu/plan.py): how its layers are laid out and which
    kernels they call."""
    from transformers import AutoConfig, AutoModelForCausalLM

    paged_attention.register()
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    # Refused before any weights load: the other backend's names, a device without the kernels, a checkpoint
    # method we cannot serve (weight_format.py).
    check_backend_kind(quant, "torch")
    if quant is not None:
        check_device(quant, device)
    method = check_checkpoint(config.to_dict(), "torch", quant)
    if method == "compressed-tensors":
        compressed_tensors.check_installed()
    model_class = AutoModelForCausalLM
    if method == "mxfp4":
        mode, why = mxfp4_experts_mode(device.type, os.environ)
        if mode == "packed":  # the config loses its quantization_config: quantization_kwargs returns {} below
            config, model_class = packed_model_class(config)
        log.info("MXFP4 experts: %s (%s)", mode, why)
    # Loaded with "eager" (every architecture has it; gpt-oss has no sdpa path), then switched to the paged hook.
    model = model_class.from_pretrained(
        model_dir, config=config, dtype=dtype, attn_implementation="eager", trust_remote_code=trust_remote_code,
        **quantization_kwargs(config, dtype, device),
    )
    model.set_attn_implementation(paged_attention.ATTN_IMPLEMENTATION)
    model.to(device)
    if method == "compressed-tensors":
        compressed_tensors.convert_model(model, dtype)  # on the device: the CPU kernels prepack there
    model.eval()
    model.requires_grad_(False)
    cpu = device.type == "cpu" and kernels is not None
    if cpu and (quant is None or native_cpu(quant, device)):
        # q/k/v and gate/up as one linear each, same products; packed below where bf16, or quantized below by the
        # CPU weight-only formats (per output row / group of a row: the same values as the unfused layers)
        if kernels.plan.fused_projections.value == "yes":
            fuse_projections(model)
        else:
            log.info("CPU decoder layers: transformers' own modules (%s)", kernels.plan.fused_projections.why)
    if quant is not None:
        quantize_model(model, quant, kernels)
    elif cpu and dtype == torch.bfloat16:
        pack_linears(model, kernels)  # oneDNN-prepacked weights where the plan has them: same products, faster
    elif cpu and dtype == torch.float32 and method is None:
        f32_gemv.use_for_linears(model, kernels)  # decode rows on tierlm's kernel: MKL's one-row path is slow on AMD
    if cpu and method == "compressed-tensors":
        use_kernel(model, kernels)  # an int8 checkpoint's decode rows on tierlm's kernel where the plan has it
    return model


def quantization_kwargs(config, dtype: torch.dtype, device: torch.device) -> dict:
    """from_pretrained arguments for quantized checkpoints the torch backend can serve.

    MXFP4 (gpt-oss expert weights as ``*_blocks``/``*_scales``) when the experts are to be dequantized
    (weight_format.mxfp4_experts_mode; packed: mxfp4_experts.py, and the config has no quantization_config by
    then): transformers' MXFP4 kernels need triton and the ``kernels`` package (fetched from the Hub), and its
    quantizer otherwise insists on accelerate. With ``Mxfp4Config(dequantize=True)`` it decodes the blocks to
    ``dtype`` while loading, in plain torch, offline and on any device; the experts then run as ordinary
    ``GptOssExperts`` (memory: 2 or 4 bytes per weight instead of ~0.53).

    compressed-tensors (llm-compressor): loaded still compressed, then swapped layer by layer
    (compressed_tensors.py).
    """
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is None:
        return {}
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else getattr(qcfg, "quant_method", None)
    method = getattr(method, "value", method)
    if method == "mxfp4":
        from transformers import Mxfp4Config

        log.info("MXFP4 expert weights: dequantizing to %s while loading (torch backend has no MXFP4 kernels)",
                 str(dtype).removeprefix("torch."))
        return {"quantization_config": Mxfp4Config(dequantize=True)}
    if method == "compressed-tensors":
        return compressed_tensors.from_pretrained_kwargs(device)
    return {}
