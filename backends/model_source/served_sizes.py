"""A model folder's sizes as a backend will serve it, from config.json and the safetensors headers alone: the dtype,
the KV storage dtype, the weight format /server_info reports, the weight bytes (a load-time quantization at its
packed size) and KV bytes per token. The backends' load plans (backends/*/load_plan.py) add what each holds
differently."""
from __future__ import annotations

from typing import Mapping

from tierlm.backends.base import ServedSizes
from tierlm.backends.dtypes import DTYPE_BYTES, kv_storage_dtype
from tierlm.backends.model_source.folder_facts import attention_shape, model_size
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.weight_format import WeightQuant, quantized_bytes, safetensors_shapes, weight_format_label


def served_sizes(folder: ModelFolder, dtype: str, device: str, kv_cache_dtype: str, quant: WeightQuant | None,
                 env: Mapping[str, str], native_bf16: bool = False) -> ServedSizes:
    """Raises KeyError/TypeError/ValueError for a config without the usual fields."""
    size = model_size(folder, dtype, device, kv_cache_dtype=kv_cache_dtype, cpu_bf16=native_bf16)
    held = size.weight_bytes
    if quant is not None:
        held = quantized_bytes(safetensors_shapes(list(folder.weight_files)), DTYPE_BYTES.get(size.dtype, 4), quant,
                               device, env)
    heads, kv_heads, head_dim = attention_shape(folder.text_config)
    return ServedSizes(size.dtype, kv_storage_dtype(kv_cache_dtype, size.dtype),
                       weight_format_label(folder.config, quant, device, env), held, size.kv_bytes_per_token,
                       size.state_slot_bytes, size.vocab_size, (heads, kv_heads, head_dim))
