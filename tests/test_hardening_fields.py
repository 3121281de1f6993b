"""Every text field, every id (issue #33): every string a request carries is valid Unicode, checked once when the
body is parsed (a 400 naming the field, before anything is generated); token ids are integers in range, booleans
are booleans; the request log escapes what it echoes; /generate refuses SGLang fields tierlm does not implement."""
from __future__ import annotations

import json
import logging
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error, sse_events
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.api.native.protocol import UNSUPPORTED_GENERATE_FIELDS
from tierlm.server.app import create_app

MESSAGES = [{"role": "user", "content": "hi"}]
SURROGATE = "bad\ud800name"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(ServerArgs(model_path="fake/model"))


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine), base_url=LOCAL)


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{LOCAL}/v1", api_key="none", http_client=client, max_retries=0)


def post(client: TestClient, route: str, body: dict[str, Any]) -> Any:
    """JSON with \\u escapes (json.dumps' default): clients that encode UTF-8 cannot send a lone surrogate at all."""
    return client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_model_is_a_400_naming_it(client: TestClient, engine: FakeEngine, stream: bool) -> None:
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MESSAGES}),
                        ("/tokenize", {"prompt": "hi"})):
        r = post(client, route, {"model": SURROGATE, "max_tokens": 2, "stream": stream, **body})
        err = assert_error(r, 400, param="model", contains="surrogate")
        assert err["code"] == "invalid_unicode"
    assert engine.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_rid_is_refused_before_generation(client: TestClient, engine: FakeEngine,
                                                              stream: bool) -> None:
    r = post(client, "/generate", {"text": "hi", "rid": SURROGATE, "stream": stream,
                                   "sampling_params": {"max_new_tokens": 2}})
    assert_error(r, 400, param="rid", contains="surrogate")
    r = post(client, "/generate", {"text": ["a", "b"], "rid": ["ok", SURROGATE]})
    assert_error(r, 400, param="rid[1]")
    assert engine.received == []


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "description": SURROGATE}}]},
     "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "description": SURROGATE}}}}}]},
     "tools[0].function.parameters.properties.a.description"),
    ({"user": SURROGATE}, "user"),
    ({"stop": ["ok", SURROGATE]}, "stop[1]"),
    ({"chat_template_kwargs": {"who": SURROGATE}}, "chat_template_kwargs.who"),
    ({"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]}, "messages[0].name"),
])
def test_every_string_field_is_checked_and_named(client: TestClient, engine: FakeEngine, body: dict,
                                                 param: str) -> None:
    r = post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **body})
    assert_error(r, 400, param=param, contains="lone UTF-16 surrogate")
    assert engine.received == []


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": [1, True, 3]}, "prompt"),
    ("/v1/completions", {"prompt": [False]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**63]}, "stop_token_ids[0]"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop_token_ids": [2**64 + 5]}, "stop_token_ids[0]"),
    ("/generate", {"input_ids": [104, True]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [2**63]}}, "sampling_params.stop_token_ids[0]"),
    ("/detokenize", {"tokens": [104, False]}, "tokens"),
])
def test_token_ids_are_integers_in_range(client: TestClient, engine: FakeEngine, route: str, body: dict,
                                         param: str) -> None:
    err = assert_error(client.post(route, json=body), 400)
    assert err["param"].startswith(param), err
    assert engine.received == []


@pytest.mark.parametrize("route,body,field", [
    ("/tokenize", {"prompt": "hi", "add_special_tokens": 0}, "add_special_tokens"),
    ("/detokenize", {"tokens": [104], "skip_special_tokens": 1}, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": 0}, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": 1}, "stream"),
    ("/generate", {"text": "hi", "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
    ("/generate", {"text": "hi", "return_logprob": "true"}, "return_logprob"),
])
def test_booleans_are_booleans(client: TestClient, route: str, body: dict, field: str) -> None:
    assert_error(client.post(route, json=body), 400, param=field, contains="valid boolean")
    ok = {k: (bool(v) if k == field.rsplit(".", 1)[-1] else v) for k, v in body.items()}
    if route != "/generate":
        assert client.post(route, json=ok).status_code == 200


def test_the_request_log_escapes_what_it_echoes(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    forged = "x\nPOST /v1/completions 200 prompt=1 completion=1"
    with caplog.at_level(logging.INFO, logger="tierlm.requests"):
        r = client.post("/v1/completions", json={"model": forged, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404 or r.status_code == 400
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tierlm.requests"]
    assert len(lines) == 1 and "\n" not in lines[0] and "x\\nPOST" in lines[0]


@pytest.mark.parametrize("field,value", [("lora_path", "adapter"), ("return_hidden_states", True),
                                         ("custom_logit_processor", "gASV..."), ("priority", 3),
                                         ("session_params", {"id": "s1"})])
def test_generate_refuses_sglang_fields_it_does_not_implement(client: TestClient, engine: FakeEngine, field: str,
                                                              value: Any) -> None:
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, field: value})
    err = assert_error(r, 400, param=field, contains=f"{field} is not implemented")
    assert err["code"] == "unsupported_parameter" and engine.received == []
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, field: None})
    assert r.status_code == 200  # "off" is accepted
    assert field in UNSUPPORTED_GENERATE_FIELDS


def test_the_refused_generate_fields_are_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "sglang-compat.md").read_text()
    assert all(f"`{f}`" in doc for f in UNSUPPORTED_GENERATE_FIELDS)


def test_valid_text_still_streams(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "h\U0001F600", "max_tokens": 2, "stream": True,
                                             "user": "\U0001F600 ok"})
    assert sse_events(r)[-1] == "[DONE]"
