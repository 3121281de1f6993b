"""A real server with weights quantized at load (--quantization w8a8_int8: torchao int8 weights and activations)
on stories260K, driven by the official `openai` client: greedy text equals transformers' model with the same
torchao quantization, /server_info reports the weight format and resident bytes, a repeated prompt hits the device
cache with the cold text; a format this CPU cannot run stops startup with the reason in the log.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import STORIES_PROMPT
from e2e_server import ServerProcess, start_server

openai = pytest.importorskip("openai")
pytest.importorskip("torchao", reason="torchao is not installed: pip install 'tierlm[quant]'")

pytestmark = pytest.mark.slow
ENV = {"TIERLM_NO_PROGRESS": "1", "TIERLM_BACKEND": "torch"}
NEW = 40


@pytest.fixture(scope="module")
def server(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_server(["--model-path", str(stories_dir), "--skip-warmup", "--quantization", "w8a8_int8"], env=ENV,
                      log_dir=tmp_path_factory.mktemp("e2e_quant_logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def _reference_text(stories_dir: Path) -> str:
    """transformers' float32 model with torchao's int8dq applied the same way, greedy, decoded."""
    import torch
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32, attn_implementation="eager").eval()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    ids = tok(STORIES_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=NEW)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_greedy_text_equals_transformers_with_the_same_quantization(server, client, stories_dir):
    model = client.models.list().data[0].id
    cold = client.completions.create(model=model, prompt=STORIES_PROMPT, max_tokens=NEW, temperature=0)
    assert cold.choices[0].text == _reference_text(stories_dir)
    again = client.completions.create(model=model, prompt=STORIES_PROMPT + cold.choices[0].text[:80],
                                      max_tokens=8, temperature=0)
    hot = client.completions.create(model=model, prompt=STORIES_PROMPT + cold.choices[0].text[:80],
                                    max_tokens=8, temperature=0)
    assert hot.choices[0].text == again.choices[0].text
    assert hot.usage.prompt_tokens_details.cached_tokens > 0


def test_server_info_reports_the_weight_format_and_bytes(server):
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    assert info["weight_format"] == "torchao:int8dq"
    assert 0 < info["weight_bytes"] and "Int8Tensor" in info["kernels"]["linear"]


def test_fp8_on_this_cpu_stops_startup_with_the_alternative(stories_dir, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU may run torchao's fp8: this is the CPU refusal")
    s = start_server(["--model-path", str(stories_dir), "--skip-warmup", "--quantization", "fp8"], env=ENV,
                     wait=False, log_dir=tmp_path)
    try:
        assert s.wait_exit(120) != 0
        log = s.log_text()
        assert "--quantization fp8" in log and "w8a8_int8" in log
    finally:
        s.stop()
