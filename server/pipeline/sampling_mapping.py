"""OpenAI / SGLang request fields -> a checked SamplingParams, and the 400s for features not supported yet."""
from __future__ import annotations

from typing import Any

from tierlm.runtime.errors import RequestError
from tierlm.runtime.sampling_params import SamplingParams, SamplingParamsError
from tierlm.server.api.native.protocol import NativeGenerateRequest, NativeSamplingParams
from tierlm.server.api.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAISamplingFields
from tierlm.server.pipeline.structured_output import native_grammar_param, openai_grammar_fields

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 2048  # chat has no fixed OpenAI default; cap what the remaining context allows


def _not_supported(what: str, param: str) -> RequestError:
    return RequestError(f"{what} is not supported yet; remove '{param}' from the request", 400, param=param,
                        code="unsupported_parameter")


def reject_unsupported_completion(req: CompletionRequest) -> None:
    if req.best_of is not None and req.best_of != req.n:
        raise _not_supported("best_of different from n", "best_of")


def reject_unsupported_chat(req: ChatCompletionRequest) -> None:
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", 400, param="top_logprobs")


def build_sampling_params(**fields: Any) -> SamplingParams:
    """Construct and normalize; a bad value becomes a 400 that names the field."""
    try:
        return SamplingParams(**fields).normalize()
    except SamplingParamsError as e:
        raise RequestError(str(e), 400, param=e.param) from None


def openai_sampling_params(req: OpenAISamplingFields, max_new_tokens: int, choice_index: int = 0) -> SamplingParams:
    """Fields set in the request override SamplingParams defaults; choice i of n gets seed + i."""
    fields: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": req.ignore_eos,
                              "skip_special_tokens": req.skip_special_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop", "stop_token_ids"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if req.seed is not None:
        fields["seed"] = req.seed + choice_index
    if req.logit_bias:
        fields["logit_bias"] = token_id_keys(req.logit_bias)
    fields.update(openai_logprob_fields(req))
    fields.update(openai_grammar_fields(req))  # structured output (server/pipeline/structured_output.py)
    return build_sampling_params(**fields)


def openai_logprob_fields(req: OpenAISamplingFields) -> dict[str, Any]:
    """completions ``logprobs: k`` (with echo: the prompt's too, from position 0), chat ``logprobs`` +
    ``top_logprobs`` -> SamplingParams' SGLang-named logprob fields (docs/logprobs.md)."""
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        return {"return_logprob": True, "top_logprobs_num": req.logprobs, "logprob_start_len": 0 if req.echo else -1}
    if isinstance(req, ChatCompletionRequest) and req.logprobs:
        return {"return_logprob": True, "top_logprobs_num": req.top_logprobs or 0}
    return {}


def with_native_logprobs(params: SamplingParams, body: NativeGenerateRequest) -> SamplingParams:
    """SGLang's /generate top-level logprob fields onto checked SamplingParams."""
    if body.return_logprob:
        params.return_logprob = True
        params.top_logprobs_num = body.top_logprobs_num
        params.logprob_start_len = body.logprob_start_len
        try:
            params.verify()
        except SamplingParamsError as e:
            raise RequestError(str(e), 400, param=e.param) from None
    return params


def token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias as clients send it (JSON keys are strings: {"50256": -100}) -> token id -> bias."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias keys must be token ids written as decimal strings (e.g. \"50256\"), got "
                               f"{key[:40]!r}", 400, param="logit_bias")
        out[int(key)] = value
    return out


def native_sampling_params(sp: NativeSamplingParams) -> SamplingParams:
    fields = sp.model_dump(exclude_none=True)
    if "logit_bias" in fields:
        fields["logit_bias"] = token_id_keys(fields["logit_bias"])
    return build_sampling_params(**fields, **native_grammar_param(fields))


def completion_max_tokens(req: CompletionRequest) -> int:
    return COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens


def chat_max_tokens(req: ChatCompletionRequest, prompt_len: int, context_length: int) -> int:
    """max_completion_tokens wins over the deprecated max_tokens; unset -> what fits, at most 2048."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    if req.max_tokens is not None:
        return req.max_tokens
    remaining = context_length - prompt_len if context_length > 0 else CHAT_DEFAULT_MAX_TOKENS
    # At least 1: a prompt that fills the context must reach engine.validate and get its "too long" 400.
    return max(1, min(remaining, CHAT_DEFAULT_MAX_TOKENS))
