"""/v1/responses against the fake engine (characters are tokens, its output scripted): input items -> the chat
template's messages, output items and usage, the stream's events as the openai SDK parses them, tools (namespaces
flattened and mapped back, hosted tools left out, others refused), previous_response_id and encrypted_content
continuing the earlier turn's exact tokens, the store's bounds, GET/DELETE and their 404s."""
from __future__ import annotations

import json
import logging
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.api.responses.reasoning_blob import TurnTokens
from tierlm.server.api.responses.store import ResponseStore, StoredResponse
from tierlm.server.app import create_app

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def make(script: str | None = "Hello there.", **args: Any) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(ServerArgs(model_path="fake/model", **args))
    engine.script = script
    return TestClient(create_app(engine), base_url=LOCAL), engine


def sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{LOCAL}/v1", api_key="none", http_client=client, max_retries=0)


def prompt_text(engine: FakeEngine, i: int = -1) -> str:
    return "".join(chr(t) for t in engine.received[i].input_ids)


def frames(resp: Any) -> list[dict[str, Any]]:
    """The Responses stream: `event: <type>` and `data: <json>` per frame, the type in both, no [DONE]."""
    out = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        out.append(data)
    return out


def test_plain_text_response_through_the_sdk():
    client, engine = make()
    r = sdk(client).responses.create(model="default", input="Hi", instructions="Be brief.", max_output_tokens=50)
    assert r.status == "completed" and r.output_text == "Hello there."
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert prompt_text(engine) == "<system>Be brief.<user>Hi<assistant>"
    assert r.usage.input_tokens == len(prompt_text(engine)) and r.usage.output_tokens == len("Hello there.")
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.id.startswith("resp_") and r.model == "fake/model"


