"""/v1/responses against a real server process (the random demo model, ChatML with tools, so the hermes tool-call
parser is chosen from the model) with the real clients: the openai SDK (create, stream, a function tool round trip
with function_call_output, json_schema, previous_response_id and encrypted_content hitting the cache), the OpenAI
Agents SDK's default Responses model running a tool, and Codex CLI (`codex exec`, then `codex exec resume`) where
npm installed it. Plain, stream and the tool round trip run on both backends."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator, Literal

import httpx
import jsonschema
import openai
import pytest
from backends_under_test import BACKENDS
from e2e_server import ServerProcess, start_server
from tierlm.backends.model_source.demo import ensure_demo_model

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
# Codex CLI sends ~20k tokens of instructions and tools: the byte-level demo model needs more than its 2048
CONTEXT = 32768


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    demo = str(ensure_demo_model(tmp_path_factory.mktemp("e2e_responses_model")))
    env = {"TIERLM_NO_PROGRESS": "1", "TIERLM_BACKEND": request.param, "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    with start_server(["--model-path", demo, "--skip-warmup", "--chat-template", "chatml-tools",
                       "--context-length", str(CONTEXT), "--log-requests"], env=env,
                      log_dir=tmp_path_factory.mktemp(f"e2e_responses_{request.param}")) as s:
        s.backend = request.param  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def torch_only(server: ServerProcess) -> None:
    if server.backend != "torch":  # type: ignore[attr-defined]
        pytest.skip("a client integration: once, on the torch backend")


def page_size(server: ServerProcess) -> int:
    return int(httpx.get(f"{server.url}/server_info", timeout=30).json()["page_size"])


def whole_pages(tokens: int, page: int) -> int:
    return tokens // page * page


def test_plain_and_streamed(client: openai.OpenAI) -> None:
    r = client.responses.create(model="default", input="Hi there", max_output_tokens=12, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    events = list(client.responses.create(model="default", input="Hi there", max_output_tokens=12, temperature=0,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == r.output_text  # greedy: the same text both ways


def test_function_tool_round_trip(client: openai.OpenAI, server: ServerProcess) -> None:
    r1 = client.responses.create(model="default", input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    [call] = [item for item in r1.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    r2 = client.responses.create(model="default", previous_response_id=r1.id, input=[result], tools=TOOLS,
                                 max_output_tokens=16, temperature=0)
    assert r2.status in ("completed", "incomplete")
    # the first turn (prompt and the call it made) is served from the cache
    first = r1.usage.input_tokens + r1.usage.output_tokens - 1  # the stop token's KV is never computed
    assert r2.usage.input_tokens_details.cached_tokens >= whole_pages(first, page_size(server)) > 0


def test_stream_helper_reads_a_forced_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model="default", input="Weather?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
                                 temperature=0) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert {"response.function_call_arguments.delta", "response.output_item.done"} <= kinds
    [call] = final.output
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_json_schema_format(client: openai.OpenAI, server: ServerProcess) -> None:
    torch_only(server)
    r = client.responses.create(model="default", input="A city?", max_output_tokens=200, temperature=0,
                                text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)


def test_previous_response_id_is_a_cache_hit(client: openai.OpenAI, server: ServerProcess) -> None:
    torch_only(server)
    r1 = client.responses.create(model="default", input="Tell me a story about a fox. " * 8, max_output_tokens=40,
                                 temperature=0, instructions="Be brief.")
    r2 = client.responses.create(model="default", input="And then?", previous_response_id=r1.id,
                                 instructions="Be brief.", max_output_tokens=8, temperature=0)
    first = r1.usage.input_tokens + r1.usage.output_tokens - (r1.status == "completed")
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached >= whole_pages(first, page_size(server)) > r1.usage.input_tokens // 2
    assert client.responses.retrieve(r2.id).previous_response_id == r1.id


def test_encrypted_content_carries_the_turn_without_a_store(client: openai.OpenAI, server: ServerProcess) -> None:
    torch_only(server)
    first_input = [{"role": "developer", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Describe a harbour at dawn."}]}]
    r1 = client.responses.create(model="default", input=first_input, store=False, max_output_tokens=40,
                                 temperature=0, include=["reasoning.encrypted_content"])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    assert r1.output[-1].type == "reasoning" and r1.output[-1].encrypted_content
    history = [*first_input, *[item.model_dump(exclude_none=True) for item in r1.output]]
    r2 = client.responses.create(model="default", input=[*history, {"role": "user", "content": "More."}],
                                 store=False, max_output_tokens=8, temperature=0)
    first = r1.usage.input_tokens + r1.usage.output_tokens - (r1.status == "completed")
    assert r2.usage.input_tokens_details.cached_tokens >= whole_pages(first, page_size(server)) > 0


def test_agents_sdk_default_model_runs_a_tool(server: ServerProcess) -> None:
    torch_only(server)
    agents = pytest.importorskip("agents", reason="pip install openai-agents (the test extra)")
    calls: list[dict[str, Any]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append({"city": city})
        return "sunny, 21 C"

    agents.set_tracing_disabled(True)  # no traces sent to OpenAI
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0),
                                     use_for_tracing=False)
    agents.set_default_openai_api("responses")  # the default; said so the test keeps meaning it
    # An enum argument: a free string, the random model writes until max_tokens. The agent stops at the tool's
    # result: free text after it may run to max_tokens too (an incomplete response, which the SDK raises on).
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model="default",
                         tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             max_tokens=200, temperature=0))
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=2)
    assert len(calls) == 1 and calls[0]["city"] in ("Paris", "Rome")
    assert result.final_output == "sunny, 21 C"


CODEX_CONFIG = """model = "default"
model_provider = "tierlm"
model_instructions_file = "{home}/instructions.md"
include_permissions_instructions = false
include_environment_context = false
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.tierlm]
name = "tierlm"
base_url = "{base_url}"
wire_api = "responses"
"""


def test_codex_cli_exec_and_resume(server: ServerProcess, tmp_path: Path) -> None:
    torch_only(server)
    if shutil.which("codex") is None:
        pytest.skip("Codex CLI is not installed (npm install -g @openai/codex; .ci/run does it where npm exists)")
    home = tmp_path / "codex_home"
    home.mkdir()
    # Codex's own instructions are ~17k characters; short ones keep the prefill of this CPU test small. The tools
    # stay Codex's own: function tools with strict, a namespace group, the hosted web_search.
    (home / "instructions.md").write_text("You are a terse assistant.\n")
    (home / "config.toml").write_text(CODEX_CONFIG.format(home=home, base_url=server.base_url))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), NO_BROWSER="1")
    before = server.log_text().count("POST /v1/responses")
    for args in (["exec", "--skip-git-repo-check", "Say hi"],
                 ["exec", "--skip-git-repo-check", "resume", "--last", "Say more"]):
        done = subprocess.run(["codex", *args], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
    lines = [ln for ln in server.log_text().splitlines() if "POST /v1/responses" in ln][before:]
    assert len(lines) >= 2 and all(" 200 " in ln for ln in lines), "\n".join(ln[:300] for ln in lines)
    # the resumed turn carries the first turn's tokens in encrypted_content: most of its prompt is cached
    prompt, cached = map(int, re.search(r"prompt=(\d+) completion=\d+ cached=(\d+)", lines[-1]).groups())
    assert cached > prompt // 2, lines[-1][:300]
