"""HTTP layer: OpenAI completions and chat against a fake engine (shapes, SSE order, usage, errors, auth)."""
from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error, sse_events
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.app import create_app


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine), base_url=LOCAL)


# ------------------------------------------------------------------ completions


def test_completion_response_shape_text_and_usage(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "default", "prompt": "abc", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == "fake/model"
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "abcab", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0, "cached_tokens_details": {"device": 0, "host": 0, "storage": 0}},
    }


def test_cached_tokens_reported_on_repeat(client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    usage = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4,
                                              "cached_tokens_details": {"device": 4, "host": 0, "storage": 0}}


def test_completion_default_max_tokens_is_16(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"prompt": "ab"})
    assert r.json()["usage"]["completion_tokens"] == 16
    assert engine.received[0].sampling_params.max_new_tokens == 16


def test_completion_prompt_forms(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "hi"
    r = client.post("/v1/completions", json={"prompt": [[104, 105], [111]], "max_tokens": 2})
    assert [c["text"] for c in r.json()["choices"]] == ["hi", "oo"]
    assert engine.received[-1].input_ids == [111]


def test_completion_prompts_times_n_choices_and_seeds(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 3, "seed": 7})
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "aba"), (1, "aba"), (2, "xyz"), (3, "xyz")]
    assert [req.sampling_params.seed for req in engine.received] == [7, 8, 7, 8]
    assert len({req.rid for req in engine.received}) == 4
    # each prompt counts once however many choices it has; completions count per choice
    assert body["usage"]["prompt_tokens"] == 2 + 3
    assert body["usage"]["completion_tokens"] == 4 * 3


def test_completion_echo_prepends_prompt(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "echo": True})
    assert r.json()["choices"][0]["text"] == "aba"


def test_stop_string_and_stop_token_ids(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 10, "stop": "c"})
    assert r.json()["choices"][0] == {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"}
    assert engine.received[-1].sampling_params.stop == ["c"]
    r = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 10, "stop_token_ids": [ord("b")]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_sampling_fields_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    client.post("/v1/completions", json={
        "prompt": "a", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "presence_penalty": 0.3, "frequency_penalty": -0.2, "repetition_penalty": 1.1, "stop": ["x", "y"],
        "stop_token_ids": [9], "ignore_eos": True, "skip_special_tokens": False, "seed": 3})
    sp = engine.received[-1].sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.5, 0.9, 5, 0.1)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.3, -0.2, 1.1)
    assert (sp.stop, sp.stop_token_ids, sp.ignore_eos, sp.skip_special_tokens, sp.seed) == (["x", "y"], [9], True, False, 3)


def test_openai_default_temperature_is_one(client: TestClient, engine: FakeEngine) -> None:
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert engine.received[-1].sampling_params.temperature == 1.0


def test_completion_stream_order_and_text(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abca"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"][0]["text"] == ""


def test_completion_stream_include_usage(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["total_tokens"] == 5
    assert all(c["usage"] is None for c in events[:-2])


# ------------------------------------------------------------------ chat


def chat(client: TestClient, **fields: Any) -> Any:
    payload = {"model": "default", "messages": [{"role": "user", "content": "hey"}], **fields}
    return client.post("/v1/chat/completions", json=payload)


def test_chat_response_shape(client: TestClient, engine: FakeEngine) -> None:
    r = chat(client, max_tokens=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    prompt = "<user>hey<assistant>"
    assert engine.received[0].input_ids == [ord(c) for c in prompt]
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "<us", "reasoning_content": None},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_chat_max_tokens_default_and_precedence(engine: FakeEngine) -> None:
    engine.context_length = 40
    client = TestClient(create_app(engine), base_url=LOCAL)
    prompt_len = len("<user>hey<assistant>")
    chat(client)
    assert engine.received[-1].sampling_params.max_new_tokens == 40 - prompt_len  # what fits
    chat(client, max_tokens=5, max_completion_tokens=2)
    assert engine.received[-1].sampling_params.max_new_tokens == 2
    engine.context_length = 100_000
    chat(client, stop="u")  # the default is capped when the context is long
    assert engine.received[-1].sampling_params.max_new_tokens == 2048


def test_chat_content_parts_are_joined(client: TestClient, engine: FakeEngine) -> None:
    r = chat(client, messages=[{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "kind"}]},
                               {"role": "user", "content": "q"}], max_tokens=1)
    assert r.status_code == 200
    assert engine.tokenizer.decode(engine.received[-1].input_ids) == "<system>be kind<user>q<assistant>"


def test_chat_non_text_part_is_400(client: TestClient) -> None:
    r = chat(client, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert_error(r, 400, param="messages[0].content", contains="only text")


def test_chat_without_template_points_to_completions(client: TestClient, engine: FakeEngine) -> None:
    engine.tokenizer.chat_template = None
    assert_error(chat(client), 400, contains="/v1/completions")


def test_chat_template_error_is_400(client: TestClient) -> None:
    assert_error(chat(client, chat_template_kwargs={"raise_template_error": True}), 400, contains="roles must alternate")


def test_chat_stream_order(client: TestClient) -> None:
    r = chat(client, max_tokens=3, stream=True, stream_options={"include_usage": True})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    first, *content, finish, usage = events[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in content] == [{"content": "<"}, {"content": "u"}, {"content": "s"}]
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *content])
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in [first, *content, finish])


