"""Load a Hugging Face causal LM with transformers' modeling classes, wired to tierlm's paged attention."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tierlm.backends.torch import paged_attention

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto -> float32 on CPU (exact reference match, fastest matmuls here), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    paged_attention.register()
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code,
    )
    model.set_attn_implementation(paged_attention.ATTN_IMPLEMENTATION)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
