"""POST /v1/messages and /v1/messages/count_tokens against the fake engine (it echoes the rendered prompt
"<system>...<user>...<assistant>", or plays a script): Anthropic's response and event shapes, the request's
translation into the chat template's messages, tool_use and thinking blocks, stop reasons, usage with cache reads,
cache_control -> pins, max_tokens clamped to the context, errors in Anthropic's shape, x-api-key, pings, and the
official anthropic client reading all of it."""
from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.api.anthropic import stream as anthropic_stream
from tierlm.server.app import create_app
from tierlm.server.pipeline import chat as chat_pipeline

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def make(**args: Any) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(ServerArgs(model_path="fake/model", **args))
    return TestClient(create_app(engine), base_url=LOCAL), engine


def post(client: TestClient, path: str = "/v1/messages", headers: dict | None = None, **fields: Any) -> Any:
    body = {"model": "default", "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}], **fields}
    return client.post(path, json=body, headers=headers)


def events(resp: Any) -> list[tuple[str, dict]]:
    out = []
    for frame in resp.text.split("\n\n"):
        if not frame.strip():
            continue
        if frame.startswith(":"):  # an SSE comment: the keepalive before message_start
            out.append((":", {}))
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def assert_anthropic_error(resp: Any, status: int, kind: str, contains: str = "") -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and contains in body["error"]["message"], body
    return body["error"]["message"]


def sent_prompt(engine: FakeEngine, i: int = -1) -> str:
    return "".join(chr(t) for t in engine.received[i].input_ids)


def test_create_returns_a_message():
    client, _ = make()
    r = post(client)
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["id"].startswith("msg_") and m["type"] == "message" and m["role"] == "assistant"
    assert m["model"] == "fake/model"
    # the echo model repeats the whole rendered prompt, then stops at max_tokens... here it has room: length
    assert m["content"][0]["type"] == "text" and m["content"][0]["text"].startswith("<user>hi<assistant>")
    assert m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None
    assert m["usage"] == {"input_tokens": len("<user>hi<assistant>"), "output_tokens": 400,
                          "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens_details": {"device": 0, "host": 0, "storage": 0}}


def test_beta_query_and_headers_are_accepted():
    client, _ = make()
    r = client.post("/v1/messages?beta=true", json={"model": "default", "max_tokens": 3, "messages": [
        {"role": "user", "content": "hi"}]}, headers={"anthropic-version": "2023-06-01", "x-app": "cli",
                                                      "anthropic-beta": "claude-code-20250219,context-1m"})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": "<us"}]


def test_end_turn_and_stop_sequence():
    client, engine = make()
    engine.script = "Hello!"
    m = post(client).json()
    assert (m["stop_reason"], m["content"]) == ("end_turn", [{"type": "text", "text": "Hello!"}])
    m = post(client, stop_sequences=["!"]).json()
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "!")
    assert m["content"] == [{"type": "text", "text": "Hello"}]


def test_request_translates_into_the_template_messages():
    client, engine = make()
    r = post(client, max_tokens=1, system=[{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "system", "content": "mid"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                                          {"type": "text", "text": "calling"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]},
                                     {"type": "text", "text": "thanks"}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xyz"},
                                          {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "next"}])
    assert r.status_code == 200, r.text
    assert sent_prompt(engine) == ("<system>S1\n\nS2<user>q<system>mid<assistant>calling<tool>42<tool>Error: boom"
                                   "<user>thanks<assistant>ok<user>next<assistant>")


@pytest.mark.parametrize("block", [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
])
def test_blocks_it_cannot_honour_are_a_400_in_anthropic_shape(block):
    client, engine = make()
    r = post(client, messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, block]}])
    assert_anthropic_error(r, 400, "invalid_request_error", f"type '{block['type']}'")
    assert not engine.received


