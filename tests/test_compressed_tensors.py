"""compressed-tensors checkpoints (the format llm-compressor writes) on the torch backend (issue #30): W8A8 int8,
W4A16 (pack-quantized int4, group 128), FP8 dynamic and static, on the tiny Llama and Qwen2 (q/k/v biases, tied
embeddings).

What must hold: every greedy token equals transformers' choice when transformers loads the SAME checkpoint
(compressed-tensors' own modules: dequantized weights, activations quantized and dequantized per token), given the
same prefix, for 32 tokens (weight-only W4A16: exactly; W8A8 and FP8, whose activations are rounded to int8 / fp8
codes: within a stated logit tolerance, exactly for 90 % of tokens); int weights stay int8 / int4 in memory
(torch's weight-only kernels); the weight format names the scheme, so L3 pages of one scheme never hit under
another; cache hits in every tier give the cold output; schemes, methods and installs the backend cannot serve stop
startup with what to do instead.

Why "given the same prefix" rather than transformers' ``generate``: with activations rounded to fp8 (3 mantissa
bits) or int8 per token, a 1-ulp difference in a layer's input can move a value to the next code, and transformers'
own incremental decode (KV cache) departs from its own full forward after 8 tokens on the Qwen2 FP8-dynamic model.
So each token tierlm picks is compared with transformers' logits over prompt + the tokens before it (one forward
over the whole sequence).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from backend_driver import run_greedy
from engine_harness import greedy, run, start_engine
from model_factory import with_quantization_config

from tierlm.backends.weight_format import WeightFormatError, check_checkpoint, weight_format_label
from tierlm.runtime.errors import StartupError

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed: pip install 'tierlm[quant]'")

PROMPTS = [[1, 17, 42, 99, 7, 250, 31], [1, 5, 6, 200, 201, 202, 12, 13, 14]]
NEW = 32
LAYERS = 3 * 7  # q, k, v, o, gate, up, down in each of 3 layers; lm_head stays float (ignored, as llm-compressor's)
# Logits (range ~45 on these models) by which a token may trail transformers' best when activations are quantized
# per token: a float difference of one ulp in a layer's input (tierlm's paged attention vs eager, the int8 kernel's
# (x @ q) * s vs x @ (q * s)) can move one activation to the next int8 / fp8 code; measured up to 0.31 (Qwen2: 2
# tokens in 64 with W8A8, 1 with static FP8); every other token is transformers' own choice.
ACTIVATION_TOLERANCE = 0.5
LABELS = {"W8A8": "w8a8-int8", "W4A16": "w4a16-g128", "FP8_DYNAMIC": "fp8-dynamic", "FP8": "fp8-static"}


def _checkpoint(root: Path, family: str, scheme: str) -> Path:
    from compressed_tensors_factory import build_compressed_tensors_model

    return build_compressed_tensors_model(family, scheme, root / f"ct-{family}-{scheme}", root / f"{family}-128")


def _backend(folder: Path):
    from tierlm.backends.torch.backend import TorchBackend

    return TorchBackend(folder, dtype="float32", device="cpu")


def _transformers_gaps(folder: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """How far below transformers' best logit each of ``tokens`` is (0: transformers' greedy choice), after each
    prefix of prompt + tokens, from one forward of the checkpoint as transformers loads it (compressed-tensors'
    modules, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return (logits.max(-1).values - chosen).tolist()


@pytest.mark.parametrize("family,scheme,kernel", [
    ("llama", "W8A8", "Int8WeightOnlyLinear"), ("llama", "W4A16", "Int4WeightOnlyLinear"),
    ("llama", "FP8_DYNAMIC", "Linear"), ("llama", "FP8", "Linear"),
    ("qwen2", "W8A8", "Int8WeightOnlyLinear"), ("qwen2", "W4A16", "Int4WeightOnlyLinear")])
def test_greedy_equals_transformers_on_the_same_checkpoint(tiny_models_root, family, scheme, kernel):
    from tierlm.backends.torch.weights.compressed_tensors import ActivationQDQ

    folder = _checkpoint(tiny_models_root, family, scheme)
    backend = _backend(folder)
    assert backend.info.weight_format == f"checkpoint:compressed-tensors-{LABELS[scheme]}"
    attn = backend.model.model.layers[0].self_attn
    proj = attn.q_proj.inner if scheme != "W4A16" else attn.q_proj
    assert isinstance(attn.q_proj, ActivationQDQ) == (scheme != "W4A16")  # W4A16 keeps 16-bit activations
    assert type(proj).__name__ == kernel
    assert not any(hasattr(m, "quantization_scheme") for m in backend.model.modules())  # every layer swapped
    got = run_greedy(backend, PROMPTS, NEW)
    gaps = [g for prompt, tokens in zip(PROMPTS, got) for g in _transformers_gaps(folder, prompt, tokens)]
    if scheme == "W4A16":  # weight-only: the same products, token for token
        assert max(gaps) == 0
    else:  # quantized activations: within ACTIVATION_TOLERANCE of transformers' choice, nearly always exactly it
        assert max(gaps) <= ACTIVATION_TOLERANCE and sum(g == 0 for g in gaps) >= 0.9 * len(gaps)


def test_batched_and_chunked_prefill_give_each_prompts_solo_output(tiny_models_root):
    backend = _backend(_checkpoint(tiny_models_root, "qwen2", "W8A8"))
    whole = run_greedy(backend, PROMPTS, 12, num_pages=64)
    assert run_greedy(backend, PROMPTS, 12, num_pages=64, chunk_size=3, stagger=2) == whole
    assert [run_greedy(backend, [p], 12, num_pages=64)[0] for p in PROMPTS] == whole


def test_int_weights_stay_int8_and_int4_in_memory(tiny_models_root):
    """Resident weight bytes: linear layers 4 bytes -> ~1 (int8 + a scale per row) -> ~0.5 (int4 + a scale and a
    zero point per group); the embeddings, norms and lm_head stay float32. fp8 is dequantized on a CPU."""
    from torch import nn

    from tierlm.backends.torch.backend import TorchBackend

    sizes = {s: _backend(_checkpoint(tiny_models_root, "llama", s)).weight_bytes()
             for s in ("W8A8", "W4A16", "FP8_DYNAMIC")}  # builds the unquantized llama-128 too
    dense = TorchBackend(tiny_models_root / "llama-128", dtype="float32", device="cpu")
    linear = sum(m.weight.numel() for n, m in dense.model.named_modules()
                 if isinstance(m, nn.Linear) and ".layers." in n)
    saved8, saved4 = dense.weight_bytes() - sizes["W8A8"], dense.weight_bytes() - sizes["W4A16"]
    assert 0.95 * 3 * linear < saved8 <= 3 * linear  # 4 -> 1 byte per weight, less the scales
    assert 0.95 * 3.5 * linear < saved4 <= 3.5 * linear  # 4 -> 0.5
    assert sizes["FP8_DYNAMIC"] == dense.weight_bytes()


def test_an_int8_checkpoint_in_bf16_packs_the_linears_it_leaves_unquantized(tiny_models_root):
    """W8A8 leaves the lm_head bf16: it is packed for oneDNN as a bf16 model's linears are (the plan's bf16_linear),
    beside the int8 layers on their own kernel."""
    from tierlm.backends.torch.backend import TorchBackend
    from tierlm.backends.torch.cpu.linear import PackedLinear
    from tierlm.backends.torch.weights.quant_linear import Int8WeightOnlyLinear

    backend = TorchBackend(_checkpoint(tiny_models_root, "llama", "W8A8"), dtype="bfloat16", device="cpu")
    plan = backend.cpu_kernels.plan
    if plan.bf16_linear.value == "torch":
        pytest.skip(f"this CPU keeps bf16 linears plain: {plan.bf16_linear}")
    assert plan.bf16_linear.value == "packed", plan.bf16_linear
    assert [n for n, m in backend.model.named_modules() if isinstance(m, PackedLinear)] == ["lm_head"]
    assert sum(isinstance(m, Int8WeightOnlyLinear) for m in backend.model.modules()) > 0


def test_the_weight_format_names_the_scheme(tiny_models_root):
    """Four schemes, four labels (the L3 namespace includes the label, tests/test_weight_quant.py)."""
    labels = set()
    for scheme, label in LABELS.items():
        config = json.loads((_checkpoint(tiny_models_root, "llama", scheme) / "config.json").read_text())
        assert check_checkpoint(config, "torch", None) == "compressed-tensors"
        labels.add(weight_format_label(config, None))
        assert weight_format_label(config, None) == f"checkpoint:compressed-tensors-{label}"
    assert len(labels) == 4


def test_hits_in_every_tier_give_the_cold_output_and_schemes_never_share_pages(tiny_models_root, store):
    from test_hicache import doc, hicache_engine, tier_round_trip

    w4 = _checkpoint(tiny_models_root, "llama", "W4A16")
    prompt = doc(3) + [9, 9]

    def names_the_scheme(engine):
        assert engine.server_info()["weight_format"] == "checkpoint:compressed-tensors-w4a16-g128"

    cold, device, host, storage = tier_round_trip(lambda: hicache_engine("torch", w4, grammar_backend="none"),
                                                  prompt, 12, on_start=names_the_scheme)
    assert device.last.cached.device == 60
    assert host.last.cached.host == 60 and host.last.cached.device == 0
    assert device.token_ids == host.token_ids == cold.token_ids
    assert storage.last.cached.storage == 60 and storage.token_ids == cold.token_ids
    # The W8A8 checkpoint of the same model: the W4A16 pages are never read under it.
    w8 = _checkpoint(tiny_models_root, "llama", "W8A8")
    engine = hicache_engine("torch", w8, grammar_backend="none")
    try:
        res, = run(engine, [prompt], greedy(4))
        assert res.last.cached.total == 0
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------------------------ refusals
def _ct(groups: dict, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": "mixed", "config_groups": groups, **extra}


NVFP4 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                        "group_size": 16, "symmetric": True}}}
W4A8 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                       "group_size": 128},
                    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}
