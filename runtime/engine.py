"""Engine: the runtime's front door. Owns the tokenizer, the backend and the scheduler thread.

The HTTP layer calls ``generate`` (an async iterator of output increments), ``abort``, ``flush_cache``,
``server_info`` and ``metrics_text``. Requests cross into the scheduler thread through a queue; outputs
come back to the event loop with ``call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Generic, Sequence, TypeVar, Union

from tierlm.runtime.chat_format import ChatFormat
from tierlm.runtime.engine_setup import EngineParts, build_engine_parts
from tierlm.runtime.errors import RequestError
from tierlm.runtime.grammar.manager import GrammarError
from tierlm.runtime.grammar.spec import grammar_spec
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest, PinRequest
from tierlm.runtime.request import Req
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.runtime.server_args import ServerArgs
from tierlm.runtime.tokenizer_protocol import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")


# ---------------------------------------------------------------- messages into the scheduler thread
@dataclass
class AddRequest:
    req: Req


@dataclass
class AbortRequest:
    rid: str


@dataclass
class CallOnScheduler(Generic[T]):
    """Run ``fn`` between two steps and resolve ``future`` (on ``loop``) with its result or exception."""

    fn: Callable[[], T]
    future: asyncio.Future[T]
    loop: asyncio.AbstractEventLoop


@dataclass
class Wake:
    """Nothing to do but look at the stop flag."""


Message = Union[AddRequest, AbortRequest, "CallOnScheduler[Any]", Wake]  # a call's result: whatever its fn returns


class Engine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ready = False
        self.parts: EngineParts | None = None
        self.tokenizer: Tokenizer | None = None  # set by start()
        self.chat_format: ChatFormat | None = None  # set by start()
        self.context_length: int = 0
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[GenerateOutput]]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.started_at = time.time()
        self.unhealthy: str | None = None  # set by the watchdog: why requests now get 503
        self._step_started: float | None = None  # monotonic start of the model step in progress (None: between steps)
        self._watchdog: threading.Thread | None = None
        # outputs of the scheduler thread's current step, per event loop: handed over once a step (one wake-up of
        # each loop, not one per request and token: at 8 streams the per-token wake-ups were ~4 % of the step)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[GenerateOutput], GenerateOutput]]] = {}

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Load tokenizer and model (with progress bars), size the pools, start the scheduler thread."""
        self.parts = build_engine_parts(self.args, emit=self._emit)
        self.tokenizer = self.parts.tokenizer
        self.chat_format = self.parts.chat_format
        self.context_length = self.parts.context_length
        self._thread = threading.Thread(target=self._loop, name="tierlm-scheduler", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="tierlm-watchdog", daemon=True)
        self._watchdog.start()
        self.ready = True

    def _started(self) -> EngineParts:
        """The parts ``start`` built: every request and the scheduler thread come after it."""
        assert self.parts is not None, "Engine.start() has not run"
        return self.parts

    def shutdown(self) -> None:
        """Stop the scheduler and close the caches in a few seconds whatever they are doing (a SIGTERM must stop
        the server even on a hung disk); threads that do not stop in time are daemons and are left behind."""
        self.stop_scheduler(timeout=5.0)
        if self.parts is not None:
            self.parts.close()

    def stop_scheduler(self, timeout: float = 10.0) -> None:
        """Stop the scheduler thread after its current step; the parts (caches, backend) stay open."""
        self._stop.set()
        self._inbox.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                log.warning("the scheduler thread did not stop within %.0f s (a step still running); "
                            "shutting down without it", timeout)

    # ------------------------------------------------------------ requests
    def validate(self, req: GenerateRequest) -> None:
        """Raise RequestError (400) for a prompt the engine cannot serve."""
        n = len(req.input_ids)
        if n == 0:
            raise RequestError("the prompt is empty: send at least one token", param="prompt")
        max_new = req.sampling_params.max_new_tokens
        # Length first: it is O(1), and refuses a megabyte prompt before anything scans its ids.
        if n >= self.context_length:
            raise RequestError(
                f"This model's maximum context length is {self.context_length} tokens, but the prompt has {n} "
                f"tokens. Shorten the prompt.", param="prompt", code="context_length_exceeded")
        self.check_token_ids(req.input_ids, "prompt")
        if req.sampling_params.logit_bias:  # the samplers index the logits with these ids
            self.check_token_ids(list(req.sampling_params.logit_bias), "logit_bias")
        if n + max_new > self.context_length:
            raise RequestError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{n + max_new} tokens ({n} in the prompt, {max_new} for the completion). Reduce the prompt or "
                f"max_tokens (at most {self.context_length - n} here).", param="max_tokens",
                code="context_length_exceeded")
        cache = self._started().cache
        pool_tokens = cache.num_pages * cache.page_size
        if n + max_new > pool_tokens:
            raise RequestError(
                f"the request needs {n + max_new} KV tokens ({n} prompt + {max_new} max_tokens) but the KV pool "
                f"holds {pool_tokens}; lower max_tokens or restart with a larger --max-total-tokens",
                param="max_tokens")
        if req.rid in self._sinks:
            raise RequestError(f"request id {req.rid!r} is already in use", param="rid")
        check_pins(req.pins, n)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yield output increments until one with finished=True. Closing the iterator early aborts the request."""
        if not self.ready:
            raise RequestError("the model is still loading; retry shortly", status=503, type="server_error")
        if self.unhealthy is not None:
            raise RequestError(self.unhealthy, status=503, type="server_error", code="unhealthy")
        self.validate(req)
        self.check_queue()
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        self._sinks[req.rid] = (loop, sink)
        self._inbox.put(AddRequest(Req(rid=req.rid, input_ids=list(req.input_ids),
                                       sampling_params=req.sampling_params, stream=req.stream, pins=list(req.pins))))
        finished = False
        try:
            while not finished:
                out: GenerateOutput = await sink.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(req.rid)
            self._sinks.pop(req.rid, None)

    def check_queue(self) -> None:
        """--max-queued-requests: refuse (503) a request when that many already wait for a running slot. Waiting
        counts every request this engine holds that is not running (also those still in the inbox)."""
        limit = self.args.max_queued_requests
        if limit is None:
            return
        waiting = len(self._sinks) - len(self._started().scheduler.running)
        if waiting >= limit:
            raise RequestError(f"the server already has {waiting} requests waiting (--max-queued-requests {limit}); "
                               "retry later", status=503, type="server_error", code="queue_full")

    def abort(self, rid: str) -> None:
        self._inbox.put(AbortRequest(rid))

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (if any) on the engine's grammar pool, without blocking the event loop;
        RequestError (400, param: the field it came from) with the compiler's message when it does not compile.
        The result lands in the engine's grammar cache, so the scheduler admits the request without waiting."""
        spec = grammar_spec(params)
        if spec is None:
            return
        try:
            await asyncio.wrap_future(self._started().grammar.compile(spec))
        except GrammarError as e:
            raise RequestError(e.for_request(spec), 400, param=spec.param, code=e.code) from None

    async def flush_cache(self, storage: bool = False) -> bool:
        return await self._call(lambda: self._started().scheduler.flush_cache(storage=storage))

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """The vocabulary rule: 400 for an id outside the model's vocabulary."""
        vocab = self._started().model_info.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # C-speed scans; the message needs the first
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)

    async def get_load(self) -> dict[str, int]:
        """Requests and tokens on this engine (SGLang's /get_load of one data-parallel rank), read on the
        scheduler thread."""
        parts = self._started()
        sched, cache = parts.scheduler, parts.cache

        def read() -> dict[str, int]:
            # SGLang's meaning: num_tokens = device KV tokens in use (the pool less its free and its evictable
            # cached pages: what running requests hold, shared prefixes included) + the tokens of every waiting
            # request (seq_len: a preempted request waits with its output too); num_pending_tokens = that waiting
            # part alone
            acc = cache.accounting()
            used = (acc["total_pages"] - acc["free_pages"] - acc["evictable_pages"]) * acc["page_size"]
            waiting = len(sched.waiting)
            pending = sum(r.seq_len for r in sched.waiting)
            return {"num_reqs": len(sched.running) + waiting, "num_waiting_reqs": waiting,
                    "num_tokens": used + pending, "num_pending_tokens": pending}
        return await self._call(read)

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread between steps and await its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._inbox.put(CallOnScheduler(fn, fut, loop))
        return await fut

    # ------------------------------------------------------------ reporting
    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"version": _version(), "ready": self.ready, "server_args": self._args_info(),
                                "uptime_s": round(time.time() - self.started_at, 1)}
        if self.parts is not None:
            info.update(self.parts.describe())
        return info

    def _args_info(self) -> dict[str, Any]:
        """The launch settings, with the parsers as decided (a flag's, or the model's: what SGLang shows)."""
        args = self.args.to_dict()
        if self.chat_format is not None:
            args.update(reasoning_parser=self.chat_format.reasoning_parser,
                        tool_call_parser=self.chat_format.tool_call_parser)
        return args

    def metrics_text(self) -> bytes:
        return self.parts.metrics.text() if self.parts is not None else b""

    # ------------------------------------------------------------ scheduler thread
    def _emit(self, req: Req, out: GenerateOutput) -> None:
        sink = self._sinks.get(req.rid)
        if sink is None:
            return
        loop, q = sink
        if threading.current_thread() is self._thread:
            self._outbox.setdefault(loop, []).append((q, out))  # sent by _send_outputs after the step
        else:
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _send_outputs(self) -> None:
        """Hand what the scheduler thread emitted to each request's event loop, in one call per loop."""
        if not self._outbox:
            return
        batches, self._outbox = self._outbox, {}
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed (its server stopped): nobody waits for these outputs
                pass

    def _loop(self) -> None:
        sched = self._started().scheduler
        while not self._stop.is_set():
            try:  # idle: sleep until a message arrives; busy: only take what is already queued
                msg = self._inbox.get_nowait() if sched.has_work() else self._inbox.get()
            except queue.Empty:
                msg = None
            try:
                while msg is not None:
                    self._handle(msg)
                    try:
                        msg = self._inbox.get_nowait()
                    except queue.Empty:
                        msg = None
            finally:  # what the handled messages emitted, even if one of them raised
                self._send_outputs()
            if self._stop.is_set():
                break
            self._step_started = time.monotonic()
            try:
                if not sched.step() and sched.has_work():
                    time.sleep(0.001)  # waiting only on a storage prefetch
            except Exception as e:  # noqa: BLE001 - a failed step must not kill the server
                log.exception("scheduler step failed; failing the requests in it")
                sched.fail_all(f"internal error in the model step: {e}")
            finally:
                self._step_started = None
                self._send_outputs()

    def _watch(self) -> None:
        """--watchdog-timeout: a step running longer marks the engine unhealthy (an error log; new requests and
        /health_generate get 503). SGLang kills the process instead; here a supervisor restarts it on the 503s."""
        timeout = self.args.watchdog_timeout
        while not self._stop.wait(min(1.0, timeout / 4)):
            started = self._step_started
            if self.unhealthy is None and started is not None and time.monotonic() - started > timeout:
                self.unhealthy = (f"a model step has run for more than {timeout:g} s (--watchdog-timeout); the server "
                                  "is stuck and should be restarted")
                log.error("watchdog: %s", self.unhealthy)

    def _handle(self, msg: Message) -> None:
        sched = self._started().scheduler
        if isinstance(msg, AddRequest):
            sched.add(msg.req)
        elif isinstance(msg, AbortRequest):
            sched.abort(msg.rid)
        elif isinstance(msg, CallOnScheduler):
            try:
                result, exc = msg.fn(), None
            except Exception as e:  # noqa: BLE001 - handed to the awaiting caller
                result, exc = None, e
            msg.loop.call_soon_threadsafe(_resolve, msg.future, result, exc)
        elif not isinstance(msg, Wake):
            raise TypeError(f"unknown scheduler message {msg!r}")


def check_pins(pins: Sequence[PinRequest], prompt_len: int) -> None:
    """A pin covers part of the prompt (0 < tokens <= its length) for a positive, finite time."""
    for pin in pins:
        if not 0 < pin.tokens <= prompt_len:
            raise RequestError(f"a pin covers {pin.tokens} tokens but the prompt has {prompt_len}; pin 1 to "
                               f"{prompt_len} tokens", param="pins")
        if not (math.isfinite(pin.ttl_s) and pin.ttl_s > 0):
            raise RequestError(f"a pin's ttl must be a positive number of seconds, got {pin.ttl_s}", param="pins")


def _deliver(items: list[tuple[asyncio.Queue[GenerateOutput], GenerateOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _resolve(fut: asyncio.Future[T], result: T, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tierlm")
    except Exception:  # noqa: BLE001
        return "unknown"
