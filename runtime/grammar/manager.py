"""Grammar compilation off the scheduler thread, its cache, and each constrained request's matcher.

``GrammarManager.compile`` checks the grammar against the per-request limits (runtime/grammar/limits.py), hands it
to a small thread pool and returns a future; futures are cached by (kind, text), so a grammar compiles once however
many requests use it (a failure is cached too: the same text fails the same way). The cache is bounded by the
compiled grammars' bytes (LRU). The backend compiles under the time limit (xgrammar's in worker processes it kills
at the limit: nothing keeps running), and a compile past it fails its requests with grammar_compile_timeout; the
limit counts from when the compiler takes the grammar, not while it waits for a free one. The HTTP handlers await that
future before queuing a request (a bad grammar is a 400 before any response starts); the scheduler only asks
whether a waiting request's grammar is ready, so a request whose grammar still compiles waits in the queue without
holding up the requests behind it.

Per step, ``fill_bitmask`` writes the allowed next tokens of the constrained rows into one packed bitmask
(SamplingBatch.token_bitmask; unconstrained rows stay all ones) and ``accept`` advances a request's matcher by its
sampled token.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from tierlm.backends.base import GrammarBackend, GrammarCompileError, GrammarCompilerUnavailable, GrammarCompileTimeout
from tierlm.runtime.grammar.limits import GrammarLimitError, check_grammar_limits
from tierlm.runtime.grammar.spec import GrammarSpec, RequestGrammar, grammar_spec

if TYPE_CHECKING:
    from tierlm.runtime.metrics import EngineMetrics
    from tierlm.runtime.request import Req

log = logging.getLogger(__name__)

GRAMMAR_DISABLED = ("structured output is turned off on this server (--grammar-backend none); restart it with "
                    "--grammar-backend xgrammar, or remove '{param}' from the request")


class GrammarError(Exception):
    """A grammar cannot be used: it does not compile, is over a limit, took too long, or structured output is off.
    Cached with the grammar, so it never names a request's field; ``for_request`` does. ``code``: the error code
    of the 400 (invalid_grammar, grammar_too_large, grammar_compile_timeout)."""

    def __init__(self, detail: str, disabled: bool = False, code: str = "invalid_grammar") -> None:
        super().__init__(detail)
        self.detail = detail
        self.disabled = disabled
        self.code = code
        self.transient = False  # the server's failure, not the grammar's: _finish does not keep it cached

    def for_request(self, spec: GrammarSpec) -> str:
        """The message for the request whose field ``spec.param`` carried the grammar."""
        if self.disabled:
            return GRAMMAR_DISABLED.format(param=spec.param)
        if self.code != "invalid_grammar":
            return f"the {spec.kind} in '{spec.param}' cannot be used: {self.detail}"
        return f"invalid {spec.kind} in '{spec.param}': {self.detail}"


class GrammarManager:
    """``cache_bytes``: the compiled grammars kept (by their size in memory; least recently used go first);
    ``compile_timeout_s``: a compile running longer is stopped and fails its requests with a 400."""

    def __init__(self, backend: GrammarBackend | None, workers: int = 2, cache_bytes: int = 256 * 2**20,
                 compile_timeout_s: float = 10.0, max_entries: int = 4096) -> None:
        self.backend = backend
        self.cache_bytes = cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self.max_entries = max_entries  # failures cost next to nothing; this bounds their count
        # futures of the backend's compiled grammars (opaque to the runtime: only the backend reads them)
        self._cache: OrderedDict[tuple[str, str], Future[object]] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierlm-grammar") if backend else None
        self.compiled = 0  # grammars compiled (cache misses)
        self.timed_out = 0  # compiles stopped at the time limit

    # ------------------------------------------------------------ compilation (any thread)
    def compile(self, spec: GrammarSpec) -> Future[object]:
        """The future of ``spec``'s compiled grammar (from the cache, or submitted to the pool now). It fails
        with GrammarError."""
        fut: Future[object] = Future()
        if self.backend is None:
            fut.set_exception(GrammarError("structured output is off", disabled=True))
            return fut
        try:
            check_grammar_limits(spec.kind, spec.text)  # before anything is cached or compiled
        except GrammarLimitError as e:
            fut.set_exception(GrammarError(str(e), code="grammar_too_large"))
            return fut
        with self._lock:
            cached = self._cache.get(spec.key)
            if cached is not None:
                self._cache.move_to_end(spec.key)
                return cached
            self._cache[spec.key] = fut
            self._evict()
            self.compiled += 1
        assert self._pool is not None  # made with the backend
        job = self._pool.submit(self._compile, spec)
        job.add_done_callback(lambda j: self._finish(spec.key, fut, j))
        return fut

    def _compile(self, spec: GrammarSpec) -> object:
        assert self.backend is not None  # the pool that runs this exists only with a backend
        try:
            return self.backend.compile(spec.kind, spec.text, timeout_s=self.compile_timeout_s)
        except GrammarCompileTimeout:
            with self._lock:
                self.timed_out += 1
            log.warning("a grammar compile took longer than %g s (--grammar-compile-timeout): stopped",
                        self.compile_timeout_s)
            raise GrammarError(
                f"compiling it took longer than the {self.compile_timeout_s:g} s limit (--grammar-compile-timeout), "
                "so it was stopped; make the grammar smaller (fewer enum values, alternatives or nested parts)",
                code="grammar_compile_timeout") from None
        except GrammarCompilerUnavailable as e:
            err = GrammarError(str(e))
            err.transient = True  # the server's failure: _finish does not keep it against the grammar
            raise err from None
        except GrammarCompileError as e:
            raise GrammarError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - any compiler failure is this grammar's fault
            log.exception("grammar compilation failed")
            raise GrammarError(f"the compiler failed: {e}") from None

    def _finish(self, key: tuple[str, str], fut: Future[object], job: Future[object]) -> None:
        if job.cancelled():  # close() dropped it before it started
            fut.set_exception(GrammarError("the server is shutting down"))
            return
        error = job.exception()
        if error is not None:
            if getattr(error, "transient", False):
                with self._lock:  # the next request for this grammar compiles it again
                    if self._cache.get(key) is fut:
                        del self._cache[key]
            fut.set_exception(error)
            return
        compiled = job.result()
        assert self.backend is not None  # a compile ran, so there is a backend
        size = int(self.backend.compiled_bytes(compiled))
        with self._lock:
            if self._cache.get(key) is fut:
                self._sizes[key] = size
                self.cached_bytes += size
                self._evict()
        fut.set_result(compiled)

    def _evict(self) -> None:
        """Least recently used compiled grammars out until the cache fits its bytes and entries (a grammar
        larger than the whole cache is used by its requests and not kept). Under the lock."""
        for key in list(self._cache):
            if self.cached_bytes <= self.cache_bytes and len(self._cache) <= self.max_entries:
                return
            if not self._cache[key].done() and key not in self._sizes:
                continue  # still compiling: its requests wait on it
            del self._cache[key]
            self.cached_bytes -= self._sizes.pop(key, 0)

    def cache_info(self) -> dict[str, Any]:
        """/server_info's grammar_cache."""
        with self._lock:
            return {"entries": len(self._cache), "bytes": self.cached_bytes, "limit_bytes": self.cache_bytes,
                    "compile_timeout_s": self.compile_timeout_s, "compiled": self.compiled,
                    "timed_out": self.timed_out}

    def register_gauges(self, metrics: EngineMetrics) -> None:
        metrics.gauge("tierlm_grammar_cache_bytes", "Bytes of compiled grammars in the grammar cache",
                      lambda: self.cached_bytes)
        metrics.gauge("tierlm_grammar_cache_entries", "Grammars in the grammar cache", lambda: len(self._cache))

    def close(self) -> None:
        if self._pool is not None:
            assert self.backend is not None  # the pool is made with the backend
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.backend.close()  # stops the compiles still running (their worker processes)

    # ------------------------------------------------------------ per request (scheduler thread)
    def attach(self, req: Req) -> None:
        """Start (or find) the compilation of ``req``'s grammar; sets ``req.grammar``."""
        spec = grammar_spec(req.sampling_params)
        if spec is not None:
            req.grammar = RequestGrammar(spec, self.compile(spec))

    def ready(self, req: Req) -> bool:
        """Whether ``req`` may be admitted: unconstrained, or its matcher exists. A failed grammar sets
        ``req.grammar.error`` and counts as ready (the scheduler ends the request with that error)."""
        g = req.grammar
        if g is None or g.matcher is not None or g.error is not None:
            return True
        if not g.future.done():
            return False
        assert self.backend is not None  # a grammar that compiled had a backend
        try:
            g.matcher = self.backend.matcher(g.future.result())
        except GrammarError as e:
            g.error = e.for_request(g.spec)
        return True

    def fill_bitmask(self, reqs: list[Req]) -> np.ndarray | None:
        """The packed bitmask of one step's sampling requests, or None when none is constrained."""
        rows = [(i, r.grammar.matcher) for i, r in enumerate(reqs)
                if r.grammar is not None and r.grammar.matcher is not None]
        if not rows:
            return None
        assert self.backend is not None  # a matcher comes from the backend
        bitmask = self.backend.allocate_bitmask(len(reqs))
        for i, matcher in rows:
            matcher.fill_bitmask(bitmask, i)
        return bitmask

    def accept(self, req: Req, token: int) -> str | None:
        """Advance ``req``'s matcher by its sampled ``token``. Returns "stop" when the grammar is complete (its stop
        token was accepted), "rejected" when the grammar does not allow the token, else None."""
        g = req.grammar
        if g is None or g.matcher is None or g.finished:
            return None
        if not g.matcher.accept_token(token):
            g.finished = True
            return "rejected"
        if g.matcher.is_terminated():
            g.finished = True
            return "stop"
        return None

