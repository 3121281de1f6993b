"""The OpenAPI document matches the server: schemathesis fuzzes every operation of the app, backed by a real Engine
on a tiny seeded model (in-process, so real tokenizer, validation and generation errors are exercised).

For every generated request (schema-valid and schema-invalid ones): no 5xx; the status code, the content type and
the body (JSON, or each server-sent event) are the ones the document declares for that operation. For schema-valid
requests, also: the server refuses them only for reasons a schema cannot state (the prompt does not fit the
model's context or vocabulary, a model name the server does not serve, cross-field rules such as best_of == n).
Generations are kept short by a hook that caps max_tokens-like fields and n.
"""
from __future__ import annotations

import re
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance)

from engine_harness import start_engine
from fake_engine import FakeEngine
from http_helpers import LOCAL
from tierlm.server.app import create_app
from tierlm.server.http.openapi_doc import OPERATIONS

EXAMPLES_PER_OPERATION = 40
MAX_TOKENS = 4  # generated max_tokens-like values are capped at this, so each request generates a few tokens
MAX_N = 2


@pytest.fixture(scope="module")
def real_app(tiny_llama):
    engine = start_engine(tiny_llama, "torch", max_total_tokens=4096)
    try:
        yield create_app(engine)
    finally:
        engine.shutdown()


def _cap(obj: dict[str, Any], key: str, limit: int) -> None:
    value = obj.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value > limit:
        obj[key] = limit
    elif isinstance(value, float) and value.is_integer() and value > limit:  # 69.0 is a valid n (pydantic: 69)
        obj[key] = float(limit)


