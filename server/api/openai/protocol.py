"""OpenAI request/response schemas (/v1/completions, /v1/chat/completions, /v1/models, errors); SGLang's own
routes have theirs in server/api/native/protocol.py, the field types both use are server/pipeline/request_fields.py.

Requests ignore fields we do not know (OpenAI clients send many optional ones); fields we know but
cannot honour yet are rejected by the handlers with a 400 that says so. Responses follow OpenAI's shapes.

These models are also the OpenAPI document (server/http/openapi_doc.py): every numeric range that SamplingParams
checks is a Field constraint here, so the document states it and a bad value is a 400 naming the field. A field the
handlers accept only in some forms (e.g. ``logprobs``, not supported yet) keeps its lax type, so the handler's
400 still says "not supported yet", while its schema (``accepts``) declares only the forms that are accepted.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema, WrapValidator, model_serializer

from tierlm.server.api.openai.structured_protocol import OpenAIGrammarFields
from tierlm.server.pipeline.request_fields import (INT32_MAX, MAX_TOP_LOGPROBS, IDS_SCHEMA, TEXT_SCHEMA, IdInt,
                                                   LogitBiasField, StopField, TokenId, accepts, nullable,
                                                   token_ids_first)
from tierlm.server.pipeline.text_fields import CheckedText


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class OpenAISamplingFields(OpenAIGrammarFields, CheckedText):
    """Sampling fields shared by /v1/completions and /v1/chat/completions, plus vLLM/SGLang extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stop: StopField = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: LogitBiasField = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM / SGLang names)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX, description="-1 or 0: off")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = Annotated[Union[str, list[str], list[IdInt], list[list[IdInt]]], WrapValidator(token_ids_first)]
_PROMPT_NOTE = ("text, a list of texts (a batch), token ids, or a list of token id lists; token ids must be in the "
                "model's vocabulary, and lists must not be empty")


class CompletionRequest(OpenAISamplingFields):
    prompt: Annotated[PromptType, accepts({"anyOf": [
        TEXT_SCHEMA,
        {"type": "array", "minItems": 1, "items": TEXT_SCHEMA},
        IDS_SCHEMA,
        {"type": "array", "minItems": 1, "items": IDS_SCHEMA},
    ]}, _PROMPT_NOTE)]
    echo: StrictBool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="log-probabilities of each returned token and this many top alternatives "
                                             "(with echo, of the prompt tokens too; docs/logprobs.md)")
    suffix: str | None = Field(default=None, description=(
        "fill-in-the-middle: the text after the insertion point, the prompt being the text before it; needs a model "
        "whose tokenizer has FIM tokens (Qwen2.5-Coder, StarCoder, DeepSeek-Coder, CodeLlama, Codestral), else 400. "
        "'' on a model without them is a plain completion. Not with echo (docs/api.md)"))
    # JSON Schema cannot say "equal to n"; the handler refuses any other value with a 400 naming best_of.
    best_of: int | None = Field(default=None, ge=1, le=128,
                                description="only best_of equal to n is supported (the n choices are the candidates)")


# The chat template is the operator's: a request's own (vLLM's chat_template, top level or in chat_template_kwargs)
# is refused unless the server runs with --trust-request-chat-template, so the document accepts only null for it.
REQUEST_TEMPLATE_NOTE = ("vLLM: a jinja template that replaces the server's; refused (400) unless the server runs "
                          "with --trust-request-chat-template")
TemplateKwargs = Annotated[dict[str, Any] | None, accepts(nullable({
    "type": "object", "properties": {"chat_template": {"type": "null", "description": REQUEST_TEMPLATE_NOTE}}}),
    "variables for the chat template, e.g. {\"enable_thinking\": false}")]


class TextContentPart(BaseModel):
    # The handler refuses a part that is not {"type": "text", "text": "..."}; the schema says so.
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["type", "text"]})
    type: Annotated[str, accepts({"const": "text"}, "only text content parts are supported")]
    text: Annotated[str | None, accepts({"type": "string"}, "the text of the part")] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may use extra keys (e.g. reasoning_content)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, description="the name the model calls the function by")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON schema of the arguments (a forced call's arguments follow it)")
    strict: StrictBool | None = Field(default=None,
                                      description="accepted; forced calls always follow the schema exactly")


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(OpenAISamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: StrictBool = Field(default=False, description="log-probabilities of the output tokens (docs/logprobs.md)")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="top alternatives per output token; needs logprobs: true")
    tools: list[ToolDefinition] | None = Field(
        default=None, description="functions the model may call (the chat template gets them as tools)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="auto (default with tools), none, required, or one named function; needs tools")
    parallel_tool_calls: StrictBool | None = Field(default=None, description="false: at most one call (default true)")
    chat_template_kwargs: TemplateKwargs = None  # vLLM/SGLang extension, e.g. {"enable_thinking": false}
    chat_template: Annotated[str | None, accepts({"type": "null"}, REQUEST_TEMPLATE_NOTE)] = None
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        default=None, description="passed to the chat template as reasoning_effort (gpt-oss reads it)")
    continue_final_message: StrictBool = Field(
        default=False, description="vLLM: the last message (the assistant's) is left open and the model continues "
                                   "it instead of starting a new turn")
    separate_reasoning: StrictBool = Field(
        default=True, description="SGLang: with a reasoning parser, the thinking text goes to reasoning_content; "
                                  "false leaves it in content")
    stream_reasoning: StrictBool = Field(
        default=True, description="SGLang: false sends the reasoning in one piece when it ends (streaming)")


# ---------------------------------------------------------------- responses


class CachedTokensDetails(BaseModel):
    device: int = 0
    host: int = 0
    storage: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    cached_tokens_details: CachedTokensDetails = Field(default_factory=CachedTokensDetails)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def _now() -> int:
    return int(time.time())


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""  # null when the message is only tool calls
    reasoning_content: str | None = None  # the thinking text, with a reasoning parser (docs/api.md)
    # left out without calls (as OpenAI), so answers without tools keep their shape
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape; with echo the prompt tokens come first, the first one with null logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of one call: the first carries index, id, type and name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI deltas carry only what changed: {"role", "content"} first, then {"content"}, then {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Annotated[ChatDelta, WithJsonSchema({
        "type": "object", "additionalProperties": False,
        "properties": {"role": {"const": "assistant"}, "content": {"type": "string"},
                       "reasoning_content": {"type": "string"},
                       "tool_calls": {"type": "array", "items": {
                           "type": "object", "required": ["index"], "additionalProperties": False,
                           "properties": {"index": {"type": "integer"}, "id": {"type": "string"},
                                          "type": {"const": "function"},
                                          "function": {"type": "object", "additionalProperties": False,
                                                       "properties": {"name": {"type": "string"},
                                                                      "arguments": {"type": "string"}}}}}}},
        "description": "only what changed: role and content first, then content, then nothing (with finish_reason)"})]
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed completions chunk (OpenAI uses one object type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tierlm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every error, whatever its status: OpenAI's shape (server/http/errors.py)."""

    error: ErrorDetail


def make_usage(prompt_tokens: int, completion_tokens: int, cached: Any) -> Usage:
    """Usage with prompt_tokens_details always present (zeros on a cache miss). ``cached``: CachedTokens."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=cached.total,
            cached_tokens_details=CachedTokensDetails(**cached.to_dict()),
        ),
    )
