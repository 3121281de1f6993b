"""gpt-oss MXFP4 experts kept packed on the torch backend (backends/torch/weights/mxfp4_experts.py, issue #30).

What must hold: the packed experts compute exactly what the experts dequantized while loading compute (the decode is
transformers' bit for bit, the forward its grouped_mm path), so greedy output equals transformers' own MXFP4
reference token for token, cache hits in every tier give the cold output, and the weight format label (and the L3
namespace) stays "checkpoint:mxfp4" for both; loading never makes a dense copy of the experts, and the experts'
resident bytes are the checkpoint's packed bytes (blocks + scales + biases), as `tierlm doctor` counts them, which
puts gpt-oss-20b at <= 14 GB.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from backend_driver import run_greedy
from model_factory import build_tiny_gpt_oss
from test_gpt_oss import PS, mxfp4_reference, prompts

from tierlm.backends.model_source.folder_facts import weight_bytes
from tierlm.backends.torch.weights import mxfp4_experts
from tierlm.backends.torch.weights.mxfp4_experts import PackedMxfp4Experts, dequantize
from tierlm.backends.weight_format import MXFP4_EXPERTS_ENV, WeightFormatError, mxfp4_experts_mode

# openai/gpt-oss-20b's config.json (the shapes; quantization_config as released).
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
    num_experts_per_tok=4, vocab_size=201088, sliding_window=128, max_position_embeddings=131072,
    tie_word_embeddings=False, torch_dtype="bfloat16", swiglu_limit=7.0, rms_norm_eps=1e-5,
    layer_types=["sliding_attention", "full_attention"] * 12,
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tiny_models_root) -> Path:
    return build_tiny_gpt_oss(tiny_models_root / "gpt_oss_mxfp4", mxfp4=True)


def _backend(folder: Path, mode: str, monkeypatch, dtype: str = "float32", device: str = "cpu"):
    from tierlm.backends.torch.backend import TorchBackend

    monkeypatch.setenv(MXFP4_EXPERTS_ENV, mode)
    return TorchBackend(folder, dtype=dtype, device=device)


# ---------------------------------------------------------------- the numerics

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_transformers_decode_bit_for_bit(dtype):
    """Every code and scale, extremes included (values that underflow or overflow ``dtype`` too), any subset of
    experts in any order: the same bits as transformers' convert_moe_packed_tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 40, 4), dtype=torch.uint8, generator=gen)
    scales[0, :6, 0] = torch.tensor([0, 1, 2, 252, 254, 255], dtype=torch.uint8)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    torch.testing.assert_close(dequantize(blocks, scales, None, dtype), expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dequantize(blocks, scales, [2, 0], dtype), expected[[2, 0]], rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_experts_equal_dequantized_experts(gpt_oss_mxfp4, monkeypatch, dtype):
    """Random hidden states and routings, 1 to 40 tokens, one expert per chunk or all in one: exactly the output
    of the experts transformers dequantized while loading."""
    packed = _backend(gpt_oss_mxfp4, "packed", monkeypatch, dtype).model
    dense = _backend(gpt_oss_mxfp4, "dequantized", monkeypatch, dtype).model
    gen = torch.Generator().manual_seed(0)
    for layer in (0, 3):
        p, d = packed.model.layers[layer].mlp.experts, dense.model.layers[layer].mlp.experts
        assert isinstance(p, PackedMxfp4Experts) and not isinstance(d, PackedMxfp4Experts)
        for tokens in (1, 5, 40):
            x = torch.randn(tokens, 64, generator=gen).to(getattr(torch, dtype))
            index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, 2, generator=gen), -1).to(x.dtype)
            expected = d(x, index, weights)
            for chunk_bytes in (1, mxfp4_experts.CHUNK_BYTES):
                p.chunk_bytes = chunk_bytes
                assert torch.equal(p(x, index, weights), expected), (layer, tokens, chunk_bytes)


def test_greedy_matches_the_mxfp4_reference_packed(gpt_oss_mxfp4, monkeypatch):
    backend = _backend(gpt_oss_mxfp4, "packed", monkeypatch)
    assert backend.info.weight_format == "checkpoint:mxfp4"  # same numerics, same label and L3 pages
    ps = prompts([7, 33, 61], seed=4)
    outputs = run_greedy(backend, ps, 32, page_size=PS, chunk_size=9)
    for prompt, out in zip(ps, outputs):
        assert out == mxfp4_reference(gpt_oss_mxfp4, prompt, 32), f"prompt of {len(prompt)} tokens"


