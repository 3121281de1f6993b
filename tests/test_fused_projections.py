"""CPU decoder layers with fused q/k/v and gate/up projections (backends/torch/fused_projections.py).

What must hold: on every covered family (llama, qwen2, qwen3, mistral) the loader installs the fused attention,
MLP and RMSNorm forms in bf16 (float32: the RMSNorm only, the projections stay separate with the reason), each
layer then makes 4 linear calls instead of 7, and the logits of prefill and decode steps equal the unfused
model's bit for bit (bf16 packed where the CPU packs); a family or an option it does not cover keeps
transformers' module, with the reason, and the same output; the CPU plan's override fused_projections=no (and the
old TIERLM_CPU_FUSED_PROJECTIONS=0, read as it) turns it off.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tierlm.backends.base import ForwardBatch, SamplingBatch
from tierlm.backends.torch.backend import TorchBackend
from tierlm.backends.torch.cpu.linear import PackedLinear, torch_refusal
from tierlm.backends.torch.fused_projections import (FusedGateUpMLP, FusedQKVAttention, FusedRMSNorm,
                                                     fuse_projections)
from tierlm.platforms.cpu_features import this_cpu

PAGE_SIZE = 4
PROMPTS = [[5, 9, 13, 2, 7, 40, 41], [11, 4, 6], [8, 1, 70, 71, 72, 73, 74, 75, 76]]


def _backend(model_dir, dtype: str, fused: bool, monkeypatch, env: dict[str, str] | None = None) -> TorchBackend:
    """``env``: the switch's setting (default: the CPU plan's override fused_projections=yes|no)."""
    for name, value in (env or {"TIERLM_CPU_PLAN": f"fused_projections={'yes' if fused else 'no'}"}).items():
        monkeypatch.setenv(name, value)
    backend = TorchBackend(model_dir, dtype=dtype)
    assert backend.cpu_kernels.plan.fused_projections.value == ("yes" if fused else "no")
    backend.init_kv_pool(16, PAGE_SIZE)
    return backend


def _steps_logits(backend: TorchBackend) -> list[torch.Tensor]:
    """Logits of a prefill step of three requests, then two decode steps of the three."""
    q = np.asarray([len(p) for p in PROMPTS], np.int32)
    table = np.asarray([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], np.int32)
    ids = np.concatenate([np.asarray(p, np.int64) for p in PROMPTS])
    positions = np.concatenate([np.arange(len(p)) for p in PROMPTS]).astype(np.int64)
    out = [backend.forward_logits(ForwardBatch(ids, positions, q, q, table, np.cumsum(q).astype(np.int64) - 1,
                                               SamplingBatch.greedy(3), PAGE_SIZE)).clone()]
    kv = q.copy()
    for token in (3, 17):
        kv = kv + 1
        out.append(backend.forward_logits(ForwardBatch(np.full(3, token, np.int64), (kv - 1).astype(np.int64),
                                                       np.ones(3, np.int32), kv, table, np.arange(3, dtype=np.int64),
                                                       SamplingBatch.greedy(3), PAGE_SIZE)).clone())
    return out


def test_every_family_runs_fused_with_the_unfused_logits_bit_for_bit(tiny_model, monkeypatch):
    dtype = "bfloat16"
    plain = _backend(tiny_model, dtype, False, monkeypatch)
    fused = _backend(tiny_model, dtype, True, monkeypatch)
    layers = fused.model.model.layers
    for layer in layers:
        assert isinstance(layer.self_attn, FusedQKVAttention) and isinstance(layer.mlp, FusedGateUpMLP)
        assert isinstance(layer.input_layernorm, FusedRMSNorm)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    linear = (nn.Linear, PackedLinear)
    n_plain = sum(isinstance(m, linear) for m in plain.model.modules())
    assert sum(isinstance(m, linear) for m in fused.model.modules()) == n_plain - 3 * len(layers)
    if dtype == "bfloat16" and this_cpu().onednn_bf16_prepack[0] and torch_refusal() is None:
        # the fused weights are the ones prepacked
        assert isinstance(layers[0].self_attn.qkv_proj, PackedLinear)
        assert isinstance(layers[0].mlp.gate_up_proj, PackedLinear)
    assert plain.weight_bytes() == fused.weight_bytes()  # the parts are dropped: no second copy
    for a, b in zip(_steps_logits(plain), _steps_logits(fused)):
        assert torch.equal(a, b)


def test_float32_keeps_separate_projections_and_fuses_the_norms(tiny_model, monkeypatch):
    """float32: MKL's GEMM gains nothing from one wider product, so only the RMSNorms change (bit-identical)."""
    plain = _backend(tiny_model, "float32", False, monkeypatch)
    fused = _backend(tiny_model, "float32", True, monkeypatch)
    layer = fused.model.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and hasattr(layer.self_attn, "q_proj")
    assert not isinstance(layer.self_attn, FusedQKVAttention) and not isinstance(layer.mlp, FusedGateUpMLP)
    report = fuse_projections(_hf_model("llama").float())
    assert "float32 weights" in report.left_unfused["LlamaAttention"] and report.norms > 0
    for a, b in zip(_steps_logits(plain), _steps_logits(fused)):
        assert torch.equal(a, b)


