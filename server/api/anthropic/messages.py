"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the chat pipeline
(server/pipeline/chat.py). The request is converted into one ChatCall (server/api/anthropic/convert.py): the chat
request, and its cache_control breakpoints (server/api/anthropic/pins.py, found once) as the pin points its engine
requests are built with. The result is written in Anthropic's shapes (server/api/anthropic/stream.py); errors on
these paths leave in Anthropic's shape (server/api/anthropic/errors.py).

Not in the OpenAPI document: its error schema is OpenAI's, and Anthropic's clients bring their own types."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import GenerateOutput
from tierlm.server.api.anthropic import stream as anthropic_stream
from tierlm.server.api.anthropic.billing_header import without_billing_header
from tierlm.server.api.anthropic.convert import refused_late_system, to_chat_call, to_chat_request
from tierlm.server.api.anthropic.pins import breakpoints
from tierlm.server.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from tierlm.server.api.anthropic.stream import (KEEPALIVE, BlockWriter, content_blocks, error_event, event,
                                                stop_reason, usage, with_pings)
from tierlm.server.deps import check_model, model_name, new_id, ready_engine
from tierlm.server.pipeline.chat import ChatRun, chat_prompt_ids, prepare_chat, run_chat, stream_chat
from tierlm.server.pipeline.sse import EventStreamResponse
from tierlm.server.pipeline.tokenization import off_loop
from tierlm.server.pipeline.tools import tool_plan

router = APIRouter()
logger = logging.getLogger("tierlm.server")
T = TypeVar("T")


async def _with_folding(body: CountTokensRequest, prepare: Callable[[bool], Awaitable[T]]) -> tuple[T, bool]:
    """``prepare``d with system messages where the client put them; if the template refuses that (many allow a
    system message only first) and the conversation has a late one, again with it folded into a user turn."""
    try:
        return await prepare(False), False
    except RequestError as e:
        if not refused_late_system(e, body):
            raise
        logger.info("the chat template refused a system message after the first (%s); its text joins a user turn "
                    "instead", e.message)
    return await prepare(True), True


def _omit_thinking(body: MessagesRequest) -> bool:
    return body.thinking is not None and body.thinking.display == "omitted"


@router.post("/v1/messages", response_model=None, include_in_schema=False)
async def create_message(body: MessagesRequest, request: Request,
                         engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    body = without_billing_header(body, engine.args.keep_anthropic_billing_header)
    points = breakpoints(body)  # once; more than Anthropic's four cache_control blocks: 400 before any work
    message_id = new_id("msg_")
    run, _ = await _with_folding(body, lambda fold: prepare_chat(engine, to_chat_call(body, points, fold),
                                                                  message_id))
    if body.stream:
        return EventStreamResponse(_events(request, engine, run, body, message_id))
    [outcome] = await run_chat(request, engine, run)
    reason, sequence = stop_reason(outcome.finish_reason, outcome.final, body.stop_sequences)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": model_name(engine),
                         "content": content_blocks(outcome.parsed, _omit_thinking(body)), "stop_reason": reason,
                         "stop_sequence": sequence, "usage": usage(outcome.final)})


async def _events(request: Request, engine: EngineAPI, run: ChatRun, body: MessagesRequest,
                  message_id: str) -> AsyncIterator[bytes]:
    """Anthropic's sequence; an error after the stream started is an ``error`` event (never OpenAI's frames).
    message_start waits for the first output, as Anthropic's does, so its usage already says how much of the prompt
    came from cache (the final message_delta repeats the same counts); until then an SSE comment keeps the
    connection alive through a long prefill."""
    pinned = max((p.tokens for p in run.reqs[0].pins), default=0)

    def start(out: GenerateOutput) -> bytes:
        return event("message_start", {"message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model_name(engine), "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(out, pinned)}})

    try:
        writer = BlockWriter(_omit_thinking(body))
        finals: list[GenerateOutput | None] = [None]
        finish: str | None = None
        started = False
        # with_pings closed first: its pending read of ``pieces`` is cancelled before ``pieces`` itself is closed
        async with aclosing(stream_chat(request, engine, run, finals)) as pieces, \
                aclosing(with_pings(pieces, anthropic_stream.PING_INTERVAL_S)) as ticks:
            async for piece in ticks:
                if piece is None:
                    yield event("ping", {}) if started else KEEPALIVE
                    continue
                if not started:
                    started = True
                    yield start(piece.out)
                    yield event("ping", {})
                for frame in writer.feed(piece.delta):
                    yield frame
                finish = piece.finish_reason or finish
        final = finals[0]
        if final is None:
            return  # the client is gone
        if not started:
            yield start(final)
        for frame in writer.close():
            yield frame
        reason, sequence = stop_reason(finish, final, body.stop_sequences)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": usage(final)})
        yield event("message_stop", {})
    except Exception as e:  # noqa: BLE001 - reported in-band; the server keeps serving
        logger.error("anthropic stream failed: %s", e)
        yield error_event(e)


@router.post("/v1/messages/count_tokens", response_model=None, include_in_schema=False)
async def count_tokens(body: CountTokensRequest, engine: EngineAPI = Depends(ready_engine)) -> Response:
    """The prompt's tokens as /v1/messages would render it (tools, system, thinking setting included)."""
    check_model(engine, body.model)
    body = without_billing_header(body, engine.args.keep_anthropic_billing_header)

    async def render(fold: bool) -> list[int]:
        chat = to_chat_request(body, fold_system=fold)
        tool_plan(engine, chat)  # the same 400s as /v1/messages for a bad tool_choice
        return await off_loop(chat_prompt_ids, engine, chat)  # the prompt /v1/messages runs, prefill included

    ids, _ = await _with_folding(body, render)
    return JSONResponse({"input_tokens": len(ids)})
