"""Seeded random tiny models of each supported family, saved as real HF folders (config + safetensors).

Weights are random, so greedy text is gibberish, but token-for-token equality with transformers' own forward
is exactly as demanding as on a trained model. Each folder is built once per test session.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# The byte-level BPE tokenizer of tierlm's own models (backends/model_source/tokenizer.py), saved with each model.
TOKENIZER_VOCAB = 285

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


def build_tiny_model(family: str, out_dir: Path, seed: int | None = None, **config: Any) -> Path:
    """Write a seeded random model of ``family`` to ``out_dir`` and return it; ``config``: fields that replace the
    family's (e.g. a larger vocab_size for a tokenizer with extra tokens)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    spec = {**COMMON, **FAMILIES[family], **config}
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
    from tierlm.backends.model_source.tokenizer import save_byte_tokenizer

    assert save_byte_tokenizer(out_dir) == TOKENIZER_VOCAB


def reference_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate in float32: the ground truth every backend must match.

    Computed once per (model, prompt) for the whole session: a shorter length is a prefix of a longer one
    (greedy, EOS ignored), so a longer request extends the stored tokens and a shorter one slices them. The
    same reference then serves every backend, page size and test that asks for it.
    """
    key = (str(Path(model_dir).resolve()), tuple(int(t) for t in prompt_ids))
    have = _REFERENCES.get(key, [])
    if len(have) < max_new_tokens:
        have = _generate_greedy(key[0], list(key[1]), max_new_tokens)
        _REFERENCES[key] = have
    return have[:max_new_tokens]


_REFERENCES: dict[tuple[str, tuple[int, ...]], list[int]] = {}
_REF_MODELS: dict = {}


def _reference_model(path: str):
    """transformers' float32 eager model of ``path``, loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _REF_MODELS:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        m.eval()
        _REF_MODELS[path] = m
    return _REF_MODELS[path]


def reference_log_softmax(model_dir: Path, ids: list[int]):
    """transformers' float32 log-softmax at every position of ``ids``, a numpy [len(ids), V] array (row p scores
    token p + 1): the ground truth for every logprob a backend returns."""
    import torch

    model = _reference_model(str(Path(model_dir).resolve()))
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()


def _generate_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = _reference_model(path).generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt_ids):].tolist()


# gpt-oss in miniature: alternating sliding (window 8, shorter than the test prompts) and full attention layers,
# attention sinks, 4 experts top-2, the real checkpoints' yarn RoPE (truncate false) and biases everywhere.
GPT_OSS_TINY = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
)
MXFP4_BLOCK = 32  # values per shared E8M0 scale; 16 bytes of two FP4 (E2M1) codes each
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; code | 8 is the negative


def build_tiny_gpt_oss(out_dir: Path, mxfp4: bool = False, seed: int = 0, **config: Any) -> Path:
    """Write a seeded random tiny gpt-oss to ``out_dir`` and return it; ``config``: fields that replace
    GPT_OSS_TINY's (the benchmark's larger shapes).

    ``mxfp4=True`` stores the expert weights the way the released checkpoints do (``*_blocks`` uint8
    [E, out, in/32, 16] and ``*_scales`` uint8 [E, out, in/32], ``quantization_config.quant_method`` "mxfp4",
    ``rope_theta``/``rope_scaling`` at the top level of config.json as on the Hub); every other tensor is float32.
    """
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**{**GPT_OSS_TINY, **config}), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" not in name else 0.5)
            elif name.endswith("sinks"):
                p.normal_(0.5, 1.0)  # clearly non-zero: a sink-less attention gives other tokens
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    _write_tokenizer(out_dir)
    if mxfp4:
        _store_experts_as_mxfp4(out_dir)
    return out_dir


def _store_experts_as_mxfp4(out_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights_file = out_dir / "model.safetensors"
    tensors = load_file(str(weights_file))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers keeps these as [E, in, out]; the checkpoint quantizes rows of the [E, out, in] weight.
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            out[name] = t
    save_file(out, str(weights_file), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def quantize_mxfp4(w):
    """[..., rows, cols] float -> (blocks uint8 [..., rows, cols/32, 16], scales uint8 [..., rows, cols/32]).

    OCP MX: each run of 32 values shares the scale 2**(floor(log2(absmax)) - 2) (6 = 1.5 * 2**2 is the largest
    E2M1 value), stored as the E8M0 byte exponent + 127; each value is rounded to the nearest E2M1 code (larger
    values clamp to 6) and two codes share a byte, the even element in the low nibble.
    """
    import torch

    *lead, cols = w.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {MXFP4_BLOCK}, got {cols}")
    x = w.detach().float().reshape(*lead, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = x.abs().amax(-1).clamp_min(2.0 ** -120)
    exponent = torch.floor(torch.log2(amax)) - 2
    scaled = x / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_E2M1_VALUES)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    code = torch.where((scaled < 0) & (code > 0), code + 8, code).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exponent + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


# Hybrids: linear-attention / Mamba layers with a recurrent state next to attention layers (tests/test_hybrid_models.py
# checks them against transformers; backends/verified_architectures.py lists them). 4 layers, hidden 32: two
# recurrent layers, so a state handed between them and across steps is exercised. transformers class -> config.
HYBRID_COMMON = dict(vocab_size=TOKENIZER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                     bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_LINEAR_ATTENTION = dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                         linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                         linear_num_key_heads=2, linear_num_value_heads=4)
HYBRIDS: dict[str, dict] = {
    "Qwen3_5ForCausalLM": dict(model_type="qwen3_5_text", **_LINEAR_ATTENTION),  # Qwen3.5
    "Qwen3NextForCausalLM": dict(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=32, **_LINEAR_ATTENTION),
    "GraniteMoeHybridForCausalLM": dict(  # Granite-4.0-H
        model_type="granitemoehybrid", layer_types=["mamba", "attention", "mamba", "attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16),
    "NemotronHForCausalLM": dict(model_type="nemotron_h", layers_block_type=["mamba", "attention", "mlp", "mamba"],
                                 mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16),
}


def hybrid_available(architecture: str) -> bool:
    """Whether the installed transformers has this hybrid's class."""
    import transformers

    return hasattr(transformers, architecture)


def build_tiny_hybrid(architecture: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a seeded random tiny hybrid of the transformers class ``architecture`` (a key of HYBRIDS)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    spec = {**HYBRID_COMMON, **HYBRIDS[architecture]}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert type(model).__name__ == architecture, type(model).__name__
    with torch.no_grad():  # as build_tiny_model: logits far apart, so greedy is not decided by noise
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" not in name else 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    _write_tokenizer(out_dir)
    return out_dir


def with_quantization_config(src: Path, dst: Path, qcfg: dict) -> Path:
    """A copy of the model folder ``src`` at ``dst`` whose config.json carries ``qcfg`` as its quantization_config."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
