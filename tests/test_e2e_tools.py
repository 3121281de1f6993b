"""Tool calling against a real server process: the random demo model with the tools-capable
``--chat-template chatml-tools`` (Qwen2.5's / Hermes' format), so the tool-call parser is chosen from the model.
A forced call (tool_choice required or named) is always a valid call whose arguments validate against the schema,
streamed or not; the openai client and LangChain's bind_tools read the calls; an agent loop (user -> call -> tool
result -> answer) runs end to end."""
from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema
import openai
import pytest

from e2e_server import ServerProcess, start_server
from tierlm.backends.model_source.demo import ensure_demo_model

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    demo = str(ensure_demo_model(tmp_path_factory.mktemp("e2e_tools_model")))  # random weights, ChatML
    with start_server(["--model-path", demo, "--skip-warmup", "--chat-template", "chatml-tools"],
                      env={"TIERLM_NO_PROGRESS": "1"},
                      log_dir=tmp_path_factory.mktemp("e2e_tools_logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_parser_is_chosen_from_the_model(server: ServerProcess) -> None:
    import httpx

    info = httpx.get(server.base_url.removesuffix("/v1") + "/server_info", timeout=30).json()
    assert info["tool_call_parser"]["name"] == "hermes"
    assert "<tool_call>" in info["tool_call_parser"]["chosen_by"]


def test_required_yields_valid_calls(client: Any) -> None:
    # parallel_tool_calls false: exactly one call (a random model given the choice may keep calling until
    # max_tokens; a real one stops after its calls)
    for seed in (1, 2, 3):  # one request each: n > 1 over this long prompt decodes slowly on a CPU
        r = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=1.0, seed=seed, parallel_tool_calls=False)
        [choice] = r.choices
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_required_parallel_calls_are_each_valid(client: Any) -> None:
    r = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=250, temperature=0, seed=3, stream=True)
    chunks = list(r)
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    complete = calls if finish == "tool_calls" else dict(list(calls.items())[:-1])  # "length" may cut the last
    assert calls and finish in ("tool_calls", "length")
    for call in complete.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_function_streamed(client: Any) -> None:
    stream = client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0, seed=5, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    chunks = list(stream)
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_time" and pieces[0].index == 0
    assert {p.index for p in pieces} == {0}
    arguments = "".join(p.function.arguments or "" for p in pieces)
    jsonschema.validate(json.loads(arguments), TIME)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_langchain_bind_tools(server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server.base_url, api_key="none", model="default", temperature=0,
                                      max_tokens=200, max_retries=0, timeout=60)
    message = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER)


def test_agent_loop(client: Any) -> None:
    """user -> tool call -> tool result -> answer, each turn rendered by the chat template."""
    messages: list[dict[str, Any]] = list(MESSAGES)
    r = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0, parallel_tool_calls=False)
    message = r.choices[0].message
    [call] = message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18})})
    r = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0)
    answer = r.choices[0]
    assert answer.finish_reason in ("stop", "length") and isinstance(answer.message.content, str)
    assert not answer.message.tool_calls
    assert r.usage.prompt_tokens > 0
