"""Errors on the Anthropic routes (/v1/messages, /v1/messages/count_tokens) in Anthropic's shape:
{"type": "error", "error": {"type": ..., "message": ...}}, same status.

Every other error path (handlers in server/http/errors.py, the API key, body limit and origin guard middleware, the
last-resort 500) writes OpenAI's shape; this middleware sits outside them and rewrites an error body on these
paths, so there is one place that knows both shapes and nothing else has to ask which route it serves.
"""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/v1/messages"

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def anthropic_error_body(message: str, status: int) -> dict:
    kind = _TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _rewrite(body: bytes, status: int) -> bytes:
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        message = None
    if not isinstance(message, str):
        return body  # not OpenAI's error shape: leave it as it is
    return json.dumps(anthropic_error_body(message, status), ensure_ascii=False).encode()


class AnthropicErrorMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_anthropic_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if message["status"] >= 400 and headers.get(b"content-type", b"").startswith(b"application/json"):
                    start = message  # held until the whole error body is here
                    return
            elif start is not None and message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = _rewrite(b"".join(chunks), start["status"])
                headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, rewriting_send)
