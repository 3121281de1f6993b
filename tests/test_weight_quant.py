"""Weight formats (issue #30, first part): load-time quantization (torch: torchao's quantize_; MLX: nn.quantize),
mlx-lm quantized checkpoints as they are, refusals naming the flag and the alternative, and the weight format in
the L3 namespace.

What must hold: greedy output with quantized weights equals a reference running the SAME quantized weights
(transformers' model with torchao applied the same way; mlx-lm's own forward on the quantized model), token for
token; resident weight bytes drop; a cache hit (L1, L2, L3) on a quantized model gives the cold output; L3 pages
written under one weight format never hit under another; what a device or backend cannot run stops startup.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from backend_driver import run_greedy
from engine_harness import greedy, run, start_engine
from model_factory import with_quantization_config
from test_hicache import doc

from tierlm.backends.weight_format import WeightFormatError, check_checkpoint, parse_weight_quant
from tierlm.runtime.errors import StartupError

PROMPTS = [[1, 17, 42, 99, 7, 250, 31], [1, 5, 6, 200, 201, 202, 12, 13, 14]]
NEW = 12


def _torchao():
    return pytest.importorskip("torchao", reason="torchao is not installed: pip install 'tierlm[quant]'")


def _torch_backend(model_dir: Path, flag: str, value: str):
    from tierlm.backends.torch.backend import TorchBackend

    quant = parse_weight_quant(value if flag == "quantization" else None,
                               value if flag == "torchao_config" else None)
    return TorchBackend(model_dir, dtype="float32", device="cpu", weight_quant=quant)


def _attention_as_transformers(monkeypatch, name: str) -> None:
    """int8dq quantizes each activation row to 255 levels at every linear, so a float32 attention that sums in
    another order can change later tokens (the C paged kernels' AVX2 build: 1.5e-7 of the float64 attention, as
    the AVX-512 one, yet the 11th token of the tied qwen2 changed under TIERLM_CPU_ISA=avx2): for it, attention
    takes the torch path (the CPU plan's overrides decode_attention=torch, extend_attention=torch), which computes
    as transformers' eager attention does. The kernels' accuracy has tests of its own."""
    if name == "int8dq":
        monkeypatch.setenv("TIERLM_CPU_PLAN", "decode_attention=torch,extend_attention=torch")


def _check_attention_as_transformers(backend, name: str) -> None:
    """The plan the backend built took the torch path for attention where ``_attention_as_transformers`` asked."""
    if name == "int8dq":
        kernels = backend.cpu_kernels
        assert kernels.decode is None and kernels.extend is None
        assert (kernels.plan.decode_attention.value, kernels.plan.extend_attention.value) == ("torch", "torch")


def _torchao_reference(model_dir: Path, name: str, prompt: list[int]) -> list[int]:
    """transformers' eager float32 model with torchao's quantize_ applied the same way, greedy."""
    import torch

    from tierlm.backends.torch.weights.weight_quant import torchao_config
    from torchao.quantization import quantize_
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    quantize_(model, torchao_config(parse_weight_quant(None, name)))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=NEW)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------------ torch, torchao
@pytest.mark.parametrize("flag,value,name", [("torchao_config", "int8wo", "int8wo"),
                                             ("quantization", "w8a8_int8", "int8dq")])
def test_torchao_greedy_matches_transformers_with_same_quantization(tiny_llama, monkeypatch, flag, value, name):
    """torchao's own path (int8wo on CPU with TIERLM_CPU_QUANT_LINEAR=0: the default path quantizes the embedding
    too, checked against its dequantized weights in tests/test_cpu_quant_linear.py)."""
    _torchao()
    monkeypatch.setenv("TIERLM_CPU_QUANT_LINEAR", "0")
    _attention_as_transformers(monkeypatch, name)
    backend = _torch_backend(tiny_llama, flag, value)
    _check_attention_as_transformers(backend, name)
    assert backend.info.weight_format == f"torchao:{name}"
    got = run_greedy(backend, PROMPTS, NEW)
    for prompt, out in zip(PROMPTS, got):
        assert out == _torchao_reference(tiny_llama, name, prompt)


@pytest.mark.parametrize("value,bytes_per_value", [("int8wo", 1), ("int4wo-32", 0.5)])
def test_weight_only_linears_take_a_quarter_or_an_eighth_of_float32(tiny_llama, value, bytes_per_value):
    import torch

    from tierlm.backends.torch.backend import TorchBackend

    dense = TorchBackend(tiny_llama, dtype="float32", device="cpu")
    q = _torch_backend(tiny_llama, "torchao_config", value)
    matrices = sum(m.weight.numel() for m in dense.model.modules() if isinstance(m, (torch.nn.Linear,
                                                                                     torch.nn.Embedding)))
    # Linear weights and the input embedding go from 4 bytes to 1 or 0.5 (+ scales: one per output row, or a
    # scale and a zero point per group of 32); norms stay float32.
    saved = dense.weight_bytes() - q.weight_bytes()
    assert 0.7 * (4 - bytes_per_value) * matrices < saved <= (4 - bytes_per_value) * matrices


@pytest.mark.parametrize("value,device,env,label", [
    ("int8wo", "cpu", {}, "torchao:int8wo+embedding"),
    ("int4wo-128", "cpu", {}, "torchao:int4wo-128+embedding"),
    ("int8wo", "cpu", {"TIERLM_CPU_QUANT_LINEAR": "0"}, "torchao:int8wo"),
    ("int8wo", "cuda", {}, "torchao:int8wo"),
    ("int8dq", "cpu", {}, "torchao:int8dq")])
def test_the_label_says_where_the_embedding_is_quantized_too(value, device, env, label):
    """The CPU weight-only path quantizes the embedding (other numerics than torchao's, which leaves it in the model
    dtype, and than tierlm before): its own label, so the L3 namespace never mixes the two."""
    from tierlm.backends.weight_format import weight_format_label

    assert weight_format_label({}, parse_weight_quant(None, value), device, env) == label


@pytest.mark.parametrize("value,needs", [("fp8wo", "compute capability 8.9"),
                                         ("fp8dq-per_row", "compute capability 8.9")])
def test_torchao_configs_this_cpu_cannot_run_are_refused_with_the_alternative(tiny_llama, value, needs):
    with pytest.raises(StartupError) as e:
        start_engine(tiny_llama, "torch", torchao_config=value)
    msg = str(e.value)
    assert f"--torchao-config {value}" in msg and needs in msg and "int8dq" in msg


def test_int4_weight_only_runs_on_cpu_and_cuda_only():
    """int4wo: torch's CPU kernel (weights/quant_linear.py) or torchao's CUDA kernels; another device is refused."""
    from tierlm.backends.weight_format import device_refusal

    quant = parse_weight_quant(None, "int4wo-128")
    assert device_refusal(quant, "cpu", None) is None and device_refusal(quant, "cuda", (8, 0)) is None
    msg = device_refusal(quant, "mps", None)
    assert "--torchao-config int4wo-128" in msg and "int8dq" in msg


def test_sglang_fp8_on_cpu_is_refused_naming_the_flag(tiny_llama):
    with pytest.raises(StartupError) as e:
        start_engine(tiny_llama, "torch", quantization="fp8")
    assert "--quantization fp8" in str(e.value) and "w8a8_int8" in str(e.value)


@pytest.mark.parametrize("kw,named", [(dict(quantization="awq"), "--quantization awq"),
                                      (dict(torchao_config="int3wo"), "--torchao-config int3wo"),
                                      (dict(quantization="q4"), "--quantization q4"),
                                      (dict(quantization="w8a8_int8", torchao_config="int8wo"), "pass one")])
def test_unknown_or_other_backend_names_are_refused(tiny_llama, kw, named):
    with pytest.raises(StartupError) as e:
        start_engine(tiny_llama, "torch", **kw)
    assert named in str(e.value)


def test_cli_takes_both_flags():
    from tierlm.server.commands.cli_args import parse_args

    args = parse_args(["--torchao-config", "int8dq"])
    assert args.torchao_config == "int8dq" and args.quantization is None
    args = parse_args(["--quantization", "q4-g32"])
    assert args.quantization == "q4-g32"


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("method", ["compressed-tensors", "gptq", "awq", "bitsandbytes"])
def test_unsupported_checkpoint_method_stops_startup_naming_it(tiny_llama, tmp_path, method):
    folder = with_quantization_config(tiny_llama, tmp_path / method, {"quant_method": method, "bits": 4})
    with pytest.raises(StartupError) as e:
        start_engine(folder, "torch")
    assert repr(method) in str(e.value) and "mxfp4" in str(e.value)


def test_mlx_checkpoint_on_torch_names_the_mlx_backend():
    with pytest.raises(WeightFormatError, match="mlx backend"):
        check_checkpoint({"quantization": {"bits": 4, "group_size": 64}}, "torch", None)


def test_quantizing_an_already_quantized_checkpoint_is_refused():
    with pytest.raises(WeightFormatError, match="already quantized"):
        check_checkpoint({"quantization": {"bits": 4, "group_size": 64}}, "mlx", parse_weight_quant("q8", None))


# ------------------------------------------------------------------------------------------------ engine: tiers
@pytest.mark.parametrize("name", ["int8dq", "int8wo"])
def test_quantized_model_hits_in_every_tier_give_the_cold_output(tiny_llama, store, name):
    """int8dq (torchao) and int8wo (torch's CPU weight-only kernel) weights: the same prompt cold, after a device
    hit, a host hit (after eviction) and a storage hit (after a restart) gives the same greedy tokens;
    /server_info names the weight format and resident bytes."""
    _torchao()
    from test_hicache import hicache_engine, tier_round_trip

    def names_the_format(engine):
        info = engine.server_info()
        # int8wo on CPU: the embedding is int8 too (weights/quant_embedding.py), which the label says
        assert info["weight_format"] == f"torchao:{name}" + ("+embedding" if name == "int8wo" else "")
        assert 0 < info["weight_bytes"] < engine.parts.backend.info.num_layers * 4 * 64 * 64 * 4 * 4

    cold, device, host, storage = tier_round_trip(
        lambda: hicache_engine("torch", tiny_llama, grammar_backend="none", torchao_config=name),
        doc(1) + [9, 9], NEW, on_start=names_the_format)
    assert device.last.cached.device == 60
    assert host.last.cached.host == 60 and host.last.cached.device == 0
    assert device.token_ids == host.token_ids == cold.token_ids
    assert storage.last.cached.storage == 60 and storage.token_ids == cold.token_ids


def test_l3_pages_of_one_weight_format_never_hit_under_another(tiny_llama, store):
    """Same model, same KV dtype: pages written with float32 weights are not read with int8 weights (nor the
    other way), each format hits its own; one namespace folder per weight format."""
    _torchao()
    from test_hicache import hicache_engine

    prompt = doc(4) + [5]
    for kw in ({}, {"torchao_config": "int8dq"}, {"torchao_config": "int8wo"}):
        engine = hicache_engine("torch", tiny_llama, grammar_backend="none", **kw)
        try:
            res, = run(engine, [prompt], greedy(4))
            assert res.last.cached.total == 0, kw  # written by the others: never read here
        finally:
            engine.shutdown()
    engine = hicache_engine("torch", tiny_llama, grammar_backend="none", torchao_config="int8dq")
    try:
        res, = run(engine, [prompt], greedy(4))
        assert res.last.cached.storage == 60
    finally:
        engine.shutdown()
    assert len([p for p in store.iterdir() if p.is_dir()]) == 3


# ------------------------------------------------------------------------------------------------ MLX
def _mlx_reference(model, prompt: list[int]) -> list[int]:
    """mlx-lm's own forward over the whole sequence (no cache) on the SAME quantized model, greedy."""
    import mlx.core as mx

    ids = list(prompt)
    for _ in range(NEW):
        logits = model(mx.array([ids]))
        ids.append(int(mx.argmax(logits[0, -1]).item()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def mlx_q4_checkpoint(tiny_llama, tmp_path_factory):
    """An mlx-community-style checkpoint made by mlx-lm's own converter: 4-bit affine, group 32."""
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("mlxq") / "q4"
    convert(str(tiny_llama), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=32, dtype="float32")
    return out


@pytest.fixture(scope="module")
def mlx_checkpoints(mlx_q4_checkpoint, tiny_llama, tmp_path_factory):
    """mlx-lm's converter in its other modes: 8-bit affine, and mxfp4 (4-bit, group 32, power-of-two scales)."""
    from mlx_lm import convert

    made = {"affine-q4-g32": mlx_q4_checkpoint}
    for mode, bits, group in (("affine", 8, 64), ("mxfp4", 4, 32)):
        out = tmp_path_factory.mktemp("mlxq") / mode
        convert(str(tiny_llama), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=group, q_mode=mode,
                dtype="float32")
        made[f"{mode}-q{bits}-g{group}"] = out
    return made


@pytest.mark.mlx
@pytest.mark.parametrize("fmt", ["affine-q4-g32", "affine-q8-g64", "mxfp4-q4-g32"])
def test_mlx_quantized_checkpoint_serves_as_it_is(mlx_checkpoints, fmt):
    from mlx_lm import load

    from tierlm.backends.mlx.backend import MLXBackend

    folder = mlx_checkpoints[fmt]
    backend = MLXBackend(folder, dtype="float32")
    assert backend.info.weight_format == f"checkpoint:mlx-{fmt}"
    ref_model, _ = load(str(folder))
    got = run_greedy(backend, PROMPTS, NEW)
    assert got == [_mlx_reference(ref_model, p) for p in PROMPTS]


@pytest.mark.mlx
@pytest.mark.parametrize("value,bits,group", [("q8", 8, 64), ("q4-g32", 4, 32)])
def test_mlx_load_time_quantization_matches_mlx_lm_with_same_quantization(tiny_llama, value, bits, group):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    from tierlm.backends.mlx.backend import MLXBackend

    backend = MLXBackend(tiny_llama, dtype="float32", weight_quant=parse_weight_quant(value, None))
    assert backend.info.weight_format == f"mlx:q{bits}-g{group}"
    dense = MLXBackend(tiny_llama, dtype="float32")
    assert backend.weight_bytes() < dense.weight_bytes() * (bits + 2) / 32 + 64 * 4 * 8  # norms stay float32
    ref_model, _ = load(str(tiny_llama))
    ref_model.set_dtype(mx.float32)
    nn.quantize(ref_model, group_size=group, bits=bits)
    got = run_greedy(backend, PROMPTS, NEW)
    assert got == [_mlx_reference(ref_model, p) for p in PROMPTS]


@pytest.mark.mlx
def test_mlx_refuses_torchao_names_with_the_equivalent(tiny_llama):
    with pytest.raises(StartupError) as e:
        start_engine(tiny_llama, "mlx", torchao_config="int8wo")
    assert "--torchao-config int8wo" in str(e.value) and "--quantization q8" in str(e.value)


@pytest.mark.mlx
def test_mlx_quantized_engine_hits_give_the_cold_output(mlx_q4_checkpoint, store):
    from test_hicache import hicache_engine

    prompt = doc(2) + [9]
    engine = hicache_engine("mlx", mlx_q4_checkpoint, grammar_backend="none")
    try:
        assert engine.server_info()["weight_format"] == "checkpoint:mlx-affine-q4-g32"
        cold, = run(engine, [prompt], greedy(NEW))
        device, = run(engine, [prompt], greedy(NEW))
        assert device.last.cached.device == 60 and device.token_ids == cold.token_ids
    finally:
        engine.shutdown()
    engine = hicache_engine("mlx", mlx_q4_checkpoint, grammar_backend="none")
    try:
        storage, = run(engine, [prompt], greedy(NEW))
        assert storage.last.cached.storage == 60 and storage.token_ids == cold.token_ids
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["w8a8_int8", "fp8", "q4", "q8", "q4-g32", "q8-g128", "q4-g16", "q3", "awq",
                                  "int8wo", "int8dq", "int4wo-128", "int4wo-7", "fp8wo", "fp8dq-per_row", "Q4"])
def test_cli_name_check_and_the_parser_agree(name):
    """runtime/server_args.py checks the names at the CLI; backends/weight_format.py parses them: same sets."""
    from tierlm.runtime.server_args import ServerArgs

    for field, flags in (("quantization", (name, None)), ("torchao_config", (None, name))):
        try:
            parse_weight_quant(*flags)
            parsed = True
        except ValueError:
            parsed = False
        try:
            ServerArgs(**{field: name}).check()
            checked = True
        except ValueError as e:
            checked = f"--{field.replace('_', '-')} {name}" not in str(e)
        assert parsed == checked, (field, name)


# ------------------------------------------------------------------------------------------------ doctor
@pytest.mark.parametrize("backend,flags", [("torch", ["--torchao-config", "int8dq"]),
                                           ("torch", ["--torchao-config", "int4wo-32"]),
                                           pytest.param("mlx", ["--quantization", "q4-g32"], marks=pytest.mark.mlx),
                                           ("torch", [])])
def test_doctor_reports_the_weight_format_and_the_bytes_serve_holds(tiny_llama, backend, flags):
    """tierlm doctor (before loading) names the same weight format as the loaded backend and sizes its weights
    within 10 % of the bytes the backend really holds."""
    if flags and backend == "torch":
        _torchao()
    from tierlm.platforms import detect
    from tierlm.server.commands import doctor as doctor_cmd

    report = doctor_cmd.diagnose(detect(), {"TIERLM_BACKEND": backend},
                                 ["--json", "--model-path", str(tiny_llama), "--dtype", "float32", *flags])
    assert not report["errors"], report["errors"]
    kind, value = (flags[0].removeprefix("--").replace("-", "_"), flags[1]) if flags else (None, None)
    quant = parse_weight_quant(value if kind == "quantization" else None, value if kind == "torchao_config" else None)
    if backend == "torch":
        from tierlm.backends.torch.backend import TorchBackend

        loaded = TorchBackend(tiny_llama, dtype="float32", device="cpu", weight_quant=quant)
    else:
        from tierlm.backends.mlx.backend import MLXBackend

        loaded = MLXBackend(tiny_llama, dtype="float32", weight_quant=quant)
    assert report["model"]["weight_format"] == loaded.info.weight_format
    assert abs(report["model"]["weight_bytes"] - loaded.weight_bytes()) <= 0.1 * loaded.weight_bytes()


def test_kernel_report_names_torchaos_linear(tiny_llama):
    _torchao()
    backend = _torch_backend(tiny_llama, "torchao_config", "int8dq")
    # 3 layers x (q, k, v, o, gate, up, down) + lm_head
    assert backend.kernels()["linear"].startswith("torchao Int8Tensor (22 layers")


@pytest.mark.parametrize("backend_name,flags,label", [
    ("torch", (None, "int8dq"), "torchao:int8dq"),
    pytest.param("mlx", ("q4-g32", None), "mlx:q4-g32", marks=pytest.mark.mlx)])
def test_fp8_kv_pages_combine_with_quantized_weights(tiny_llama, backend_name, flags, label):
    """--kv-cache-dtype fp8_e4m3 with quantized weights: both in the L3 namespace; batched and chunked prefill
    (steps that sample no row included) give each prompt's solo output."""
    quant = parse_weight_quant(*flags)
    if backend_name == "torch":
        _torchao()
        from tierlm.backends.torch.backend import TorchBackend

        backend = TorchBackend(tiny_llama, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3",
                               weight_quant=quant)
    else:
        from tierlm.backends.mlx.backend import MLXBackend

        backend = MLXBackend(tiny_llama, dtype="float32", kv_cache_dtype="fp8_e4m3", weight_quant=quant)
    ns = backend.kv_namespace()
    assert (ns["kv_dtype"], ns["weight_format"]) == ("fp8_e4m3", label)
    whole = run_greedy(backend, PROMPTS, NEW, num_pages=64)
    assert run_greedy(backend, PROMPTS, NEW, num_pages=64, chunk_size=3, stagger=2) == whole
    assert [run_greedy(backend, [p], NEW, num_pages=64)[0] for p in PROMPTS] == whole


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_models_root):
    """Tied embeddings: lm_head shares the embedding matrix in the checkpoint."""
    from model_factory import build_tiny_model

    return build_tiny_model("qwen2", tiny_models_root / "qwen2")


def test_tied_embeddings_quantize_on_torch(tiny_qwen2, monkeypatch):
    _torchao()
    _attention_as_transformers(monkeypatch, "int8dq")
    backend = _torch_backend(tiny_qwen2, "torchao_config", "int8dq")
    _check_attention_as_transformers(backend, "int8dq")
    got = run_greedy(backend, PROMPTS[:1], NEW)
    assert got[0] == _torchao_reference(tiny_qwen2, "int8dq", PROMPTS[0])


@pytest.mark.parametrize("value", ["int8wo", "int4wo-32"])
def test_doctor_counts_the_one_quantized_table_of_a_tied_lm_head(tiny_qwen2, value):
    """Tied embeddings on the CPU weight-only path: the embedding and lm_head share one quantized table; doctor's
    estimate counts it once (within 2 % of what the backend holds; a second quantized copy would add ~14 % to this
    model, a float32 embedding ~50 %) and names the same format."""
    from tierlm.backends.torch.backend import TorchBackend
    from tierlm.platforms import detect
    from tierlm.server.commands import doctor as doctor_cmd

    report = doctor_cmd.diagnose(detect(), {"TIERLM_BACKEND": "torch"},
                                 ["--json", "--model-path", str(tiny_qwen2), "--dtype", "float32",
                                  "--torchao-config", value])
    assert not report["errors"], report["errors"]
    loaded = TorchBackend(tiny_qwen2, dtype="float32", device="cpu", weight_quant=parse_weight_quant(None, value))
    assert report["model"]["weight_format"] == loaded.info.weight_format == f"torchao:{value}+embedding"
    assert abs(report["model"]["weight_bytes"] - loaded.weight_bytes()) <= 0.02 * loaded.weight_bytes()


@pytest.mark.mlx
def test_tied_embeddings_quantize_on_mlx(tiny_qwen2):
    import mlx.core as mx
    from mlx import nn
    from mlx_lm import load

    from tierlm.backends.mlx.backend import MLXBackend

    backend = MLXBackend(tiny_qwen2, dtype="float32", weight_quant=parse_weight_quant("q8", None))
    ref_model, _ = load(str(tiny_qwen2))
    ref_model.set_dtype(mx.float32)
    nn.quantize(ref_model, group_size=64, bits=8)
    assert run_greedy(backend, PROMPTS[:1], NEW)[0] == _mlx_reference(ref_model, PROMPTS[0])


def test_doctor_reports_what_serve_would_refuse_on_this_device(tiny_llama):
    from tierlm.platforms import detect
    from tierlm.server.commands import doctor as doctor_cmd

    report = doctor_cmd.diagnose(detect(), {"TIERLM_BACKEND": "torch"},
                                 ["--json", "--model-path", str(tiny_llama), "--device", "cpu",
                                  "--torchao-config", "fp8wo"])
    assert any("--torchao-config fp8wo" in e and "int8dq" in e for e in report["errors"])