def test_max_output_tokens_makes_it_incomplete():
    client, _ = make()
    r = sdk(client).responses.create(model="default", input="Hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hel"


def test_max_output_tokens_beyond_the_context_is_clamped_as_on_messages(caplog):
    client, engine = make(script=None)
    caplog.set_level(logging.INFO, logger="tierlm.server")
    r = sdk(client).responses.create(model="default", input="Hi", max_output_tokens=10 ** 6)
    prompt = len(prompt_text(engine))
    assert r.status == "incomplete" and r.usage.output_tokens == engine.context_length - prompt
    assert engine.received[-1].sampling_params.max_new_tokens == engine.context_length - prompt
    assert any("clamped" in rec.getMessage() for rec in caplog.records)


def test_input_items_become_messages():
    client, engine = make()
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Dev."}]},
             {"role": "user", "content": "Q1"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A1"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "user", "content": [{"type": "input_text", "text": "Q"}, {"type": "input_text", "text": "2"}]}]
    r = client.post("/v1/responses", json={"model": "default", "input": items})
    assert r.status_code == 200, r.text
    # the assistant's text and its call are one turn, as one generation made them
    assert prompt_text(engine) == "<developer>Dev.<user>Q1<assistant>A1<tool>sunny<user>Q2<assistant>"


@pytest.mark.parametrize("item, param", [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input[0].content[0].type"),
    ({"type": "item_reference", "id": "x"}, "input[0].type"),
    ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
])
def test_items_tierlm_cannot_read_are_400s(item, param):
    client, engine = make()
    assert_error(client.post("/v1/responses", json={"input": [item]}), 400, param=param)
    assert engine.received == []


def test_fields_it_cannot_honour_are_400s():
    client, _ = make()
    for field, value in (("background", True), ("conversation", "conv_1"), ("top_logprobs", 2),
                         ("truncation", "auto"), ("include", ["message.output_text.logprobs"])):
        assert_error(client.post("/v1/responses", json={"input": "x", field: value}), 400, param=field)
    for field, value in (("truncation", "disabled"), ("include", ["web_search_call.action.sources"])):
        assert client.post("/v1/responses", json={"input": "x", field: value}).status_code == 200
    assert_error(client.post("/v1/responses", json={"input": "x", "text": {"format": {"type": "yaml"}}}), 400,
                 param="text.format.type")


def test_function_call_output_items_and_namespace_calls_map_back():
    client, engine = make(script=CALL.replace("get_weather", "files__read"), tool_call_parser="qwen25")
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
             {"type": "namespace", "name": "files", "description": "Files",
              "tools": [{"type": "function", "name": "read", "parameters": WEATHER}]},
             {"type": "web_search"}]
    engine.tokenizer.chat_template = ("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                                      "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    r = sdk(client).responses.create(model="default", input="Weather?", tools=tools)
    [call] = r.output
    assert call.type == "function_call" and call.name == "read" and call.namespace == "files"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    # the model saw the flattened names and no hosted tool
    assert prompt_text(engine) == "get_weather;files__read;<user>Weather?<assistant>"
    follow = [{"role": "user", "content": "Weather?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    engine.script = "It is sunny."
    r2 = sdk(client).responses.create(model="default", input=follow, tools=tools)
    assert r2.output_text == "It is sunny."


def test_unknown_tool_types_are_400s_hosted_ones_are_left_out():
    client, engine = make()
    r = client.post("/v1/responses", json={"input": "x", "tools": [{"type": "local_shell"}]})
    assert_error(r, 400, param="tools[0].type", contains="local_shell")
    r = client.post("/v1/responses", json={"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    assert engine.received[-1].sampling_params.structural_tag is None
    # a call required, but only hosted tools given: nothing the model could call, so a 400, not a free answer
    r = client.post("/v1/responses", json={"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"})
    assert_error(r, 400, param="tool_choice", contains="hosted")


def test_forced_named_call_goes_through_the_grammar():
    client, _ = make(tool_call_parser="qwen25")
    r = client.post("/v1/responses", json={"input": "x", "tool_choice": {"type": "function", "name": "get_weather"},
                                           "tools": [{"type": "function", "name": "get_weather",
                                                      "parameters": WEATHER}]})
    # the fake engine refuses every grammar as --grammar-backend none does: the forced call reached that path
    assert_error(r, 400, param="tools")


def test_json_schema_format_reaches_the_grammar():
    client, _ = make()
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
    r = client.post("/v1/responses", json={"input": "x", "text": {"format": fmt}})
    assert_error(r, 400, contains="structured output")


def test_stream_events_in_order_with_sequence_numbers():
    client, _ = make(script="Hi!")
    r = client.post("/v1/responses", json={"input": "x", "stream": True})
    events = frames(r)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hi!"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hi!"


def test_sdk_stream_helper_parses_the_events():
    client, _ = make(script=CALL, tool_call_parser="qwen25")
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    with sdk(client).responses.stream(model="default", input="x", tools=tools) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    [call] = final.output
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_reasoning_becomes_a_reasoning_item():
    client, _ = make(script="<think>Let me see.</think>Four.", reasoning_parser="deepseek-r1")
    r = sdk(client).responses.create(model="default", input="2+2?")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me see."
    assert message.content[0].text == "Four."
    assert r.usage.output_tokens_details.reasoning_tokens == len("Let me see.")
    events = frames(client.post("/v1/responses", json={"input": "2+2?", "stream": True}))
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Let me see."


def test_previous_response_id_continues_the_exact_tokens():
    client, engine = make(script="A1")
    oa = sdk(client)
    r1 = oa.responses.create(model="default", input="Q1")
    first = engine.received[-1].input_ids + [ord(c) for c in "A1"]
    engine.script = "A2"
    r2 = oa.responses.create(model="default", input="Q2", previous_response_id=r1.id)
    ids = engine.received[-1].input_ids
    assert ids[:len(first)] == first  # the first turn's prompt and output, token for token
    assert prompt_text(engine) == "<user>Q1<assistant>A1<user>Q2<assistant>"
    assert r2.previous_response_id == r1.id
    # GET returns it; DELETE removes it; then both are 404s, and so is a follow-up on it
    assert oa.responses.retrieve(r2.id).output_text == "A2"
    oa.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r2.id)
    assert_error(client.delete(f"/v1/responses/{r2.id}"), 404)
    assert_error(client.post("/v1/responses", json={"input": "x", "previous_response_id": r2.id}), 404,
                 param="previous_response_id", contains="not found")


def test_the_earlier_turn_tokens_are_kept_even_where_a_rerender_differs():
    # a template that trims assistant text (as Qwen's do): a re-render loses the model's own "A1 \n" and with it
    # the cache hit; the splice keeps it
    client, engine = make(script="A1 \n")
    engine.tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}"
                                      "{% if add_generation_prompt %}<assistant>{% endif %}")
    r1 = client.post("/v1/responses", json={"input": "Q1"}).json()
    first = engine.received[-1].input_ids + [ord(c) for c in "A1 \n"]
    engine.script = "A2"
    client.post("/v1/responses", json={"input": "Q2", "previous_response_id": r1["id"]})
    assert engine.received[-1].input_ids[:len(first)] == first
    assert prompt_text(engine) == "<user>Q1<assistant>A1 \n<user>Q2<assistant>"


def test_store_false_keeps_nothing_but_encrypted_content_carries_the_turn():
    client, engine = make(script="A1")
    body = {"input": [{"role": "user", "content": "Q1"}], "store": False, "include": ["reasoning.encrypted_content"]}
    r1 = client.post("/v1/responses", json=body).json()
    assert_error(client.get(f"/v1/responses/{r1['id']}"), 404)
    first = engine.received[-1].input_ids + [ord(c) for c in "A1"]
    message, blob = r1["output"]
    assert blob["type"] == "reasoning" and blob["encrypted_content"]
    engine.script = "A2"
    follow = {**body, "input": [*body["input"], message, blob, {"role": "user", "content": "Q2"}]}
    assert client.post("/v1/responses", json=follow).status_code == 200
    assert engine.received[-1].input_ids[:len(first)] == first
    tampered = dict(blob, encrypted_content=blob["encrypted_content"][:-3] + "AAA")
    r = client.post("/v1/responses", json={**follow, "input": [*body["input"], message, tampered]})
    assert_error(r, 400, param="input[2].encrypted_content")


def test_an_edited_earlier_turn_is_rendered_as_sent_not_spliced_from_its_blob():
    # the blob holds the tokens of "A1"; a client that edits that turn (or adds a message that joins it) must get
    # what it sent, not the model's old output
    client, engine = make(script="A1")
    body = {"input": [{"role": "user", "content": "Q1"}], "store": False, "include": ["reasoning.encrypted_content"]}
    message, blob = client.post("/v1/responses", json=body).json()["output"]
    engine.script = "A2"
    edited = {**message, "content": [{"type": "output_text", "text": "B1"}]}
    r = client.post("/v1/responses", json={**body, "input": [*body["input"], edited, blob,
                                                             {"role": "user", "content": "Q2"}]})
    assert r.status_code == 200, r.text
    assert prompt_text(engine) == "<user>Q1<assistant>B1<user>Q2<assistant>"
    joined = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": " more"}]}
    client.post("/v1/responses", json={**body, "input": [*body["input"], message, blob, joined,
                                                         {"role": "user", "content": "Q2"}]})
    assert prompt_text(engine) == "<user>Q1<assistant>A1 more<user>Q2<assistant>"


def test_a_changed_conversation_is_rendered_whole():
    client, engine = make(script="A1")
    r1 = client.post("/v1/responses", json={"input": "Q1"}).json()
    engine.script = "A2"
    client.post("/v1/responses", json={"input": "Q2", "previous_response_id": r1["id"], "instructions": "New."})
    assert prompt_text(engine) == "<system>New.<user>Q1<assistant>A1<user>Q2<assistant>"


def test_store_is_bounded_by_count_and_bytes_least_recently_used_first():
    def entry(rid: str, n: int) -> StoredResponse:
        return StoredResponse(response={"id": rid}, items=[], instructions=None,
                              turn=TurnTokens(ids=[1] * n, prompt_hash=""), output_start=0)

    store = ResponseStore(max_responses=2, max_bytes=2000)
    store.put(entry("a", 1))
    store.put(entry("b", 1))
    assert store.get("a") is not None  # a read is a use: b is now the oldest
    store.put(entry("c", 1))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    small = store.bytes // 2
    big = entry("big", (store.max_bytes - small) // 8 - 4)  # fits next to one small entry, not two
    store.put(big)
    assert small + big.size <= store.max_bytes < 2 * small + big.size
    assert store.get("c") is None and store.get("a") is not None and store.get("big") is not None
    store.put(entry("huge", 300))  # larger than the whole store: kept nowhere, nothing else dropped for it
    assert store.get("huge") is None and len(store) == 2


def test_an_error_after_the_stream_started_is_response_failed():
    client, engine = make(script="Hello there.")
    engine.error_after_tokens = 3
    events = frames(client.post("/v1/responses", json={"input": "x", "stream": True}))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed" and "fake model exploded" in \
        events[-1]["response"]["error"]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_hosted_tools_are_logged_once_per_type(caplog):
    from tierlm.server.api.responses import input as responses_input

    responses_input._logged_hosted.discard("file_search")
    client, _ = make()
    with caplog.at_level("INFO", logger="tierlm.server"):
        for _ in range(2):
            client.post("/v1/responses", json={"input": "x", "tools": [{"type": "file_search"}]})
    assert sum("'file_search'" in r.getMessage() for r in caplog.records) == 1


def test_reasoning_effort_reaches_the_template():
    client, engine = make()
    engine.tokenizer.chat_template = "[{{ reasoning_effort }}]{% for m in messages %}{{ m.content }}{% endfor %}"
    for effort, seen in (("minimal", "low"), ("high", "high"), ("xhigh", "high")):
        client.post("/v1/responses", json={"input": "x", "reasoning": {"effort": effort, "summary": "auto"}})
        assert prompt_text(engine).startswith(f"[{seen}]")
    # effort none: no reasoning, which hybrid thinking templates (Qwen3's) read as enable_thinking
    engine.tokenizer.chat_template = "[{{ enable_thinking }}]{% for m in messages %}{{ m.content }}{% endfor %}"
    client.post("/v1/responses", json={"input": "x", "reasoning": {"effort": "none"}})
    assert prompt_text(engine).startswith("[False]")


HARMONY_ANALYSIS = "<|channel|>analysis<|message|>User wants weather.<|end|>"
HARMONY_CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city":"Tokyo"}<|call|>')
HARMONY_FINAL = "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"


def test_gpt_oss_channels_become_reasoning_message_and_function_call_items():
    client, _ = make(script=HARMONY_ANALYSIS + HARMONY_FINAL, reasoning_parser="gpt-oss")
    reasoning, message = sdk(client).responses.create(model="default", input="Weather?").output
    assert reasoning.content[0].text == "User wants weather." and message.content[0].text == "Sunny."
    client, _ = make(script=HARMONY_ANALYSIS + HARMONY_CALL, reasoning_parser="gpt-oss")
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    reasoning, call = sdk(client).responses.create(model="default", input="Weather?", tools=tools).output
    assert reasoning.type == "reasoning" and call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Tokyo"}
