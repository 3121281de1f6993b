"""Hostile input and hostile web pages: body limits, tokenization off the event loop, invalid Unicode, token ids
outside the vocabulary, the admin route guard, unknown model names, and the per-request log line."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine, FakeTokenizer
from http_helpers import LOCAL, assert_error
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.app import create_app

JSON = {"content-type": "application/json"}


def make_client(**args: Any) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(ServerArgs(model_path="fake/model", **args))
    return TestClient(create_app(engine), base_url=LOCAL), engine


# ------------------------------------------------------------------ request body limit


def test_body_over_the_declared_limit_is_413_before_parsing() -> None:
    client, engine = make_client(max_request_bytes=4096)
    body = json.dumps({"prompt": "a" * 5000, "max_tokens": 1})
    err = assert_error(client.post("/v1/completions", content=body, headers=JSON), 413,
                       contains="--max-request-bytes")
    assert err["code"] == "request_too_large"
    assert engine.received == []
    assert client.post("/v1/completions", json={"prompt": "a" * 3000, "max_tokens": 1}).status_code == 200


def test_chunked_body_is_cut_off_at_the_limit() -> None:
    client, engine = make_client(max_request_bytes=4096)

    def chunks():  # no Content-Length: the server has to count
        for _ in range(10):
            yield b" " * 1000

    assert_error(client.post("/generate", content=chunks(), headers=JSON), 413, contains="4096 bytes")
    assert engine.received == []
    assert client.get("/health").status_code == 200


class BlockingTokenizer(FakeTokenizer):
    """encode() of a long text waits until the test lets it go, like tokenizing megabytes would take seconds."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        if len(text) > 1000:
            self.started.set()
            assert self.release.wait(10), "the test never released the tokenizer"
        return super().encode(text, **kwargs)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_health_answers_while_a_large_prompt_is_tokenized(route: str) -> None:
    engine = FakeEngine()
    engine.tokenizer = tok = BlockingTokenizer()
    big = "x" * 3000
    body = {"/v1/completions": {"prompt": big, "max_tokens": 2},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": big}], "max_tokens": 2},
            "/generate": {"text": big, "sampling_params": {"max_new_tokens": 2}}}[route]

    async def scenario() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url=LOCAL) as client:
            generation = asyncio.create_task(client.post(route, json=body))
            await asyncio.wait_for(asyncio.to_thread(tok.started.wait, 5), 10)
            # Tokenization is blocked now; on the event loop this would deadlock, so bound it.
            health = await asyncio.wait_for(client.get("/health"), 5)
            tok.release.set()
            return health.status_code, (await asyncio.wait_for(generation, 10)).status_code

    try:
        assert asyncio.run(scenario()) == (200, 200)
    finally:
        tok.release.set()


# ------------------------------------------------------------------ invalid text and token ids


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "\ud800 x"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\udfff"]}, "prompt[1]"),
    ("/generate", {"text": "\ud800 x"}, "text"),
    ("/generate", {"text": ["ok", "\ud800"]}, "text[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 x"}]}, "messages[0].content"),
])
def test_lone_surrogate_is_a_400_naming_the_field(route: str, body: dict, param: str) -> None:
    client, engine = make_client()
    # json.dumps escapes the surrogate as \ud800, which is what a hostile client sends on the wire
    resp = client.post(route, content=json.dumps(body), headers=JSON)
    err = assert_error(resp, 400, param=param, contains="surrogate")
    assert err["code"] == "invalid_unicode"
    assert engine.received == []
    assert client.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("ids", [[1, -5], [1, 99999999999], [1, 2**70], [-(2**70)]])
def test_echo_of_ids_outside_the_vocabulary_is_a_400(ids: list[int]) -> None:
    client, engine = make_client()
    resp = client.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 1})
    assert_error(resp, 400, param="prompt", contains="outside the vocabulary")
    resp = client.post("/v1/completions", json={"prompt": [[65], ids], "echo": True, "max_tokens": 1})
    assert_error(resp, 400, param="prompt[1]", contains="outside the vocabulary")
    assert_error(client.post("/generate", json={"input_ids": ids}), 400, param="input_ids",
                 contains="outside the vocabulary")
    assert engine.received == []


# ------------------------------------------------------------------ admin route guard


def test_flush_cache_is_post_only() -> None:
    client, engine = make_client()
    assert_error(client.get("/flush_cache", params={"storage": "true"}), 405, contains="use POST")
    assert engine.flushed == []
    assert client.post("/flush_cache").status_code == 200


