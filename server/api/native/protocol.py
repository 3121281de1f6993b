"""SGLang's and vLLM's own request/response schemas (pydantic): /generate, /tokenize and /detokenize, /health,
/model_info, /server_info, /flush_cache, /get_load, /version. Unknown sampling parameter names are an error; the
/generate fields tierlm does not implement are a 400 naming them."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema, WrapValidator,
                      model_validator)

from tierlm.runtime.errors import RequestError
from tierlm.server.api.openai.protocol import (REQUEST_TEMPLATE_NOTE, CachedTokensDetails, ChatMessage,
                                               TemplateKwargs)
from tierlm.server.api.openai.structured_protocol import NativeGrammarFields
from tierlm.server.pipeline.request_fields import (INT32_MAX, MAX_TOP_LOGPROBS, IDS_SCHEMA, TEXT_SCHEMA, IdInt,
                                                   LogitBiasField, StopField, TokenId, accepts, nullable,
                                                   token_ids_first)
from tierlm.server.pipeline.text_fields import CheckedText

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
    text: Annotated[str | list[str] | None, accepts(nullable({"anyOf": [
        TEXT_SCHEMA, {"type": "array", "minItems": 1, "items": TEXT_SCHEMA}]}),
        "the prompt, or a list of prompts (a batch)")] = None
    input_ids: Annotated[list[IdInt] | list[list[IdInt]] | None, WrapValidator(token_ids_first), accepts(nullable({"anyOf": [
        IDS_SCHEMA, {"type": "array", "minItems": 1, "items": IDS_SCHEMA}]}),
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
    chat_template: Annotated[str | None, accepts({"type": "null"}, REQUEST_TEMPLATE_NOTE)] = None


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]] = Field(description="a list per text when the prompt was a list")
    count: int | list[int]
    max_model_len: int


class DetokenizeRequest(CheckedText):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: Annotated[list[IdInt] | list[list[IdInt]], WrapValidator(token_ids_first)] = Field(
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
