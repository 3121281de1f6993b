"""compressed-tensors checkpoints (what llm-compressor writes) on the torch backend.

transformers' CompressedTensorsHfQuantizer (the ``compressed-tensors`` package) loads the checkpoint with every
quantized linear still compressed: int8 ``weight`` (int-quantized), int32 ``weight_packed`` (pack-quantized int4)
or float8 ``weight``, each with its ``weight_scale`` (and zero point when asymmetric). Left alone, its first forward
decompresses the whole model to dense float and fake-quantizes the activations. Instead each quantized linear is
swapped here, from the compressed tensors, for:

- int8 per-channel weights (W8A8, W8A16): ``Int8WeightOnlyLinear`` (quant_linear.py; no dense copy);
- int4 weights (W4A16, group or channel): ``Int4WeightOnlyLinear``;
- fp8 weights: on a GPU with fp8 matmuls transformers' own ``CompressedTensorsFP8Linear`` (torch's scaled_mm, asked
  for in ``from_pretrained_kwargs``); elsewhere dequantized to the model dtype (logged: a CPU has no fp8 matmul);
- anything else (a GPU, a shape or group the CPU kernels cannot take): dequantized with the library's
  ``dequantize`` to the model dtype, counted in the log line.

Quantized input activations (W8A8's int8 per token, FP8's fp8 per token or per tensor) are quantized and
dequantized in front of the matmul with the library's arithmetic (``ActivationQDQ``), so the model computes what the
checkpoint describes, as transformers does on the same checkpoint (tests/test_compressed_tensors.py); the int8 x int8
product itself runs as int8 weights x dequantized activations (same values; no CPU int8 GEMM is used).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from tierlm.backends.weight_format import FP8_MATMUL_CAPABILITY, WeightFormatError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tierlm[quant]' (compressed-tensors)"


def check_installed() -> None:
    """Refuse before any weights load when the compressed-tensors package is missing."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as e:
        raise WeightFormatError(f"this checkpoint is in compressed-tensors format (llm-compressor) and the "
                                f"compressed-tensors package is not installed ({e}): {INSTALL_HINT}") from e


def fp8_matmul_device(device: torch.device) -> bool:
    """Whether ``device`` runs fp8 matmuls (CUDA compute capability 8.9+: Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MATMUL_CAPABILITY


def from_pretrained_kwargs(device: torch.device) -> dict:
    """from_pretrained's loading attributes: the weights stay compressed (transformers' default,
    ``dequantize=False``); on a GPU with fp8 matmuls transformers runs fp8 layers through scaled_mm
    (``use_optimized_inference``; not run here yet: no such GPU in this project's CI)."""
    if not fp8_matmul_device(device):
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=False, use_optimized_inference=True)}