W4_ASYM = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                          "group_size": 128, "symmetric": False}}}
W4_ACT_ORDER = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                               "group_size": 128, "actorder": "group"}}}


@pytest.mark.parametrize("qcfg,named", [
    (_ct(NVFP4), "float4 weights per tensor_group"),
    (_ct(W4A8), "int4 weights with int8 activations"),
    (_ct(W4_ACT_ORDER), "actorder 'static'"),
    (_ct(W4_ASYM), "symmetric W4A16"),
    (_ct({}), "no config_groups"),
    (_ct(W4A8, sparsity_config={"format": "sparse-24-bitmask"}), "sparsity format 'sparse-24-bitmask'")])
def test_schemes_the_backend_cannot_serve_stop_startup_naming_them(tiny_llama, tmp_path, qcfg, named):
    folder = with_quantization_config(tiny_llama, tmp_path / "ct", qcfg)
    with pytest.raises(StartupError) as e:
        start_engine(folder, "torch")
    msg = str(e.value)
    assert "'compressed-tensors'" in msg and named in msg and "w8a8-int8" in msg and "fp8-dynamic" in msg


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_are_refused_with_the_way_round(tiny_llama, tmp_path, method):
    folder = with_quantization_config(tiny_llama, tmp_path / method, {"quant_method": method, "bits": 4})
    with pytest.raises(StartupError) as e:
        start_engine(folder, "torch")
    msg = str(e.value)
    assert repr(method) in msg and "gptqmodel" in msg and "compressed-tensors" in msg