def test_hits_in_every_tier_give_the_cold_output_and_pages_cross_modes(gpt_oss_mxfp4, store, monkeypatch):
    """Cold, L1 and L2 hits on the packed model; then a restart with the experts dequantized reads the packed
    model's L3 pages (one label, the same numerics) and continues with the same tokens."""
    from test_hicache import doc, hicache_engine, tier_round_trip

    modes = iter(["packed", "dequantized"])

    def start():
        monkeypatch.setenv(MXFP4_EXPERTS_ENV, next(modes))
        return hicache_engine("torch", gpt_oss_mxfp4, grammar_backend="none")

    def is_packed(engine):
        assert isinstance(engine.parts.backend.model.model.layers[0].mlp.experts, PackedMxfp4Experts)

    prompt = doc(4) + [9, 9]
    cold, device, host, storage = tier_round_trip(start, prompt, 12, on_start=is_packed)
    assert device.last.cached.device == 60
    assert host.last.cached.host == 60 and host.last.cached.device == 0
    assert storage.last.cached.storage == 60
    assert device.token_ids == host.token_ids == storage.token_ids == cold.token_ids
    assert cold.token_ids == mxfp4_reference(gpt_oss_mxfp4, prompt, 12)


# ---------------------------------------------------------------- memory

def test_loading_never_makes_a_dense_copy_of_the_experts(gpt_oss_mxfp4, monkeypatch):
    """Neither transformers' decode nor ours runs while loading; the experts hold exactly the checkpoint's
    blocks, scales and biases, and the backend's resident bytes are what doctor counts from the headers."""
    import transformers.integrations.mxfp4 as hf_mxfp4

    def refuse(*args, **kwargs):
        raise AssertionError("a dense copy of the experts was made while loading")

    for name in ("convert_moe_packed_tensors", "_convert_moe_packed_tensors", "dequantize_convertops"):
        monkeypatch.setattr(hf_mxfp4, name, refuse)
    monkeypatch.setattr(mxfp4_experts, "dequantize", refuse)
    backend = _backend(gpt_oss_mxfp4, "packed", monkeypatch)
    monkeypatch.undo()

    from safetensors import safe_open

    with safe_open(str(gpt_oss_mxfp4 / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys() if ".mlp.experts." in k}
    resident = {f"model.{n}": p for n, p in backend.model.model.named_parameters() if ".mlp.experts." in n}
    assert resident.keys() == stored.keys()  # *_blocks, *_scales, *_bias: no gate_up_proj / down_proj
    assert all(torch.equal(resident[k], stored[k]) for k in stored)
    packed_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    assert mxfp4_experts.packed_bytes(backend.model) == packed_bytes
    assert backend.weight_bytes() == weight_bytes(gpt_oss_mxfp4, "float32")  # doctor's count, as resident

    dense = _backend(gpt_oss_mxfp4, "dequantized", monkeypatch)
    assert dense.weight_bytes() == weight_bytes(gpt_oss_mxfp4, "float32", mxfp4_dequantized=True)
    blocks = sum(t.numel() for k, t in stored.items() if k.endswith("_blocks"))
    scales = sum(t.numel() for k, t in stored.items() if k.endswith("_scales"))
    assert dense.weight_bytes() - backend.weight_bytes() == blocks * 2 * 4 - blocks - scales


def _header_only_folder(root: Path, config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> Path:
    """A model folder whose safetensors file is its header alone (sizes are read from headers only)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * (1 if dtype == "U8" else 2)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return root


def _packed_gpt_oss_20b() -> torch.nn.Module:
    """The torch backend's packed gpt-oss-20b in bfloat16 built on the meta device: the exact parameters it loads."""
    from transformers import GptOssConfig

    config = GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k not in ("architectures", "model_type")})
    hf_config, cls = mxfp4_experts.packed_model_class(config)
    with torch.device("meta"):
        return cls(hf_config).to(torch.bfloat16)


@pytest.fixture(scope="module")
def gpt_oss_20b_header(tmp_path_factory) -> tuple[Path, int]:
    """A gpt-oss-20b folder (config.json, a safetensors header with the released names and shapes, no tensor
    bytes) and the packed model's resident bytes."""
    model = _packed_gpt_oss_20b()
    tensors = {n: ("U8" if p.dtype == torch.uint8 else "BF16", tuple(p.shape)) for n, p in model.named_parameters()}
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    return _header_only_folder(tmp_path_factory.mktemp("h") / "gpt-oss-20b", GPT_OSS_20B, tensors), resident


