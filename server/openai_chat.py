"""POST /v1/chat/completions: messages -> chat template -> generation, n choices, optional SSE streaming."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.server.deps import check_model, make_request, model_name, new_id, ready_engine, sub_rid
from tierlm.server.generation import (collect_outputs, finish_reason_of, stream_choices, summed_usage,
                                      unless_disconnected)
from tierlm.server.logprob_format import Pieces, chat_logprob_content
from tierlm.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                    ChatCompletionResponse, ChatDelta, ChatMessageOut, make_usage)
from tierlm.server.sampling_mapping import chat_max_tokens, openai_sampling_params, reject_unsupported_chat
from tierlm.server.sse import DONE, EventStreamResponse, sse_data
from tierlm.server.structured_output import check_grammars
from tierlm.server.tokenization import apply_chat_template, off_loop

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    reject_unsupported_chat(body)
    ids = await off_loop(apply_chat_template, engine.tokenizer, body.messages, body.chat_template_kwargs)
    max_new_tokens = chat_max_tokens(body, len(ids), engine.context_length)
    response_id = new_id("chatcmpl-")
    reqs: list[GenerateRequest] = []
    for c in range(body.n):
        params = openai_sampling_params(body, max_new_tokens, choice_index=c)
        reqs.append(make_request(engine, sub_rid(response_id, c, body.n), ids, params, body.stream))
    await check_grammars(engine, reqs)  # a grammar that does not compile: 400 before anything is queued

    if body.stream:
        return EventStreamResponse(_events(request, engine, reqs, body, response_id))

    results = await unless_disconnected(request, lambda: collect_outputs(engine, reqs))
    response = ChatCompletionResponse(
        id=response_id,
        model=model_name(engine),
        choices=[ChatChoice(index=i, message=ChatMessageOut(content=r.text), finish_reason=finish_reason_of(r.final),
                            logprobs=_logprobs(body, Pieces(engine.tokenizer), r.final))
                 for i, r in enumerate(results)],
        usage=make_usage(*summed_usage([r.final for r in results], body.n)),  # type: ignore[misc]
    )
    return JSONResponse(response.model_dump())


def _logprobs(body: ChatCompletionRequest, pieces: Pieces, out: GenerateOutput | None) -> dict | None:
    """``choices[].logprobs`` (OpenAI: {"content": [...]}) of the output tokens in ``out``; None unless asked."""
    if not body.logprobs or out is None:
        return None
    return {"content": chat_logprob_content(pieces, out.logprobs)}


async def _events(request: Request, engine: EngineAPI, reqs: list[GenerateRequest], body: ChatCompletionRequest,
                  response_id: str) -> AsyncIterator[bytes]:
    """OpenAI's order: per choice a role chunk, content deltas, a finish chunk; then usage (if asked), [DONE]."""
    created = int(time.time())
    name = model_name(engine)
    exclude = None if body.include_usage else {"usage"}

    def chunk(index: int, delta: ChatDelta, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        c = ChatCompletionChunk(id=response_id, created=created, model=name,
                                choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                                         logprobs=logprobs)])
        return sse_data(c.model_dump(exclude=exclude))

    pieces = Pieces(engine.tokenizer)
    for i in range(len(reqs)):
        yield chunk(i, ChatDelta(role="assistant", content=""))
    finals: list[GenerateOutput | None] = [None] * len(reqs)
    # aclosing: a client that goes away mid-stream aborts the unfinished requests at once
    async with aclosing(stream_choices(request, engine, reqs, finals)) as choices:
        async for i, out in choices:
            lp = _logprobs(body, pieces, out)
            if out.text or (lp and lp["content"]):
                yield chunk(i, ChatDelta(content=out.text), logprobs=lp)
            if out.finished:
                yield chunk(i, ChatDelta(), finish_reason_of(out))
    if any(f is None for f in finals):
        return  # the client is gone
    if body.include_usage:
        usage = make_usage(*summed_usage(finals, body.n))  # type: ignore[arg-type]
        yield sse_data(ChatCompletionChunk(id=response_id, created=created, model=name, choices=[], usage=usage))
    yield DONE