def short_generations(ctx: schemathesis.HookContext, body: Any) -> Any:
    """Keep valid values valid and invalid ones invalid: only integers above the cap are lowered to it."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens"):
        _cap(body, key, MAX_TOKENS)
    _cap(body, "n", MAX_N)
    if isinstance(body.get("best_of"), int) and isinstance(body.get("n"), int):
        _cap(body, "best_of", MAX_N)
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS  # chat's default is "what the context allows"
    if "input" in body and "max_output_tokens" not in body:
        body["max_output_tokens"] = MAX_TOKENS  # /v1/responses: the same default
    sp = body.get("sampling_params")
    if isinstance(sp, dict):
        _cap(sp, "max_new_tokens", MAX_TOKENS)
        sp.setdefault("max_new_tokens", MAX_TOKENS)
    return body


@pytest.fixture(scope="module")
def api_schema(real_app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", real_app, headers={"Host": "localhost"})
    schema.hook("map_body")(short_generations)
    return schema


# Why a schema-valid request may still get a 400: what depends on the model, the server's state, or more than
# one field at once. Each entry: (param pattern, message pattern).
ALLOWED_REFUSALS = [
    (r"(prompt|input_ids|text|tokens)(\[\d+\])?$", r"outside the vocabulary|is empty|maximum context length|surrogate"),
    (r"(sampling_params\.)?logit_bias$", r"outside the vocabulary"),  # the schema cannot know the vocabulary size
    (r"prompt$", r"exactly one of 'prompt'"),  # /tokenize: a text prompt or chat messages, not both, not neither
    (r"max_tokens$", r"context length|KV pool"),
    (r"messages", r"chat template"),
    # continue_final_message: JSON Schema cannot say "and the last message is an assistant's with text"
    (r"messages$", r"continue_final_message needs a conversation that ends with an assistant message"),
    (r"best_of$", r"best_of different from n"),  # JSON Schema cannot say "equal to n"
    (r"top_logprobs$", r"needs logprobs"),  # chat: top_logprobs only with logprobs: true (as OpenAI)
    (r"stream$", r"streaming a batch"),
    (r"(input_)?suffix$", r"fill-in-the-middle needs a model"),  # the model's tokenizer decides (docs/api.md)
    (r"echo$", r"echo cannot be combined with suffix"),
    (r"rid$", r"ids for \d+ prompts|already in use"),
    # /v1/responses: a reasoning blob must be one this server sealed (an HMAC no schema can state)
    (r"input\[\d+\]\.encrypted_content$", r"not a reasoning blob made by this server"),
    (r"(text|input_ids)$", r"batch is empty"),
    # Structured output: JSON Schema cannot say "at most one of these fields", and a schema-valid grammar (any
    # string, any schema object) may not compile: both are 400s naming the field (docs/api.md).
    (r"(response_format|json_schema|regex|ebnf|guided_(json|regex|choice|grammar)|sampling_params\.(json_schema|regex|ebnf))$",
     r"at most one|invalid (json_schema|regex|ebnf) in|the compiler failed|cannot be used"),
    # Tool calling: tool_choice needs tools and names one of them; a forced call's grammar is built from each
    # function's parameters schema, which may not compile, and cannot be combined with another constraint.
    (r"tool_choice$", r"only allowed when tools|not in tools|cannot be combined|needs a function tool"),
    # /v1/responses: include may name any output; the ones tierlm does not return (logprobs) are refused
    (r"include$", r"not supported by tierlm's Responses API"),
    (r"tools$", r"invalid structural_tag in|structural_tag in 'tools' cannot be used"),
    # JSON Schema cannot say "valid Unicode": a lone surrogate in any string is a 400 naming the field
    (r".*", r"lone UTF-16 surrogate"),
]


def schema_valid_requests_are_accepted(ctx: Any, response: Any, case: schemathesis.Case) -> None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or not 400 <= response.status_code < 500:
        return
    err = response.json()["error"]
    if response.status_code == 404 and err.get("code") in ("model_not_found", "response_not_found"):
        return  # which names are served, and which responses are stored, is state, not schema
    if response.status_code == 400 and err.get("param") and any(
            re.match(p, err["param"]) and re.search(m, err["message"]) for p, m in ALLOWED_REFUSALS):
        return
    raise AssertionError(f"{case.operation.label}: a request valid by the schema was refused with "
                         f"{response.status_code}: {err}")


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, schema_valid_requests_are_accepted]

# Each operation gets its own Hypothesis run, driven here rather than by schemathesis' pytest plugin (its lazy
# fixture support reaches into pytest internals that pytest 9.2 removed).
HYPOTHESIS_SETTINGS = settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                      HealthCheck.data_too_large])


@pytest.mark.slow  # ~35 s on 2 cores
def test_every_operation_conforms_to_the_openapi_document(api_schema: Any, subtests: Any) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == len(OPERATIONS)
    for operation in operations:
        takes_input = any(len(part) for part in (operation.body, operation.query, operation.path_parameters))
        # An operation without inputs has no invalid request to generate.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if takes_input else (GenerationMode.POSITIVE,)
        for mode in modes:
            @HYPOTHESIS_SETTINGS
            @given(case=operation.as_strategy(generation_mode=mode))
            def conforms(case: schemathesis.Case) -> None:
                case.call_and_validate(base_url=LOCAL, checks=CHECKS)

            with subtests.test(msg=f"{operation.label} ({mode.value})"):
                conforms()


def test_every_route_is_described() -> None:
    doc = create_app(FakeEngine()).openapi()
    routes = {(method, path) for path, item in doc["paths"].items() for method in item}
    assert routes == set(OPERATIONS), "describe new routes in server/http/openapi_doc.py OPERATIONS"
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), ids
    for item in doc["paths"].values():
        for op in item.values():
            assert "422" not in op["responses"]
            for status, resp in op["responses"].items():
                if status != "200":
                    error_schema = resp["content"]["application/json"]["schema"]
                    assert error_schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "401" in doc["paths"]["/v1/completions"]["post"]["responses"]  # behind --api-key
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]  # always open
    assert {"413", "503"} <= set(doc["paths"]["/v1/chat/completions"]["post"]["responses"])
    assert "HTTPValidationError" not in doc["components"]["schemas"]
