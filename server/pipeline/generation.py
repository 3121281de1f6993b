"""Run one HTTP request's engine requests (n choices x prompts): collect them, or stream them merged.

Whatever ends the HTTP request early (client disconnect, cancellation, an error in a sibling choice), every
engine request that has not finished is aborted, so no work keeps running for a client that is gone.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import CachedTokens, GenerateOutput, GenerateRequest
from tierlm.server.http.request_log import RequestRecord, current_record

logger = logging.getLogger("tierlm.server")
T = TypeVar("T")


class EngineFailure(Exception):
    """A request failed inside the engine (GenerateOutput.error, or an unexpected abort)."""


def finish_reason_of(out: GenerateOutput | None) -> str:
    """OpenAI's finish_reason for a choice's last output ("stop" when it has none)."""
    return (out.finish_reason if out is not None else None) or "stop"


def failure_of(out: GenerateOutput) -> str | None:
    """The error text when a finished output did not complete normally, else None."""
    if out.error:
        return out.error
    if out.finished and out.finish_reason == "abort":
        return "the request was aborted by the server before it finished"
    return None


@dataclass
class ChoiceResult:
    """The accumulated output of one engine request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: GenerateOutput | None = None

    def add(self, out: GenerateOutput) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        if out.finished:
            self.final = out


class RequestGroup:
    """Tracks which engine requests are still running so they can be aborted."""

    def __init__(self, engine: EngineAPI, reqs: list[GenerateRequest]) -> None:
        self.engine = engine
        self.reqs = reqs
        self.unfinished = {r.rid for r in reqs}

    def mark(self, out: GenerateOutput) -> None:
        if out.finished:
            self.unfinished.discard(out.rid)

    def abort_unfinished(self) -> None:
        for rid in list(self.unfinished):
            self.unfinished.discard(rid)
            try:
                self.engine.abort(rid)
                logger.info("aborted request %s (client gone or sibling request failed)", rid)
            except Exception:  # noqa: BLE001 - aborting is best effort; log and keep cleaning up
                logger.exception("engine.abort(%s) failed", rid)


async def stream_outputs(engine: EngineAPI, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Yield (request index, output increment) from all requests as they arrive.

    Stops after every request finished; aborts the unfinished ones when closed or cancelled early.
    """
    group = RequestGroup(engine, reqs)
    record = current_record() or RequestRecord()  # what the request's log line reports
    try:
        if len(reqs) == 1:  # the common case needs no tasks
            outputs = engine.generate(reqs[0])
            try:
                async for out in outputs:
                    group.mark(out)
                    record.observe(out)
                    yield 0, out
                    if out.finished:
                        break
            finally:
                await _aclose(outputs)
            return
        async for item in _merged(engine, reqs, group):
            record.observe(item[1])
            yield item
    finally:
        group.abort_unfinished()


async def _merged(engine: EngineAPI, reqs: list[GenerateRequest], group: RequestGroup) -> AsyncIterator[tuple[int, GenerateOutput]]:
    queue: asyncio.Queue[tuple[int, GenerateOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest) -> None:
        outputs = engine.generate(req)
        try:
            async for out in outputs:
                await queue.put((i, out))
                if out.finished:
                    break
            await queue.put((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer, which re-raises it
            await queue.put((i, e))
        finally:
            await _aclose(outputs)

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    remaining = len(reqs)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            group.mark(item)
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _aclose(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def collect_outputs(engine: EngineAPI, reqs: list[GenerateRequest]) -> list[ChoiceResult]:
    """Run all requests to completion. Raises EngineFailure if any of them failed (the rest are aborted)."""
    results = [ChoiceResult() for _ in reqs]
    stream = stream_outputs(engine, reqs)
    try:
        async for i, out in stream:
            failure = failure_of(out)
            if failure:
                raise EngineFailure(failure)
            results[i].add(out)
    finally:
        await stream.aclose()
    for r, req in zip(results, reqs):
        if r.final is None:
            raise EngineFailure(f"the engine ended request {req.rid} without a final output")
    return results


async def stream_choices(request: Request, engine: EngineAPI, reqs: list[GenerateRequest],
                         finals: list[GenerateOutput | None]) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """What an SSE endpoint streams: (choice index, increment) as they arrive, each choice's last increment
    stored in ``finals``. A failed choice raises EngineFailure; when the client disconnects the stream ends
    early with ``finals`` incomplete, and the unfinished requests are aborted.

    One watcher task per stream notices the disconnect: asking ``request.is_disconnected()`` after every
    increment cost more event-loop time than the rest of the stream together (an anyio cancel scope each time,
    ~60 % of the loop's busy time at 8 streams), time the model thread then waited for the GIL."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        async with aclosing(stream_outputs(engine, reqs)) as outputs:
            async for i, out in outputs:
                failure = failure_of(out)
                if failure:
                    raise EngineFailure(failure)
                if out.finished:
                    finals[i] = out
                yield i, out
                if watcher.done():
                    return  # closing `outputs` aborts the unfinished requests
    finally:
        watcher.cancel()
        if watcher.done() and not watcher.cancelled():
            watcher.exception()  # defensive: a receive() that raised is retrieved, so asyncio does not log it
    if any(f is None for f in finals):
        raise EngineFailure("the engine ended a request without a final output")


def summed_usage(finals: list[GenerateOutput], n: int) -> tuple[int, int, CachedTokens]:
    """(prompt_tokens, completion_tokens, cached) for all choices; each prompt counts once per n choices."""
    prompt = sum(f.prompt_tokens for f in finals[::n])
    completion = sum(f.completion_tokens for f in finals)
    cached = CachedTokens()
    for f in finals[::n]:
        cached.device += f.cached.device
        cached.host += f.cached.host
        cached.storage += f.cached.storage
    return prompt, completion, cached


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work``; if the client disconnects first, cancel it (which aborts its engine requests).

    After the body is read, ASGI servers answer receive() only when the client goes away, so waiting on it
    detects a disconnect without polling.
    """
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        logger.info("client disconnected from %s before the response was ready; cancelling", request.url.path)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise RequestError("client disconnected", 499, code="client_closed_request")
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
