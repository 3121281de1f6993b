"""Reasoning in the chat handler against the fake engine (which echoes the rendered prompt "<user>...<assistant>"):
reasoning_content on message and delta, separate_reasoning, reasoning_effort into the template, special tokens
kept for harmony, the no-template 400 naming --chat-template."""
from __future__ import annotations

from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error, sse_events
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.app import create_app
from tierlm.server.pipeline import tokenization


def make_client(parser: str | None) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(ServerArgs(model_path="fake/model", reasoning_parser=parser))
    return TestClient(create_app(engine), base_url=LOCAL), engine


def chat(client: TestClient, content: str, **extra):
    n = len(f"<user>{content}<assistant>")  # the fake model echoes the prompt: this many tokens is all of it
    return client.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": n, **extra})


def test_deepseek_r1_message_has_reasoning_content():
    client, _ = make_client("deepseek-r1")
    r = chat(client, "x</think>answer")
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "answer<assistant>", "reasoning_content": "<user>x"}


def test_separate_reasoning_false_leaves_the_text_as_generated():
    client, _ = make_client("deepseek-r1")
    message = chat(client, "x</think>answer", separate_reasoning=False).json()["choices"][0]["message"]
    assert message["content"] == "<user>x</think>answer<assistant>" and message["reasoning_content"] is None


def test_without_a_parser_reasoning_content_is_null():
    client, _ = make_client(None)
    message = chat(client, "x</think>answer").json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<user>x</think>answer<assistant>", "reasoning_content": None}


def test_streamed_deltas_carry_reasoning_then_content():
    client, _ = make_client("deepseek-r1")
    r = chat(client, "x</think>answer", stream=True, n=2)
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    for index in (0, 1):
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "<user>x"
        assert "".join(d.get("content", "") for d in deltas[1:]) == "answer<assistant>"
        first_content = next(i for i, d in enumerate(deltas[1:]) if d.get("content"))
        last_reasoning = max(i for i, d in enumerate(deltas[1:]) if d.get("reasoning_content"))
        assert last_reasoning < first_content


def test_qwen3_starts_inside_thinking_when_the_prompt_opened_it(monkeypatch):
    client, engine = make_client("qwen3")
    # the fake prompt "<user>...<assistant>" does not end in <think>: the output opens its own block or has none
    message = chat(client, "x</think>answer").json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == "<user>x</think>answer<assistant>"
    monkeypatch.setattr(engine.tokenizer, "chat_template", engine.tokenizer.chat_template + "<think>{{ '\\n' }}")
    n = len("<user>x</think>answer<assistant><think>\n")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x</think>answer"}],
                                                  "max_tokens": n})
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "<user>x" and message["content"] == "answer<assistant><think>\n"


def test_gpt_oss_keeps_special_tokens_and_splits_channels():
    client, engine = make_client("gpt-oss")
    r = chat(client, "hi")
    assert r.status_code == 200, r.text
    assert engine.received[0].sampling_params.skip_special_tokens is False  # harmony's markers are special tokens
    assert r.json()["choices"][0]["message"]["content"] == "<user>hi<assistant>"  # not harmony: content
    client, engine = make_client("deepseek-r1")
    chat(client, "hi")
    assert engine.received[0].sampling_params.skip_special_tokens is True


def test_reasoning_effort_and_template_kwargs_reach_the_template(monkeypatch):
    client, engine = make_client(None)
    seen = []
    original = tokenization.render_template

    def recording(template, variables, *limits):
        seen.append(variables)
        return original(template, variables, *limits)

    monkeypatch.setattr(tokenization, "render_template", recording)
    assert chat(client, "hi", reasoning_effort="high").status_code == 200
    assert seen[-1]["reasoning_effort"] == "high"
    chat(client, "hi", reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
    assert seen[-1]["reasoning_effort"] == "low" and seen[-1]["enable_thinking"] is False
    chat(client, "hi")
    assert "reasoning_effort" not in seen[-1]
    assert_error(chat(client, "hi", reasoning_effort="extreme"), 400)


def test_no_chat_template_400_names_the_flag():
    client, engine = make_client(None)
    engine.tokenizer.chat_template = None
    assert_error(chat(client, "hi"), 400, contains="--chat-template")
