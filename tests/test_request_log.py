"""The request log's "aborted by the client" mark, driven through RequestLogMiddleware with hand-written ASGI
messages: whichever side notices the disconnect first (Starlette's own listener cancelling the stream, or the
stream's generator returning and the response sending its closing message), the line says aborted."""
from __future__ import annotations

import asyncio
import logging

import pytest

from tierlm.server.http.request_log import RequestLogMiddleware


def run(app, messages: list[dict]) -> list[dict]:
    """Serve one request to ``app`` behind the middleware; the client's messages come from ``messages``."""
    sent: list[dict] = []
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(RequestLogMiddleware(app)(scope, receive, send))
    return sent


def streaming_app(notice_disconnect: bool):
    async def app(scope, receive, send) -> None:
        await receive()  # the request body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        if notice_disconnect:
            assert (await receive())["type"] == "http.disconnect"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


@pytest.mark.parametrize("notice_disconnect, aborted", [(True, True), (False, False)])
def test_a_stream_closed_after_the_client_left_is_logged_as_aborted(caplog: pytest.LogCaptureFixture,
                                                                      notice_disconnect: bool, aborted: bool) -> None:
    caplog.set_level(logging.INFO, logger="tierlm.requests")
    sent = run(streaming_app(notice_disconnect), [{"type": "http.request", "body": b"{}", "more_body": False}])
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/completions")]
    assert ("aborted by the client" in line) == aborted, line


def test_a_stream_cancelled_mid_way_is_logged_as_aborted(caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope, receive, send) -> None:  # Starlette's listener saw the disconnect: no closing message
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await receive()

    caplog.set_level(logging.INFO, logger="tierlm.requests")
    run(app, [{"type": "http.request", "body": b"{}", "more_body": False}])
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/completions")]
    assert "POST /v1/completions 200 aborted by the client" in line


@pytest.mark.parametrize("status, level", [(200, logging.DEBUG), (503, logging.DEBUG), (500, logging.WARNING)])
def test_health_polls_are_quiet_while_the_model_loads(caplog: pytest.LogCaptureFixture, status: int,
                                                      level: int) -> None:
    """An orchestrator (or Claude Code's launcher) polls /health through the whole load: 503s are not warnings."""
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    caplog.set_level(logging.DEBUG, logger="tierlm.requests")
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(RequestLogMiddleware(app)({"type": "http", "method": "GET", "path": "/health", "headers": []},
                                          receive, send))
    [record] = [r for r in caplog.records if r.getMessage().startswith("GET /health")]
    assert record.levelno == level
