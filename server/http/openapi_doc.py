"""The OpenAPI document (/openapi.json, /docs) as the server really behaves.

FastAPI's generated document knows the request models but not the rest: the handlers return JSONResponse and
event streams, errors leave in OpenAI's shape with 400 (never 422), and middleware answers 401, 403 and 413
before any route runs. ``install_openapi`` replaces ``app.openapi`` with a builder that starts from FastAPI's
document and, per operation, sets a stable operation id, the 200 response's schemas and media types (JSON,
text/event-stream, text/plain) and every error status the operation can answer, each with the error schema.
tests/test_openapi_conformance.py checks the result against the running app with schemathesis.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tierlm.server.api.native.infill_protocol import InfillResponse, InfillStreamChunk
from tierlm.server.api.native.protocol import (DetokenizeResponse, FlushCacheResponse, ModelInfo,
                                               NativeGenerateResponse, RankLoad, ServerInfo, StatusResponse,
                                               TokenizeResponse, VersionResponse)
from tierlm.server.api.openai.protocol import (ChatCompletionChunk, ChatCompletionResponse, CompletionResponse,
                                               ErrorResponse, ModelCard, ModelList)
from tierlm.server.api.responses.protocol import ResponseDeleted, ResponseObject, ResponseStreamEvent
from tierlm.server.http.auth import OPEN_PATHS

logger = logging.getLogger("tierlm.server")

REF = "#/components/schemas/{model}"
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    ErrorResponse, CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, NativeGenerateResponse,
    StatusResponse, ModelList, ModelCard, ModelInfo, ServerInfo, FlushCacheResponse, TokenizeResponse,
    DetokenizeResponse, RankLoad, VersionResponse, InfillResponse, InfillStreamChunk, ResponseObject,
    ResponseStreamEvent, ResponseDeleted,
)

ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field fails validation, a value is out of range, a feature is not supported yet, or "
         "the prompt does not fit the model (context length, vocabulary)",
    401: "Missing or invalid API key (only when the server runs with --api-key or --admin-api-key)",
    403: "Refused cross-site request: the Host or Origin header does not name this server (see --allowed-origins)",
    404: "Unknown model: the 'model' named is not the one this server serves (or, on /v1/responses, an unknown "
         "response id)",
    413: "The request body is larger than --max-request-bytes",
    500: "Internal error (the server keeps serving)",
    503: "The model is still loading (or, for /health_generate, produced no token in time)",
}
# Every operation can get these: the origin guard and the body limit run before routing; 500 is the last resort.
COMMON_ERRORS = (403, 413, 500)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _event_stream(*events: type[BaseModel]) -> dict[str, Any]:
    """text/event-stream whose events carry `data: <json>` (one of ``events`` or an error), then `data: [DONE]`."""
    payload = {"anyOf": [*(_ref(m) for m in events), _ref(ErrorResponse)]}
    return {"text/event-stream": {"schema": {
        "description": "Server-sent events: each `data:` line is a JSON object; the stream ends with `data: [DONE]`. "
                       "An error after the stream started arrives as an event in the error shape.",
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]}},
    }}}


def _responses_event_stream() -> dict[str, Any]:
    """The Responses API's stream: `event: <type>` and `data: <json>` per event, no [DONE]."""
    return {"text/event-stream": {"schema": {
        "description": "Server-sent events: `event:` names the type, `data:` is the event as JSON (with the same "
                       "`type` and a `sequence_number`); the stream ends with response.completed, "
                       "response.incomplete or response.failed.",
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": {
            "type": "string", "contentMediaType": "application/json", "contentSchema": _ref(ResponseStreamEvent)}},
    }}}


@dataclass(frozen=True)
class Operation:
    operation_id: str
    summary: str
    ok: dict[str, Any]  # the 200 response's content
    errors: tuple[int, ...]  # besides COMMON_ERRORS; 401 is added for routes behind the API key
    path_patterns: tuple[tuple[str, str], ...] = ()  # (path parameter, the pattern its route accepts)


