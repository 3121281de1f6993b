"""The OpenAI Responses API request (POST /v1/responses) as tierlm reads it (docs/api.md, "OpenAI Responses API").

Items, tools and text.format stay loosely typed here: server/api/responses/input.py reads them and answers anything it
cannot honour with a 400 that names the exact item (``input[3].content[0].type``), which a schema error would not.
Fields that change nothing here (``user``, ``service_tier``, ``client_metadata``, ...) are accepted and ignored, as
on the other OpenAI routes.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema

from tierlm.server.pipeline.text_fields import CheckedText

# The OpenAPI document states exactly the forms server/api/responses/input.py reads (the fields keep lax types, so its
# 400s name the exact item); server/http/openapi_doc.py serves it.
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_ITEM = {"anyOf": [
    {"type": "object", "description": "a message", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]}, "content": _TEXT}},
    {"type": "object", "description": "a call the model made", "required": ["type", "call_id", "name", "arguments"],
     "properties": {"type": {"const": "function_call"}, "call_id": {"type": "string"},
                    "name": {"type": "string", "minLength": 1}, "arguments": {"type": "string"},
                    "namespace": {"type": "string", "minLength": 1}}},
    {"type": "object", "description": "a call's result", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": _TEXT}},
    {"type": "object", "description": "reasoning; encrypted_content must be one this server made",
     "required": ["type"], "properties": {
         "type": {"const": "reasoning"},
         "summary": {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
             "type": {"const": "summary_text"}, "text": {"type": "string"}}}},
         "content": {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
             "type": {"const": "reasoning_text"}, "text": {"type": "string"}}}},
         "encrypted_content": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
]}
_FUNCTION_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
    "parameters": {"type": "object", "description": "a JSON schema of the arguments"}, "strict": {"type": "boolean"}}}
HOSTED_TOOL_TYPES = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                     "file_search", "code_interpreter", "image_generation", "computer_use_preview", "computer_use",
                     "mcp", "tool_search")
_TOOL = {"anyOf": [
    _FUNCTION_TOOL,
    {"type": "object", "required": ["type", "name", "tools"], "properties": {
        "type": {"const": "namespace"}, "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "tools": {"type": "array", "items": _FUNCTION_TOOL}}},
    {"type": "object", "required": ["type"], "description": "hosted: left out of what the model sees",
     "properties": {"type": {"enum": list(HOSTED_TOOL_TYPES)}}},
]}
_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "schema"], "properties": {
        "type": {"const": "json_schema"}, "name": {"type": "string"}, "description": {"type": "string"},
        "schema": {"type": "object"}, "strict": {"type": "boolean"}}},
    {"type": "null"},
]}


def _doc(schema: dict[str, Any], note: str = "") -> Any:
    return WithJsonSchema({**schema, "description": note} if note else schema)


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        default=None, description="the chat template's reasoning_effort (minimal -> low, xhigh -> high; none: unset)")
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, description="accepted; the reasoning parser's text is returned in full, not summarized")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: Annotated[dict[str, Any] | None, _doc(_FORMAT, "text, json_object or json_schema (name, schema, strict)")] \
        = None
    verbosity: str | None = Field(default=None, description="accepted and ignored")


class ResponsesRequest(CheckedText):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Annotated[str | list[dict[str, Any]], _doc(
        {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _ITEM}]},
        "a user message, or items: message (text parts), function_call, function_call_output, reasoning")]
    instructions: str | None = Field(default=None, description="a system message before the input")
    tools: Annotated[list[dict[str, Any]] | None, _doc(
        {"anyOf": [{"type": "array", "items": _TOOL}, {"type": "null"}]},
        "function tools and namespace groups of them; hosted tools (web_search, ...) are left out of what the model "
        "sees; other types are refused")] = None
    tool_choice: Annotated[str | dict[str, Any] | None, _doc({"anyOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"}, "name": {"type": "string"}, "namespace": {"type": "string"}}},
        {"type": "null"}]}, "none, auto, required, or {type: function, name} (a function in tools)")] = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    store: StrictBool = Field(default=True, description="keep the response for previous_response_id and GET "
                                                        "(a bounded in-memory store)")
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = Field(
        default=None, description="reasoning.encrypted_content: each response carries an integrity-checked blob of "
                                  "its exact tokens, from which the next turn's prompt reproduces them")
    prompt_cache_key: str | None = Field(default=None, description="accepted and echoed (docs/api.md)")
    # Refused when set: tierlm cannot do them (a 400 names the field)
    background: Annotated[StrictBool | None, _doc({"enum": [False, None]}, "not supported: false or null")] = None
    conversation: Annotated[Any, _doc({"type": "null"}, "not supported: only null")] = None
    prompt: Annotated[Any, _doc({"type": "null"}, "not supported: only null")] = None
    top_logprobs: Annotated[int | None, _doc({"enum": [0, None]}, "not supported: 0 or null")] = None
    truncation: Annotated[str | None, _doc({"enum": ["disabled", None]},
                                           "disabled (a prompt too long is a 400); auto is not supported")] = None

    def refused_field(self) -> str | None:
        """The first field set that tierlm cannot honour."""
        if self.background:
            return "background"
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                return name
        if self.top_logprobs:
            return "top_logprobs"
        if self.truncation not in (None, "disabled"):
            return "truncation"  # auto drops earlier items to fit: a different prompt than the client sent
        if any(i in REFUSED_INCLUDES for i in self.include or ()):
            return "include"
        return None


# `include` values that ask for something tierlm does not return; the others name outputs of hosted tools or images,
# which tierlm never produces (so there is nothing to leave out), or the encrypted_content blob it does return
REFUSED_INCLUDES = ("message.output_text.logprobs",)


class ResponseObject(BaseModel):
    """The response object (POST /v1/responses, GET /v1/responses/{id}; the stream's lifecycle events carry it)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response: ``type`` says which (docs/api.md lists them)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool
