"""Weight-only int8 and int4 linear layers on CPU (``--torchao-config int8wo`` and ``int4wo-<group>`` there;
weight_quant.py swaps them in), on torch's kernels and, for int8, tierlm's own (below).

torchao's CPU weight-only path converts the int8 weight to the activation dtype inside every matmul (a dense copy
per call: 4-5x slower than float32 decode). torch ships weight-only kernels that read the packed weight directly:
``torch._weight_int8pack_mm`` (int8 [N, K] + one scale per output row) and ``torch._weight_int4pack_mm_for_cpu``
(tinygemm's 4-bit layout + a scale and a zero point per group of K). Both take activations in the model dtype;
both are vectorized for bfloat16 activations only (float32 and float16 run a scalar loop, measured 10-70x slower
per GEMV than bfloat16 on AVX-512: still faster than torchao's dequantize-per-call, and the only int4 path on a
CPU), so bfloat16 (``--dtype auto`` where the CPU has it) is the fast dtype for int4.

For int8, decode rows go through tierlm's own streaming kernel instead where it runs (cpu/int8_gemv.py, x86 AVX2 or
AVX-512: 1.9-2.3x faster per matrix; float32 activations at every row count), and bf16 prefill through oneDNN's
bf16 GEMM on the weight widened in slices (``_dense_prefill``): torch's int8 kernel is bound by float32
multiply-adds there.

The quantization itself repeats torchao's recipes step for step, so the weights equal what ``quantize_`` would
hold (tests/test_cpu_quant_linear.py checks them against torchao): int8wo symmetric per output row
(scale = max|w| / 127.5, q = round(w / scale) in -128..127); int4wo asymmetric per group (tinygemm:
scale = (max - min) / 15, zero = min + 8 * scale, q = round((w - min) / scale) in 0..15, w ~ (q - 8) * scale + zero).

Kernel limits (checked, the layer stays dense otherwise): int8 needs K % 16 == 0 (torch's bfloat16 kernel reads
past the row otherwise); int4 needs K % group == 0, group in 32, 64, 128, 256, and N % 16 == 0 (other N, e.g. a
vocabulary of 32001, are padded with zero rows that the output drops).
"""
from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from tierlm.backends.torch import ops
from tierlm.backends.torch.cpu import int8_gemv, library
from tierlm.backends.torch.cpu.library import KernelLibrary

log = logging.getLogger(__name__)

INT8_K_MULTIPLE = 16
INT4_N_MULTIPLE = 16
INT4_GROUPS = (32, 64, 128, 256)
INT4_EPS = 1e-6  # torchao's int4 tinygemm recipe clamps the scale here
INT8_EPS = torch.finfo(torch.float32).eps  # torchao's int8 recipe: float32 eps for every dtype


def _frozen(t: torch.Tensor) -> nn.Parameter:
    # Parameters (not buffers) so that the backend's weight_bytes and doctor count them like any weight.
    return nn.Parameter(t, requires_grad=False)


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Parameter | None:
    return None if bias is None else _frozen(bias.detach().to(dtype).contiguous())  # the C kernel reads it flat


def _flat(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).contiguous()