def _hf_model(family: str, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, **config)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
    return model.to(torch.bfloat16)  # the dtype whose projections fuse


def test_a_family_it_does_not_cover_keeps_transformers_modules_with_the_reason():
    model = _hf_model("gemma")  # q/k/v and gate/up like llama, but its own RMSNorm (1 + weight) and classes
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        before = model(ids).logits
        report = fuse_projections(model)
        after = model(ids).logits
    assert report.attention == report.mlp == report.norms == 0
    assert "not a module class tierlm's fused forward covers" in report.left_unfused["GemmaAttention"]
    assert "GemmaMLP" in report.left_unfused
    assert hasattr(model.model.layers[0].self_attn, "q_proj")
    assert report.linears_before == report.linears_after
    assert torch.equal(before, after)


def test_adapted_or_hooked_projections_stay_unfused_and_the_rest_fuses():
    """A projection that is not a plain nn.Linear (an adapter, a quantized layer) or that carries a hook keeps its
    module's transformers forward; every other layer is fused; the output is the same."""

    class Adapted(nn.Linear):  # what an adapter or a quantized layer looks like to the fusion: its own forward
        def forward(self, x):
            return super().forward(x)

    model = _hf_model("llama")
    attn0, mlp1 = model.model.layers[0].self_attn, model.model.layers[1].mlp
    adapted = Adapted(attn0.q_proj.in_features, attn0.q_proj.out_features, bias=False, dtype=torch.bfloat16)
    adapted.load_state_dict(attn0.q_proj.state_dict())
    attn0.q_proj = adapted
    mlp1.up_proj.register_forward_hook(lambda mod, args, out: None)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        before = model(ids).logits
        report = fuse_projections(model)
        after = model(ids).logits
    assert report.attention == 1 and report.mlp == 1
    assert "not a plain nn.Linear" in report.left_unfused["LlamaAttention"]
    assert "hooks" in report.left_unfused["LlamaMLP"]
    assert not isinstance(attn0, FusedQKVAttention) and not isinstance(mlp1, FusedGateUpMLP)
    assert isinstance(model.model.layers[1].self_attn, FusedQKVAttention)
    assert torch.equal(before, after)


@pytest.mark.parametrize("env,why", [
    ({"TIERLM_CPU_PLAN": "fused_projections=no"}, "TIERLM_CPU_PLAN fused_projections=no"),
    ({"TIERLM_CPU_FUSED_PROJECTIONS": "0"}, "TIERLM_CPU_FUSED_PROJECTIONS=0")])  # the old switch, read as the override
def test_the_switch_turns_it_off(tiny_llama, monkeypatch, env, why):
    backend = _backend(tiny_llama, "float32", False, monkeypatch, env)
    assert backend.cpu_kernels.plan.fused_projections.why == why
    assert not any(isinstance(m, (FusedQKVAttention, FusedGateUpMLP, FusedRMSNorm)) for m in backend.model.modules())
    assert hasattr(backend.model.model.layers[0].self_attn, "q_proj")


def test_fused_modules_keep_transformers_generate_and_its_cache():
    """The fused forward outside tierlm's paged attention: transformers' own generate with its KV cache (the
    path the reference tests compare against) gives the same tokens."""
    model = _hf_model("qwen3")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)
        fuse_projections(model)
        ours = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert isinstance(model.model.layers[0].self_attn, FusedQKVAttention)
    assert torch.equal(ref, ours)