class ActivationQDQ(nn.Module):
    """Quantize-dequantize a linear's input as the checkpoint's ``input_activations`` say (dynamic: scale per token
    or tensor from the input itself; static: the checkpoint's ``input_scale``), then run the linear."""

    def __init__(self, inner: nn.Module, args, scale: torch.Tensor | None, zero_point: torch.Tensor | None):
        super().__init__()
        self.inner, self.args = inner, args
        self.register_buffer("input_scale", scale, persistent=False)
        self.register_buffer("input_zero_point", zero_point, persistent=False)
        # The presets' case (W8A8, FP8_DYNAMIC): dynamic, symmetric, per token. The library's functions take ~25
        # small ops per call (40 % of a bf16 decode step on Qwen2.5-0.5B); _qdq_per_token does the same arithmetic
        # in 6 (tests/test_compressed_tensors.py holds the two bit-equal).
        self.per_token = None
        if args.dynamic is True and args.symmetric and args.strategy == "token" and args.num_bits == 8:
            self.per_token = (127.5, -128.0, 127.0, None) if args.type == "int" else \
                (448.0, -448.0, 448.0, torch.float8_e4m3fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

        if x.numel():  # a prefill-only step may hand lm_head no rows
            if self.per_token is not None:
                return self.inner(_qdq_per_token(x, *self.per_token))
            dtype = x.dtype  # the library computes in its scales' dtype (float32); the kernels take the model's
            if self.args.dynamic:
                # per token reduces over the last dimension of a [batch, tokens, features] input
                x3 = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
                scale, zp = compute_dynamic_scales_and_zp(x3, self.args, module=self)
                x = fake_quantize(x3, scale, zp, self.args).reshape(x.shape)
            else:
                x = fake_quantize(x, self.input_scale, self.input_zero_point, self.args)
            x = x.to(dtype)
        return self.inner(x)

    def extra_repr(self) -> str:
        a = self.args
        return f"input {a.type}{a.num_bits} per {a.strategy}, {'dynamic' if a.dynamic else 'static'}"


def _qdq_per_token(x: torch.Tensor, half_range: float, lo: float, hi: float,
                   fp8: torch.dtype | None) -> torch.Tensor:
    """compressed-tensors' dynamic symmetric per-token quantize-dequantize (calculate_qparams + fake_quantize),
    op for op: scale = max|x| / half the code range (eps where 0), codes rounded (int8) or cast (fp8) after the
    clamp, times the scale; in x's dtype."""
    scale = x.abs().amax(-1, keepdim=True) / half_range
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    q = torch.clamp(x / scale, lo, hi)
    q = torch.round(q) if fp8 is None else q.to(fp8).to(x.dtype)
    return q * scale


def convert_model(model: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Swap every compressed linear of a model transformers loaded from a compressed-tensors checkpoint (see the
    module docstring); returns how many layers took each path."""
    hook = getattr(model, "ct_decompress_hook", None)  # ModelCompressor's: it would densify every layer on the
    if hook is not None:                                 # first forward
        hook.remove()
        del model.ct_decompress_hook
    counts: dict[str, int] = {}
    for name, module in list(model.named_modules()):
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        if not isinstance(module, nn.Linear):  # e.g. fused MoE experts: nothing here runs them compressed
            raise WeightFormatError(f"{name}: a compressed-tensors {type(module).__name__} (not a linear layer) is "
                                    "not served by the torch backend; only quantized linear layers are")
        if scheme.weights is None:
            raise WeightFormatError(f"{name}: a compressed-tensors layer without quantized weights")
        inner, kind = _weights(module, scheme.weights, dtype)
        a = scheme.input_activations
        if a is not None:
            inner = ActivationQDQ(inner, a, getattr(module, "input_scale", None),
                                  getattr(module, "input_zero_point", None))
        model.set_submodule(name, inner)
        counts[kind] = counts.get(kind, 0) + 1
    if counts.get("fp8 dequantized"):
        log.warning("compressed-tensors fp8 weights dequantized to %s on this device (%d layers; fp8 matmuls need a "
                    "CUDA GPU with compute capability 8.9+): memory as the unquantized model, activations still "
                    "quantized as the checkpoint says", str(dtype).removeprefix("torch."), counts["fp8 dequantized"])
    dense_int = sum(n for k, n in counts.items() if k.startswith("int") and k.endswith("dequantized"))
    if dense_int:
        log.warning("compressed-tensors int weights dequantized to %s in %d layers (the weight-only kernels are "
                    "CPU-only and take int8 per channel with K %% 16 == 0, int4 with N %% 16 == 0 and groups of "
                    "32-256): those layers hold dense weights", str(dtype).removeprefix("torch."), dense_int)
    log.info("compressed-tensors layers: %s", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return counts


def _weights(module: nn.Linear, args, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """The module that multiplies by this layer's quantized weight, and which path it took."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    scale = module.weight_scale.detach()
    bias = module.bias.detach() if module.bias is not None else None
    if args.type == "float":
        w = dequantize(module.weight.detach(), scale, None, args)
        return _dense(w, bias, dtype), "fp8 dequantized"
    q, zp = _int_values(module, args)
    n, k = q.shape
    kernels = _kernels() if q.device.type == "cpu" else None
    if kernels is not None:
        int8_linear, int4_linear = kernels
        scales = scale.reshape(n, -1)
        if args.num_bits == 8 and args.strategy == "channel" and args.symmetric \
                and int8_linear.shape_supported(n, k) is None:
            # A copy: a weight straight from the mmapped safetensors file can sit at any byte offset, and torch's
            # bfloat16 _weight_int8pack_mm segfaults on a weight not 16-byte aligned (measured, torch 2.13).
            return int8_linear.from_quantized(q.clone(), scales.reshape(n), bias, dtype=dtype), "int8 weight-only"
        if args.num_bits == 4 and int4_linear.shape_supported(n, k, k // scales.shape[1]) is None:
            zeros = zp.reshape(n, -1) if zp is not None else None
            return int4_linear.from_quantized(q, scales, zeros, bias, dtype=dtype), "int4 weight-only"
    w = dequantize(q, scale, zp, args)
    return _dense(w, bias, dtype), f"int{args.num_bits} dequantized"


def _int_values(module: nn.Linear, args) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The integer weight values (int8 tensor [out, in], signed range) and zero points (None: symmetric)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    zp = getattr(module, "weight_zero_point", None)
    if hasattr(module, "weight_packed"):
        shape = torch.Size(int(d) for d in module.weight_shape)
        q = unpack_from_int32(module.weight_packed.detach(), args.num_bits, shape)
        if zp is not None and not args.symmetric and zp.dtype == torch.int32:  # zero points packed along dim 0
            zp = unpack_from_int32(zp.detach(), args.num_bits, (shape[0], module.weight_scale.shape[-1]),
                                   packed_dim=0)
    else:
        q = module.weight.detach()
    if args.symmetric:
        zp = None
    return q, (zp.detach() if zp is not None else None)


def _dense(w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    lin.requires_grad_(False)
    return lin


def _kernels():
    """(Int8WeightOnlyLinear, Int4WeightOnlyLinear): torch's CPU weight-only kernels (quant_linear.py)."""
    from tierlm.backends.torch.weights.quant_linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    return Int8WeightOnlyLinear, Int4WeightOnlyLinear
