"""The chat template is the operator's (issue #33): a request's own template is refused unless the operator allows
it (--trust-request-chat-template), and every render, the operator's template included, runs in a sandbox with a
time limit and a bound on its output, so no request can hold a tokenizer thread or the server's memory."""
from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.app import create_app
from tierlm.server.pipeline import render as chat_render

MESSAGES = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(6000) %}{% for j in range(6000) %}x{% endfor %}{% endfor %}"


def make(**args: Any) -> tuple[TestClient, FakeEngine, openai.OpenAI]:
    engine = FakeEngine(ServerArgs(model_path="fake/model", **args))
    client = TestClient(create_app(engine), base_url=LOCAL)
    return client, engine, openai.OpenAI(base_url=f"{LOCAL}/v1", api_key="none", http_client=client, max_retries=0)


def chat(oai: openai.OpenAI, **extra: Any) -> Any:
    return oai.chat.completions.create(model="fake/model", messages=MESSAGES, max_tokens=2, extra_body=extra)


@pytest.fixture
def short_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_render, "TIME_LIMIT_S", 0.3)  # the limit is what is tested, not how long it is


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template": "{{ 7*7 }}"}, "chat_template"),
])
def test_a_request_template_is_refused_by_default(extra: dict, param: str) -> None:
    client, engine, oai = make()
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, **extra)
    err = e.value.body
    assert err["param"] == param and err["code"] == "chat_template_not_allowed"
    assert "--trust-request-chat-template" in err["message"]
    assert engine.received == []
    r = client.post("/tokenize", json={"messages": MESSAGES, **extra})
    assert_error(r, 400, param=param, contains="--trust-request-chat-template")


def test_the_operator_may_allow_request_templates() -> None:
    client, engine, oai = make(trust_request_chat_template=True)
    chat(oai, chat_template_kwargs={"chat_template": "{{ 7*7 }}|{{ messages[0].content }}"})
    assert engine.tokenizer.decode(engine.received[0].input_ids) == "49|hi"
    r = client.post("/tokenize", json={"messages": MESSAGES, "chat_template": "[{{ messages|length }}]"})
    assert r.json()["tokens"] == [ord(c) for c in "[1]"]
    assert_error(client.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{% for %}"}), 400,
                 param="chat_template", contains="not a valid jinja template")


@pytest.mark.usefixtures("short_time_limit")
@pytest.mark.parametrize("template,says", [
    (NESTED_LOOPS, "longer than the 0.3 s limit"),
    ("{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "0.3 s limit"),
    ("{{ 'a'*20000000 }}", "characters a rendered prompt may hold"),
    ("{{ 'a'|center(1000000000) }}", "characters a rendered prompt may hold"),
    ("{{ '{:>999999999}'.format('a') }}", "characters a rendered prompt may hold"),
    ("{{ 2**100000000 }}", "characters a rendered prompt may hold"),
    ("{% set s = 'a'*100000 %}{{ s|replace('', s) }}", "characters a rendered prompt may hold"),
    ("{% set s = '\\n'*1000000 %}{{ s|indent(1000)|length }}", "characters a rendered prompt may hold"),
    ("{% set s = '\\t'*1000000 %}{{ s.expandtabs(1000)|length }}", "characters a rendered prompt may hold"),
    ("{{ '%999999999s'|format('a') }}", "characters a rendered prompt may hold"),
])
def test_a_trusted_request_template_is_still_bounded(template: str, says: str) -> None:
    client, engine, oai = make(trust_request_chat_template=True)
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, chat_template=template)
    assert e.value.body["code"] == "chat_template_limit" and says in e.value.body["message"]
    assert engine.received == []
    assert client.get("/health").status_code == 200
    chat(oai)  # the tokenizer pool is free: the next request renders the operator's template
    assert engine.tokenizer.decode(engine.received[-1].input_ids) == "<user>hi<assistant>"


@pytest.mark.usefixtures("short_time_limit")
def test_the_operators_template_is_bounded_against_hostile_messages() -> None:
    client, engine, oai = make(max_request_bytes=2**20)
    # a template that loops over each character of each message, twice nested: a long message makes it quadratic
    engine.tokenizer.chat_template = ("{% for m in messages %}{% for a in m.content %}{% for b in m.content %}"
                                      "{% endfor %}{% endfor %}{% endfor %}<assistant>")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 200_000}]})
    assert_error(r, 400, param="messages", contains="0.3 s limit")
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m.content * 40 }}{% endfor %}"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 100_000}]})
    assert_error(r, 400, param="messages", contains=f"{2 * 2**20} characters")


@pytest.mark.parametrize("template", [
    "{{ messages.append(1) }}",  # the sandbox is immutable
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_templates_run_in_the_immutable_sandbox(template: str) -> None:
    client, engine, oai = make(trust_request_chat_template=True)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": template})
    assert_error(r, 400, param="messages", contains="the chat template rejected")
    assert engine.received == []


def test_templates_render_as_transformers_renders_them() -> None:
    """The guarded sandbox has transformers' filters and globals: the same ids as apply_chat_template."""
    from pathlib import Path

    from tierlm.backends.model_source.chat_templates import CHATML_TOOLS_TEMPLATE
    from tierlm.server.api.openai.protocol import ChatMessage
    from tierlm.server.pipeline.tokenization import apply_chat_template

    folder = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
    if not folder.is_dir():
        pytest.skip("needs ../shared/models/stories260K")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "f", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "18 C"}]
    other = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
             "{{ m.role | upper }}:{{ m.content | trim }}{{ dict(a=1) | tojson }}{% if loop.last %}{% break %}"
             "{% endif %}{% endfor %}{% generation %}{{ ns.n }}{% endgeneration %}{{ enable_thinking }}")
    for template, kwargs in ((CHATML_TOOLS_TEMPLATE, {"tools": tools}), (other, {"enable_thinking": False})):
        tok.chat_template = template
        ours = apply_chat_template(tok, [ChatMessage(**m) for m in messages], kwargs)
        theirs = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                         **kwargs)
        assert ours == list(theirs)
