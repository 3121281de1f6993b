"""POST /v1/completions: OpenAI text completions, n choices per prompt, optional SSE streaming and echo, and
fill-in-the-middle with ``suffix`` (server/pipeline/fim.py)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.server.api.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, make_usage
from tierlm.server.deps import check_model, make_request, model_name, new_id, ready_engine, sub_rid
from tierlm.server.pipeline.fim import fim_prompts
from tierlm.server.pipeline.generation import (collect_outputs, finish_reason_of, stream_choices, summed_usage,
                                               unless_disconnected)
from tierlm.server.pipeline.logprob_format import CompletionLogprobBuilder, without_stop_token
from tierlm.server.pipeline.sampling_mapping import (completion_max_tokens, openai_sampling_params,
                                                     reject_unsupported_completion)
from tierlm.server.pipeline.sse import DONE, EventStreamResponse, sse_data
from tierlm.server.pipeline.structured_output import check_grammars
from tierlm.server.pipeline.tokenization import decode_ids, normalize_prompts, off_loop

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request, engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    reject_unsupported_completion(body)
    fim = await off_loop(fim_prompts, engine.tokenizer, model_name(engine), body.prompt, body.suffix, body.echo)
    if fim is None:
        prompts = await off_loop(normalize_prompts, engine.tokenizer, body.prompt)
    else:  # suffix: the prompt is the code before the hole (server/pipeline/fim.py)
        prompts, tokens = fim
        if tokens.end_id is not None:  # the family's end-of-middle token, when it is not the model's EOS
            body = body.model_copy(update={"stop_token_ids": [*(body.stop_token_ids or []), tokens.end_id]})
    max_new_tokens = completion_max_tokens(body)
    response_id = new_id("cmpl-")
    count = len(prompts) * body.n
    reqs: list[GenerateRequest] = []
    for p, (ids, _) in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
        for c in range(body.n):
            params = openai_sampling_params(body, max_new_tokens, choice_index=c)
            reqs.append(make_request(engine, sub_rid(response_id, len(reqs), count), ids, params, body.stream, param))
    await check_grammars(engine, reqs)  # a grammar that does not compile: 400 before anything is queued
    # Echo only after every prompt passed validation: decoding ids outside the vocabulary would fail.
    echoes = await off_loop(_echoes, engine, prompts, body) if body.echo else [""] * count

    if body.stream:
        return EventStreamResponse(_events(request, engine, reqs, body, response_id, echoes))

    results = await unless_disconnected(request, lambda: collect_outputs(engine, reqs))
    finals = [r.final for r in results]
    logprobs = [_logprobs(engine, body, r.final, echoes[i]) for i, r in enumerate(results)]
    response = CompletionResponse(
        id=response_id,
        model=model_name(engine),
        choices=[CompletionChoice(index=i, text=echoes[i] + r.text, logprobs=logprobs[i],
                                  finish_reason=finish_reason_of(r.final))
                 for i, r in enumerate(results)],
        usage=make_usage(*summed_usage(finals, body.n)),  # type: ignore[arg-type]
    )
    return JSONResponse(response.model_dump())


def _logprobs(engine: EngineAPI, body: CompletionRequest, final: GenerateOutput | None, echo: str
              ) -> dict[str, Any] | None:
    """A whole choice's ``logprobs`` (prompt tokens first with echo), offsets into echo + text."""
    if body.logprobs is None or final is None:
        return None
    return CompletionLogprobBuilder(engine.tokenizer).build(without_stop_token(final.logprobs, final), body.echo,
                                                            len(echo) if body.echo else 0)


def _echoes(engine: EngineAPI, prompts: list[tuple[list[int], str | None]], body: CompletionRequest) -> list[str]:
    """Each choice's echoed prompt: the prompt text as sent, or the decoded ids of an id prompt."""
    texts = [text if text is not None else decode_ids(engine.tokenizer, ids) for ids, text in prompts]
    return [t for t in texts for _ in range(body.n)]


async def _events(request: Request, engine: EngineAPI, reqs: list[GenerateRequest], body: CompletionRequest,
                  response_id: str, echoes: list[str]) -> AsyncIterator[bytes]:
    created = int(time.time())
    name = model_name(engine)
    exclude = None if body.include_usage else {"usage"}

    def chunk(index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        c = CompletionResponse(id=response_id, created=created, model=name,
                               choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                         finish_reason=finish_reason)])
        return sse_data(c.model_dump(exclude=exclude))

    with_logprobs = body.logprobs is not None
    builders = [CompletionLogprobBuilder(engine.tokenizer) for _ in reqs] if with_logprobs else []
    echo_pending = [bool(e) and with_logprobs for e in echoes]  # echoed with the prompt logprobs, which come later
    for i, echo in enumerate(echoes):
        if echo and not with_logprobs:
            yield chunk(i, echo)
    finals: list[GenerateOutput | None] = [None] * len(reqs)
    # aclosing: a client that goes away mid-stream aborts the unfinished requests at once
    async with aclosing(stream_choices(request, engine, reqs, finals)) as choices:
        async for i, out in choices:
            if with_logprobs:
                if echo_pending[i] and out.logprobs is not None:  # the echo carries the prompt's logprobs
                    echo_pending[i] = False
                    yield chunk(i, echoes[i], logprobs=builders[i].inputs(out.logprobs))
                    builders[i].offset = len(echoes[i])
                lp = builders[i].outputs(without_stop_token(out.logprobs, out)) if out.logprobs is not None else None
                if out.text or (lp and lp["tokens"]):
                    yield chunk(i, out.text, logprobs=lp)
            elif out.text:
                yield chunk(i, out.text)
            if out.finished:
                yield chunk(i, "", finish_reason_of(out))
    if any(f is None for f in finals):
        return  # the client is gone
    if body.include_usage:
        usage = make_usage(*summed_usage(finals, body.n))  # type: ignore[arg-type]
        yield sse_data(CompletionResponse(id=response_id, created=created, model=name, choices=[], usage=usage))
    yield DONE
