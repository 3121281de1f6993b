"""Which kernel each layer type of a loaded torch model runs, and why: /server_info's ``kernels``.

On CPU the decisions are the model's execution plan (cpu/plan.py, platforms/cpu_plan.py); this report says them per
layer type, counted from what was actually set up in the model (packed linears, kernel-backed layers), so it cannot
drift from them. The plan itself (every field, its value and reason) and the kernel library (its level, file and
kernels, or why none loaded) are in the report too.
"""
from __future__ import annotations

import torch
from torch import nn

from tierlm.backends.torch import paged_attention
from tierlm.backends.torch.cpu import f32_gemv, int8_gemv, paged_extend
from tierlm.backends.torch.cpu.linear import PackedLinear, torch_refusal
from tierlm.backends.torch.fused_projections import FusedGateUpMLP, FusedQKVAttention
from tierlm.backends.torch.weights.quant_linear import DENSE_PREFILL_ROWS, Int4WeightOnlyLinear, Int8WeightOnlyLinear


def _weight_only(int8: list, int4: int, plain: int, dtype: torch.dtype, name: str) -> str:
    """The int8 / int4 weight-only layers' kernels, as weights/quant_linear.py picks them per call."""
    parts = []
    if int8:
        prefill = f"; from {DENSE_PREFILL_ROWS} rows oneDNN on the weight widened to bf16" \
            if dtype == torch.bfloat16 else ""
        lib = int8[0].lib
        if lib is not None and int8_gemv.takes(1, dtype):
            rows = f"up to {int8_gemv.MAX_ROWS} rows" if dtype == torch.bfloat16 else "all rows"
            parts.append(f"int8: C weight-only streaming kernel for {rows} (cpu/int8_gemv.py, built for "
                         f"{lib.level}), else torch _weight_int8pack_mm{prefill}")
        else:
            parts.append(f"int8: torch _weight_int8pack_mm weight-only{prefill}")
    if int4:
        parts.append("int4: torch _weight_int4pack_mm_for_cpu weight-only")
    return f"{'; '.join(parts)} ({len(int8) + int4} layers, activations {name}" + \
        (f"; {plain} plain)" if plain else ")")


def _linear(model: nn.Module, device: str, dtype: torch.dtype, kernels) -> str:
    name = str(dtype).removeprefix("torch.")
    modules = list(model.modules())
    packed = [m for m in modules if isinstance(m, PackedLinear)]
    plain = sum(type(m) is nn.Linear for m in modules)
    # torchao-quantized linears (--torchao-config, weights/weight_quant.py) keep nn.Linear with a tensor-subclass
    # weight.
    quantized = [type(m.weight).__name__ for m in modules
                 if isinstance(m, nn.Linear) and type(m.weight) not in (torch.Tensor, nn.Parameter)]
    int8 = [m for m in modules if isinstance(m, Int8WeightOnlyLinear)]
    int4 = sum(isinstance(m, Int4WeightOnlyLinear) for m in modules)
    f32 = [m for m in modules if isinstance(m, f32_gemv.F32GemvLinear)]
    if int8 or int4:
        return _weight_only(int8, int4, plain, dtype, name)
    if quantized:
        return f"torchao {', '.join(sorted(set(quantized)))} ({len(quantized)} layers, activations {name})"
    if device != "cpu":
        return f"torch F.linear {name} (cuBLAS)"
    plan = kernels.plan if kernels is not None else None
    if f32:
        held = {d: sum(m.weight.dtype == d for m in f32) for d in (torch.bfloat16, torch.float16)}
        kinds = " and ".join(f"{n} weights held as {str(d).removeprefix('torch.')}" for d, n in held.items() if n)
        return (f"float32: up to {f32_gemv.MAX_ROWS} rows on tierlm's C kernel ({len(f32)} layers; cpu/f32_gemv.py, "
                f"built for {kernels.lib.level}), longer products torch F.linear (MKL GEMM)" +
                (f"; {kinds}, exactly (weights/stored_16bit.py: half the bytes, widened in registers or in slices)"
                 if kinds else "") + (f"; {plain} plain" if plain else ""))
    if packed:
        linear = f"oneDNN-prepacked {name} ({len(packed)} layers" + (f"; {plain} shared/tied plain)" if plain else ")")
        fast = [m for m in packed if m.fast_rows]
        if fast:
            linear += (f"; up to {max(m.fast_rows for m in fast)} rows on tierlm's {fast[0].kernel.NAME} kernel over "
                       f"the packed weight in {len(fast)} of them (cpu/{fast[0].kernel.__name__.rpartition('.')[2]}"
                       f".py, built for {fast[0].lib.level})")
        elif plan is not None:
            linear += f"; decode-sized products on oneDNN ({plan.decode_products.why})"
        return linear
    if dtype == torch.bfloat16 and plan is not None:
        refusal = torch_refusal() if plan.bf16_linear.value == "packed" else None  # the plan said packed; torch not
        why = f"torch's plain bf16 linear: torch refuses the oneDNN bf16 reorder here ({refusal})" if refusal \
            else plan.bf16_linear.why
        return f"torch F.linear {name} ({why})"
    if dtype == torch.float32 and plan is not None and plan.f32_products.value == "mkl":
        return f"torch F.linear {name} (oneDNN/MKL GEMM; {plan.f32_products.why})"
    return f"torch F.linear {name} (oneDNN/MKL GEMM)"