def test_compressed_tensors_on_mlx_is_refused():
    with pytest.raises(WeightFormatError, match="'compressed-tensors' is not supported by the mlx backend"):
        check_checkpoint({"quantization_config": _ct(W4A8)}, "mlx", None)


def test_a_missing_compressed_tensors_package_names_the_install(monkeypatch):
    import sys

    from tierlm.backends.torch.weights.compressed_tensors import check_installed

    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # import raises ImportError
    with pytest.raises(WeightFormatError, match=r"pip install 'tierlm\[quant\]'"):
        check_installed()


@pytest.mark.parametrize("preset", ["W8A8", "FP8_DYNAMIC"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_per_token_fast_path_is_bit_equal_to_the_librarys(preset, dtype):
    """ActivationQDQ's own per-token quantize-dequantize gives exactly what compressed-tensors' functions give
    (rows of zeros included), in float32 and bfloat16."""
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from tierlm.backends.torch.weights.compressed_tensors import ActivationQDQ

    args = preset_name_to_scheme(preset, ["Linear"]).input_activations
    qdq = ActivationQDQ(torch.nn.Identity(), args, None, None)
    assert qdq.per_token is not None
    torch.manual_seed(0)
    for shape in ((1, 1, 896), (1, 7, 128)):
        x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 10).to(getattr(torch, dtype))
        x[0, -1] = 0
        scale, zp = compute_dynamic_scales_and_zp(x, args, module=qdq)
        assert torch.equal(qdq(x), fake_quantize(x, scale, zp, args).to(x.dtype))
