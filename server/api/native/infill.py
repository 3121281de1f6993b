"""POST /infill: llama.cpp's fill-in-the-middle route for code-completion plugins (llama.vim, llama.vscode).

{input_prefix, input_suffix, input_extra, prompt, n_predict, ...} -> {content, stop, tokens_predicted, ...}. The
prompt is the same FIM prompt /v1/completions builds for ``suffix`` (server/pipeline/fim.py), with the other files of
input_extra before it. Streamed, each event carries the new text and the last one the whole accounting, as llama.cpp
sends them (no [DONE]). Unlike llama.cpp, a prompt too long for the context is a 400, not truncated.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.server.api.native.infill_protocol import InfillRequest, InfillResponse, InfillStreamChunk
from tierlm.server.deps import check_model, make_request, model_name, new_id, ready_engine
from tierlm.server.pipeline.fim import build_fim_prompt, encode_plain, extra_context, require_fim_tokens
from tierlm.server.pipeline.generation import collect_outputs, stream_choices, unless_disconnected
from tierlm.server.pipeline.sampling_mapping import CHAT_DEFAULT_MAX_TOKENS, build_sampling_params
from tierlm.server.pipeline.sse import EventStreamResponse, sse_data
from tierlm.server.pipeline.tokenization import off_loop

router = APIRouter()
RANDOM_SEEDS = (-1, 2**32 - 1)  # llama.cpp's "pick a seed" values (LLAMA_DEFAULT_SEED)


def infill_prompt(engine: EngineAPI, body: InfillRequest) -> tuple[list[int], int | None]:
    """The FIM prompt's ids, and the family's end-of-middle token (a stop token) when it is not the model's EOS."""
    tokenizer = engine.tokenizer
    fim = require_fim_tokens(tokenizer, model_name(engine), param="input_suffix")
    extra = extra_context(tokenizer, fim, [(c.filename, c.text) for c in body.input_extra])
    # llama.cpp tokenizes the prompt on its own and puts it right after the prefix
    prefix = encode_plain(tokenizer, body.input_prefix, "input_prefix")
    prefix += encode_plain(tokenizer, body.prompt, "prompt")
    return build_fim_prompt(tokenizer, fim, prefix, body.input_suffix, extra), fim.end_id


def sampling_params(engine: EngineAPI, body: InfillRequest, prompt_len: int,
                    end_id: int | None = None) -> SamplingParams:
    wanted = body.max_tokens if body.max_tokens is not None else body.n_predict
    if wanted < 0:  # -1: what the context leaves (at least 1, so an over-long prompt still gets its 400)
        wanted = max(1, min(engine.context_length - prompt_len, CHAT_DEFAULT_MAX_TOKENS))
    fields = {"max_new_tokens": wanted, "ignore_eos": body.ignore_eos}
    names = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "stop": "stop"}
    for ours, theirs in names.items():
        value = getattr(body, ours)
        if value is not None:
            fields[theirs] = value
    if body.seed is not None and body.seed not in RANDOM_SEEDS:
        fields["seed"] = body.seed
    if end_id is not None:  # CodeLlama's <EOT> ends the middle (as on /v1/completions with suffix)
        fields["stop_token_ids"] = [end_id]
    return build_sampling_params(**fields)


def final_response(engine: EngineAPI, text: str, final: GenerateOutput) -> InfillResponse:
    if final.finish_reason == "length":
        stop_type, word = "limit", ""
    elif isinstance(final.matched_stop, str):
        stop_type, word = "word", final.matched_stop
    else:
        stop_type, word = "eos", ""
    return InfillResponse(content=text, model=model_name(engine), tokens_predicted=final.completion_tokens,
                          tokens_evaluated=final.prompt_tokens, tokens_cached=final.cached.total,
                          stop_type=stop_type, stopping_word=word)


@router.post("/infill", response_model=None)
async def infill(body: InfillRequest, request: Request, engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    ids, end_id = await off_loop(infill_prompt, engine, body)
    req = make_request(engine, new_id("infill-"), ids, sampling_params(engine, body, len(ids), end_id), body.stream)
    if body.stream:
        return EventStreamResponse(_events(request, engine, req))
    result = (await unless_disconnected(request, lambda: collect_outputs(engine, [req])))[0]
    assert result.final is not None  # collect_outputs raises otherwise
    return JSONResponse(final_response(engine, result.text, result.final).model_dump())


async def _events(request: Request, engine: EngineAPI, req: GenerateRequest) -> AsyncIterator[bytes]:
    finals: list[GenerateOutput | None] = [None]
    async with aclosing(stream_choices(request, engine, [req], finals)) as outputs:
        async for _, out in outputs:
            if out.text:
                yield sse_data(InfillStreamChunk(content=out.text))
            if out.finished:
                yield sse_data(final_response(engine, "", out))
