"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat pipeline
(server/pipeline/chat.py). The request becomes a chat request (server/api/responses/input.py), its prompt continues an
earlier turn's exact tokens where there is one (server/api/responses/prefix.py), and the parsed output becomes
``output`` items, streamed as Responses events (server/api/responses/stream.py)."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import GenerateOutput
from tierlm.server.api.responses.input import (Conversation, ToolNames, chat_request, chat_tools, conversation,
                                               input_items)
from tierlm.server.api.responses.prefix import Earlier, Prompt, assistant_digest, build_prompt
from tierlm.server.api.responses.protocol import ResponsesRequest
from tierlm.server.api.responses.reasoning_blob import TurnTokens, seal, unseal
from tierlm.server.api.responses.store import ResponseStore, StoredResponse
from tierlm.server.api.responses.stream import Event, OutputBuilder
from tierlm.server.deps import check_model, model_name, new_id, ready_engine
from tierlm.server.http.errors import error_body
from tierlm.server.pipeline.chat import ChatCall, ChatRun, prepare_chat, run_chat, stream_chat, template_kwargs
from tierlm.server.pipeline.generation import EngineFailure
from tierlm.server.pipeline.sse import EventStreamResponse
from tierlm.server.pipeline.tokenization import TemplatePolicy, off_loop
from tierlm.server.pipeline.tools import template_messages, template_tools

logger = logging.getLogger("tierlm.server")
router = APIRouter()
ENCRYPTED = "reasoning.encrypted_content"


def response_store(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


def _not_found(rid: str, param: str | None = None) -> RequestError:
    return RequestError(f"Response with id '{rid}' not found (responses are kept in memory, the least recently used "
                        "dropped first, and none survive a restart)", 404, param=param, code="response_not_found")


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request,
                          engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    refused = body.refused_field()
    if refused:
        raise RequestError(f"{refused} is not supported by tierlm's Responses API", 400, param=refused,
                           code="unsupported_parameter")
    store = response_store(request)
    items, conv, earlier = _conversation(body, store)
    tools, names = chat_tools(body.tools)
    chat = chat_request(body, conv.messages, tools)
    kwargs = {**template_kwargs(chat), **template_tools(chat)}
    prompt = await off_loop(build_prompt, engine.tokenizer, chat.messages, kwargs, TemplatePolicy.of(engine.args),
                            earlier)
    response_id = new_id("resp_")
    # max_output_tokens beyond what the context leaves after the prompt is clamped (logged), as on /v1/messages
    run = await prepare_chat(engine, ChatCall(chat=chat, prompt_ids=prompt.ids, max_tokens_cap=body.max_output_tokens),
                             response_id)
    turn = _Turn(body, engine, response_id, prompt, names, items, store)
    if body.stream:
        return EventStreamResponse(_events(request, engine, run, turn))
    [outcome] = await run_chat(request, engine, run)
    turn.builder.feed(outcome.parsed)
    turn.builder.finish(incomplete=outcome.finish_reason == "length")
    return JSONResponse(turn.complete(outcome.final, outcome.result.token_ids))


def _conversation(body: ResponsesRequest, store: ResponseStore) -> tuple[list[dict[str, Any]], Conversation,
                                                                        Earlier | None]:
    """The conversation's items (the stored ones of previous_response_id, then the input), its chat messages, and
    the latest earlier turn whose exact tokens the prompt can continue (stored, or in an encrypted_content)."""
    history: list[dict[str, Any]] = []
    earlier: Earlier | None = None
    prev = None
    if body.previous_response_id:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = prev.items
    new = input_items(body)
    items = history + new
    params = [f"previous_response_id:{i}" for i in range(len(history))]
    params += ["input"] if isinstance(body.input, str) else [f"input[{j}]" for j in range(len(new))]
    conv = conversation(body.instructions, items, params)
    if prev is not None:
        start = len(conversation(body.instructions, items[:prev.output_start], params).messages)
        earlier = Earlier(prev.turn, start)
    for index, blob, param in conv.blobs:  # every blob is checked (a forged one is a 400); the latest turn wins
        sealed = unseal(blob, param)
        if earlier is None or index >= earlier.first_assistant:
            earlier = Earlier(sealed, index)
    return items, conv, earlier


@router.get("/v1/responses/{response_id:path}", response_model=None)  # any id gets its 404
async def get_response(response_id: str, request: Request) -> Response:
    entry = response_store(request).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.response)


@router.delete("/v1/responses/{response_id:path}", response_model=None)  # any id gets its 404
async def delete_response(response_id: str, request: Request) -> Response:
    if not response_store(request).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


