"""--model-path resolution (local folder, hub cache, offline errors), the model fingerprint, eos ids and the
random demo model (deterministic, loadable by transformers and mlx-lm, safe to build from two processes).
The built-in model (no --model-path) has tests/test_builtin_model.py."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tierlm.backends.model_source import ModelSourceError, fingerprint, resolve, resolve_model_path
from tierlm.backends.model_source import demo as demo_model
from tierlm.backends.model_source.demo import DEMO_MODEL_NAME, ensure_demo_model
from tierlm.backends.model_source.fingerprint import model_fingerprint
from tierlm.backends.model_source.model_folder import ModelFolder

UNICODE_TEXT = "Hello, wörld! 你好 🙂  two spaces\n\ttab <b>&amp;</b> café"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("demo_cache"))


def _fake_model(folder: Path, config: dict | None = None, weights: bytes = b"\x01" * 4096) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama", "eos_token_id": 2}))
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- resolve


def test_local_folder_resolves_to_itself(tmp_path):
    folder = _fake_model(tmp_path / "m")
    assert resolve_model_path(str(folder)) == folder.resolve()


def test_local_folder_without_config_names_the_missing_file(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="config.json"):
        resolve_model_path(str(folder))


def test_local_folder_without_weights_says_so(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"safetensors"):
        resolve_model_path(str(folder))


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve.hub, "resolve_hub_id", lambda *a: pytest.fail("a path went to the hub"))
    with pytest.raises(ModelSourceError, match="no such folder"):
        resolve_model_path(str(tmp_path / "does" / "not" / "exist"))


def test_invalid_hub_id_is_a_model_source_error():
    with pytest.raises(ModelSourceError, match="neither an existing folder nor a valid Hugging Face hub id"):
        resolve_model_path("bad name with spaces")


def test_hub_id_offline_and_not_cached_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError) as err:
        resolve_model_path("tierlm-test/not-cached", cache_dir=tmp_path / "hub")
    message = str(err.value)
    assert "'tierlm-test/not-cached' is not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1" in message
    assert "hf download tierlm-test/not-cached" in message
    assert "--model-path /path/to/model" in message


def test_hub_id_unreachable_hub_and_not_cached_names_the_fix(tmp_path, monkeypatch):
    # Not offline by configuration, but the hub refuses connections (a closed local port stands in for it).
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(ModelSourceError) as err:
        resolve_model_path("tierlm-test/not-cached", cache_dir=tmp_path / "hub")
    message = str(err.value)
    assert "not in the local Hugging Face cache" in message and "cannot be reached" in message
    assert "hf download tierlm-test/not-cached" in message


def test_cached_hub_model_resolves_offline(tmp_path, monkeypatch):
    # The standard hub cache layout: models--owner--name/refs/main -> commit, snapshots/<commit>/files.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tierlm-test--cached"
    snapshot = _fake_model(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    assert resolve_model_path("tierlm-test/cached", cache_dir=tmp_path / "hub") == snapshot


def test_cached_snapshot_without_weights_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tierlm-test--partial"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    with pytest.raises(ModelSourceError, match="not in the local Hugging Face cache"):
        resolve_model_path("tierlm-test/partial", cache_dir=tmp_path / "hub")


# ------------------------------------------------------------------------------------------ fingerprint


def test_fingerprint_survives_a_copy(tmp_path):
    original = _fake_model(tmp_path / "a", weights=bytes(range(256)) * 64)
    time.sleep(0.01)  # the copy gets different mtimes
    copy = Path(shutil.copytree(original, tmp_path / "b"))
    assert model_fingerprint(copy) == model_fingerprint(original)


def test_fingerprint_changes_with_one_weight_byte(tmp_path):
    weights = bytearray(bytes(range(256)) * 64)
    folder = _fake_model(tmp_path / "a", weights=bytes(weights))
    before = model_fingerprint(folder)
    weights[5000] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(weights))
    assert model_fingerprint(folder) != before


def test_fingerprint_changes_with_config(tmp_path):
    folder = _fake_model(tmp_path / "a")
    before = model_fingerprint(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 3}))
    assert model_fingerprint(folder) != before


def test_fingerprint_of_a_big_file_sees_its_start_end_and_middle(tmp_path):
    size = 8 << 20
    folder = _fake_model(tmp_path / "a", weights=bytes(size))
    before = model_fingerprint(folder)
    path = folder / "model.safetensors"
    sampled_offsets = [off for off, _ in fingerprint._sample_ranges(size)]
    for offset in (0, size - 1, sampled_offsets[len(sampled_offsets) // 2]):
        data = bytearray(bytes(size))
        data[offset] = 7
        path.write_bytes(bytes(data))
        assert model_fingerprint(folder) != before, f"a change at byte {offset} was missed"


def test_sample_ranges_stay_inside_the_file():
    for size in (0, 10, (3 << 20) - 1, 3 << 20, 10 << 20, 10**10 + 7):
        for offset, length in fingerprint._sample_ranges(size):
            assert 0 <= offset and offset + length <= size


# ---------------------------------------------------------------------------------------------- eos ids


def test_generation_eos_union_in_order(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151643}))
    assert ModelFolder.read(tmp_path).eos_token_ids == [151645, 151643]


def test_generation_eos_from_config_only_and_null(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert ModelFolder.read(tmp_path).eos_token_ids == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert ModelFolder.read(tmp_path).eos_token_ids == [2]
    assert ModelFolder.read(tmp_path / "missing").eos_token_ids == []


# ------------------------------------------------------------------------------------------- demo model


def test_demo_model_is_deterministic(tmp_path, demo_dir):
    other = ensure_demo_model(tmp_path / "other")
    assert other != demo_dir
    for name in demo_model.REQUIRED_FILES:
        assert (other / name).read_bytes() == (demo_dir / name).read_bytes(), name
    assert model_fingerprint(other) == model_fingerprint(demo_dir)


def test_demo_model_config_and_eos(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    tokenizer = json.loads((demo_dir / "tokenizer.json").read_text())
    vocab = len(tokenizer["model"]["vocab"])
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == vocab
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert ModelFolder.read(demo_dir).eos_token_ids == [specials["<|im_end|>"], specials["</s>"]]


def test_demo_model_incomplete_folder_is_rebuilt(tmp_path):
    folder = ensure_demo_model(tmp_path)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()
    assert ensure_demo_model(tmp_path) == folder
    assert (folder / "model.safetensors").read_bytes() == weights
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_MODEL_NAME]  # no temp folders left behind


def test_demo_model_unwritable_cache_is_a_model_source_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ModelSourceError, match="--model-path"):
        ensure_demo_model(blocker / "cache")


def test_demo_model_loads_with_transformers(demo_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    ids = tok.encode(UNICODE_TEXT, add_special_tokens=False)
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<s>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.encode(prompt, add_special_tokens=False)
    assert chat_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in chat_ids

    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert torch.isfinite(logits).all()


@pytest.mark.mlx
def test_demo_model_loads_with_mlx_lm(demo_dir):
    import mlx.core as mx
    import mlx_lm

    model, tok = mlx_lm.load(str(demo_dir))
    ids = tok.encode(UNICODE_TEXT, add_special_tokens=False)
    assert tok.decode(ids) == UNICODE_TEXT
    logits = model(mx.array([ids]))
    config = json.loads((demo_dir / "config.json").read_text())
    assert tuple(logits.shape) == (1, len(ids), config["vocab_size"])


def test_demo_model_built_by_two_processes_at_once(tmp_path):
    """Both processes wait for a go signal, then build; both must get the same complete folder."""
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from tierlm.backends.model_source.demo import ensure_demo_model
        Path(sys.argv[1]).touch()
        while not Path({str(go)!r}).exists():
            time.sleep(0.005)
        print(ensure_demo_model(Path({str(tmp_path / 'cache')!r})))
    """)
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    paths = {out.strip() for out, _ in results}
    assert paths == {str(tmp_path / "cache" / DEMO_MODEL_NAME)}
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [DEMO_MODEL_NAME]
    reference = tmp_path / "ref"
    reference.mkdir()
    demo_model.write_demo_model(reference)
    for name in demo_model.REQUIRED_FILES:
        assert (tmp_path / "cache" / DEMO_MODEL_NAME / name).read_bytes() == (reference / name).read_bytes()


