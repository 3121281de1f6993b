"""Dtype facts every part of tierlm shares: what ``--dtype auto`` means on a device, and bytes per KV token.

Backends, ``tierlm doctor`` and ``tierlm bench`` all size models from these, so a planned size is the size
the backend allocates.
"""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
HALF_DTYPES = ("bfloat16", "float16")


def serving_dtype(requested: str, device: str, stored: str | None = None, cpu_bf16: bool = False) -> str:
    """The dtype a model is served in on ``device`` ("cpu" | "cuda" | "mps"/"metal"); see ``dtype_decision``."""
    return dtype_decision(requested, device, stored, cpu_bf16)[0]


def dtype_decision(requested: str, device: str, stored: str | None = None, cpu_bf16: bool = False
                   ) -> tuple[str, str]:
    """(dtype, why) for ``--dtype`` on ``device``; ``stored`` is the checkpoint's dtype (config.json), and
    ``cpu_bf16`` says the CPU has native bf16 matmuls (AVX512-BF16 or AMX-BF16: platforms/facts.py) and the
    backend's kernels use them (torch; MLX's CPU kernels gain nothing from bf16, so it never passes True).

    ``auto``: bfloat16 on CUDA; on Apple's GPU the checkpoint's half dtype, else float32; on a CPU with native
    bf16, bfloat16 for every floating checkpoint (vLLM CPU's rule: float32 checkpoints are downcast to bf16 and
    bf16 ones kept; a float16 checkpoint also becomes bf16 here, where vLLM keeps it, because torch's float16
    CPU matmuls run 5-10x slower than bf16 without AVX512-FP16); float32 on any other CPU (exact against the
    float32 reference, and the fast matmuls there).
    """
    if requested != "auto":
        if requested in HALF_DTYPES and device == "cpu" and not cpu_bf16:
            return requested, (f"--dtype {requested} on a CPU without native {requested} matmuls (AVX512-BF16, "
                               "AMX-BF16 or Arm BF16): it runs converted through float32, slower than --dtype float32")
        return requested, "--dtype"
    if device == "cuda":
        return "bfloat16", "--dtype auto on CUDA"
    if device in ("mps", "metal"):
        if stored in HALF_DTYPES:
            return stored, f"--dtype auto on Apple's GPU: the checkpoint's {stored}"
        return "float32", f"--dtype auto on Apple's GPU: the checkpoint is {stored or 'of unknown dtype'}"
    if cpu_bf16:
        kept = "kept" if stored == "bfloat16" else f"{stored or 'float32 (unstated)'} served in bfloat16"
        return "bfloat16", (f"--dtype auto on a CPU with native bf16 matmuls: the checkpoint's {kept}, as vLLM CPU "
                            "does; --dtype float32 for float32 outputs")
    return "float32", "--dtype auto on a CPU without native bf16 matmuls (AVX512-BF16, AMX-BF16 or Arm BF16)"


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype KV pages are stored in for ``--kv-cache-dtype`` (SGLang's names): ``auto`` is the model's
    serving dtype, ``bf16``/``bfloat16`` is bfloat16, ``fp8_e4m3``/``fp8_e5m2`` are 8-bit floats."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("bf16", "bfloat16"):
        return "bfloat16"
    if kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2"):
        return kv_cache_dtype
    raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; use auto, bf16, fp8_e4m3 or fp8_e5m2")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of one token across all layers: the unit every KV pool (device, host, file) is sized in."""
    return 2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
