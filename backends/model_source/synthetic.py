"""Synthetic models for benchmarks: seeded random weights in the exact shapes of real architectures.

`tierlm bench --synthetic qwen2.5-0.5b` needs no download: the config is the published one (hidden size, layers,
heads, vocabulary, rope), the weights are seeded noise, so speed and memory match the real model while its
output is meaningless. Benchmarks therefore send token ids and count tokens, never text.

The tokenizer saved with each model is the demo model's byte-level tokenizer (285 ids); the model's vocabulary
is much larger, so generated ids above 284 decode to nothing. That is fine for timing and cache statistics.

A model is built once into ``<user cache>/tierlm/synthetic/<name>`` (a private temporary folder renamed into
place, as the demo model is) and rebuilt only when its spec changes. The safetensors file is written one
tensor at a time, so building Qwen2.5-0.5B needs about one embedding matrix of memory. Weights are stored as
bf16 (and config.json says so), as the published checkpoints of these shapes are: a server loading them sees the
bytes and the dtype a real checkpoint gives it (a float32-serving CPU holds them as bf16: backends/torch/weights/stored_16bit.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tierlm.backends.model_source.tokenizer import save_byte_tokenizer

log = logging.getLogger(__name__)

SEED = 20250101
WEIGHT_STD = 0.02  # the published initializer_range of both families
FORMAT_VERSION = 2  # bump when the bytes written for the same spec change (2: bf16 instead of float32)
MARKER = "synthetic.json"

# Published configs (Hugging Face config.json of the real checkpoints), minus the weights.
SPECS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_act="silu", use_sliding_window=False, sliding_window=None, max_window_layers=21,
        bos_token_id=151643, eos_token_id=151645, initializer_range=0.02,
    ),
    # The next size up (issue #30's second shape for weight formats): 1.54 B parameters, 6.2 GB as float32 on disk.
    "qwen2.5-1.5b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=1536, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_act="silu", use_sliding_window=False, sliding_window=None, max_window_layers=21,
        bos_token_id=151643, eos_token_id=151645, initializer_range=0.02,
    ),
    "llama-small": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=512, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408, vocab_size=32000,
        tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5,
        hidden_act="silu", bos_token_id=1, eos_token_id=2, initializer_range=0.02,
    ),
    # A hybrid (gated DeltaNet + gated attention every 4th layer) of Qwen3.5-0.8B's published size: 24 layers,
    # hidden 1024, 8 query / 2 KV heads, 6 attention layers. The linear-attention widths (16 key and 16 value heads
    # of 128) and the MLP width are assumptions of this shape, not read from the checkpoint: its state per request
    # is then ~19 MiB (18 layers x (1 MiB recurrent + 48 KiB conv)), the size that matters for the cache tiers.
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=1024, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, intermediate_size=3584, vocab_size=248320,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_act="silu", bos_token_id=248044, eos_token_id=248044, initializer_range=0.02,
    ),
    # Seconds to build and run: for tests of the benchmark commands themselves.
    "tiny": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=285,
        tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-5,
        hidden_act="silu", bos_token_id=1, eos_token_id=2, initializer_range=0.02,
    ),
}


def synthetic_names() -> list[str]:
    return sorted(SPECS)


def default_cache_root() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("tierlm")) / "synthetic"


def ensure_synthetic_model(name: str, cache_root: Path | None = None,
                           progress: Callable[[int, int], None] | None = None) -> Path:
    """Return the folder of synthetic model ``name``, building it first when absent or built from another spec.

    ``progress(done_bytes, total_bytes)`` is called while weights are written (a build can take ~20 s).
    """
    if name not in SPECS:
        raise ValueError(f"unknown synthetic model {name!r}; choose one of {', '.join(synthetic_names())}")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / name
    digest = spec_digest(name)
    if _built_from(target) == digest:
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=root))
    try:
        log.info("building synthetic model %s (random weights, published shapes) in %s", name, target)
        write_synthetic_model(name, tmp, progress)
        if target.exists():  # an older spec or an interrupted build: replace it
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=root))
            os.rename(target, old / "m")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if _built_from(target) != digest:  # another process won the race with the same spec: use it
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def spec_digest(name: str) -> str:
    blob = json.dumps({"spec": SPECS[name], "seed": SEED, "std": WEIGHT_STD, "v": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_synthetic_model(name: str, out_dir: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write config, generation config, weights (model.safetensors) and tokenizer of ``name`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(SPECS[name])
    config = _hf_config(spec)
    config.dtype = "bfloat16"  # the weights' dtype (config.json "dtype"), as the published checkpoints say
    config.save_pretrained(out_dir)
    eos = spec["eos_token_id"]
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": spec["bos_token_id"], "eos_token_id": eos, "do_sample": False}, indent=2))
    shapes = weight_shapes(config)
    _write_safetensors(out_dir / "model.safetensors", shapes, progress)
    save_byte_tokenizer(out_dir, model_max_length=1 << 30)
    (out_dir / MARKER).write_text(json.dumps({"name": name, "digest": spec_digest(name), "seed": SEED,
                                              "note": "random weights in a published shape; output is meaningless"},
                                             indent=2))
    return out_dir


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the architecture, from transformers itself (on the meta device, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # stored once, as the embedding
    return shapes


def _hf_config(spec: dict[str, Any]):
    from transformers import AutoConfig

    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, **spec)


def _tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Seeded per tensor name (not by order), so every build writes the same bytes."""
    if len(shape) == 1 and "norm" in name:
        return np.ones(shape, np.float32)  # RMSNorm scales start at one, as in a fresh model
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= WEIGHT_STD
    return a


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even, as torch rounds), as their uint16 bits."""
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]],
                       progress: Callable[[int, int], None] | None) -> None:
    """The safetensors format written by hand, streaming one tensor at a time (bf16)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(shapes)
    for n in names:
        size = int(np.prod(shapes[n])) * 2
        header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data must start 8-byte aligned
    done = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for n in names:
            data = _bf16_bits(_tensor(n, shapes[n]))
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            done += data.nbytes
            if progress is not None:
                progress(done, offset)


def _built_from(folder: Path) -> str | None:
    try:
        meta = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():
        return None
    return meta.get("digest")
