"""Which kernel each layer type of a loaded torch model runs, and why: /server_info's ``kernels``.

Read from what was actually set up (packed linears counted in the model, the decode kernel as built), so the report
cannot drift from the decisions in cpu_linear.py, cpu_int8_gemv.py, cpu_paged_decode.py and the extend kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from tierlm.backends.torch import (cpu_blocked_attention, cpu_blocked_scores, cpu_f32_gemv, cpu_int8_gemv,
                                   cpu_paged_decode, cpu_paged_extend, cpu_paged_extend_f32, paged_attention)
from tierlm.backends.torch.cpu_linear import PackedLinear, decode_kernel, packing_available
from tierlm.backends.torch.cpu_quant_linear import DENSE_PREFILL_ROWS, Int4WeightOnlyLinear, Int8WeightOnlyLinear
from tierlm.backends.torch.fused_projections import FusedGateUpMLP, FusedQKVAttention


def _weight_only(int8: int, int4: int, plain: int, dtype: torch.dtype, name: str) -> str:
    """The int8 / int4 weight-only layers' kernels, as cpu_quant_linear.py picks them per call."""
    parts = []
    if int8:
        prefill = f"; from {DENSE_PREFILL_ROWS} rows oneDNN on the weight widened to bf16" \
            if dtype == torch.bfloat16 else ""
        if cpu_int8_gemv.takes(1, dtype):
            rows = f"up to {cpu_int8_gemv.MAX_ROWS} rows" if dtype == torch.bfloat16 else "all rows"
            parts.append(f"int8: C weight-only streaming kernel for {rows} (cpu_int8_gemv.py, built for "
                         f"{cpu_int8_gemv.describe()['level']}), else torch _weight_int8pack_mm{prefill}")
        else:
            parts.append(f"int8: torch _weight_int8pack_mm weight-only{prefill}")
    if int4:
        parts.append("int4: torch _weight_int4pack_mm_for_cpu weight-only")
    return f"{'; '.join(parts)} ({int8 + int4} layers, activations {name}" + (f"; {plain} plain)" if plain else ")")


