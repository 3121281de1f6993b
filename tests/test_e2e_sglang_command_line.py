"""A real server started with a long SGLang-style command line: every flag with real behaviour in
docs/sglang-compat.md is passed at once, and each one's effect is checked over HTTP (server info, metrics,
output) or in the startup log."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from e2e_server import ServerProcess, start_server

pytestmark = pytest.mark.slow

KEY = "sk-sglang-flags"
PAGE = 8
DEVICE_TOKENS = 512


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    l3 = tmp_path_factory.mktemp("l3")
    args = [
        "--model-path", str(tiny_llama), "--tokenizer-path", str(tiny_llama), "--served-model-name", "sg-tiny",
        "--trust-remote-code", "--dtype", "float32", "--device", "cpu", "--tp-size", "1", "--dp-size", "1",
        "--context-length", "256", "--page-size", str(PAGE), "--max-total-tokens", str(DEVICE_TOKENS),
        "--max-running-requests", "4", "--chunked-prefill-size", "64", "--max-prefill-tokens", "32",
        "--max-queued-requests", "16", "--schedule-policy", "lpm", "--kv-cache-dtype", "fp8_e4m3",
        "--stream-interval", "3", "--attention-backend", "tierlm_paged", "--disable-cuda-graph",
        "--cuda-graph-max-bs", "8", "--enable-metrics", "--enable-cache-report", "--skip-server-warmup",
        "--watchdog-timeout", "120", "--random-seed", "7", "--grammar-backend", "xgrammar",
        "--chat-template", "chatml", "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-mem-layout", "page_first", "--hicache-write-policy", "write_through",
        "--hicache-io-backend", "direct", "--hicache-storage-backend", "file",
        "--hicache-storage-prefetch-policy", "wait_complete", "--api-key", KEY, "--log-level", "info",
    ]
    with start_server(args, env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(l3)},
                      log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s, l3


def _get(s: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(f"{s.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def _client(s: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url, api_key=KEY, max_retries=0)


def test_server_info_reflects_the_sizes_and_policies(server) -> None:
    s, l3 = server
    info = _get(s, "/get_server_info").json()
    pool = info["kv_pool"]
    assert pool["total_tokens"] == DEVICE_TOKENS and pool["page_size"] == PAGE  # --max-total-tokens, --page-size
    # --kv-cache-dtype fp8_e4m3: one byte per K/V element (the float32 model would take four)
    cfg = json.loads((Path(info["model_path"]) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert pool["bytes_per_token"] == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
    assert pool["kv_dtype"] == "fp8_e4m3"
    assert info["context_length"] == 256  # --context-length
    assert info["max_running_requests"] == 4  # --max-running-requests
    assert info["prefill_budget_tokens"] == 32  # min(--chunked-prefill-size, --max-prefill-tokens)
    assert info["grammar_backend"] == "xgrammar" and info["chat_template"]  # --grammar-backend, --chat-template
    host, storage = info["tiers"]["host"], info["tiers"]["storage"]
    assert host["total_tokens"] == 2 * DEVICE_TOKENS  # --hicache-ratio 2
    assert (host["layout"], host["write_policy"]) == ("page_first", "write_through")
    assert storage["backend"] == "file" and Path(storage["dir"]).is_relative_to(l3)  # the env var's folder
    assert storage["prefetch_policy"] == "wait_complete"
    a = info["server_args"]
    assert (a["schedule_policy"], a["stream_interval"], a["watchdog_timeout"], a["random_seed"]) == ("lpm", 3, 120.0, 7)
    assert (a["max_queued_requests"], a["warmup"], a["hicache_io_backend"]) == (16, False, "direct")


def test_startup_log_says_what_each_accepted_flag_means(server) -> None:
    s, _ = server
    log = s.log_text()
    for line in ("schedule policy lpm", "KV fp8_e4m3", "attention: tierlm_paged", "--disable-cuda-graph",
                 "--enable-metrics: accepted", "--enable-cache-report: accepted", "--hicache-io-backend direct",
                 "chat template: built-in template 'chatml'"):
        assert line in log, line


def test_api_key_served_name_and_context_length(server) -> None:
    s, _ = server
    assert httpx.get(f"{s.url}/v1/models", timeout=10).status_code == 401  # --api-key
    client = _client(s)
    assert [m.id for m in client.models.list().data] == ["sg-tiny"]  # --served-model-name
    with pytest.raises(openai.BadRequestError) as e:  # --context-length 256
        client.completions.create(model="sg-tiny", prompt=list(range(5, 305)), max_tokens=2)
    assert "256" in str(e.value)


def test_stream_interval_cache_report_metrics_and_storage(server) -> None:
    s, l3 = server
    client = _client(s)
    prompt = list(range(10, 90))  # 80 tokens: prefilled in chunks of 32 (--max-prefill-tokens)
    chunks = list(client.completions.create(model="sg-tiny", prompt=prompt, max_tokens=9, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    texts = [c for c in chunks if c.choices and c.choices[0].text]
    assert 2 <= len(texts) <= 4  # --stream-interval 3: token 1, then every 3rd token, then the rest
    again = client.completions.create(model="sg-tiny", prompt=prompt, max_tokens=9, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == "".join(c.choices[0].text for c in chunks)  # a cache hit keeps the output
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # --enable-cache-report
    metrics = _get(s, "/metrics").text  # --enable-metrics
    assert 'sglang:prompt_tokens_total{model_name="sg-tiny"}' in metrics
    assert any(p.is_file() for p in l3.rglob("*") if p.suffix != ".json")  # write_through reached the file tier


def test_grammar_backend_constrains_the_output(server) -> None:
    s, _ = server
    out = _client(s).chat.completions.create(
        model="sg-tiny", messages=[{"role": "user", "content": "pick"}], max_tokens=12, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": {
            "type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"],
            "additionalProperties": False}}})
    assert json.loads(out.choices[0].message.content)["c"] in ("red", "blue")
