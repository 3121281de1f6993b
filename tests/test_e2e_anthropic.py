"""The Anthropic Messages API against a real server process, both backends: the random demo model with the
tools-capable ``--chat-template chatml-tools`` (the hermes tool-call parser is chosen from it), read by the official
``anthropic`` client (create, stream, count_tokens, a forced tool call and its tool_result round trip, cache_control
pins read back on the next call), LangChain's ChatAnthropic, and Claude Code itself (``claude -p``, where npm
installed it) with its traffic to Anthropic turned off by its own settings. Thinking blocks: the torch server with
``--reasoning-parser deepseek-r1`` (the random model never closes its thinking, so all of it is thinking)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import anthropic
import jsonschema
import pytest
from backends_under_test import BACKENDS

from e2e_server import ServerProcess, start_server
from tierlm.backends.model_source.demo import ensure_demo_model

pytestmark = pytest.mark.slow

NAME = "tiny-coder"  # a served name Claude Code does not take for one of its aliases ("default", "opus", ...)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _start(tmp_path_factory: pytest.TempPathFactory, backend: str, *extra: str) -> ServerProcess:
    demo = str(ensure_demo_model(tmp_path_factory.mktemp("e2e_anthropic_model")))
    # Claude Code's request (its system prompt and tools, cut down below) needs more than the demo's 2048 positions
    return start_server(["--model-path", demo, "--served-model-name", NAME, "--skip-warmup", "--chat-template",
                         "chatml-tools", "--context-length", "8192", *extra],
                        env={"TIERLM_NO_PROGRESS": "1", "TIERLM_BACKEND": backend,
                             "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"},
                        log_dir=tmp_path_factory.mktemp(f"e2e_anthropic_logs_{backend}"))


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with _start(tmp_path_factory, request.param) as s:
        yield s


def client_of(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def test_create_stream_and_count_tokens(server: ServerProcess) -> None:
    client = client_of(server)
    m = client.messages.create(model=NAME, max_tokens=8, messages=ASK, extra_body={"temperature": 0})
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == NAME
    assert m.stop_reason in ("max_tokens", "end_turn") and m.content[0].type == "text"
    assert m.usage.output_tokens == 8 or m.stop_reason == "end_turn"
    with client.messages.stream(model=NAME, max_tokens=8, messages=ASK, extra_body={"temperature": 0}) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == final.content[0].text == m.content[0].text  # greedy: the same text both ways
    n = client.messages.count_tokens(model=NAME, messages=ASK)
    u = final.usage
    assert n.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert u.cache_read_input_tokens > 0  # the same prompt a second time


def test_forced_tool_call_and_tool_result_round_trip(server: ServerProcess) -> None:
    client = client_of(server)
    m = client.messages.create(model=NAME, max_tokens=120, messages=ASK, tools=TOOLS, extra_body={"temperature": 0},
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use", m
    [call] = [b for b in m.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    follow_up = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}]}]
    with client.messages.stream(model=NAME, max_tokens=8, messages=follow_up, tools=TOOLS,
                                tool_choice={"type": "none"}) as s:
        answer = s.get_final_message()
    assert answer.stop_reason in ("max_tokens", "end_turn") and answer.content[0].type == "text"
    assert answer.usage.cache_read_input_tokens > 0  # the question and the tools are the prefix of this prompt


def test_cache_control_pins_then_reads(server: ServerProcess) -> None:
    client = client_of(server)
    system = [{"type": "text", "text": "You review code. " * 40, "cache_control": {"type": "ephemeral"}}]
    question = [{"role": "user", "content": "Is this fine? (first)"}]
    first = client.messages.create(model=NAME, max_tokens=2, system=system, messages=question)
    assert first.usage.cache_creation_input_tokens > 0 and first.usage.cache_read_input_tokens == 0
    second = client.messages.create(model=NAME, max_tokens=2, system=system,
                                    messages=[{"role": "user", "content": "Another question"}])
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0  # the pin was refreshed, not computed again


def test_langchain_chat_anthropic(server: ServerProcess) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=NAME, base_url=server.url, api_key="none", max_tokens=8, max_retries=0)
    reply = llm.invoke("Hello")
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] > 0
    tool = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}
    call = llm.bind_tools([tool], tool_choice="any").invoke("Weather in Paris?", max_tokens=120)
    assert [c["name"] for c in call.tool_calls] == ["get_weather"]
    jsonschema.validate(call.tool_calls[0]["args"], WEATHER)


def _claude(server: ServerProcess, tmp_path: Path, prompt: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``claude -p prompt`` (a new session) against ``server``; its result and the server's log lines of it."""
    claude = shutil.which("claude")
    if claude is None:
        pytest.skip("Claude Code is not installed (npm install -g @anthropic-ai/claude-code; .ci/run does it where "
                    "npm exists)")
    env = {"PATH": str(Path(claude).parent) + ":/usr/bin:/bin", "HOME": str(tmp_path),
           "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "none",
           # its own switches for its traffic to Anthropic (telemetry, error reports, updates, ...)
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_MAX_RETRIES": "0",
           # a random model never stops by itself: keep each answer short
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16"}
    before = len(server.log_text())
    # its full system prompt and ~24 tools are ~65k tokens, minutes of prefill on a CPU: one tool, a short prompt
    r = subprocess.run([claude, "-p", prompt, "--model", NAME, "--system-prompt", "Answer briefly.", "--tools",
                        "Read", "--output-format", "json"], env=env, capture_output=True, text=True, timeout=300,
                       check=False, cwd=tmp_path)
    answered = [line for line in server.log_text()[before:].splitlines() if "POST /v1/messages" in line]
    return r, answered


def test_claude_code_runs_against_tierlm(server: ServerProcess, tmp_path: Path) -> None:
    r, answered = _claude(server, tmp_path, "hi")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["type"] == "result" and result["terminal_reason"] == "completed", result
    assert result["api_error_status"] is None, result  # no HTTP error status from tierlm
    # the random model writes until max_tokens, which Claude Code reports as an error of the turn (exit status 1)
    assert r.returncode == 0 or "output token maximum" in result["result"], r.stdout + r.stderr
    assert answered and all(" 200 " in line for line in answered), "\n".join(answered)
    assert result["usage"]["cache_read_input_tokens"] + result["usage"]["input_tokens"] > 0


def test_a_second_claude_code_session_reuses_the_first_ones_prompt(server: ServerProcess, tmp_path: Path) -> None:
    """Claude Code's first system block is a billing header whose hash changes with every prompt: left out of the
    prompt (server/api/anthropic/billing_header.py), a new session hits everything up to its own question."""
    counts = []
    for question in ("Say hi", "Say yo"):
        _, answered = _claude(server, tmp_path, question)  # a new session each time (no --continue)
        assert answered and all(" 200 " in line for line in answered), "\n".join(answered)
        prompt, cached = map(int, re.search(r"prompt=(\d+) completion=\d+ cached=(\d+)", answered[0]).groups())
        counts.append((prompt, cached))
    (first_prompt, _), (_, second_cached) = counts
    assert second_cached >= 0.95 * first_prompt, counts


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with _start(tmp_path_factory, "torch", "--reasoning-parser", "deepseek-r1") as s:
        yield s


def test_thinking_blocks(thinking_server: ServerProcess) -> None:
    client = client_of(thinking_server)
    m = client.messages.create(model=NAME, max_tokens=12, messages=ASK, thinking={"type": "enabled",
                                                                                 "budget_tokens": 1024})
    assert m.content[0].type == "thinking" and m.content[0].thinking
    with client.messages.stream(model=NAME, max_tokens=12, messages=ASK,
                                thinking={"type": "adaptive"}) as s:  # type: ignore[arg-type]
        kinds = {e.delta.type for e in s if e.type == "content_block_delta"}
        final = s.get_final_message()
    assert "thinking_delta" in kinds and final.content[0].type == "thinking" and final.content[0].thinking
