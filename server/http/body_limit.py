"""--max-request-bytes: a body over the limit is answered with 413 before it is parsed.

A declared Content-Length over the limit is refused without reading a byte; a chunked body is counted as it
arrives and refused as soon as it passes the limit, so no request can make the server buffer (or tokenize)
more than the operator allowed.
"""
from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierlm.server.http.errors import send_error


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes; send a shorter prompt, or "
            f"restart the server with a larger --max-request-bytes")


class BodyTooLarge(HTTPException):
    """Raised from receive() mid-body; FastAPI re-raises HTTPExceptions from body reading untouched."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await send_error(send, too_large_message(self.max_bytes), 413, code="request_too_large")
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
