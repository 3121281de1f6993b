"""The OpenAI chat completion stream: per choice a role chunk, content (reasoning, tool call) deltas and a finish
chunk, then the usage chunk if asked and [DONE]; and each choice's ``logprobs``."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.io_struct import GenerateOutput
from tierlm.server.api.openai.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatDelta,
                                               make_usage)
from tierlm.server.deps import model_name
from tierlm.server.pipeline.chat import ChatRun, stream_chat
from tierlm.server.pipeline.generation import summed_usage
from tierlm.server.pipeline.logprob_format import Pieces, chat_logprob_content
from tierlm.server.pipeline.sse import DONE, sse_data
from tierlm.server.pipeline.tools import delta_tool_calls


def chat_logprobs(body: ChatCompletionRequest, pieces: Pieces, out: GenerateOutput | None) -> dict | None:
    """``choices[].logprobs`` (OpenAI: {"content": [...]}) of the output tokens in ``out``; None unless asked."""
    if not body.logprobs or out is None:
        return None
    return {"content": chat_logprob_content(pieces, out.logprobs)}


async def chat_events(request: Request, engine: EngineAPI, run: ChatRun, response_id: str) -> AsyncIterator[bytes]:
    """OpenAI's order: per choice a role chunk, content deltas, a finish chunk; then usage (if asked), [DONE]."""
    body = run.body
    created = int(time.time())
    name = model_name(engine)
    exclude = None if body.include_usage else {"usage"}

    def chunk(index: int, delta: ChatDelta, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        c = ChatCompletionChunk(id=response_id, created=created, model=name,
                                choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                                         logprobs=logprobs)])
        return sse_data(c.model_dump(exclude=exclude))

    pieces = Pieces(engine.tokenizer)
    for i in range(len(run.reqs)):
        yield chunk(i, ChatDelta(role="assistant", content=""))
    finals: list[GenerateOutput | None] = [None] * len(run.reqs)
    # aclosing: a client that goes away mid-stream aborts the unfinished requests at once
    async with aclosing(stream_chat(request, engine, run, finals)) as stream:
        async for piece in stream:
            lp = chat_logprobs(body, pieces, piece.out)
            d = piece.delta
            if d or (lp and lp["content"]):
                content = d.content if d.content or not (d.reasoning or d.tool_calls) else None
                yield chunk(piece.index, ChatDelta(content=content, reasoning_content=d.reasoning or None,
                                                   tool_calls=delta_tool_calls(d.tool_calls)), logprobs=lp)
            if piece.finish_reason is not None:
                yield chunk(piece.index, ChatDelta(), piece.finish_reason)
    if any(f is None for f in finals):
        return  # the client is gone
    if body.include_usage:
        usage = make_usage(*summed_usage(finals, body.n))  # type: ignore[arg-type]
        yield sse_data(ChatCompletionChunk(id=response_id, created=created, model=name, choices=[], usage=usage))
    yield DONE
