"""Real server processes, both backends: ``--chat-template`` (stories260K has no template of its own; a bad file
stops startup), and gpt-oss's harmony output split into reasoning_content and content (the tiny gpt-oss is
forced into the harmony format by an EBNF grammar; the reasoning parser is chosen from the model)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from backends_under_test import BACKENDS
from conftest import STORIES_PROMPT, STORIES_TEXT
from e2e_server import ServerProcess, start_server
from model_factory import build_tiny_gpt_oss

pytestmark = pytest.mark.slow

ENV = {"TIERLM_NO_PROGRESS": "1"}
STORIES_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
# A harmony-shaped template that shows reasoning_effort the way gpt-oss's own template does.
HARMONY_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "<|start|>assistant")
ANALYSIS, FINAL = "The user says hi. Answer briefly.", "Hello there."
HARMONY_OUTPUT = (f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
                  f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>")


def ebnf_literal(text: str) -> str:
    return "root ::= " + json.dumps(text)


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def _env(backend: str) -> dict[str, str]:
    return {**ENV, "TIERLM_BACKEND": backend}


# ---------------------------------------------------------------- --chat-template on stories260K


@pytest.fixture(scope="module", params=BACKENDS)
def stories_server(request, stories_dir: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp(f"chat_template_{request.param}")
    template = folder / "story.jinja"
    template.write_text(STORIES_TEMPLATE, encoding="utf-8")
    with start_server(["--model-path", str(stories_dir), "--skip-warmup", "--chat-template", str(template)],
                      env=_env(request.param), log_dir=folder) as s:
        yield s


def test_stories_chats_through_a_template_file(stories_server: ServerProcess) -> None:
    r = client_of(stories_server).chat.completions.create(
        model="default", messages=[{"role": "user", "content": STORIES_PROMPT}], max_tokens=12, temperature=0)
    # the template renders exactly the plain prompt (BOS + text), so greedy chat continues the known story
    assert STORIES_TEXT.startswith(r.choices[0].message.content)
    assert len(r.choices[0].message.content) > 20
    assert r.usage.prompt_tokens == 5
    info = httpx.get(stories_server.base_url.removesuffix("/v1") + "/server_info").json()
    assert info["chat_template"].startswith("file ")
    assert info["server_args"]["chat_template"].endswith("story.jinja")
    assert info["reasoning_parser"]["name"] is None


def test_without_a_template_chat_is_a_400_naming_the_flag(stories_dir: Path, tmp_path: Path) -> None:
    with start_server(["--model-path", str(stories_dir), "--skip-warmup"], env=ENV, log_dir=tmp_path) as s:
        r = httpx.post(s.base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]


@pytest.mark.parametrize("value,message", [
    ("missing.jinja", "neither a file nor a built-in template name"),
    ("{% for m in messages %}", "not a valid jinja template"),
])
def test_a_bad_template_stops_startup_with_the_reason(stories_dir: Path, tmp_path: Path, value, message) -> None:
    s = start_server(["--model-path", str(stories_dir), "--skip-warmup", "--chat-template", value], env=ENV,
                     wait=False, log_dir=tmp_path)
    try:
        assert s.wait_exit(120) != 0
        assert message in s.log_text()
    finally:
        s.stop()


# ---------------------------------------------------------------- gpt-oss: harmony channels


@pytest.fixture(scope="module", params=BACKENDS)
def gpt_oss_server(request, tiny_models_root: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    model = build_tiny_gpt_oss(tiny_models_root / "gpt_oss")
    folder = tmp_path_factory.mktemp(f"harmony_{request.param}")
    template = folder / "harmony.jinja"
    template.write_text(HARMONY_TEMPLATE, encoding="utf-8")
    with start_server(["--model-path", str(model), "--skip-warmup", "--chat-template", str(template)],
                      env=_env(request.param), log_dir=folder) as s:
        yield s


MESSAGES = [{"role": "user", "content": "hi"}]


def test_gpt_oss_parser_is_chosen_from_the_model(gpt_oss_server: ServerProcess) -> None:
    info = httpx.get(gpt_oss_server.base_url.removesuffix("/v1") + "/server_info").json()
    assert info["reasoning_parser"]["name"] == "gpt-oss"
    assert "gpt_oss" in info["reasoning_parser"]["chosen_by"]
    assert "reasoning parser: gpt-oss" in gpt_oss_server.log_text()


def test_gpt_oss_harmony_output_is_split(gpt_oss_server: ServerProcess) -> None:
    client = client_of(gpt_oss_server)
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=200, temperature=0,
                                       extra_body={"ebnf": ebnf_literal(HARMONY_OUTPUT)})
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (ANALYSIS, FINAL)
    assert r.choices[0].finish_reason == "stop"

    stream = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=200, temperature=0,
                                            stream=True, extra_body={"ebnf": ebnf_literal(HARMONY_OUTPUT)})
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        assert "<|" not in content + reasoning
    assert (reasoning, content) == (ANALYSIS, FINAL)

    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=200, temperature=0,
                                       extra_body={"ebnf": ebnf_literal(HARMONY_OUTPUT), "separate_reasoning": False})
    assert r.choices[0].message.content == ANALYSIS + FINAL


def test_gpt_oss_reasoning_effort_reaches_the_template(gpt_oss_server: ServerProcess) -> None:
    client = client_of(gpt_oss_server)

    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens

    from tierlm.backends.model_source.tokenizer import build_byte_tokenizer

    n = {e: len(build_byte_tokenizer().encode(f" {e}").ids) for e in ("low", "medium", "high")}
    medium, low, high = prompt_tokens(), prompt_tokens(reasoning_effort="low"), prompt_tokens(reasoning_effort="high")
    assert (medium - low, high - low) == (n["medium"] - n["low"], n["high"] - n["low"]) != (0, 0)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
ARGS = '{"city":"Paris"}'
CALL_OUTPUT = (f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>commentary "
               f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>")


def test_gpt_oss_commentary_to_a_function_is_a_tool_call(gpt_oss_server: ServerProcess) -> None:
    client = client_of(gpt_oss_server)
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=200, temperature=0,
                                       tools=[WEATHER_TOOL], extra_body={"ebnf": ebnf_literal(CALL_OUTPUT)})
    choice = r.choices[0]
    assert choice.message.reasoning_content == ANALYSIS
    assert not choice.message.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_weather", ARGS)]
    assert choice.message.tool_calls[0].id.startswith("call_")
    assert choice.finish_reason == "tool_calls"

    stream = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=200, temperature=0,
                                            tools=[WEATHER_TOOL], stream=True,
                                            extra_body={"ebnf": ebnf_literal(CALL_OUTPUT)})
    reasoning, name, arguments, finish = "", "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert not delta.content
        for call in delta.tool_calls or []:
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, name, arguments, finish) == (ANALYSIS, "get_weather", ARGS, "tool_calls")


def test_gpt_oss_forced_call_is_a_valid_harmony_call(gpt_oss_server: ServerProcess) -> None:
    """tool_choice "required" / named on gpt-oss: a grammar makes even the random tiny model write a harmony
    commentary call whose arguments follow the function's schema."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
    client = client_of(gpt_oss_server)
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=200, temperature=0,
                                           tools=[tool], tool_choice=tool_choice)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