def kernel_report(model: nn.Module, device: str, dtype: torch.dtype, kv_dtype: torch.dtype, attention_backend: str,
                  heads: int, kv_heads: int, head_dim: int, kernels=None) -> dict:
    """``kernels``: the model's CpuKernels on CPU (None elsewhere)."""
    linear = _linear(model, device, dtype, kernels)
    fused_qkv = sum(isinstance(m, FusedQKVAttention) for m in model.modules())
    fused_mlp = sum(isinstance(m, FusedGateUpMLP) for m in model.modules())
    if fused_qkv or fused_mlp:  # fused_projections.py: fewer, wider linears per layer
        linear += f"; q/k/v fused in {fused_qkv} layers, gate/up in {fused_mlp}"
    if attention_backend == paged_attention.TRITON:
        return {"linear": linear, "prefill_attention": "Triton paged extend over the pool",
                "decode_attention": "Triton paged decode over the pool"}
    eager = "torch eager matmuls + softmax over gathered pages" if dtype in (torch.bfloat16, torch.float16) \
        else "torch SDPA over gathered pages"
    if kernels is None:
        return {"linear": linear, "prefill_attention": "torch SDPA (fused causal; gathered pages after a prefix hit)",
                "decode_attention": eager}
    plan = kernels.plan
    decode = f"C paged kernel over the pool in place, built for {kernels.lib.level}" \
        if kernels.decode is not None else f"{eager} ({plan.decode_attention.why})"
    choice = plan.prefill_attention
    if choice.value == "one_pass":
        prefill = (f"blocked bf16 attention, each block's scores, softmax and P.V in one AVX512-BF16 C pass "
                   f"(cpu/blocked_one_pass.py), built for {kernels.lib.level}; SDPA for sliding windows and sinks")
    elif choice.value == "blocked":
        prefill = (f"blocked bf16 GEMMs + C row softmax (cpu/blocked_attention.py), built for {kernels.lib.level}; "
                   "SDPA for sliding windows and sinks")
    else:
        prefill = f"torch SDPA (fused causal; gathered pages after a prefix hit; {choice.why})"
    kernel = plan.extend_kernel.value
    if kernels.extend is not None:
        rows = paged_extend.MAX_ROWS_F32 if kernel == "f32" else paged_extend.MAX_ROWS
        how = {"amx": "AMX tiles", "avx512": "AVX-512", "f32": "float32"}[kernel]
        prefill += (f"; extends of up to {rows} rows per request: C paged extend kernel over the pool in place "
                    f"({how}, cpu/paged_extend.py, built for {kernels.lib.level})")
    return {"linear": linear, "prefill_attention": prefill, "decode_attention": decode, **kernels.to_dict()}