def test_an_image_in_a_tool_result_is_a_400():
    client, _ = make()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    r = post(client, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a"}, image]}]}])
    assert_anthropic_error(r, 400, "invalid_request_error", "content block 1 has type 'image'")


def test_validation_and_model_errors_are_in_anthropic_shape():
    client, _ = make()
    r = client.post("/v1/messages", json={"model": "default", "messages": [{"role": "user", "content": "hi"}]})
    assert_anthropic_error(r, 400, "invalid_request_error", "max_tokens")
    assert_anthropic_error(post(client, model="claude-opus"), 404, "not_found_error", "claude-opus")
    assert_anthropic_error(post(client, path="/v1/messages/count_tokens", model="nope"), 404, "not_found_error")
    r = client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert_anthropic_error(r, 400, "invalid_request_error", "JSON")
    # the OpenAI routes keep OpenAI's shape
    r = client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_max_tokens_beyond_the_context_is_clamped(caplog):
    client, engine = make()
    engine.script = "ok"
    with caplog.at_level("INFO", logger="tierlm.server"):
        r = post(client, max_tokens=32000)
    assert r.status_code == 200, r.text
    prompt = len("<user>hi<assistant>")
    assert engine.received[-1].sampling_params.max_new_tokens == engine.context_length - prompt
    assert "max_tokens 32000 clamped" in caplog.text


def test_x_api_key_and_bearer_both_authenticate():
    client, _ = make(api_key="sekret")
    assert_anthropic_error(post(client), 401, "authentication_error", "x-api-key")
    assert_anthropic_error(post(client, headers={"x-api-key": "wrong"}), 401, "authentication_error")
    assert post(client, headers={"x-api-key": "sekret"}, max_tokens=1).status_code == 200
    assert post(client, headers={"Authorization": "Bearer sekret"}, max_tokens=1).status_code == 200
    r = client.post("/v1/chat/completions", headers={"x-api-key": "sekret"},
                    json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 200


def test_stream_event_sequence():
    client, engine = make()
    engine.script = "Hello"
    r = post(client, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r)
    kinds = [k for k, _ in evs]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[2] == "content_block_start" and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = evs[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len("<user>hi<assistant>")
    assert evs[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for k, d in evs if k == "content_block_delta")
    assert text == "Hello"
    delta = evs[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5


def test_tool_use_blocks_streamed_and_not():
    client, engine = make(tool_call_parser="qwen25")
    engine.script = "Let me check.\n" + CALL
    m = post(client, tools=TOOLS).json()
    assert m["stop_reason"] == "tool_use"
    text, call = m["content"]
    assert text["type"] == "text" and text["text"].startswith("Let me check.")
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"})

    evs = events(post(client, tools=TOOLS, stream=True))
    starts = [d["content_block"] for k, d in evs if k == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    args = "".join(d["delta"]["partial_json"] for k, d in evs if k == "content_block_delta"
                   and d["delta"]["type"] == "input_json_delta")
    assert json.loads(args) == {"city": "Paris"}
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert [d["index"] for k, d in evs if k == "content_block_stop"] == [0, 1]


def test_tool_choice_maps_onto_the_chat_rules():
    client, engine = make(tool_call_parser="qwen25")
    engine.script = CALL
    assert_anthropic_error(post(client, tool_choice={"type": "any"}), 400, "invalid_request_error", "needs tools")
    assert_anthropic_error(post(client, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), 400,
                           "invalid_request_error", "nope")
    r = post(client, tools=TOOLS, tool_choice={"type": "none"})
    assert r.json()["stop_reason"] == "end_turn"  # with none, calls are not read out of the output
    # any / tool: the forced call goes through the grammar, which the fake engine refuses (as --grammar-backend none)
    r = post(client, tools=TOOLS,
             tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_thinking_blocks_and_display_omitted():
    client, engine = make(reasoning_parser="deepseek-r1")
    engine.script = "plan</think>Answer"
    m = post(client, thinking={"type": "enabled", "budget_tokens": 1024}).json()
    assert m["content"] == [{"type": "thinking", "thinking": "plan", "signature": ""},
                            {"type": "text", "text": "Answer"}]
    evs = events(post(client, stream=True, thinking={"type": "adaptive"}))
    deltas = [d["delta"] for k, d in evs if k == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "plan"
    assert "".join(d.get("text", "") for d in deltas) == "Answer"
    assert deltas[0]["type"] == "thinking_delta" and deltas[-1]["type"] == "text_delta"
    m = post(client, thinking={"type": "adaptive", "display": "omitted"}).json()
    assert m["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
    evs = events(post(client, stream=True, thinking={"type": "adaptive", "display": "omitted"}))
    assert not any(d["delta"]["type"] == "thinking_delta" for k, d in evs if k == "content_block_delta")
    assert [d["content_block"]["type"] for k, d in evs if k == "content_block_start"] == ["thinking", "text"]


def test_thinking_setting_reaches_the_template(monkeypatch):
    client, _ = make()
    seen = []
    real = chat_pipeline.apply_chat_template
    monkeypatch.setattr(chat_pipeline, "apply_chat_template",
                        lambda tok, msgs, kwargs, *a: seen.append(kwargs.get("enable_thinking")) or real(tok, msgs,
                                                                                                          kwargs, *a))
    for thinking in ({"type": "enabled", "budget_tokens": 2000}, {"type": "disabled"}, None):
        post(client, max_tokens=1, **({"thinking": thinking} if thinking else {}))
    assert seen == [True, False, False]


def test_cache_reads_reported_in_usage():
    client, engine = make()
    engine.script = "ok"
    first = post(client).json()["usage"]
    second = post(client).json()["usage"]
    prompt = len("<user>hi<assistant>")
    assert first["cache_read_input_tokens"] == 0 and first["input_tokens"] == prompt
    assert second["cache_read_input_tokens"] == prompt - 1  # the fake engine: all but the last token
    assert second["input_tokens"] == 1


def test_cache_control_breakpoints_become_pins():
    client, engine = make()
    engine.script = "ok"
    r = post(client, system=[{"type": "text", "text": "SYS", "cache_control": {"type": "ephemeral"}}],
             messages=[{"role": "user", "content": [
                 {"type": "text", "text": "long document", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                 {"type": "text", "text": " question"}]}])
    assert r.status_code == 200, r.text
    prompt = sent_prompt(engine)
    assert prompt == "<system>SYS<user>long document question<assistant>"
    pins = engine.received[-1].pins
    assert [p.ttl_s for p in pins] == [300.0, 3600.0]
    # each pin covers the prompt up to the end of its block (a shared "<" of the next marker may follow)
    assert prompt[:pins[0].tokens].startswith("<system>SYS") and "user" not in prompt[:pins[0].tokens]
    assert prompt[:pins[1].tokens].startswith("<system>SYS<user>long document")
    assert "question" not in prompt[:pins[1].tokens]
    post(client)  # no cache_control: no pins
    assert engine.received[-1].pins == []


def test_more_than_four_breakpoints_is_a_400():
    client, _ = make()
    cc = {"type": "ephemeral"}
    blocks = [{"type": "text", "text": str(i), "cache_control": cc} for i in range(5)]
    assert_anthropic_error(post(client, messages=[{"role": "user", "content": blocks}]), 400,
                           "invalid_request_error", "at most 4")


def test_count_tokens_matches_the_prompt():
    client, engine = make()
    body = {"system": "S", "messages": [{"role": "user", "content": "hello"}]}
    r = client.post("/v1/messages/count_tokens", json={"model": "default", **body})
    assert r.status_code == 200, r.text
    assert r.json() == {"input_tokens": len("<system>S<user>hello<assistant>")}
    engine.script = "ok"
    assert post(client, **body).json()["usage"]["input_tokens"] == r.json()["input_tokens"]


def test_pings_while_the_first_token_is_slow(monkeypatch):
    client, engine = make()
    engine.script = "ok"
    engine.token_delay_s = 0.3
    monkeypatch.setattr(anthropic_stream, "PING_INTERVAL_S", 0.05)
    kinds = [k for k, _ in events(post(client, stream=True))]
    # message_start waits for the first output (its usage holds the cache reads): SSE comments keep the stream
    # alive until then (every reader skips them), pings after it
    start = kinds.index("message_start")
    assert start >= 1 and set(kinds[:start]) == {":"}
    assert kinds[start + 1] == "ping" and kinds[start + 2:].count("ping") >= 1
    assert kinds[-1] == "message_stop"


def test_error_mid_stream_is_an_error_event():
    client, engine = make()
    engine.error_after_tokens = 3
    evs = events(post(client, stream=True))
    kind, data = evs[-1]
    assert kind == "error" and data["error"]["type"] == "api_error"
    assert "fake model exploded" in data["error"]["message"]
    assert "message_stop" not in [k for k, _ in evs]


def test_official_client_reads_messages_streams_and_counts():
    client, engine = make(tool_call_parser="qwen25")
    engine.script = "Sure.\n" + CALL
    ac = anthropic.Anthropic(base_url=LOCAL, api_key="x", http_client=client, max_retries=0)
    m = ac.messages.create(model="default", max_tokens=200, tools=TOOLS,
                           messages=[{"role": "user", "content": "weather?"}])
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Paris"}
    with ac.messages.stream(model="default", max_tokens=200, tools=TOOLS,
                            messages=[{"role": "user", "content": "weather?"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"city": "Paris"}
    assert final.usage.output_tokens == len(engine.script)
    n = ac.messages.count_tokens(model="default", messages=[{"role": "user", "content": "weather?"}])
    assert n.input_tokens == len("<user>weather?<assistant>")
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="other", max_tokens=1, messages=[{"role": "user", "content": "x"}])


def test_top_level_cache_control_pins_the_whole_prompt():
    client, engine = make()
    engine.script = "ok"
    r = post(client, cache_control={"type": "ephemeral"})
    assert r.status_code == 200, r.text
    assert [(p.tokens, p.ttl_s) for p in engine.received[-1].pins] == [(len("<user>hi<assistant>"), 300.0)]


def test_a_late_system_message_folds_into_a_user_turn_where_the_template_refuses_it():
    client, engine = make()
    engine.script = "ok"
    # a template that, like many, takes a system message only first
    engine.tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                                      "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                                      "<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    body = {"system": "S", "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "mid"},
                                        {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]}
    r = post(client, **body)
    assert r.status_code == 200, r.text
    assert sent_prompt(engine) == "<system>S<user>q\n\nmid<assistant>a<user>q2<assistant>"
    n = client.post("/v1/messages/count_tokens", json={"model": "default", **body}).json()["input_tokens"]
    assert n == len(sent_prompt(engine))
    # a system message at the end joins the last user turn; a refusal for another reason stays a 400
    post(client, messages=[{"role": "user", "content": "q"}, {"role": "system", "content": "end"}])
    assert sent_prompt(engine) == "<user>q\n\nend<assistant>"
    r = post(client, messages=[{"role": "user", "content": "q"}], system="S",
             extra_ignored=True, thinking={"type": "disabled"})
    assert r.status_code == 200
    engine.tokenizer.chat_template = "{{ raise_exception('no') }}"
    assert_anthropic_error(post(client), 400, "invalid_request_error", "chat template rejected")


REFUSES_LATE_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                       "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                       "<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")


@pytest.mark.parametrize("template", [None, REFUSES_LATE_SYSTEM], ids=["late-system-allowed", "late-system-folded"])
def test_an_appended_turn_keeps_the_tokens_of_the_earlier_ones(template):
    """Claude Code's session, request by request (its agent list is a system message right after the first prompt;
    a continued session appends a new prompt, a later one a reminder with it): each prompt, without the generation
    prompt, is a prefix of the next one, so every turn reuses the whole previous prompt."""
    client, engine = make()
    engine.script = "ok"
    if template is not None:
        engine.tokenizer.chat_template = template
    first = [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>date</system-reminder>"},
                                          {"type": "text", "text": "Review it", "cache_control": {"type": "ephemeral"}}]},
             {"role": "system", "content": "Available agent types: Explore"}]
    call = {"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                              "input": {"city": "Paris"}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}
    again = [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Review it again"}]
    later = [{"role": "assistant", "content": "Still fine."}, {"role": "system", "content": "reminder: be brief"},
             {"role": "user", "content": "And now?"}]
    conversations = [first, [*first, call, result], [*first, call, result, *again],
                     [*first, call, result, *again, *later]]
    prompts = []
    for messages in conversations:
        r = post(client, system="S", tools=TOOLS, messages=messages)
        assert r.status_code == 200, r.text
        prompts.append(sent_prompt(engine).removesuffix("<assistant>"))
    for before, after in zip(prompts, prompts[1:]):
        assert after.startswith(before), (before, after)
    assert "Available agent types" in prompts[0] and "reminder: be brief" in prompts[-1]


def test_claude_codes_billing_header_is_left_out_unless_kept():
    """Its hash changes with every prompt: kept, no two sessions share the prefix behind it."""
    billing = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;"
    system = [{"type": "text", "text": billing.format("3eb")},
              {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]
    client, engine = make()
    engine.script = "ok"
    for suffix in ("3eb", "f5e"):
        system[0]["text"] = billing.format(suffix)
        r = post(client, system=system)
        assert r.status_code == 200, r.text
        assert sent_prompt(engine) == "<system>You are an agent.<user>hi<assistant>"
    # the breakpoint on the second block still pins the prompt up to its end (in the same place as without the
    # billing block)
    pins = [p.tokens for p in engine.received[-1].pins]
    post(client, system=system[1:])
    assert pins == [p.tokens for p in engine.received[-1].pins] and pins[0] >= len("<system>You are an agent.")
    n = client.post("/v1/messages/count_tokens", json={"model": "default", "system": system,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert n.json()["input_tokens"] == len("<system>You are an agent.<user>hi<assistant>")
    client, engine = make(keep_anthropic_billing_header=True)
    engine.script = "ok"
    post(client, system=system)
    assert sent_prompt(engine).startswith("<system>" + billing.format("f5e") + "\n\nYou are an agent.")


def test_message_start_usage_agrees_with_the_final_usage():
    """Anthropic's message_start carries the uncached input_tokens and both cache fields; the final message_delta
    says the same."""
    client, engine = make()
    engine.script = "ok"
    system = [{"type": "text", "text": "You review code. " * 4, "cache_control": {"type": "ephemeral"}}]
    post(client, system=system, stream=True)  # pins the system block
    evs = events(post(client, system=system, stream=True))  # the fake engine: all but the last token cached
    start = next(d for k, d in evs if k == "message_start")["message"]["usage"]
    final = next(d for k, d in evs if k == "message_delta")["usage"]
    for field in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",
                  "cache_read_input_tokens_details"):
        assert start[field] == final[field], field
    prompt = len("<system>" + "You review code. " * 4 + "<user>hi<assistant>")
    assert start["cache_read_input_tokens"] == prompt - 1 == start["cache_read_input_tokens_details"]["device"]
    assert start["input_tokens"] + start["cache_read_input_tokens"] + start["cache_creation_input_tokens"] == prompt
    first = events(post(client, system=[{**system[0], "text": "Other instructions."}], stream=True))
    start = next(d for k, d in first if k == "message_start")["message"]["usage"]
    [pin] = engine.received[-1].pins
    assert start["cache_read_input_tokens"] == 0 and start["cache_creation_input_tokens"] == pin.tokens > 0


def test_middleware_errors_are_in_anthropic_shape_too():
    client, _ = make(max_request_bytes=2000)
    r = post(client, messages=[{"role": "user", "content": "x" * 5000}])
    assert_anthropic_error(r, 413, "request_too_large", "--max-request-bytes")
    r = client.post("/v1/messages", json={}, headers={"Origin": "https://evil.example"})
    assert_anthropic_error(r, 403, "permission_error")


def test_a_final_assistant_message_is_a_prefill_the_reply_continues():
    client, engine = make()
    r = post(client, messages=[{"role": "user", "content": "tell"},
                               {"role": "assistant", "content": [{"type": "text", "text": "Once upon"}]}])
    assert r.status_code == 200, r.text
    # the prompt ends inside the assistant's turn, right after its text: no new turn is opened after it
    assert sent_prompt(engine) == "<user>tell<assistant>Once upon"
    # a conversation that ends with the user's turn still opens the assistant's
    post(client, messages=[{"role": "user", "content": "tell"}])
    assert sent_prompt(engine) == "<user>tell<assistant>"


def test_chat_completions_continue_final_message_needs_an_assistant_message_to_continue():
    client, engine = make()
    body = {"model": "default", "max_tokens": 4, "continue_final_message": True}
    r = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "a"},
                                                                     {"role": "assistant", "content": "b c"}]})
    assert r.status_code == 200, r.text
    assert sent_prompt(engine) == "<user>a<assistant>b c"
    r = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "nothing_to_continue", r.text
