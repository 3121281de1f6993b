"""The random demo model: a tiny random Llama with a ChatML template and a byte-level tokenizer, needing no download.

Its weights are seeded noise, so it answers with meaningless text; tests use it where the server's chat, tool and
grammar paths need a ChatML model with a large context (`tierlm serve` with no --model-path serves the real
stories260K instead: builtin_model.py). It is built on first use (well under a second, numpy only, no torch)
into the user cache folder and reused afterwards. Every build gives the same bytes, so its fingerprint, and
therefore any L3 KV cache made with it, is the same on every machine and after a rebuild.

Building happens in a private temporary folder that is renamed into place in one step, so two servers
starting at once never see a half-built model: one rename wins, the other process uses the winner's folder.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from tierlm.backends.model_source.errors import ModelSourceError
from tierlm.backends.model_source.tokenizer import BOS_ID, EOS_ID, IM_END_ID, save_byte_tokenizer

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo-model-v1"  # bump the suffix whenever the built bytes change

# Files a complete demo folder has; a folder missing any of them is rebuilt.
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")

HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
SEED = 20240601
WEIGHT_STD = 0.1  # larger than HF's 0.02 init so logits are spread and sampled text varies


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the demo model folder, building it first if it is absent or incomplete.

    ``cache_dir`` is the parent folder (default: platformdirs' user cache folder for "tierlm"); the model lives
    in ``cache_dir / "demo-model-v1"``.
    """
    if cache_dir is None:
        import platformdirs

        cache_dir = Path(platformdirs.user_cache_dir("tierlm"))
    cache_dir = Path(cache_dir)
    target = cache_dir / DEMO_MODEL_NAME
    if _is_complete(target):
        return target
    if target.exists():
        logger.warning("demo model folder %s is incomplete (a file was deleted?); rebuilding it", target)
        _move_aside(target)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.building-", dir=cache_dir))
    except OSError as exc:
        raise ModelSourceError(
            f"cannot build the demo model in {cache_dir} ({exc}); make that folder writable, or pass a real "
            "model with --model-path (e.g. Qwen/Qwen2.5-0.5B-Instruct)."
        ) from None
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the finished model is an ordinary readable folder
    try:
        write_demo_model(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process renamed its build in first
            logger.info("built the demo model at %s", target)
        except OSError:
            if not _is_complete(target):
                raise
            logger.info("another process built the demo model at %s first; using it", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_demo_model(out_dir: Path) -> Path:
    """Write the demo model's files into ``out_dir`` (an existing folder); the same bytes on every call."""
    out_dir = Path(out_dir)
    special = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<|im_end|>"}
    _write_json(out_dir / "special_tokens_map.json", special)
    vocab_size = save_byte_tokenizer(out_dir, **special, add_bos_token=False, add_eos_token=False,
                                     model_max_length=2048)
    _write_json(out_dir / "config.json", _model_config(vocab_size))
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": [IM_END_ID, EOS_ID], "do_sample": True,
        "temperature": 0.7, "top_p": 0.9,
    })
    _write_weights(out_dir / "model.safetensors", vocab_size)
    return out_dir


def _model_config(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": [IM_END_ID, EOS_ID],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _weight_shapes(vocab_size: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        })
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (vocab_size, HIDDEN)
    return shapes


def _write_weights(path: Path, vocab_size: int) -> None:
    from safetensors.numpy import save_file

    # RandomState, not default_rng: NumPy guarantees RandomState's stream never changes between versions,
    # so the demo weights (and their fingerprint) are the same bytes everywhere.
    rng = np.random.RandomState(SEED)
    tensors: dict[str, np.ndarray] = {}
    for name, shape in _weight_shapes(vocab_size).items():  # fixed order: the stream depends on it
        if len(shape) == 1:  # RMSNorm scales
            tensors[name] = np.ones(shape, np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def _move_aside(folder: Path) -> None:
    """Rename a broken folder out of the way (then delete it); another process may have done so already."""
    trash = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.broken-", dir=folder.parent))
    try:
        os.rename(folder, trash / "old")
    except OSError:
        pass
    shutil.rmtree(trash, ignore_errors=True)
