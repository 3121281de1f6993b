"""Sizes of a model folder without loading it: KV bytes per token and weight bytes in the serving dtype.

`tierlm doctor` and `tierlm bench` size a model here with the formulas the backends size their pools by
(backends/dtypes.py); the folder's files themselves are read once, in model_folder.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierlm.backends.base import StateGeometry
from tierlm.backends.dtypes import DTYPE_BYTES, kv_bytes_per_token, kv_storage_dtype, serving_dtype
from tierlm.backends.model_source.builtin_model import is_builtin_model
from tierlm.backends.model_source.hybrid_layout import hybrid_layout
from tierlm.backends.model_source.model_folder import ModelFolder, as_model_folder

SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")
MAX_HEADER_BYTES = 100 << 20  # a larger header length means the file is not safetensors


@dataclass
class ModelSize:
    path: str
    dtype: str
    kv_bytes_per_token: int
    weight_bytes: int
    vocab_size: int | None
    state_slot_bytes: int = 0  # hybrids: one request's recurrent state (the memory plan sets aside one per slot)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def attention_shape(text_config: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a config's text model (head size: ``head_dim``, else hidden / heads)."""
    heads = int(text_config["num_attention_heads"])
    return heads, int(text_config.get("num_key_value_heads") or heads), \
        int(text_config.get("head_dim") or text_config["hidden_size"] // heads)


def model_size(model_dir: ModelFolder | Path, dtype: str = "auto", device: str = "cpu", kv_cache_dtype: str = "auto",
               cpu_bf16: bool = False) -> ModelSize:
    """KV bytes per token and weight bytes of a local model folder served in ``dtype`` on ``device`` (auto: as
    the backends resolve it, dtypes.serving_dtype, with ``cpu_bf16`` the platform decision's native_bf16) with KV
    pages in ``kv_cache_dtype`` (--kv-cache-dtype), from config.json and the safetensors headers."""
    folder = as_model_folder(model_dir)
    cfg = folder.text_config
    stored = cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype == "auto" and is_builtin_model(folder.path):
        dtype = "float32"  # builtin_model.BUILTIN_DTYPE_WHY
    dtype = serving_dtype(dtype, device, stored if isinstance(stored, str) else None, cpu_bf16)
    heads, kv_heads, head_dim = attention_shape(cfg)
    vocab = cfg.get("vocab_size")
    layout = hybrid_layout(cfg)
    state = 0 if layout is None else StateGeometry(len(layout.linear_layers), layout.conv_dim, layout.conv_kernel,
                                                   layout.rec_shape, dtype).slot_bytes
    return ModelSize(path=str(folder.path), dtype=dtype,
                     kv_bytes_per_token=kv_bytes_per_token(int(cfg["num_hidden_layers"]), kv_heads, head_dim,
                                                           kv_storage_dtype(kv_cache_dtype, dtype)),
                     weight_bytes=weight_bytes(folder, dtype), vocab_size=int(vocab) if vocab else None,
                     state_slot_bytes=state)


def weight_bytes(model_dir: ModelFolder | Path, dtype: str, mxfp4_dequantized: bool = False,
                 fp8_dequantized: bool = False) -> int:
    """Bytes of the weights as an engine holds them in ``dtype`` (floating tensors cast, the rest as stored: MXFP4
    ``*_blocks`` / ``*_scales`` stay packed, as the mlx backend and the torch backend's packed experts hold them;
    ``mxfp4_dequantized``: as the torch backend holds them dequantized, two values per block byte in ``dtype``;
    ``fp8_dequantized``: float8 tensors in ``dtype``, as a device without fp8 matmuls holds them).

    Read from the safetensors headers; a file whose header cannot be read (and *.bin files, which have none)
    counts its size on disk.
    """
    files = list(as_model_folder(model_dir).weight_files)
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    total = 0
    for path in safetensors or files:  # a folder with both formats is loaded from its safetensors
        header = _safetensors_header(path) if path.suffix == ".safetensors" else None
        if header is None:
            total += path.stat().st_size
            continue
        for name, t in header.items():
            if name == "__metadata__":
                continue
            numel = math.prod(int(d) for d in t["shape"])
            if mxfp4_dequantized and t["dtype"] == "U8" and name.endswith(("_blocks", "_scales")):
                total += 2 * numel * DTYPE_BYTES[dtype] if name.endswith("_blocks") else 0
                continue
            floats = SAFETENSORS_FLOATS + (("F8_E4M3", "F8_E5M2") if fp8_dequantized else ())
            float_bytes = DTYPE_BYTES.get(dtype) if t["dtype"] in floats else None
            total += numel * (float_bytes or SAFETENSORS_BYTES.get(t["dtype"], 4))
    return total


def _safetensors_header(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    return header if isinstance(header, dict) else None
