"""The built-in model: `tierlm serve` with no --model-path serves llama2.c's stories260K from the package, offline,
under a stable name, with greedy text equal to llama2.c run.c's; its chat template makes a chat a story prompt."""
from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conftest import STORIES_DIR
from e2e_server import start_server
from engine_harness import greedy, run, start_engine
from tierlm.backends.model_source import resolve_model_path
from tierlm.backends.model_source.builtin_model import (BUILTIN_MODEL_DIR, BUILTIN_MODEL_NAME, BUILTIN_MODEL_NOTICE,
                                                        REQUIRED_FILES, builtin_model_dir)
from tierlm.backends.model_source.errors import ModelSourceError
from tierlm.backends.model_source.folder_facts import model_size
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.model_source.tokenizer import load_tokenizer
from tierlm.runtime import load_plan
from tierlm.runtime.server_args import BUILTIN_MODEL_NAME as SERVED_NAME
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.api.openai.protocol import ChatMessage
from tierlm.server.pipeline.tokenization import apply_chat_template

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"
# llama2.c `./run stories260K.bin -z tok512.bin -t 0 -n 64 -i "Once upon a time"` (64 positions: 60 new tokens),
# recorded in ../shared/models/stories260K/README.md
RUN_C_TEXT = (", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, "
              "red ball. She wanted to play with it, but it was too high.\nLily")
RUN_C_NEW_TOKENS = 60


def test_no_model_path_is_the_packaged_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path(None) == BUILTIN_MODEL_DIR
    assert BUILTIN_MODEL_DIR.is_relative_to(REPO / "backends")  # inside the package, not in a cache or ../shared
    assert "MIT License" in (BUILTIN_MODEL_DIR / "LICENSE").read_text()
    provenance = (BUILTIN_MODEL_DIR / "README.md").read_text()
    assert "karpathy/tinyllamas" in provenance
    assert "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696" in provenance  # stories260K.bin


def test_a_lost_file_is_a_model_source_error_naming_the_fix(monkeypatch, tmp_path):
    from tierlm.backends.model_source import builtin_model

    monkeypatch.setattr(builtin_model, "BUILTIN_MODEL_DIR", tmp_path)
    with pytest.raises(ModelSourceError, match="reinstall") as e:
        builtin_model_dir()
    assert "model.safetensors" in str(e.value)


def test_the_weights_are_llama2c_stories260k_unchanged():
    if not (STORIES_DIR / "config.json").exists():
        pytest.skip(f"reference copy not found at {STORIES_DIR} (../shared/models is absent)")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "LICENSE"):
        assert (BUILTIN_MODEL_DIR / name).read_bytes() == (STORIES_DIR / name).read_bytes(), name
    ours = json.loads((BUILTIN_MODEL_DIR / "tokenizer_config.json").read_text())
    assert "chat_template" in ours
    del ours["chat_template"]  # tierlm's one addition
    assert ours == json.loads((STORIES_DIR / "tokenizer_config.json").read_text())


def test_the_served_name_is_stable():
    assert SERVED_NAME == BUILTIN_MODEL_NAME == "stories260K"  # runtime/ may not import backends/: kept equal here
    assert ServerArgs().model_name == "stories260K"
    assert ServerArgs(served_model_name="mine").model_name == "mine"
    assert "stories260K" in BUILTIN_MODEL_NOTICE and "--model-path" in BUILTIN_MODEL_NOTICE


@pytest.mark.parametrize("device, native_bf16", [("cuda", False), ("cpu", True)])
def test_dtype_auto_serves_it_as_trained_where_others_get_bfloat16(device, native_bf16, tmp_path):
    """float32 keeps the greedy text run.c's on every device; serve (the composition root) and doctor/bench
    (model_size) agree. A copy of the same files elsewhere is an ordinary float32 checkpoint."""
    decision = SimpleNamespace(backend="torch", device=device, native_bf16=native_bf16)
    builtin = ModelFolder.read(BUILTIN_MODEL_DIR)
    assert load_plan.choose_dtype(ServerArgs(), decision, builtin)[0] == "float32"
    assert model_size(builtin, "auto", device, cpu_bf16=native_bf16).dtype == "float32"
    assert load_plan.choose_dtype(ServerArgs(dtype="bfloat16"), decision, builtin)[0] == "bfloat16"
    copy = tmp_path / "copy"
    shutil.copytree(BUILTIN_MODEL_DIR, copy)
    assert load_plan.choose_dtype(ServerArgs(), decision, ModelFolder.read(copy))[0] == "bfloat16"
    assert model_size(copy, "auto", device, cpu_bf16=native_bf16).dtype == "bfloat16"


def test_package_data_ships_the_model_in_wheels_and_editable_installs():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "stories260K/*" in data["tierlm.backends.model_source"]
    for name in REQUIRED_FILES + ("README.md",):
        assert (BUILTIN_MODEL_DIR / name).is_file(), name


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUILTIN_MODEL_DIR)


def _chat_ids(tokenizer, *messages: tuple[str, str]) -> list[int]:
    return apply_chat_template(tokenizer, [ChatMessage(role=r, content=c) for r, c in messages])


def test_a_chat_turn_is_the_story_prompt(tokenizer):
    completion_ids = list(tokenizer.encode(PROMPT))
    assert completion_ids[0] == 1  # BOS, as run.c starts
    assert _chat_ids(tokenizer, ("user", PROMPT)) == completion_ids
    assert _chat_ids(tokenizer, ("system", "You are a helpful assistant."), ("user", PROMPT)) == completion_ids
    # turns continue one story: the answer's own leading comma/space kept, a space before a turn starting a word
    story = _chat_ids(tokenizer, ("user", PROMPT), ("assistant", ", there was a dog."), ("user", "The dog"))
    assert story == list(tokenizer.encode(PROMPT + ", there was a dog. The dog"))
    assert _chat_ids(tokenizer, ("system", "only a system message")) == [1]  # BOS: a story from the start


def test_greedy_text_is_run_c_on_each_backend(backend_name):
    engine = start_engine(BUILTIN_MODEL_DIR, backend_name)
    try:
        prompt = list(engine.tokenizer.encode(PROMPT))
        result = run(engine, [prompt], greedy(RUN_C_NEW_TOKENS))[0]
        assert result.text == RUN_C_TEXT
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_serve_without_arguments_tells_the_run_c_story_offline(tmp_path):
    """The real server process with no --model-path and the hub switched off: the completion and the chat answer of
    "Once upon a time" are run.c's text, under the name stories260K."""
    openai = pytest.importorskip("openai")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path),
           "HF_HOME": str(tmp_path)}
    with start_server(["--skip-warmup"], env=env, log_dir=tmp_path) as server:
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["stories260K"]
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        comp = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=RUN_C_NEW_TOKENS,
                                         temperature=0)
        assert comp.choices[0].text == RUN_C_TEXT
        chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=RUN_C_NEW_TOKENS, temperature=0)
        assert chat.choices[0].message.content == RUN_C_TEXT
    log = server.log_text()
    assert "built-in model stories260K" in log
