"""Grammar compiles in child processes that can be killed (compile_worker.py is the child's side).

A compile takes an idle worker, or starts one (lazily: a server that never compiles a grammar never starts one,
and a start costs about as much as importing xgrammar, which imports torch), sends it the grammar and waits for the
answer up to the time limit. Past the limit the worker is killed (SIGKILL): no thread and no CPU keep working on
the abandoned grammar, and the next compile starts a fresh worker. A worker that dies during a compile (a crash in
the compiler, the OOM killer) fails that grammar with a message that says so; the next compile starts a fresh one.

A compiled grammar comes back serialized when it is small (``ship_bytes`` in memory, almost every grammar: a
typical schema's JSON is 0.07 MB); a larger one comes back as "compiled within the limit", and the server compiles it
again itself (compile_worker.py says why): proven to finish in about the time the worker took, and not to crash.

At most ``size`` compiles run at once, one per worker; a compile waiting for a free worker is not yet on the clock:
the time limit counts from when a worker takes it, so a slow grammar cannot make the ones queued behind it time out.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from tierlm.backends.base import GrammarCompileError, GrammarCompilerUnavailable, GrammarCompileTimeout

log = logging.getLogger(__name__)

SHIP_BYTES = 4 * 2**20  # compiled grammars up to this size come back serialized; larger ones are compiled again
START_TIMEOUT_S = 120.0  # a fresh worker imports xgrammar (and torch): seconds on a busy machine
# The child sees the server's sys.path (as multiprocessing's spawn does), so it imports the same tierlm.
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         "from tierlm.backends.grammar.compile_worker import main; main(sys.argv[2:])")


class WorkerGone(Exception):
    """The worker process is dead (it crashed, was killed, or never started)."""


class CompileWorker:
    """One compile process and its connection; used by one compile at a time."""

    def __init__(self, tokenizer_info_json: str, max_threads: int) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        self.conn = Connection(ours.detach())
        self.pid = self.proc.pid
        # Sent from a thread: the message outgrows the socket's buffer, so it waits for the child to read it, and a
        # child stuck in its imports must not hold this thread past the start limit.
        threading.Thread(target=self._send_init, args=(tokenizer_info_json, max_threads), daemon=True,
                         name="tierlm-grammar-worker-init").start()
        try:
            if not self.conn.poll(START_TIMEOUT_S):
                raise WorkerGone(f"it did not start within {START_TIMEOUT_S:g} s")
            self.conn.recv()  # ("ready", pid)
        except (OSError, EOFError, WorkerGone) as e:
            self.kill()
            raise GrammarCompilerUnavailable(f"the grammar compiler process could not start ({_why(e, self.proc)}); "
                                      "this is the server's fault, not the grammar's: see the server log") from None

    def _send_init(self, tokenizer_info_json: str, max_threads: int) -> None:
        try:
            self.conn.send(("init", tokenizer_info_json, max_threads))
        except OSError:
            pass  # the child died or was killed: the start fails on its own

    def compile(self, kind: str, text: str, timeout_s: float | None, ship_bytes: int) -> str | None:
        """The serialized compiled grammar, or None for one larger than ``ship_bytes`` that compiled;
        GrammarCompileError when it does not compile, GrammarCompileTimeout (the worker killed) past ``timeout_s``,
        WorkerGone when the worker died while compiling."""
        try:
            self.conn.send(("compile", kind, text, ship_bytes))
            if not self.conn.poll(timeout_s):
                self.kill()
                raise GrammarCompileTimeout(f"the compile ran longer than {timeout_s:g} s; it was stopped")
            status, payload = self.conn.recv()
        except (OSError, EOFError) as e:
            self.kill()
            raise WorkerGone(_why(e, self.proc)) from None
        if status == "error":
            raise GrammarCompileError(payload)
        return payload if status == "ok" else None

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.conn.closed

    def kill(self) -> None:
        """SIGKILL and reap (a compile in native code does not answer SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if not self.conn.closed:
            self.conn.close()


class CompileWorkerPool:
    """Up to ``size`` compile workers for one tokenizer (``tokenizer_info_json``: xgrammar's TokenizerInfo
    serialized), started when a compile needs one. Thread-safe."""

    def __init__(self, tokenizer_info_json: str, size: int = 2, max_threads: int = 2,
                 ship_bytes: int = SHIP_BYTES) -> None:
        self._info_json = tokenizer_info_json
        self.ship_bytes = ship_bytes
        self._max_threads = max_threads
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[CompileWorker] = []
        self._live: set[CompileWorker] = set()
        self._closed = False
        self.started = 0  # workers started
        self.killed = 0  # workers killed at the time limit
        self.crashed = 0  # workers that died while compiling

    def compile(self, kind: str, text: str, timeout_s: float | None = None) -> str | None:
        """The serialized CompiledGrammar of ``text`` (a grammar of ``kind``), or None when it compiled within the
        limit and passed the checks but is larger than ``ship_bytes`` (the caller compiles it again);
        GrammarCompileError when it does not compile or its worker died, GrammarCompileTimeout when it ran past
        ``timeout_s`` (counted from when a worker took it)."""
        with self._slots:
            worker = self._take()
            try:
                return worker.compile(kind, text, timeout_s, self.ship_bytes)
            except GrammarCompileTimeout:
                with self._lock:
                    self.killed += 1
                log.warning("grammar compile worker %d killed at the %g s compile time limit", worker.pid, timeout_s)
                raise
            except WorkerGone as e:
                if self._closed:
                    raise GrammarCompileError("the server is shutting down") from None
                with self._lock:
                    self.crashed += 1
                log.error("grammar compile worker %d died while compiling a %s (%s); the next compile starts a "
                          "fresh one", worker.pid, kind, e)
                raise GrammarCompileError(f"the grammar compiler process died while compiling it ({e}); the next "
                                          "compile starts a fresh one. A grammar that crashes the compiler (or takes "
                                          "all its memory) cannot be used: simplify it") from None
            finally:
                self._give_back(worker)

    def _take(self) -> CompileWorker:
        with self._lock:
            if self._closed:
                raise GrammarCompileError("the server is shutting down")
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                self._live.discard(worker)
        worker = CompileWorker(self._info_json, self._max_threads)  # outside the lock: it takes seconds
        with self._lock:
            self.started += 1
            self._live.add(worker)
            if self._closed:
                worker.kill()
                raise GrammarCompileError("the server is shutting down")
        log.info("grammar compile worker %d started", worker.pid)
        return worker

    def _give_back(self, worker: CompileWorker) -> None:
        with self._lock:
            if worker.alive() and not self._closed:
                self._idle.append(worker)
                return
            self._live.discard(worker)
        worker.kill()

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        with self._lock:
            return sorted(w.pid for w in self._live if w.alive())

    def busy(self) -> int:
        """Workers compiling now."""
        with self._lock:
            return len(self._live) - len(self._idle)

    def close(self) -> None:
        """Kill every worker, busy ones too (their compiles fail; their threads close the connections)."""
        with self._lock:
            self._closed = True
            idle, busy = self._idle, self._live.difference(self._idle)
            self._idle, self._live = [], set()
        for worker in idle:
            worker.kill()
        for worker in busy:
            worker.proc.kill()


def _why(e: BaseException, proc: subprocess.Popen) -> str:
    code = proc.poll()
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code is not None:
        return f"exited with status {code}"
    return str(e) or type(e).__name__