@pytest.mark.parametrize("headers", [
    {"origin": "http://evil.example"},
    {"origin": "null"},
    {"host": "evil.example:30000", "origin": "http://evil.example:30000"},  # DNS rebinding: "same origin"
    {"host": "evil.example"},
])
def test_requests_from_other_sites_are_refused(headers: dict[str, str]) -> None:
    client, engine = make_client()
    resp = client.post("/flush_cache", params={"storage": "true"}, headers=headers)
    err = assert_error(resp, 403, contains="--allowed-origins")
    assert err["code"] == "origin_not_allowed"
    assert engine.flushed == []
    assert_error(client.post("/v1/completions", json={"prompt": "a"}, headers=headers), 403)


@pytest.mark.parametrize("headers", [
    {},  # curl, the openai client, sglang-router: no Origin
    {"origin": "http://localhost"},  # the server's own pages (/docs)
    {"host": "127.0.0.1:30000"},
    {"host": "[::1]:30000"},
    {"host": "10.1.2.3:30000"},  # addressed by IP from another machine
])
def test_own_origin_and_plain_clients_pass(headers: dict[str, str]) -> None:
    client, engine = make_client()
    assert client.post("/flush_cache", headers=headers).status_code == 200


def test_allowed_origins_lets_named_sites_and_hosts_in() -> None:
    client, engine = make_client(allowed_origins=["http://app.example:3000", "tierlm.lan"])
    assert client.post("/flush_cache", headers={"origin": "http://app.example:3000"}).status_code == 200
    assert client.post("/health_generate", headers={"host": "tierlm.lan:30000"}).status_code == 405
    assert client.get("/health", headers={"host": "tierlm.lan:30000"}).status_code == 200
    assert_error(client.post("/flush_cache", headers={"origin": "http://app.example:4000"}), 403)
    everyone, _ = make_client(allowed_origins=["*"])
    assert everyone.post("/flush_cache", headers={"origin": "http://evil.example"}).status_code == 200


def test_admin_api_key_guards_admin_routes_only() -> None:
    client, engine = make_client(api_key="user-key", admin_api_key="admin-key")
    user = {"authorization": "Bearer user-key"}
    admin = {"authorization": "Bearer admin-key"}
    assert_error(client.post("/flush_cache"), 401, contains="--admin-api-key")
    assert_error(client.post("/flush_cache", headers=user), 401, contains="--admin-api-key")
    assert client.post("/flush_cache", headers=admin).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=user).status_code == 200
    assert_error(client.post("/v1/completions", json={"prompt": "a"}, headers=admin), 401, contains="--api-key")
    assert engine.flushed == [False]


def test_api_key_alone_also_guards_admin_routes() -> None:
    client, engine = make_client(api_key="k")
    assert_error(client.post("/flush_cache"), 401, contains="--api-key")
    assert client.post("/flush_cache", headers={"authorization": "Bearer k"}).status_code == 200
    admin_only, _ = make_client(admin_api_key="a")
    assert admin_only.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
    assert_error(admin_only.post("/flush_cache"), 401)


# ------------------------------------------------------------------ model names


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
])
def test_unknown_model_is_a_404_like_the_models_route(route: str, body: dict) -> None:
    client, engine = make_client(served_model_name="mine")
    err = assert_error(client.post(route, json={**body, "model": "gpt-4"}), 404, param="model", contains="gpt-4")
    assert err == assert_error(client.get("/v1/models/gpt-4"), 404, param="model") | {"message": err["message"]}
    assert engine.received == []
    for name in ("mine", "default", "fake/model", None):
        assert client.post(route, json={**body, "model": name}).status_code == 200, name
        if name:
            assert client.get(f"/v1/models/{name}").status_code == 200


# ------------------------------------------------------------------ request log


def test_one_log_line_per_request_with_tokens_cache_and_errors(caplog: pytest.LogCaptureFixture) -> None:
    client, engine = make_client()
    caplog.set_level(logging.INFO, logger="tierlm.requests")
    for _ in range(2):  # the second one hits the (fake) prefix cache
        assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}).status_code == 200
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "temperature": -1})
    client.get("/health")  # health checks stay out of the info log
    lines = [r.getMessage() for r in caplog.records if r.name == "tierlm.requests"]
    assert len(lines) == 3, lines
    first, second, error = lines
    assert first.startswith("POST /v1/completions 200 prompt=5 completion=3 cached=0 ")
    assert "ttft=" in first and "total=" in first
    assert second.startswith("POST /v1/completions 200 prompt=5 completion=3 cached=4 (device=4 host=0 storage=0)")
    assert error.startswith("POST /v1/completions 400 ") and "error: " in error and "temperature" in error
    assert "body=" not in first


def test_log_requests_adds_the_prompt_and_the_output(caplog: pytest.LogCaptureFixture) -> None:
    client, engine = make_client(log_requests=True)
    caplog.set_level(logging.INFO, logger="tierlm.requests")
    client.post("/v1/completions", json={"prompt": "zyx", "max_tokens": 3})
    line = next(r.getMessage() for r in caplog.records if r.name == "tierlm.requests")
    assert '"prompt":"zyx"' in line and "output='zyx'" in line
