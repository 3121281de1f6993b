"""The real server process: starts, serves the official OpenAI client, stops; failed startups exit 1 fast."""
from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from e2e_server import free_port, start_server

pytestmark = pytest.mark.slow


def test_builtin_model_server_serves_openai_client_and_stops(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    env = {"XDG_CACHE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}  # no --model-path: the built-in model
    with start_server(["--max-running-requests", "4", "--skip-warmup"], env=env, log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        prompt = "Once upon a time there was a tiny model that served requests. " * 3  # several KV pages
        comp = client.completions.create(model="stories260K", prompt=prompt, max_tokens=5, temperature=0)
        assert comp.choices[0].finish_reason in ("length", "stop")
        assert comp.usage.completion_tokens <= 5
        again = client.completions.create(model="stories260K", prompt=prompt, max_tokens=5, temperature=0)
        assert again.choices[0].text == comp.choices[0].text  # greedy is deterministic
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prompt prefix was reused
        stream = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4
        assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert "stopping the engine" in server.log_text()


def test_bad_model_path_exits_1_with_message(tmp_path: Path) -> None:
    server = start_server(["--model-path", str(tmp_path / "no-such-model")], wait=False, log_dir=tmp_path)
    try:
        assert server.wait_exit(timeout=90) == 1
    finally:
        server.stop()
    log = server.log_text()
    assert "startup failed" in log and "no-such-model" in log


def test_busy_port_exits_1_before_loading(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        server = start_server(["--port", str(port), "--model-path", "/never/loaded"], wait=False, log_dir=tmp_path)
        try:
            assert server.wait_exit(timeout=60) == 1
        finally:
            server.stop()
    log = server.log_text()
    assert f"cannot listen on 127.0.0.1:{port}" in log
    assert "loading model" not in log
