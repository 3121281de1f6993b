"""A client that goes away must not leave work running: the HTTP layer aborts its engine requests.

Driven at the ASGI level so the disconnect happens exactly when the test says, in both ways servers report
it: an http.disconnect message (ASGI spec 2.3, what uvicorn sends) or a send() that fails (spec 2.4).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from fake_engine import FakeEngine
from tierlm.server.app import create_app


class AsgiCall:
    """One POST through the app, with a client that disconnects on cue."""

    def __init__(self, path: str, body: dict[str, Any], spec_version: str = "2.3") -> None:
        self.scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"localhost")],
            "client": ("127.0.0.1", 5000), "server": ("test", 80),
        }
        self.body = json.dumps(body).encode()
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.fail_sends_when_gone = spec_version >= "2.4"
        self._body_delivered = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_delivered:
            self._body_delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if self.fail_sends_when_gone:
            await asyncio.Event().wait()  # spec 2.4 servers never report it here
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.gone.is_set() and self.fail_sends_when_gone:
            raise OSError("connection reset by peer")
        self.sent.append(message)

    def body_chunks(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body" and m.get("body")]


async def _wait_until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 50, "stream": True}),
    ("/generate", {"text": "abc", "sampling_params": {"max_new_tokens": 50}, "stream": True}),
])
def test_stream_disconnect_aborts_request(spec_version: str, path: str, body: dict[str, Any]) -> None:
    engine = FakeEngine()
    if spec_version >= "2.4":
        engine.token_delay_s = 0.02  # 2.4 servers report the disconnect as a failing send: keep tokens coming
    else:
        engine.hang_after_tokens = 2  # the engine is mid-generation when the client leaves
    call = AsgiCall(path, body, spec_version)

    async def scenario() -> None:
        app_task = asyncio.ensure_future(create_app(engine)(call.scope, call.receive, call.send))
        await _wait_until(lambda: len(call.body_chunks()) >= 2)  # the stream is flowing
        call.gone.set()
        await asyncio.wait_for(app_task, 5)
        # aborted by the time the response ends, not later when garbage collection closes the stream
        assert len(engine.aborted) == 1

    asyncio.run(scenario())
    assert [r.rid for r in engine.received] == engine.aborted


def test_stream_disconnect_aborts_every_choice() -> None:
    engine = FakeEngine()
    engine.hang_after_tokens = 1
    call = AsgiCall("/v1/completions", {"prompt": "abc", "max_tokens": 50, "n": 3, "stream": True})

    async def scenario() -> None:
        app_task = asyncio.ensure_future(create_app(engine)(call.scope, call.receive, call.send))
        await _wait_until(lambda: len(call.body_chunks()) >= 3)
        call.gone.set()
        await asyncio.wait_for(app_task, 5)

    asyncio.run(scenario())
    assert sorted(engine.aborted) == sorted(r.rid for r in engine.received)
    assert len(engine.aborted) == 3


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 50, "n": 2}),
    ("/generate", {"text": "abc", "sampling_params": {"max_new_tokens": 50}}),
])
def test_non_stream_disconnect_aborts_request(path: str, body: dict[str, Any]) -> None:
    engine = FakeEngine()
    engine.hang_after_tokens = 1
    call = AsgiCall(path, body)

    async def scenario() -> None:
        app_task = asyncio.ensure_future(create_app(engine)(call.scope, call.receive, call.send))
        await _wait_until(lambda: len(engine.received) == body.get("n", 1))
        await asyncio.sleep(0.05)
        assert not app_task.done()  # still waiting on the engine
        call.gone.set()
        await asyncio.wait_for(app_task, 5)

    asyncio.run(scenario())
    assert sorted(engine.aborted) == sorted(r.rid for r in engine.received)


def test_finished_requests_are_not_aborted() -> None:
    engine = FakeEngine()
    call = AsgiCall("/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True})
    asyncio.run(create_app(engine)(call.scope, call.receive, call.send))
    assert call.body_chunks()[-1] == b"data: [DONE]\n\n"
    assert engine.aborted == []


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_stream_does_not_poll_the_client_per_token(spec_version: str) -> None:
    """One watcher per stream notices a disconnect: asking after every increment (Starlette's is_disconnected)
    cost the event loop more than the rest of the stream, time the model thread waited for the GIL."""
    engine = FakeEngine()
    call = AsgiCall("/v1/completions", {"prompt": "abc", "max_tokens": 60, "stream": True}, spec_version)
    receives = 0
    receive = call.receive

    async def counting_receive() -> dict[str, Any]:
        nonlocal receives
        receives += 1
        return await receive()

    asyncio.run(create_app(engine)(call.scope, counting_receive, call.send))
    assert len(call.body_chunks()) > 60 and call.body_chunks()[-1] == b"data: [DONE]\n\n"
    assert receives <= 4, receives  # the body, Starlette's listener (2.3) and this stream's one watcher
    assert engine.aborted == []
