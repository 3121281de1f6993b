"""Seeded random tiny models of each supported family, saved as real HF folders (config + safetensors).

Weights are random, so greedy text is gibberish, but token-for-token equality with transformers' own forward
is exactly as demanding as on a trained model. Each folder is built once per test session.
"""
from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_VOCAB = 285  # the demo model's byte-level BPE tokenizer (backends/demo_model.py), saved with each model

# Small enough for a 2-core CPU, big enough to exercise GQA, several layers and pages.
COMMON = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1000000.0,
                  tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=1000000.0, head_dim=32),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], rope_theta=10000.0,
                    sliding_window=None),
}


def build_tiny_model(family: str, out_dir: Path, seed: int | None = None) -> Path:
    """Write a seeded random model of ``family`` to ``out_dir`` and return it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    spec = {**COMMON, **FAMILIES[family]}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(sorted(FAMILIES).index(family) if seed is None else seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init has tiny std (0.02): scale up so logits are far apart and greedy is not decided by noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" not in name else 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    _write_tokenizer(out_dir)
    return out_dir


def _write_tokenizer(out_dir: Path) -> None:
    """The demo tokenizer (byte-level BPE, ChatML template), so the engine and server can serve the model."""
    from tierlm.backends.demo_model import CHATML_TEMPLATE, build_tokenizer

    tok = build_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == TOKENIZER_VOCAB
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "clean_up_tokenization_spaces": False, "chat_template": CHATML_TEMPLATE,
    }))


def reference_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate in float32: the ground truth every backend must match."""
    import torch
    from transformers import AutoModelForCausalLM

    model = _cached_reference_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt_ids):].tolist()


_REF_MODELS: dict = {}


def _cached_reference_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _REF_MODELS:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        m.eval()
        _REF_MODELS[path] = m
    return _REF_MODELS[path]