class _Turn:
    """One response being made: its output items, the response object, and what is kept of it."""

    def __init__(self, body: ResponsesRequest, engine: EngineAPI, response_id: str, prompt: Prompt, names: ToolNames,
                 items: list[dict[str, Any]], store: ResponseStore) -> None:
        self.body, self.engine, self.id, self.prompt = body, engine, response_id, prompt
        self.items, self.store = items, store
        self.builder = OutputBuilder(names)
        self.created_at = int(time.time())
        self._turn: TurnTokens | None = None

    def response(self, status: str, usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> \
            dict[str, Any]:
        """The response object; its output only once finished (``usage`` given): the lifecycle events before that
        carry none, as OpenAI's do (the items arrive in their own events)."""
        b = self.body
        fmt = (b.text.format if b.text is not None else None) or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": model_name(self.engine), "output": [dict(i) for i in self.builder.items] if usage else [],
            "instructions": b.instructions, "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature,
            "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id, "store": b.store, "metadata": b.metadata or {},
            "reasoning": b.reasoning.model_dump() if b.reasoning else {"effort": None, "summary": None},
            "text": {"format": fmt}, "truncation": "disabled", "background": False,
            "prompt_cache_key": b.prompt_cache_key, "usage": usage, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        }

    def blob_item(self, final: GenerateOutput, output_ids: list[int]) -> dict[str, Any] | None:
        """The reasoning item that carries this turn's tokens to a client that keeps the conversation itself."""
        if ENCRYPTED not in (self.body.include or []):
            return None
        return {"id": new_id("rs_"), "type": "reasoning", "summary": [], "status": "completed",
                "encrypted_content": seal(self.turn_tokens(final, output_ids))}

    def turn_tokens(self, final: GenerateOutput, output_ids: list[int]) -> TurnTokens:
        """What the turn left in the cache; made once (the blob and the store both keep it)."""
        if self._turn is None:
            self._turn = self._make_turn_tokens(final, output_ids)
        return self._turn

    def _make_turn_tokens(self, final: GenerateOutput, output_ids: list[int]) -> TurnTokens:
        ids = list(output_ids)
        if final.finish_reason == "stop" and ids and ids[-1] == final.matched_stop:
            ids.pop()  # the stop token: the template writes the turn's close itself
        return TurnTokens(ids=self.prompt.ids + ids, prompt_hash=self.prompt.prompt_hash,
                          output_digest=self.output_digest())

    def output_digest(self) -> str:
        """assistant_digest of this turn's output items as the next request's conversation will carry them back
        (one assistant message; "" otherwise, so the next turn renders whole rather than splice a split turn)."""
        items = [i for i in self.builder.items if not i.get("encrypted_content")]
        messages = conversation(None, items, [f"output[{j}]" for j in range(len(items))]).messages
        if len(messages) != 1 or messages[0].role != "assistant":
            return ""
        return assistant_digest(template_messages(messages)[0])

    def complete(self, final: GenerateOutput, output_ids: list[int], blob: dict[str, Any] | None = None) -> \
            dict[str, Any]:
        """The finished response (kept in the store when asked); ``blob``: the blob item a stream already sent."""
        blob = blob or self.blob_item(final, output_ids)
        if blob is not None:
            self.builder.items.append(blob)  # last: after every item it holds the tokens of
        reasoning = self.builder.reasoning_text
        reasoning_tokens = len(self.engine.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        usage = {"input_tokens": final.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": final.cached.total,
                                          "cached_tokens_details": final.cached.to_dict()},  # tierlm: per tier
                 "output_tokens": final.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, final.completion_tokens)},
                 "total_tokens": final.prompt_tokens + final.completion_tokens}
        status = "incomplete" if final.finish_reason == "length" else "completed"
        response = self.response(status, usage)
        if self.body.store:
            self.store.put(StoredResponse(response=response, items=[*self.items, *response["output"]],
                                          instructions=self.body.instructions,
                                          turn=self.turn_tokens(final, output_ids), output_start=len(self.items)))
        return response


def _frame(event: Event) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


async def _events(request: Request, engine: EngineAPI, run: ChatRun, turn: _Turn) -> AsyncIterator[bytes]:
    """response.created, response.in_progress, the items' events, then response.completed (or .incomplete); an
    error after the stream started is response.failed."""
    seq = 0

    def frame(event: Event) -> bytes:
        nonlocal seq
        event["sequence_number"] = seq
        seq += 1
        return _frame(event)

    yield frame({"type": "response.created", "response": turn.response("in_progress")})
    yield frame({"type": "response.in_progress", "response": turn.response("in_progress")})
    finals: list[GenerateOutput | None] = [None]
    output_ids: list[int] = []
    try:
        async with aclosing(stream_chat(request, engine, run, finals)) as stream:
            async for piece in stream:
                output_ids.extend(piece.out.token_ids)
                for event in turn.builder.feed(piece.delta):
                    yield frame(event)
                if piece.finish_reason is not None:
                    for event in turn.builder.finish(incomplete=piece.finish_reason == "length"):
                        yield frame(event)
        final = finals[0]
        if final is None:
            return  # the client is gone
        blob = turn.blob_item(final, output_ids)
        if blob is not None:  # Codex reads items from output_item.done: the blob is announced like any item
            index = len(turn.builder.items)
            yield frame({"type": "response.output_item.added", "output_index": index, "item": blob})
            yield frame({"type": "response.output_item.done", "output_index": index, "item": blob})
        response = turn.complete(final, output_ids, blob)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield frame({"type": kind, "response": response})
    except (RequestError, EngineFailure) as e:
        logger.error("/v1/responses stream failed: %s", e)
        message = e.message if isinstance(e, RequestError) else f"generation failed: {e}"
        error = {"code": "server_error" if not isinstance(e, RequestError) else (e.code or "invalid_request"),
                 "message": message}
        yield frame({"type": "response.failed", "response": turn.response("failed", error=error)})
    except Exception as e:  # noqa: BLE001 - reported in-band: the stream has started
        logger.exception("/v1/responses stream failed")
        body = error_body(f"internal server error: {type(e).__name__}: {e}", 500)["error"]
        yield frame({"type": "response.failed",
                     "response": turn.response("failed", error={"code": "server_error", "message": body["message"]})})