# torch 2.13's bf16 _weight_int8pack_mm crashes (segfault) on a weight whose address is not 16-byte aligned, which
# a tensor mapped straight from a safetensors file can be; 64 also keeps rows on cache-line boundaries.
_WEIGHT_ALIGNMENT = 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at an aligned address (a copy only where it is not already)."""
    t = t.contiguous()
    return t if t.data_ptr() % _WEIGHT_ALIGNMENT == 0 else t.clone()


# bf16 prefill: from this many rows on, the int8 weight is widened to bf16 (exact: every int8 value is a bf16) in
# slices of at most DENSE_SLICE_WEIGHTS and multiplied by oneDNN's bf16 GEMM, the scales applied to the output.
# torch's int8 kernel runs prefill on float32 multiply-adds: 3.1-3.7x slower than that at 512 rows of the
# Qwen2.5-0.5B shape (4864 x 896: 47 vs 13 ms, one thread); at 16 rows it is still the faster one.
DENSE_PREFILL_ROWS = 32
DENSE_SLICE_WEIGHTS = 1 << 24  # 32 MiB of bf16 scratch, reused: an lm_head over every prompt token fits in slices

# One scratch per thread (two engines in one process never share one), grown to the largest slice; not counted in
# weight_bytes: it is working memory, like activations.
_scratch = threading.local()


def _dense_prefill(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 @ (qweight * scales[:, None]).T + bias as (x @ bf16(qweight).T) * scales + bias (the scale and
    bias in one rounding), a slice of output columns at a time through this thread's reused scratch buffer."""
    n, k = qweight.shape
    step = max(1, min(n, DENSE_SLICE_WEIGHTS // k))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < step * k:
        with torch.inference_mode(False):  # a normal tensor: written inside inference mode and outside
            buf = _scratch.buf = torch.empty(step * k, dtype=torch.bfloat16)
    if step == n:
        w = buf[:n * k].view(n, k)
        w.copy_(qweight)
        y = torch.nn.functional.linear(x, w)
    else:
        y = torch.empty((x.shape[0], n), dtype=x.dtype)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            w = buf[:(n1 - n0) * k].view(n1 - n0, k)
            w.copy_(qweight[n0:n1])
            y[:, n0:n1] = torch.nn.functional.linear(x, w)
    return y.mul_(scales) if bias is None else torch.addcmul(bias, y, scales)


def int8_weight_only_product(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                             bias: torch.Tensor | None, lib: KernelLibrary | None = None) -> torch.Tensor:
    """x [M, K] contiguous in the scales' dtype -> [M, N]: decode rows through tierlm's streaming kernel (``lib``,
    where the plan has it), bf16 prefill through oneDNN on the widened weight, the rest through torch's kernel."""
    rows = x.shape[0]
    if lib is not None and int8_gemv.takes(rows, scales.dtype):  # bias included
        return int8_gemv.int8_linear(lib, x, qweight, scales, bias)
    if rows >= DENSE_PREFILL_ROWS and scales.dtype == torch.bfloat16:
        return _dense_prefill(x, qweight, scales, bias)
    y = torch._weight_int8pack_mm(x, qweight, scales)
    return y if bias is None else y.add_(bias)


def _python_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               kernel: bool) -> torch.Tensor:
    """``tierlm::int8_weight_only``: the product, on the process's library where the layer's plan has the kernel."""
    return int8_weight_only_product(x, qweight, scales, bias, library.load() if kernel else None)


ops.implement("int8_weight_only", _python_op,
              lambda x, qweight, scales, bias, kernel: x.new_empty((x.shape[0], qweight.shape[0])))


class Int8WeightOnlyLinear(nn.Module):
    """``nn.Linear`` with an int8 weight and one scale per output channel: y = x @ (q * scale[:, None]).T + bias,
    without a dense copy of the weight: decode rows through cpu/int8_gemv.py where the plan has it (``lib``, set by
    ``use_kernel``), bf16 prefill through oneDNN's GEMM on slices widened to bf16 (``_dense_prefill``), the rest
    through ``torch._weight_int8pack_mm``."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.qweight = _frozen(_aligned(qweight))
        self.scales = _frozen(scales.contiguous())
        self.bias = _bias(bias, scales.dtype)
        self.lib: KernelLibrary | None = None

    @classmethod
    def shape_supported(cls, out_features: int, in_features: int) -> str | None:
        """Why the kernel cannot take this shape (None: it can)."""
        if in_features % INT8_K_MULTIPLE:
            return f"in_features {in_features} is not a multiple of {INT8_K_MULTIPLE}"
        return None

    @classmethod
    def from_quantized(cls, w_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
                       dtype: torch.dtype | None = None) -> Int8WeightOnlyLinear:
        """A layer from weights already quantized (e.g. a compressed-tensors W8A16 / W8A8 checkpoint).

        ``w_int8``: int8 [N, K], values -128..127, row n = output channel n (nn.Linear's weight layout).
        ``scales``: [N] or [N, 1], any float dtype; the dequantized weight is ``w_int8[n, k] * scales[n]``
        (symmetric: no zero point). ``bias``: [N] or None.
        ``dtype``: the activation dtype the layer will be called with (default: ``scales.dtype``); the kernel
        takes the scales in it, so they are cast (a bfloat16 model holds bfloat16 scales), as is the bias.
        Raises ValueError for a shape the kernel cannot take (see ``shape_supported``)."""
        if w_int8.dtype != torch.int8 or w_int8.dim() != 2:
            raise ValueError(f"w_int8 must be a 2-D int8 tensor [N, K], got {w_int8.dtype} {tuple(w_int8.shape)}")
        n, k = w_int8.shape
        if scales.numel() != n:
            raise ValueError(f"scales must hold one value per output channel ({n}), got {tuple(scales.shape)}")
        why = cls.shape_supported(n, k)
        if why:
            raise ValueError(f"torch._weight_int8pack_mm cannot take this layer: {why}")
        dtype = dtype or scales.dtype
        return cls(w_int8.detach().cpu(), scales.detach().reshape(n).to(device="cpu", dtype=dtype),
                   None if bias is None else bias.detach().cpu())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        """Quantize ``linear`` with torchao's int8wo recipe (symmetric per output row, float32 eps, round half to
        even), in the linear's own dtype as torchao does; activations stay in that dtype."""
        w = linear.weight.detach()
        zero = torch.zeros((), dtype=w.dtype)
        amax = torch.maximum(-torch.minimum(w.amin(dim=1, keepdim=True), zero),
                             torch.maximum(w.amax(dim=1, keepdim=True), zero))
        scale = torch.clamp(amax / 127.5, min=INT8_EPS).to(torch.float32)
        q = torch.clamp(torch.round(w * (1.0 / scale)), -128, 127).to(torch.int8)
        return cls.from_quantized(q, scale.reshape(-1), linear.bias, dtype=w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Few eager ops: a decode step calls this ~100-170 times for one row each (Qwen2.5-0.5B).
        scales, bias, dtype = self.scales, self.bias, x.dtype
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(x.shape[:-1] + (self.out_features,))
        if dtype != scales.dtype:  # the kernels take activations in their scales' dtype only
            x2 = x2.to(scales.dtype)
        if torch.compiler.is_compiling():  # --enable-torch-compile: one opaque op, not a graph break per layer
            y = ops.int8_weight_only(x2.contiguous(), self.qweight, scales, bias, self.lib is not None)
        else:
            y = int8_weight_only_product(x2.contiguous(), self.qweight, scales, bias, self.lib)
        y = y.view(x.shape[:-1] + (self.out_features,))
        return y if y.dtype == dtype else y.to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the layer multiplies by (tests, debugging)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"int8 weight-only, activations {str(self.scales.dtype).removeprefix('torch.')}"


def int4_tinygemm_recipe(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's int4wo tinygemm recipe on w [N, K] (K a multiple of ``group_size``): q [N, K] in 0..15 (float),
    scale and zero [N, K / group] in w's dtype, with w ~ (q - 8) * scale + zero."""
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = torch.clamp((hi - lo) / 15.0, min=INT4_EPS)
    zero = lo + scale * 8.0
    low = (zero - scale * 8.0)[..., None]
    q = torch.clamp(torch.round((g - low) / scale[..., None]), 0, 15).reshape(n, k)
    return q, scale, zero


class Int4WeightOnlyLinear(nn.Module):
    """``nn.Linear`` with 4-bit weights in groups of ``group_size`` along K, each with a scale and a zero point,
    computed by ``torch._weight_int4pack_mm_for_cpu`` on tinygemm's packed layout (two values per byte)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # packed may hold padding rows
        self.group_size = group_size
        self.qweight = _frozen(packed)
        self.scales_and_zeros = _frozen(scales_and_zeros)  # [K / group, N, 2]: tinygemm's scale, zero
        self.bias = _bias(bias, scales_and_zeros.dtype)

    @classmethod
    def shape_supported(cls, out_features: int, in_features: int, group_size: int) -> str | None:
        """Why the kernel cannot take this shape (None: it can)."""
        if group_size not in INT4_GROUPS:
            return f"group size {group_size} is not one of {INT4_GROUPS}"
        if in_features % group_size:
            return f"in_features {in_features} is not a multiple of the group size {group_size}"
        return None

    @classmethod
    def _from_tinygemm(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                       bias: torch.Tensor | None, dtype: torch.dtype) -> Int4WeightOnlyLinear:
        """q: [N, K] 0..15; scale, zero: [N, K / group] with w = (q - 8) * scale + zero (tinygemm's convention)."""
        n, k = q.shape
        why = cls.shape_supported(n, k, group_size)
        if why:
            raise ValueError(f"torch._weight_int4pack_mm_for_cpu cannot take this layer: {why}")
        pad = -n % INT4_N_MULTIPLE  # rows of q = 8, scale = zero = 0: they compute 0 and are dropped
        q = torch.nn.functional.pad(q.to(device="cpu", dtype=torch.int32), (0, 0, 0, pad), value=8)
        scale, zero = (torch.nn.functional.pad(t.to(device="cpu", dtype=dtype), (0, 0, 0, pad)) for t in (scale, zero))
        packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
        return cls(packed, sz, group_size, k, n, None if bias is None else bias.detach().cpu())

    @classmethod
    def from_quantized(cls, w_int4: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       bias: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
                       ) -> Int4WeightOnlyLinear:
        """A layer from weights already quantized (e.g. a compressed-tensors W4A16 pack-quantized checkpoint,
        unpacked to one value per element).

        ``w_int4``: [N, K], one 4-bit value per element: int8 holding -8..7 (signed) or uint8 holding 0..15
        (unsigned); the dtype says which. ``scales``: [N, K / g], float. ``zeros``: [N, K / g] or None (= 0,
        symmetric), a zero point in the SAME integer domain as ``w_int4`` (compressed-tensors' ``zero_point``).
        The dequantized weight is ``(w_int4[n, k] - zeros[n, k // g]) * scales[n, k // g]``; the group size g is
        K / scales.shape[1]. ``dtype``: the activation dtype (default ``scales.dtype``): the kernel takes scales
        and zero points in it (rounded there; a zero point of 0 stays exact). Raises ValueError for values out of
        range or a shape the kernel cannot take."""
        if w_int4.dim() != 2 or w_int4.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"w_int4 must be a 2-D int8 (-8..7) or uint8 (0..15) tensor [N, K], got "
                             f"{w_int4.dtype} {tuple(w_int4.shape)}")
        n, k = w_int4.shape
        if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
            raise ValueError(f"scales must be [N, K / group] = [{n}, K / group] for K {k}, got {tuple(scales.shape)}")
        if zeros is not None and zeros.shape != scales.shape:
            raise ValueError(f"zeros must have the scales' shape {tuple(scales.shape)}, got {tuple(zeros.shape)}")
        signed = w_int4.dtype == torch.int8
        lo, hi = (-8, 7) if signed else (0, 15)
        if w_int4.numel() and (int(w_int4.min()) < lo or int(w_int4.max()) > hi):
            raise ValueError(f"w_int4 ({w_int4.dtype}) values must lie in {lo}..{hi}")
        group = k // scales.shape[1]
        dtype = dtype or scales.dtype
        offset = 8 if signed else 0  # to tinygemm's unsigned 0..15
        s = scales.detach().float()
        z = torch.zeros_like(s) if zeros is None else zeros.detach().float()
        # (q - z) * s = (q_u - 8) * s + (8 - (z + offset)) * s with q_u = q + offset
        zero = (8 - (z + offset)) * s
        return cls._from_tinygemm(w_int4.to(torch.int32) + offset, s, zero, group, bias, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4WeightOnlyLinear:
        """Quantize ``linear`` with torchao's int4wo tinygemm recipe (asymmetric per group, eps 1e-6, scale and zero
        in the linear's dtype); activations stay in that dtype."""
        w = linear.weight.detach()
        why = cls.shape_supported(*w.shape, group_size)
        if why:
            raise ValueError(f"torch._weight_int4pack_mm_for_cpu cannot take this layer: {why}")
        q, scale, zero = int4_tinygemm_recipe(w, group_size)
        return cls._from_tinygemm(q, scale, zero, group_size, linear.bias, w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.out_features,)
        if x.numel() == 0:
            return x.new_empty(shape)
        dtype = x.dtype
        if dtype != self.scales_and_zeros.dtype:  # the kernel takes activations in its scales' dtype only
            x = x.to(self.scales_and_zeros.dtype)
        y = torch._weight_int4pack_mm_for_cpu(_flat(x, self.in_features), self.qweight, self.group_size,
                                              self.scales_and_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(shape).to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the layer multiplies by, read back through the kernel (x = identity)."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        w = torch._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scales_and_zeros)
        return w[:, :self.out_features].t().float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"int4 weight-only, group {self.group_size}, " \
               f"activations {str(self.scales_and_zeros.dtype).removeprefix('torch.')}"


QUANT_LINEARS = (Int8WeightOnlyLinear, Int4WeightOnlyLinear)


def use_kernel(model: nn.Module, kernels) -> int:
    """Give the int8 weight-only layers of ``model`` tierlm's streaming kernel where ``kernels`` (the model's
    CpuKernels) plans ``int8_products=gemv``; returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, Int8WeightOnlyLinear)]
    lib = kernels.lib if kernels is not None and kernels.plan.int8_products.value == "gemv" else None
    for m in layers:
        m.lib = lib
    return len(layers) if lib is not None else 0


def quantize_linears(model: nn.Module, bits: int, group_size: int | None = None) -> tuple[int, list[str]]:
    """Swap every CPU ``nn.Linear`` of ``model`` (lm_head included: a tied one gets a quantized table of its own,
    which quant_embedding.quantize_embedding then makes the embedding's table too, so it is held once) for an
    int8 (``bits`` 8) or int4 (``bits`` 4, ``group_size``)
    weight-only layer; returns (how many, the layers kept dense with the reason: shapes the kernel cannot take)."""
    swaps, kept = [], []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear or m.weight.device.type != "cpu" or not m.weight.is_floating_point():
            continue  # subclasses (LoRA, already quantized) have their own forward
        n, k = m.weight.shape
        why = Int8WeightOnlyLinear.shape_supported(n, k) if bits == 8 else \
            Int4WeightOnlyLinear.shape_supported(n, k, group_size)
        if why:
            kept.append(f"{name}: {why}")
        else:
            swaps.append((name, m))
    for name, m in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = Int8WeightOnlyLinear.from_linear(m) if bits == 8 else Int4WeightOnlyLinear.from_linear(m, group_size)
        setattr(parent, attr, new)
    return len(swaps), kept