GENERATION_ERRORS = (400, 404, 503)
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/v1/completions"): Operation(
        "createCompletion", "OpenAI text completions (n choices per prompt; SSE with stream=true)",
        {**_json(_ref(CompletionResponse)), **_event_stream(CompletionResponse)}, GENERATION_ERRORS),
    ("post", "/v1/chat/completions"): Operation(
        "createChatCompletion", "OpenAI chat completions (SSE with stream=true)",
        {**_json(_ref(ChatCompletionResponse)), **_event_stream(ChatCompletionChunk)}, GENERATION_ERRORS),
    ("post", "/infill"): Operation(
        "infill", "llama.cpp's fill-in-the-middle for code-completion plugins (SSE with stream=true, no [DONE])",
        {**_json(_ref(InfillResponse)), **_event_stream(InfillStreamChunk, InfillResponse)}, GENERATION_ERRORS),
    ("post", "/v1/responses"): Operation(
        "createResponse", "OpenAI Responses API (Responses events with stream=true; docs/api.md)",
        {**_json(_ref(ResponseObject)), **_responses_event_stream()}, GENERATION_ERRORS),
    ("get", "/v1/responses/{response_id}"): Operation(
        "retrieveResponse", "A stored response (404 once it is deleted or dropped from the bounded store)",
        _json(_ref(ResponseObject)), (404,), (("response_id", r"^[^\n]*$"),)),
    ("delete", "/v1/responses/{response_id}"): Operation(
        "deleteResponse", "Delete a stored response", _json(_ref(ResponseDeleted)), (404,),
        (("response_id", r"^[^\n]*$"),)),
    ("post", "/generate"): Operation(
        "generate", "SGLang-native generation: one result per prompt, a list for a batch",
        {**_json({"anyOf": [_ref(NativeGenerateResponse), {"type": "array", "items": _ref(NativeGenerateResponse)}]}),
         **_event_stream(NativeGenerateResponse)}, (400, 503)),
    ("get", "/health"): Operation("health", "200 once the model is loaded", _json(_ref(StatusResponse)), (503,)),
    ("get", "/health_generate"): Operation(
        "healthGenerate", "200 once the engine really generates a token", _json(_ref(StatusResponse)), (503,)),
    ("get", "/v1/models"): Operation("listModels", "The served model", _json(_ref(ModelList)), ()),
    ("get", "/v1/models/{model_id}"): Operation(
        # {model_id:path} matches any text but a line break (model paths contain "/")
        "retrieveModel", "One model by name", _json(_ref(ModelCard)), (404,), (("model_id", r"^[^\n]*$"),)),
    ("get", "/model_info"): Operation(
        "modelInfo", "Model path, names and architecture (SGLang; sglang-router reads it)", _json(_ref(ModelInfo)), ()),
    ("get", "/get_model_info"): Operation("getModelInfo", "Model path and names (SGLang)", _json(_ref(ModelInfo)), ()),
    ("get", "/server_info"): Operation(
        "serverInfo", "Settings, backend, pool sizes per cache tier", _json(_ref(ServerInfo)), (503,)),
    ("get", "/get_server_info"): Operation(
        "getServerInfo", "Same as /server_info (SGLang's name)", _json(_ref(ServerInfo)), (503,)),
    ("post", "/flush_cache"): Operation(
        "flushCache", "Drop every cached prefix (and the storage tier with storage=true) when idle",
        _json(_ref(FlushCacheResponse)), (400, 503)),
    ("get", "/get_load"): Operation(
        "getLoad", "Requests and tokens per data-parallel rank (SGLang)",
        _json({"type": "array", "items": _ref(RankLoad)}), (503,)),
    ("get", "/version"): Operation("version", "The tierlm version", _json(_ref(VersionResponse)), ()),
    ("post", "/tokenize"): Operation(
        "tokenize", "Text or chat messages -> token ids (vLLM/SGLang)", _json(_ref(TokenizeResponse)),
        (400, 404, 503)),
    ("post", "/detokenize"): Operation(
        "detokenize", "Token ids -> text (vLLM/SGLang)", _json(_ref(DetokenizeResponse)), (400, 404, 503)),
    ("get", "/metrics"): Operation(
        "metrics", "Prometheus metrics (text exposition format)", {"text/plain": {"schema": {"type": "string"}}},
        (503,)),
    ("get", "/tiers"): Operation(
        "tiers", "KV tier occupancy, prompt tokens per tier (with a short history), queues, requests, the machine "
        "(docs/api.md; the page at / polls it)", _json({"type": "object"}), (503,)),
}


def _response_schemas() -> dict[str, Any]:
    _, top = models_json_schema([(m, "serialization") for m in RESPONSE_MODELS], ref_template=REF)
    return top.get("$defs", {})


def _document_operation(path: str, method: str, op: dict[str, Any], known: Operation | None) -> None:
    if known is None:  # a route this table does not know yet: still OpenAI-shaped errors, no 422
        logger.warning("OpenAPI: %s %s is not described in server/http/openapi_doc.py", method.upper(), path)
        known = Operation(op.get("operationId", f"{method}{path}"), op.get("summary", ""),
                          op.get("responses", {}).get("200", {}).get("content", {}), (400,))
    op["operationId"] = known.operation_id
    for param in op.get("parameters", []):
        pattern = dict(known.path_patterns).get(param["name"]) if param.get("in") == "path" else None
        if pattern is not None:
            param["schema"]["pattern"] = pattern
    op["summary"] = known.summary
    statuses = set(known.errors) | set(COMMON_ERRORS)
    if path not in OPEN_PATHS:
        statuses.add(401)
    if op.get("requestBody") or any(p.get("in") != "path" for p in op.get("parameters", [])):
        statuses.add(400)  # validation errors are 400 in OpenAI's shape, never FastAPI's 422
    responses: dict[str, Any] = {"200": {"description": "Success", "content": known.ok}}
    for status in sorted(statuses):
        responses[str(status)] = {"description": ERROR_DESCRIPTIONS[status], "content": _json(_ref(ErrorResponse))}
    op["responses"] = responses


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for name, schema in _response_schemas().items():
        if name in schemas and schemas[name] != schema:
            raise RuntimeError(f"OpenAPI: two different schemas are named {name}")
        schemas[name] = schema
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            _document_operation(path, method, op, OPERATIONS.get((method, path)))
    return doc


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
