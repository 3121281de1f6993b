"""Server-sent events: `data: <json>\\n\\n` frames, the `[DONE]` terminator, and a response that always
closes its event source (so engine requests are aborted as soon as the client goes away)."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tierlm.runtime.errors import RequestError
from tierlm.server.http.errors import error_body, request_error_body
from tierlm.server.pipeline.generation import EngineFailure

logger = logging.getLogger("tierlm.server")

DONE = b"data: [DONE]\n\n"


def sse_data(payload: Any) -> bytes:
    """One SSE frame. Pydantic models are dumped as-is; dicts are JSON-encoded."""
    if hasattr(payload, "model_dump_json"):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


def sse_error(e: BaseException) -> bytes:
    """The error event OpenAI-compatible servers send when a stream fails after it started."""
    if isinstance(e, RequestError):
        return sse_data(request_error_body(e))
    if isinstance(e, EngineFailure):
        return sse_data(error_body(f"generation failed: {e}", 500))
    return sse_data(error_body(f"internal server error: {type(e).__name__}: {e}", 500))


async def with_error_events(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass frames through; turn an exception into an error event followed by [DONE]."""
    try:
        async for frame in events:
            yield frame
    except Exception as e:  # noqa: BLE001 - reported to the client in-band; the server keeps serving
        if not isinstance(e, (RequestError, EngineFailure)):
            logger.exception("stream failed")
        else:
            logger.error("stream failed: %s", e)
        yield sse_error(e)
        yield DONE
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class EventStreamResponse(StreamingResponse):
    """text/event-stream that closes its iterator however the response ends (done, disconnect, error)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], status_code: int = 200) -> None:
        super().__init__(with_error_events(content), status_code=status_code,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # If the send failed while the iterator was parked at a yield, Starlette leaves it open;
            # closing it here runs its cleanup (engine.abort) now rather than at garbage collection.
            await self.body_iterator.aclose()  # type: ignore[union-attr]