def kernel_report(model: nn.Module, device: str, dtype: torch.dtype, kv_dtype: torch.dtype,
                  attention_backend: str, heads: int, kv_heads: int, head_dim: int) -> dict[str, str]:
    name = str(dtype).removeprefix("torch.")
    packed = sum(isinstance(m, PackedLinear) for m in model.modules())
    plain = sum(type(m) is nn.Linear for m in model.modules())
    # torchao-quantized linears (--torchao-config, weight_quant.py) keep nn.Linear with a tensor-subclass weight.
    quantized = [type(m.weight).__name__ for m in model.modules()
                 if isinstance(m, nn.Linear) and type(m.weight) not in (torch.Tensor, nn.Parameter)]
    int8 = sum(isinstance(m, Int8WeightOnlyLinear) for m in model.modules())
    int4 = sum(isinstance(m, Int4WeightOnlyLinear) for m in model.modules())
    f32 = sum(isinstance(m, cpu_f32_gemv.F32GemvLinear) for m in model.modules())
    if int8 or int4:
        linear = _weight_only(int8, int4, plain, dtype, name)
    elif quantized:
        linear = f"torchao {', '.join(sorted(set(quantized)))} ({len(quantized)} layers, activations {name})"
    elif device != "cpu":
        linear = f"torch F.linear {name} (cuBLAS)"
    elif f32:
        held = {d: sum(isinstance(m, cpu_f32_gemv.F32GemvLinear) and m.weight.dtype == d for m in model.modules())
                for d in (torch.bfloat16, torch.float16)}
        kinds = " and ".join(f"{n} weights held as {str(d).removeprefix('torch.')}" for d, n in held.items() if n)
        linear = (f"float32: up to {cpu_f32_gemv.MAX_ROWS} rows on tierlm's C kernel ({f32} layers; cpu_f32_gemv.py, "
                  f"built for {cpu_f32_gemv.describe()['level']}), longer products torch F.linear (MKL GEMM)" +
                  (f"; {kinds}, exactly (cpu_16bit_stored_weights.py: half the bytes, widened in registers or in "
                   "slices)" if kinds else "") + (f"; {plain} plain" if plain else ""))
    elif packed:
        linear = f"oneDNN-prepacked {name} ({packed} layers" + (f"; {plain} shared/tied plain)" if plain else ")")
        fast = [m.fast_rows for m in model.modules() if isinstance(m, PackedLinear) and m.fast_rows]
        kernel = decode_kernel()
        if fast and kernel is not None:
            linear += (f"; up to {max(fast)} rows on tierlm's {kernel.NAME} kernel over the packed weight in "
                       f"{len(fast)} of them ({kernel.__name__.rpartition('.')[2]}.py, built for "
                       f"{kernel.describe()['level']})")
    elif dtype == torch.bfloat16:
        linear = f"torch F.linear {name} ({packing_available()[1]})"
    else:
        linear = f"torch F.linear {name} (oneDNN/MKL GEMM)"
    fused_qkv = sum(isinstance(m, FusedQKVAttention) for m in model.modules())
    fused_mlp = sum(isinstance(m, FusedGateUpMLP) for m in model.modules())
    if fused_qkv or fused_mlp:  # fused_projections.py: fewer, wider linears per layer
        linear += f"; q/k/v fused in {fused_qkv} layers, gate/up in {fused_mlp}"
    if attention_backend == paged_attention.TRITON:
        return {"linear": linear, "prefill_attention": "Triton paged extend over the pool",
                "decode_attention": "Triton paged decode over the pool"}
    decode = "torch eager matmuls + softmax over gathered pages" if dtype in (torch.bfloat16, torch.float16) \
        else "torch SDPA over gathered pages"
    if device == "cpu" and cpu_paged_decode.supported(dtype, kv_dtype, heads, kv_heads, head_dim):
        build = cpu_paged_decode.describe()
        if cpu_paged_decode.load() is not None:
            decode = f"C paged kernel over the pool in place, built for {build['level']}"
        else:
            decode += f" ({build['why']})"
    prefill = "torch SDPA (fused causal; gathered pages after a prefix hit)"
    lib = cpu_paged_decode.load() if device == "cpu" else None
    if cpu_blocked_attention.runs_on(device, dtype) and lib is not None:
        prefill = (f"blocked bf16 GEMMs + C row softmax (cpu_blocked_attention.py), built for "
                   f"{cpu_paged_decode.describe()['level']}; SDPA for sliding windows and sinks")
        if cpu_blocked_scores.available(lib):
            prefill += ("; each block's scores, softmax and P.V in one AVX512-BF16 C pass (cpu_blocked_scores.py), "
                        "split between torch's threads by the C++ op where it is loaded, else at one thread only")
    elif device == "cpu" and dtype == torch.bfloat16 and cpu_blocked_attention.choice()[0] == "sdpa":
        prefill = f"torch SDPA (fused causal; gathered pages after a prefix hit; {cpu_blocked_attention.choice()[1]})"
    if device == "cpu" and cpu_paged_extend.available(lib) and \
            cpu_paged_extend.supported(dtype, kv_dtype, heads, kv_heads, head_dim):
        tiles = cpu_paged_extend.amx_usable(lib) and head_dim % 32 == 0
        if tiles or cpu_blocked_attention.runs_on(device, dtype):
            prefill += (f"; extends of up to {cpu_paged_extend.MAX_ROWS} rows per request: C paged extend kernel "
                        f"over the pool in place ({'AMX tiles' if tiles else 'AVX-512'}, cpu_paged_extend.py)")
    if device == "cpu" and cpu_paged_extend_f32.available(lib) and \
            cpu_paged_extend_f32.supported(dtype, kv_dtype, heads, kv_heads, head_dim):
        prefill += (f"; extends of up to {cpu_paged_extend_f32.MAX_ROWS} rows per request: C float32 paged extend "
                    f"kernel over the pool in place (cpu_paged_extend_f32.py, built for "
                    f"{cpu_paged_decode.describe()['level']})")
    return {"linear": linear, "prefill_attention": prefill, "decode_attention": decode}
