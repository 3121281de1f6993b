"""Tool calling in the chat handler against the fake engine (its output scripted): message.tool_calls and
finish_reason "tool_calls", OpenAI's streaming shape, tool_choice rules (400s, none), the template's view of tools
and of earlier calls, forced calls going through the grammar path, and the openai client reading the calls."""
from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error, sse_events
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.app import create_app
from tierlm.server.pipeline import tokenization

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def make(parser: str | None = "qwen25", script: str | None = CALL) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(ServerArgs(model_path="fake/model", tool_call_parser=parser))
    engine.script = script
    return TestClient(create_app(engine), base_url=LOCAL), engine


def chat(client: TestClient, **fields: Any) -> Any:
    body = {"model": "default", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, **fields}
    return client.post("/v1/chat/completions", json=body)


def test_message_tool_calls_and_finish_reason():
    client, _ = make(script="Sure.\n" + CALL)
    r = chat(client)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Sure.\n"
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_only_a_call_has_null_content():
    client, _ = make()
    message = chat(client).json()["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_without_tools_no_tool_calls_key_and_text_is_content():
    client, _ = make()
    r = client.post("/v1/chat/completions", json={"model": "default", "messages": MESSAGES, "max_tokens": 200})
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["message"]["content"] == CALL
    assert choice["finish_reason"] == "stop"


def test_streamed_call_follows_openai_shape():
    client, _ = make(script="Hi " + CALL)
    events = sse_events(chat(client, stream=True))
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "tool_calls"
    assert "".join(d.get("content") or "" for d in deltas) == "Hi "
    pieces = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first = pieces[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces[1:])
    assert len(pieces) > 3  # arguments stream in fragments
    args = "".join(p["function"].get("arguments", "") for p in pieces)
    assert json.loads(args) == {"city": "Paris"}


def test_tool_choice_none_leaves_the_text_as_content():
    client, _ = make()
    choice = chat(client, tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]


def test_no_parser_means_no_parsing():
    client, _ = make(parser=None)
    choice = chat(client).json()["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"


def test_tool_choice_needs_tools_and_a_known_name():
    client, _ = make()
    r = client.post("/v1/chat/completions", json={"model": "default", "messages": MESSAGES, "tool_choice": "auto"})
    assert_error(r, 400, param="tool_choice")
    r = chat(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert_error(r, 400, param="tool_choice", contains="nope")
    assert chat(client, tool_choice="sometimes").status_code == 400
    assert chat(client, tools=[{"type": "function", "function": {}}]).status_code == 400


def test_forced_calls_use_the_grammar_path():
    # the fake engine refuses every grammar (as --grammar-backend none): the 400 shows the forced call asked for one
    client, _ = make()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert_error(chat(client, tool_choice=choice), 400, param="tools")
    r = chat(client, tool_choice="required", response_format={"type": "json_object"})
    assert_error(r, 400, param="tool_choice")


def test_template_gets_tools_and_arguments_as_dicts(monkeypatch: pytest.MonkeyPatch):
    client, engine = make(script="It is sunny.")
    seen: dict[str, Any] = {}
    original = tokenization.render_template

    def spy(template, variables, *limits):
        seen.update(conversation=variables["messages"], kwargs=variables)
        return original(template, variables, *limits)

    monkeypatch.setattr(tokenization, "render_template", spy)
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = chat(client, messages=messages)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "It is sunny."
    assert seen["kwargs"]["tools"] == TOOLS
    assert seen["conversation"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert seen["conversation"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}


def test_parallel_tool_calls_false_keeps_the_first_call():
    other = CALL.replace("Paris", "Rome")
    client, _ = make(script=CALL + "\n" + other)
    calls = chat(client).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    calls = chat(client, parallel_tool_calls=False).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_reads_the_calls(stream):
    openai = pytest.importorskip("openai")
    client, _ = make()
    oa = openai.OpenAI(base_url=f"{LOCAL}/v1", api_key="none", http_client=client, max_retries=0)
    if not stream:
        r = oa.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=200)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        return
    with oa.chat.completions.stream(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=200) as s:
        final = s.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_server_info_shows_the_tool_call_parser_setting():
    client, _ = make()
    assert client.get("/server_info").json()["server_args"]["tool_call_parser"] == "qwen25"
