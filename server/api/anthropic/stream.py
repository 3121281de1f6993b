"""Anthropic's shapes for the chat pipeline's results: content blocks, stop_reason, usage, and the SSE event
sequence (message_start, ping, content_block_start/_delta/_stop, message_delta, message_stop; error)."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any, TypeVar

from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import GenerateOutput
from tierlm.server.pipeline.generation import EngineFailure
from tierlm.server.pipeline.parsing.base import ParsedDelta, ToolCallDelta
from tierlm.server.pipeline.tools import message_tool_calls

logger = logging.getLogger("tierlm.server")

# before message_start (which waits for the first output): an SSE comment, which every SSE reader skips
KEEPALIVE = b": ping\n\n"
PING_INTERVAL_S = 5.0  # a ping when no event went out for this long (a long prefill), so proxies keep the stream
T = TypeVar("T")


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or "").removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """The call's arguments as the object Anthropic's ``input`` is; text that is no JSON object becomes {} (logged)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        logger.warning("anthropic messages: tool call arguments are not a JSON object, sent as {}: %.200s", arguments)
        return {}
    return value


def content_blocks(parsed: ParsedDelta, omit_thinking: bool) -> list[dict[str, Any]]:
    """A finished choice's blocks, in the order the model wrote them: thinking, text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": "" if omit_thinking else parsed.reasoning, "signature": ""})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    for call in message_tool_calls(parsed.tool_calls) or []:
        blocks.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.function.name,
                       "input": tool_input(call.function.arguments)})
    return blocks


def stop_reason(finish_reason: str | None, final: GenerateOutput | None,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the pipeline's finish reason (OpenAI's names)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    matched = final.matched_stop if final is not None else None
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def usage(out: GenerateOutput, pinned_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens excludes the tokens read from cache (any tier) and those newly pinned at
    cache_control breakpoints (cache creation); ``cache_read_input_tokens_details`` (tierlm's) says which tier each
    read came from. ``pinned_tokens``: the pins' size when ``out`` is not the final output (message_start)."""
    cached = out.cached.total
    pinned = out.pinned_tokens if pinned_tokens is None else pinned_tokens
    created = max(0, min(pinned, out.prompt_tokens) - cached)
    return {"input_tokens": max(0, out.prompt_tokens - cached - created), "output_tokens": out.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": created,
            "cache_read_input_tokens_details": out.cached.to_dict()}


def event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


def error_event(e: BaseException) -> bytes:
    """An error after the stream started, as Anthropic sends it."""
    if isinstance(e, RequestError):
        kind, message = ("invalid_request_error" if e.status < 500 else "api_error"), e.message
    elif isinstance(e, EngineFailure):
        kind, message = "api_error", f"generation failed: {e}"
    else:
        kind, message = "api_error", f"internal server error: {type(e).__name__}: {e}"
    return event("error", {"error": {"type": kind, "message": message}})


class BlockWriter:
    """Parsed pieces -> content_block_* events: one block open at a time; a new kind of piece closes it."""

    def __init__(self, omit_thinking: bool) -> None:
        self.omit_thinking = omit_thinking
        self.index = -1
        self.open: Any = None  # "thinking" | "text" | ("tool", call index) | None
        self.calls: dict[int, ToolCallDelta] = {}

    def _switch(self, key: Any, block: dict[str, Any]) -> list[bytes]:
        frames = self.close()
        self.index += 1
        self.open = key
        return [*frames, event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, d: ParsedDelta) -> list[bytes]:
        frames: list[bytes] = []
        if d.reasoning:
            if self.open != "thinking":
                frames += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                frames.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.open != "text":
                frames += self._switch("text", {"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": d.content}))
        for tc in d.tool_calls:
            first = self.calls.setdefault(tc.index, ToolCallDelta(tc.index, tc.id, tc.name))
            if self.open != ("tool", tc.index):
                frames += self._switch(("tool", tc.index), {"type": "tool_use", "id": tool_use_id(first.id),
                                                            "name": first.name or "", "input": {}})
            if tc.arguments:
                frames.append(self._delta({"type": "input_json_delta", "partial_json": tc.arguments}))
        return frames

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]


async def with_pings(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """``source``'s items, and None whenever ``interval`` seconds pass without one (the caller sends a ping). The
    pending read is cancelled if the consumer stops early (the source's own cleanup then aborts its requests)."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with suppress(BaseException):
                await pending
