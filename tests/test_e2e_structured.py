"""Structured output against a real server process (the random demo model): the openai client's
response_format (plain and through its pydantic `parse`), vLLM-style extra_body aliases, a 400 for a bad schema,
and LangChain's ChatOpenAI(...).with_structured_output(Model, method="json_schema")."""
from __future__ import annotations

import json
from typing import Any, Iterator, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from e2e_server import ServerProcess, start_server
from tierlm.backends.model_source.demo import ensure_demo_model

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "temperature": {"type": "integer", "minimum": -30, "maximum": 45},
    "sky": {"enum": ["clear", "cloudy", "rain"]},
    "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "minItems": 1, "maxItems": 3},
}, "required": ["city", "temperature", "sky", "hours"]}


class Weather(BaseModel):
    city: str = Field(max_length=10)
    temperature: int = Field(ge=-30, le=45)
    sky: Literal["clear", "cloudy", "rain"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    demo = str(ensure_demo_model(tmp_path_factory.mktemp("e2e_structured_model")))  # random weights, ChatML
    with start_server(["--model-path", demo, "--skip-warmup"], env={"TIERLM_NO_PROGRESS": "1"},
                      log_dir=tmp_path_factory.mktemp("e2e_structured_logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_openai_response_format_json_schema(client: Any) -> None:
    r = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=128, temperature=0.8, seed=1, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_openai_parse_with_a_pydantic_model(client: Any) -> None:
    r = client.chat.completions.parse(model="default", messages=MESSAGES, max_tokens=128, temperature=0,
                                      response_format=Weather)
    assert isinstance(r.choices[0].message.parsed, Weather)


def test_streamed_completion_with_guided_json(client: Any) -> None:
    stream = client.completions.create(model="default", prompt="Weather:", max_tokens=128, temperature=0,
                                       stream=True, extra_body={"guided_json": SCHEMA})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_choice_and_bad_schema(client: Any) -> None:
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=16, temperature=1.0,
                                       extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=16, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}})
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"


def test_langchain_with_structured_output(server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server.base_url, api_key="none", model="default", temperature=0,
                                      max_tokens=128, max_retries=0, timeout=60)
    result = llm.with_structured_output(Weather, method="json_schema").invoke("What is the weather in Paris?")
    assert isinstance(result, Weather)
