"""POST /v1/chat/completions: the chat pipeline (server/pipeline/chat.py) in OpenAI's chat completion shapes, n
choices, optional SSE streaming."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.server.api.openai.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                               ChatMessageOut, make_usage)
from tierlm.server.api.openai.stream import chat_events, chat_logprobs
from tierlm.server.deps import check_model, model_name, new_id, ready_engine
from tierlm.server.pipeline.chat import ChatCall, prepare_chat, run_chat
from tierlm.server.pipeline.generation import summed_usage
from tierlm.server.pipeline.logprob_format import Pieces
from tierlm.server.pipeline.sse import EventStreamResponse
from tierlm.server.pipeline.tools import message_tool_calls

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    response_id = new_id("chatcmpl-")
    run = await prepare_chat(engine, ChatCall(chat=body), response_id)
    if body.stream:
        return EventStreamResponse(chat_events(request, engine, run, response_id))

    outcomes = await run_chat(request, engine, run)
    pieces = Pieces(engine.tokenizer)
    response = ChatCompletionResponse(
        id=response_id,
        model=model_name(engine),
        choices=[ChatChoice(index=i, message=ChatMessageOut(content=o.parsed.content or (None if o.parsed.tool_calls
                                                                                         else ""),
                                                            reasoning_content=o.parsed.reasoning or None,
                                                            tool_calls=message_tool_calls(o.parsed.tool_calls)),
                            finish_reason=o.finish_reason, logprobs=chat_logprobs(body, pieces, o.final))
                 for i, o in enumerate(outcomes)],
        usage=make_usage(*summed_usage([o.final for o in outcomes], body.n)),  # type: ignore[misc]
    )
    return JSONResponse(response.model_dump())
