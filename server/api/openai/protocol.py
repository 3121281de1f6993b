"""OpenAI (and SGLang-native) request/response schemas.

Requests ignore fields we do not know (OpenAI clients send many optional ones); fields we know but
cannot honour yet are rejected by the handlers with a 400 that says so. Responses follow OpenAI's shapes.

These models are also the OpenAPI document (server/http/openapi_doc.py): every numeric range that SamplingParams
checks is a Field constraint here, so the document states it and a bad value is a 400 naming the field. A field the
handlers accept only in some forms (e.g. ``logprobs``, not supported yet) keeps its lax type, so the handler's
400 still says "not supported yet", while its schema (``_accepts``) declares only the forms that are accepted.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, TypeAdapter,
                      ValidationError, ValidatorFunctionWrapHandler, WithJsonSchema, WrapValidator, model_serializer,
                      model_validator)

from tierlm.runtime.errors import RequestError
from tierlm.server.api.openai.structured_protocol import NativeGrammarFields, OpenAIGrammarFields
from tierlm.server.pipeline.text_fields import CheckedText

INT32_MAX = 2**31 - 1  # top_k travels to the samplers as int32
MAX_STOP_STRINGS = 16  # as SamplingParams.verify
MAX_TOP_LOGPROBS = 20  # as SamplingParams.verify (backends/base.py)


def _accepts(schema: dict[str, Any], note: str) -> Any:
    """The OpenAPI schema of a field whose other forms the handler refuses with a 400 (it keeps a lax type)."""
    return WithJsonSchema({**schema, "description": note})


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# Lax type: SamplingParams counts the stop strings and its 400 says how many are allowed.
StopField = Annotated[Union[str, list[str], None], _accepts(_nullable({"anyOf": [
    {"type": "string"}, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string"}}]}),
    f"a stop string or a list of at most {MAX_STOP_STRINGS}")]
JSON_SAFE_INT_MAX = 2**53 - 1
# Lax type: keys are checked as decimal token ids (server/pipeline/sampling_mapping.token_id_keys) and against the
# vocabulary (a 400 naming logit_bias); the document says what a valid key and value are.
LogitBiasField = Annotated[dict[str, float] | None, _accepts(_nullable({
    "type": "object", "propertyNames": {"pattern": "^[0-9]+$", "maxLength": 19},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
    "token id (as a decimal string) -> bias in [-100, 100] added to its logit before sampling")]


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a token id must be an integer, not true or false")
    return value


# Token ids are integers (JSON true/false are not; 7.0 is, as JSON Schema's integer says) that fit the engine's
# int64; booleans are booleans (StrictBool: not 0/1 or "true").
IdInt = Annotated[int, BeforeValidator(_not_bool)]
# The bounds before the validator: placed after it, pydantic writes them into the OpenAPI schema as "ge"/"le"
# (no JSON Schema meaning) instead of "minimum"/"maximum", and clients validating against the document miss them.
# The bound is 2**53 - 1, the largest integer every JSON parser holds exactly: at 2**63 - 1 a client (or a fuzzer)
# writing the bound as a float (9.223372036854776e18, "an integer" to JSON Schema) sends 2**63 after parsing.
TokenId = Annotated[int, Field(ge=0, le=JSON_SAFE_INT_MAX), BeforeValidator(_not_bool)]

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


_TOKEN_IDS = TypeAdapter(list[StrictInt])
_TOKEN_ID_LISTS = TypeAdapter(list[list[StrictInt]])


def _token_ids_first(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A list of ints skips the union: pydantic validates a value against every member of a union (and collects
    an error per item for list[str]), which took 270 ms on the event loop for a 1M-id prompt; this takes 20 ms.
    Anything else, and ids that do not validate, go through the union for its usual result and errors."""
    if isinstance(value, list) and value and (type(value[0]) is int or (
            isinstance(value[0], list) and value[0] and type(value[0][0]) is int)):
        try:  # plain ints (strict: no bool, no float) at C speed; the union's per-item check is the slow path
            return (_TOKEN_IDS if type(value[0]) is int else _TOKEN_ID_LISTS).validate_python(value)
        except ValidationError:
            pass
    return handler(value)


