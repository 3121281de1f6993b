"""Dtype facts every part of tierlm shares: what ``--dtype auto`` means on a device, and bytes per KV token.

Backends, ``tierlm doctor`` and ``tierlm bench`` all size models from these, so a planned size is the size
the backend allocates.
"""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
HALF_DTYPES = ("bfloat16", "float16")


def serving_dtype(requested: str, device: str, stored: str | None = None) -> str:
    """The dtype a model is served in on ``device`` ("cpu" | "cuda" | "mps"/"metal").

    ``auto``: float32 on CPU (exact match with the float32 reference, and the fast matmuls there today),
    bfloat16 on CUDA, and on Apple's GPU the checkpoint's half dtype (``stored``) or else float32.
    """
    if requested != "auto":
        return requested
    if device == "cuda":
        return "bfloat16"
    if device in ("mps", "metal") and stored in HALF_DTYPES:
        return stored
    return "float32"


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
