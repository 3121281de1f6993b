"""Grammar compilation off the scheduler thread, its cache, and each constrained request's matcher.

``GrammarManager.compile`` hands a grammar to a small thread pool and returns a future; futures are cached by
(kind, text), so a grammar compiles once however many requests use it (a failure is cached too: the same text
fails the same way). The HTTP handlers await that future before queuing a request (a bad grammar is a 400 before
any response starts); the scheduler only asks whether a waiting request's grammar is ready, so a request whose
grammar still compiles waits in the queue without holding up the requests behind it.

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

from tierlm.backends.base import GrammarBackend, GrammarCompileError
from tierlm.runtime.grammar.spec import GrammarSpec, RequestGrammar, grammar_spec

if TYPE_CHECKING:
    from tierlm.runtime.request import Req

log = logging.getLogger(__name__)

GRAMMAR_DISABLED = ("structured output is turned off on this server (--grammar-backend none); restart it with "
                    "--grammar-backend xgrammar, or remove '{param}' from the request")


class GrammarError(Exception):
    """A grammar cannot be used: it does not compile, or structured output is off. Cached with the grammar, so
    it never names a request's field; ``for_request`` does."""

    def __init__(self, detail: str, disabled: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.disabled = disabled

    def for_request(self, spec: GrammarSpec) -> str:
        """The message for the request whose field ``spec.param`` carried the grammar."""
        if self.disabled:
            return GRAMMAR_DISABLED.format(param=spec.param)
        return f"invalid {spec.kind} in '{spec.param}': {self.detail}"


class GrammarManager:
    def __init__(self, backend: GrammarBackend | None, workers: int = 2, cache_size: int = 256) -> None:
        self.backend = backend
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierlm-grammar") if backend else None
        self.compiled = 0  # grammars compiled (cache misses)

    # ------------------------------------------------------------ compilation (any thread)
    def compile(self, spec: GrammarSpec) -> Future:
        """The future of ``spec``'s compiled grammar (from the cache, or submitted to the pool now). It fails
        with GrammarError."""
        if self.backend is None:
            fut: Future = Future()
            fut.set_exception(GrammarError("structured output is off", disabled=True))
            return fut
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.compiled += 1
            return fut

    def _compile(self, spec: GrammarSpec) -> Any:
        try:
            return self.backend.compile(spec.kind, spec.text)
        except GrammarCompileError as e:
            raise GrammarError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - any compiler failure is this grammar's fault
            log.exception("grammar compilation failed")
            raise GrammarError(f"the compiler failed: {e}") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

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