PromptType = Annotated[Union[str, list[str], list[IdInt], list[list[IdInt]]], WrapValidator(_token_ids_first)]
# Token ids must be in the model's vocabulary: the engine refuses others with a 400 that says which (its message is
# better than a schema error, so validation stays lax and only the document states the rule).
_IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_TEXT_SCHEMA = {"type": "string", "minLength": 1}  # "" has no tokens (unless the tokenizer adds BOS): a 400
_PROMPT_NOTE = ("text, a list of texts (a batch), token ids, or a list of token id lists; token ids must be in the "
                "model's vocabulary, and lists must not be empty")


class CompletionRequest(OpenAISamplingFields):
    prompt: Annotated[PromptType, _accepts({"anyOf": [
        _TEXT_SCHEMA,
        {"type": "array", "minItems": 1, "items": _TEXT_SCHEMA},
        _IDS_SCHEMA,
        {"type": "array", "minItems": 1, "items": _IDS_SCHEMA},
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
_REQUEST_TEMPLATE_NOTE = ("vLLM: a jinja template that replaces the server's; refused (400) unless the server runs "
                          "with --trust-request-chat-template")
TemplateKwargs = Annotated[dict[str, Any] | None, _accepts(_nullable({
    "type": "object", "properties": {"chat_template": {"type": "null", "description": _REQUEST_TEMPLATE_NOTE}}}),
    "variables for the chat template, e.g. {\"enable_thinking\": false}")]


class TextContentPart(BaseModel):
    # The handler refuses a part that is not {"type": "text", "text": "..."}; the schema says so.
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["type", "text"]})
    type: Annotated[str, _accepts({"const": "text"}, "only text content parts are supported")]
    text: Annotated[str | None, _accepts({"type": "string"}, "the text of the part")] = None


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
    chat_template: Annotated[str | None, _accepts({"type": "null"}, _REQUEST_TEMPLATE_NOTE)] = None
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


class NativeSamplingParams(NativeGrammarFields):
    """SGLang /generate sampling_params; unknown names are an error so typos do not pass silently."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX, description="-1 or 0: off")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    stop: StopField = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    seed: int | None = None
    logit_bias: LogitBiasField = None


# SGLang /generate top-level fields that change what is generated or returned, which tierlm does not implement: a
# request giving one a value other than "off" is a 400 naming it (docs/sglang-compat.md lists them)
UNSUPPORTED_GENERATE_FIELDS = ("lora_path", "lora_id", "return_hidden_states", "custom_logit_processor", "priority",
                               "session_params", "image_data", "video_data", "audio_data", "input_embeds",
                               "token_ids_logprob")


def _refuse_unimplemented(body: Any) -> Any:
    if isinstance(body, dict):
        given = [f for f in UNSUPPORTED_GENERATE_FIELDS if body.get(f) not in (None, False, [], {})]
        if given:
            raise RequestError(f"/generate: {', '.join(given)} {'is' if len(given) == 1 else 'are'} not implemented "
                               f"in tierlm (docs/sglang-compat.md); remove {'it' if len(given) == 1 else 'them'} from "
                               "the request", 400, param=given[0], code="unsupported_parameter")
    return body


def _printable_rid(value: str) -> str:
    # checked here, not with Field(max_length=...): a constrained str refuses a lone surrogate with a vaguer message
    # than the body's own Unicode check (server/pipeline/text_fields.py) gives
    if not 1 <= len(value) <= MAX_RID_CHARS:
        raise ValueError(f"a request id has 1 to {MAX_RID_CHARS} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError("a request id may not contain control characters (newline, tab, ...): it is written into "
                         "log lines, where one could forge others")
    return value


MAX_RID_CHARS = 256
# A client's own request id (SGLang's rid): printable, bounded, so every log line that names it stays one line.
RidField = Annotated[str, AfterValidator(_printable_rid), WithJsonSchema({
    "type": "string", "minLength": 1, "maxLength": MAX_RID_CHARS, "pattern": r"^[^\x00-\x1f\x7f]+$"})]


class NativeGenerateRequest(CheckedText):
    # The handler needs exactly one of text and input_ids (a 400 otherwise); the schema says so.
    model_config = ConfigDict(extra="ignore", json_schema_extra={"anyOf": [
        {"required": ["text"], "properties": {"text": {"not": {"type": "null"}}, "input_ids": {"type": "null"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"not": {"type": "null"}}, "text": {"type": "null"}}},
    ]})
    text: Annotated[str | list[str] | None, _accepts(_nullable({"anyOf": [
        _TEXT_SCHEMA, {"type": "array", "minItems": 1, "items": _TEXT_SCHEMA}]}),
        "the prompt, or a list of prompts (a batch)")] = None
    input_ids: Annotated[list[IdInt] | list[list[IdInt]] | None, WrapValidator(_token_ids_first), _accepts(_nullable({"anyOf": [
        _IDS_SCHEMA, {"type": "array", "minItems": 1, "items": _IDS_SCHEMA}]}),
        "token ids (one prompt) or lists of token ids (a batch), in the model's vocabulary")] = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: StrictBool = False
    rid: RidField | list[RidField] | None = None
    # SGLang's logprob fields (docs/logprobs.md)
    return_logprob: StrictBool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int = Field(default=-1, ge=-1, description="prompt logprobs from this position on; -1: none")
    return_text_in_logprobs: StrictBool = False

    _refuse_unimplemented = model_validator(mode="before")(_refuse_unimplemented)


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


class StatusResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ModelInfo(BaseModel):
    model_path: str | None
    tokenizer_path: str | None
    served_model_name: str
    is_generation: bool
    architectures: list[str] | None = Field(default=None, description="the model's architecture once it is loaded")


class ServerInfo(BaseModel):
    """Settings, backend, pool sizes per tier; the keys beyond these depend on the backend and the tiers."""

    model_config = ConfigDict(extra="allow")
    ready: bool
    server_args: dict[str, Any]


class FlushCacheResponse(BaseModel):
    success: bool
    message: str


class TokenizeRequest(CheckedText):
    """vLLM's and SGLang's POST /tokenize: a text prompt, or chat messages through the chat template."""
    model_config = ConfigDict(extra="ignore", json_schema_extra={"anyOf": [{"required": ["prompt"]},
                                                                           {"required": ["messages"]}]})
    model: str | None = None
    prompt: str | list[str] | None = Field(default=None, description="a text, or a list of texts (SGLang: one "
                                                                    "token list per text)")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = Field(default=True, description="with a text prompt: add the tokenizer's special "
                                                               "tokens (e.g. BOS)")
    chat_template_kwargs: TemplateKwargs = None
    chat_template: Annotated[str | None, _accepts({"type": "null"}, _REQUEST_TEMPLATE_NOTE)] = None


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]] = Field(description="a list per text when the prompt was a list")
    count: int | list[int]
    max_model_len: int


class DetokenizeRequest(CheckedText):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: Annotated[list[IdInt] | list[list[IdInt]], WrapValidator(_token_ids_first)] = Field(
        description="ids, or a list of id lists (SGLang: one text each)")
    skip_special_tokens: StrictBool = Field(default=True, description="drop special tokens (BOS, EOS, ...) from the "
                                                                      "text (SGLang's default)")


class DetokenizeResponse(BaseModel):
    text: str | list[str] = Field(description="SGLang's field")
    prompt: str | list[str] = Field(description="vLLM's field: the same text")


class RankLoad(BaseModel):
    """SGLang's /get_load entry of one data-parallel rank (tierlm has one), field for field."""
    dp_rank: int
    num_reqs: int = Field(description="running and waiting requests")
    num_waiting_reqs: int
    num_tokens: int = Field(description="device KV tokens in use (pool less free and evictable cached pages) plus "
                                        "the tokens of the waiting requests")
    num_pending_tokens: int = Field(default=0, description="the tokens of the waiting requests (not yet prefilled)")
    ts_tic: float = Field(default=0.0, description="time.perf_counter() of the server when the load was read "
                                                   "(a monotonic clock, not wall time)")


class VersionResponse(BaseModel):
    version: str


class NativeFinishReason(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    length: int | None = None
    matched: str | int | None = None


LogprobEntry = tuple[float | None, int, str | None]


class NativeMetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails
    finish_reason: NativeFinishReason | None
    e2e_latency: float | None = None
    # with --speculative-algorithm NGRAM, on requests that took part in verify steps (docs/speculative.md)
    spec_verify_ct: int | None = None
    spec_draft_token_num: int | None = None
    spec_accept_token_num: int | None = None
    spec_accept_rate: float | None = None
    spec_accept_length: float | None = None
    # with return_logprob (docs/logprobs.md): (logprob or null, token id, text or null) per token
    input_token_logprobs: list[LogprobEntry] | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None


class NativeGenerateResponse(BaseModel):
    """One prompt's result from /generate (and, streamed, the cumulative state in each event)."""

    text: str
    output_ids: list[int]
    meta_info: NativeMetaInfo


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