def test_gpt_oss_20b_resident_bytes_fit_14_gb(gpt_oss_20b_header):
    """From its config shape: ~13.76 GB resident (experts ~10.2 GB, embeddings + lm_head 2.3 GB, attention 1.3 GB),
    what doctor counts from the header; dequantized at load it would be ~41.8 GB."""
    folder, resident = gpt_oss_20b_header
    experts = sum(p.numel() * p.element_size() for n, p in _packed_gpt_oss_20b().named_parameters()
                  if ".experts." in n)
    assert 13.0e9 < resident <= 14.0e9
    assert 10.0e9 < experts < 10.3e9
    assert weight_bytes(folder, "bfloat16") == resident
    assert weight_bytes(folder, "bfloat16", mxfp4_dequantized=True) > 41e9


def test_doctor_fits_gpt_oss_20b_on_a_16_gb_gpu(gpt_oss_20b_header):
    """A 16 GB GPU (no real one needed: doctor's facts): packed, the weights leave room for KV pages; with the
    experts dequantized at load there is none (the refusal names the weights)."""
    from tierlm.platforms.facts import Facts
    from tierlm.server.commands import doctor as doctor_cmd

    folder, resident = gpt_oss_20b_header
    facts = Facts(os_name="Linux", arch="x86_64", cpu_count=8, ram_total_bytes=32 << 30,
                  ram_available_bytes=28 << 30, accelerator="cuda", device_name="NVIDIA GeForce RTX 4080",
                  device_count=1, compute_capability=(8, 9), device_memory_total_bytes=16 << 30,
                  device_memory_free_bytes=(31 << 29), torch_version="2.9.0", torch_cuda_version="12.8",
                  torch_cuda_available=True)
    argv = ["--json", "--model-path", str(folder), "--context-length", "32768", "--mem-fraction-static", "0.9"]
    report = doctor_cmd.diagnose(facts, {"TIERLM_BACKEND": "torch"}, argv)
    assert report["errors"] == [] and report["model"]["mxfp4_experts"]["mode"] == "packed"
    assert report["memory"]["weight_bytes"] == resident
    assert report["memory"]["device_kv_tokens"] > 16384  # 48 KiB a token: ~1.1 GB of KV pages
    dense = doctor_cmd.diagnose(facts, {"TIERLM_BACKEND": "torch", MXFP4_EXPERTS_ENV: "dequantized"}, argv)
    assert any("weights 41.8" in e for e in dense["errors"])


def test_doctor_sizes_the_weights_as_serve_holds_the_experts(gpt_oss_mxfp4):
    """cuda: packed (the stored bytes); cpu: dequantized (two values a block byte in the serving dtype); the
    override; mlx keeps them packed on every device."""
    from tierlm.backends.base import PlanFacts
    from tierlm.backends.mlx.load_plan import plan_load as mlx_plan
    from tierlm.backends.model_source.model_folder import ModelFolder
    from tierlm.backends.torch.load_plan import held_sizes

    folder = ModelFolder.read(gpt_oss_mxfp4)
    packed, dense = weight_bytes(folder, "float32"), weight_bytes(folder, "float32", mxfp4_dequantized=True)
    assert dense > packed

    def sizes(device: str, env: dict):
        s = held_sizes(PlanFacts(folder, device, "float32", "auto", False, None, env), "float32")
        return {"weight_bytes": s.weight_bytes, "weight_format": s.weight_format, **s.notes}

    cuda = sizes("cuda", {})
    assert (cuda["weight_bytes"], cuda["mxfp4_experts"]["mode"]) == (packed, "packed")
    cpu = sizes("cpu", {})
    assert (cpu["weight_bytes"], cpu["mxfp4_experts"]["mode"]) == (dense, "dequantized")
    assert sizes("cpu", {MXFP4_EXPERTS_ENV: "packed"})["weight_bytes"] == packed
    mlx = mlx_plan(PlanFacts(folder, "cpu", "float32", "auto", False, None, {})).sizes
    assert mlx is not None and mlx.weight_bytes == packed
    assert cuda["weight_format"] == cpu["weight_format"] == "checkpoint:mxfp4"


def test_the_mode_per_device_and_a_bad_override():
    assert mxfp4_experts_mode("cuda", {})[0] == "packed"
    mode, why = mxfp4_experts_mode("cpu", {})
    assert mode == "dequantized" and MXFP4_EXPERTS_ENV in why
    assert mxfp4_experts_mode("cuda", {MXFP4_EXPERTS_ENV: "dequantized"})[0] == "dequantized"
    with pytest.raises(WeightFormatError, match="packed, dequantized"):
        mxfp4_experts_mode("cpu", {MXFP4_EXPERTS_ENV: "fp4"})