def test_model_size_counts_the_weights_the_backend_loads(tmp_path):
    """A folder with both formats is loaded from its safetensors; sizes follow the dtype served on the device."""
    from safetensors.numpy import save_file

    from tierlm.backends.model_source.folder_facts import model_size

    config = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                  vocab_size=100, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {"w": np.zeros((10, 10), np.float32), "ids": np.zeros(8, np.int64)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 10_000)  # an older copy of the same weights
    on_cpu = model_size(tmp_path, "auto", "cpu")  # auto on CPU: float32
    assert on_cpu.dtype == "float32" and on_cpu.weight_bytes == 100 * 4 + 8 * 8
    assert on_cpu.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 and on_cpu.vocab_size == 100
    on_gpu = model_size(tmp_path, "auto", "cuda")  # floats cast to bfloat16, integers as stored
    assert on_gpu.dtype == "bfloat16" and on_gpu.weight_bytes == 100 * 2 + 8 * 8
    assert model_size(tmp_path, "auto", "mps").dtype == "bfloat16"  # Apple GPU: the checkpoint's half dtype
    assert model_size(tmp_path, "float16", "cpu").kv_bytes_per_token == on_cpu.kv_bytes_per_token // 2


def test_a_model_folder_is_read_once_and_shared(tmp_path):
    config = {"model_type": "llava", "text_config": {"model_type": "llama", "eos_token_id": 7}, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    folder = ModelFolder.read(tmp_path)
    assert (folder.path, folder.config, folder.model_type) == (tmp_path, config, "llava")
    assert folder.text_config == config["text_config"] and folder.eos_token_ids == [2]
    assert folder.weight_files == (tmp_path / "model.safetensors",)
    assert model_fingerprint(folder) == model_fingerprint(tmp_path)  # the same bytes hashed
    (tmp_path / "config.json").write_text("{}")  # later edits are not seen: the record is what startup read
    assert model_fingerprint(folder) != model_fingerprint(tmp_path) and folder.model_type == "llava"
