"""One log line per HTTP request: method, path, status, prompt/completion/cached tokens, TTFT, total time, and
the error message of every 4xx/5xx. With --log-requests also the request body and the generated text.

The middleware puts a RequestRecord in a context variable; the generation code (server/pipeline/generation.py) fills it
as outputs arrive, so handlers need no logging code of their own. Health checks and metrics scrapes log at
debug level: an orchestrator polling them every few seconds would drown everything else.
"""
from __future__ import annotations

import json
import logging
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierlm.runtime.io_struct import CachedTokens, GenerateOutput

logger = logging.getLogger("tierlm.requests")
QUIET_PATHS = ("/health", "/health_generate", "/metrics")
LOGGED_TEXT_CHARS = 2000  # --log-requests: how much of a body or an output goes into one line
_ERROR_BODY_BYTES = 4096  # enough for any error message this server writes


@dataclass
class RequestRecord:
    started: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    first_token_at: float | None = None
    output_text: str = ""
    # engine request id -> (prompt, completion) tokens of its latest increment: the counts so far when the
    # client goes away before the request finishes
    so_far: dict[str, tuple[int, int]] = field(default_factory=dict)

    def observe(self, out: GenerateOutput) -> None:
        """Called for every output increment of the request's engine requests."""
        if self.first_token_at is None and (out.token_ids or out.text):
            self.first_token_at = time.perf_counter()
        if len(self.output_text) < LOGGED_TEXT_CHARS:
            self.output_text += out.text
        if out.finished:
            self.so_far.pop(out.rid, None)
        else:
            self.so_far[out.rid] = (out.prompt_tokens, out.completion_tokens)
        if out.finished:
            self.prompt_tokens += out.prompt_tokens
            self.completion_tokens += out.completion_tokens
            self.cached.device += out.cached.device
            self.cached.host += out.cached.host
            self.cached.storage += out.cached.storage


_current: ContextVar[RequestRecord | None] = ContextVar("tierlm_request_record", default=None)


def current_record() -> RequestRecord | None:
    """The record of the HTTP request being served (None outside one, e.g. in engine-only tests)."""
    return _current.get()


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    """Control characters as escapes: what a client sent (a model name, a path) can never start a line of its own
    in the log (log forging) or move the terminal's cursor."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _clip(text: str) -> str:
    return text if len(text) <= LOGGED_TEXT_CHARS else text[:LOGGED_TEXT_CHARS] + f"... ({len(text)} chars)"


class RequestLogMiddleware:
    def __init__(self, app: ASGIApp, log_bodies: bool = False) -> None:
        self.app = app
        self.log_bodies = log_bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord()
        token = _current.set(record)
        status = 0
        error_body = bytearray()
        request_body = bytearray()
        sent_all = disconnected = False

        async def recording_receive() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            if self.log_bodies and message["type"] == "http.request" and len(request_body) < LOGGED_TEXT_CHARS:
                request_body.extend(message.get("body", b""))
            return message

        async def recording_send(message: Message) -> None:
            nonlocal status, sent_all
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                # A stream that ends after the client is gone (its generator saw the disconnect first and
                # returned) still sends its closing message: that is not a complete response.
                sent_all = sent_all or (not message.get("more_body", False) and not disconnected)
                if status >= 400 and len(error_body) < _ERROR_BODY_BYTES:  # a one-piece body is the error too
                    error_body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            _current.reset(token)
            self._log(scope, status, record, bytes(error_body), bytes(request_body), disconnected and not sent_all)

    def _log(self, scope: Scope, status: int, r: RequestRecord, error_body: bytes, request_body: bytes,
             aborted: bool = False) -> None:
        now = time.perf_counter()
        parts = [f"{escape(str(scope.get('method')))} {escape(str(scope.get('path')))} {status or 'disconnected'}"]
        if aborted:  # the client went away before the whole response was sent: its requests were aborted
            parts.append("aborted by the client")
        prompt = r.prompt_tokens + sum(p for p, _ in r.so_far.values())
        completion = r.completion_tokens + sum(c for _, c in r.so_far.values())
        if prompt or completion:
            c = r.cached
            parts.append(f"prompt={prompt} completion={completion}{' so far' if r.so_far else ''} "
                         f"cached={c.total} (device={c.device} host={c.host} storage={c.storage})")
        if r.first_token_at is not None:
            parts.append(f"ttft={(r.first_token_at - r.started) * 1000:.0f}ms")
        parts.append(f"total={(now - r.started) * 1000:.0f}ms")
        if status >= 400:
            parts.append(f"error: {escape(_error_message(error_body))}")
        if self.log_bodies:
            parts.append(f"body={_clip(request_body.decode('utf-8', 'replace'))!r}")
            if r.output_text:
                parts.append(f"output={_clip(r.output_text)!r}")
        # a 503 from /health is the answer while the model loads (the watchdog logs an unhealthy engine itself)
        quiet = scope.get("path") in QUIET_PATHS and (0 < status < 400 or status == 503)
        level = logging.DEBUG if quiet else logging.WARNING if status >= 500 else logging.INFO
        logger.log(level, " ".join(parts))