def test_chat_stream_n2_each_choice_starts_and_finishes(client: TestClient) -> None:
    events = sse_events(chat(client, max_tokens=2, n=2, stream=True))[:-1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in events if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "<u"
        assert mine[-1]["finish_reason"] == "length"


# ------------------------------------------------------------------ errors


def test_logprobs_ranges(client: TestClient) -> None:
    # accepted shapes and values are tested against a real engine in tests/test_server_logprobs.py
    assert_error(chat(client, top_logprobs=2), 400, param="top_logprobs", contains="needs logprobs")
    assert_error(chat(client, logprobs=True, top_logprobs=21), 400, param="top_logprobs")
    r = client.post("/v1/completions", json={"prompt": "a", "logprobs": 21})
    assert_error(r, 400, param="logprobs")


def test_bad_sampling_value_names_param(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "top_p": 0})
    assert_error(r, 400, param="top_p", contains="top_p")
    assert_error(chat(client, temperature=-1), 400, param="temperature")


def test_validation_errors_are_400_naming_the_field(client: TestClient) -> None:
    assert_error(client.post("/v1/chat/completions", json={"model": "default"}), 400, param="messages", contains="messages")
    assert_error(client.post("/v1/completions", json={"prompt": "a", "max_tokens": "many"}), 400, param="max_tokens")
    assert_error(chat(client, messages=[{"role": "wizard", "content": "x"}]), 400, param="messages[0].role")
    assert_error(chat(client, n=0), 400, param="n")


def test_invalid_json_and_non_json_body(client: TestClient) -> None:
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, contains="not valid JSON")
    r = client.post("/v1/completions", content=b"prompt=a", headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(r, 400, contains="JSON")


def test_engine_validate_rejection_keeps_its_status_and_code(client: TestClient, engine: FakeEngine) -> None:
    engine.context_length = 10
    err = assert_error(client.post("/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 5}), 400,
                       param="max_tokens", contains="context length")
    assert err["code"] == "context_length_exceeded"
    # a streaming request is rejected the same way, as JSON before any event is sent
    r = client.post("/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 5, "stream": True})
    assert r.headers["content-type"] == "application/json"
    assert_error(r, 400, param="max_tokens")
    assert engine.received == []  # rejected before generation started


def test_unknown_route_and_wrong_method(client: TestClient) -> None:
    assert_error(client.get("/v1/nope"), 404, contains="unknown route")
    err = assert_error(client.get("/v1/completions"), 405, contains="POST")
    assert err["type"] == "invalid_request_error"


def test_not_ready_is_503(engine: FakeEngine) -> None:
    engine.ready = False
    client = TestClient(create_app(engine), base_url=LOCAL)
    assert client.get("/health").status_code == 503
    assert_error(client.post("/v1/completions", json={"prompt": "a"}), 503, contains="loading")
    assert_error(chat(client), 503)
    engine.ready = True
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_in_band_engine_error_is_500_and_server_keeps_serving(client: TestClient, engine: FakeEngine) -> None:
    engine.error_after_tokens = 1
    err = assert_error(client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4}), 500,
                       contains="fake model exploded")
    assert err["type"] == "server_error"
    engine.error_after_tokens = None
    assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}).status_code == 200


def test_in_band_error_in_one_choice_aborts_the_others(client: TestClient, engine: FakeEngine) -> None:
    engine.token_delay_s = 0.01  # the healthy choice is still running when its sibling fails
    engine.error_after_tokens = 0
    engine.fail_rid_suffix = "-1"
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 200, "n": 2})
    assert_error(r, 500, contains="fake model exploded")
    healthy = [req.rid for req in engine.received if req.rid.endswith("-0")]
    assert len(healthy) == 1 and engine.aborted == healthy


def test_stream_error_becomes_error_event_then_done(client: TestClient, engine: FakeEngine) -> None:
    engine.error_after_tokens = 2
    events = sse_events(chat(client, max_tokens=5, stream=True))
    assert events[-1] == "[DONE]"
    assert "fake model exploded" in events[-2]["error"]["message"]
    assert [c["choices"][0]["delta"].get("content") for c in events[1:3]] == ["<", "u"]


def test_unexpected_exception_is_500_json_and_server_survives(client: TestClient, engine: FakeEngine) -> None:
    engine.raise_in_generate = RuntimeError("boom")
    err = assert_error(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}), 500, contains="boom")
    assert err["type"] == "server_error"
    events = sse_events(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "stream": True}))
    assert "boom" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    engine.raise_in_generate = None
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


# ------------------------------------------------------------------ auth


def test_api_key_required_on_api_routes_but_not_health() -> None:
    engine = FakeEngine(ServerArgs(model_path="fake/model", api_key="sekrit"))
    client = TestClient(create_app(engine), base_url=LOCAL)
    body = {"prompt": "a", "max_tokens": 1}
    err = assert_error(client.post("/v1/completions", json=body), 401, contains="api key")
    assert err["type"] == "authentication_error"
    assert_error(client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.get("/v1/models"), 401)
    assert_error(client.post("/generate", json={"text": "a"}), 401)
    ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200


# ------------------------------------------------------------------ the official client


def test_official_openai_client_parses_responses(engine: FakeEngine) -> None:
    openai = pytest.importorskip("openai")
    http = TestClient(create_app(engine), base_url=LOCAL)
    oc = openai.OpenAI(base_url=f"{LOCAL}/v1", api_key="none", http_client=http)
    resp = oc.chat.completions.create(model="default", messages=[{"role": "user", "content": "hey"}], max_tokens=3)
    assert resp.choices[0].message.content == "<us"
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    stream = oc.chat.completions.create(model="default", messages=[{"role": "user", "content": "hey"}], max_tokens=3,
                                        stream=True, stream_options={"include_usage": True})
    parts = [c for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == "<us"
    assert parts[-1].usage.completion_tokens == 3
    comp = oc.completions.create(model="default", prompt="abc", max_tokens=2)
    assert comp.choices[0].text == "ab"
    with pytest.raises(openai.BadRequestError) as exc:
        oc.completions.create(model="default", prompt="abc", top_p=0)
    assert exc.value.body["param"] == "top_p"  # type: ignore[index]
