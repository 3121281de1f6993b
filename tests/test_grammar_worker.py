"""The grammar compile workers (backends/grammar/worker_pool.py): a compile past its limit is stopped by killing its
worker, a worker that dies mid-compile fails only that grammar, a grammar queued behind a slow one is not on the
clock while it waits, close() leaves no process, and a server killed with SIGKILL leaves no worker behind. The real
xgrammar backend on the demo model's tokenizer."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_hardening_grammar import slow_grammar

from tierlm.backends.base import GrammarCompileError, GrammarCompileTimeout
from tierlm.backends.grammar.xgrammar_backend import XGrammarBackend
from tierlm.backends.model_source.demo import ensure_demo_model


def demo_backend(workers: int) -> XGrammarBackend:
    from transformers import AutoTokenizer

    return XGrammarBackend(AutoTokenizer.from_pretrained(ensure_demo_model()), 285, [2], workers=workers)


@pytest.fixture(scope="module")
def backend():
    b = demo_backend(workers=1)
    yield b
    b.close()


def alive(pid: int) -> bool:
    """``pid`` runs (an orphan that exited may stay a zombie where PID 1 does not reap: not running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (macOS): kill(0) said it exists


def wait_until(cond, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_compile_past_the_limit_kills_its_worker_and_one_queued_behind_it_is_not_timed_out(backend) -> None:
    backend.compile("regex", "a|b", timeout_s=60)  # the worker is up
    (pid,) = backend.workers.pids()
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(backend.compile, "ebnf", slow_grammar(), 1.0)
        wait_until(lambda: backend.workers.busy() == 1)
        fast = pool.submit(backend.compile, "regex", "queued|behind", 1.0)  # one worker: it waits for the slow one
        with pytest.raises(GrammarCompileTimeout, match="longer than 1 s"):
            slow.result(60)
        assert not alive(pid)  # killed: nothing keeps compiling the abandoned grammar
        # it waited more than its 1 s in all (the slow compile, then a fresh worker's start), and compiled in time
        assert backend.compiled_bytes(fast.result(120)) > 0
    assert backend.workers.pids() and pid not in backend.workers.pids() and backend.workers.killed == 1


def test_a_worker_that_dies_mid_compile_fails_that_grammar_only(backend) -> None:
    backend.compile("regex", "a|b", timeout_s=60)
    (pid,) = backend.workers.pids()
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(backend.compile, "ebnf", slow_grammar(), 120)
        wait_until(lambda: backend.workers.busy() == 1)
        os.kill(pid, signal.SIGKILL)  # as a crash in the compiler or the OOM killer would
        with pytest.raises(GrammarCompileError, match="died while compiling it .killed by SIGKILL."):
            job.result(60)
    assert backend.workers.crashed == 1
    backend.compile("regex", "c|d", timeout_s=60)  # served by a fresh worker
    assert pid not in backend.workers.pids()


def test_a_large_grammar_is_compiled_again_here_and_masks_the_same(backend) -> None:
    """Over ship_bytes the worker answers "compiled in time" and the server compiles it itself: the same grammar."""
    def first_mask(compiled) -> np.ndarray:
        mask = backend.allocate_bitmask(1)
        backend.matcher(compiled).fill_bitmask(mask, 0)
        return mask

    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    shipped = backend.compile("json_schema", schema, timeout_s=60)
    bound = backend.workers.ship_bytes
    backend.workers.ship_bytes = 0
    try:
        again = backend.compile("json_schema", schema, timeout_s=60)
        with pytest.raises(GrammarCompileError, match="no text matches"):  # the worker's checks still apply
            backend.compile("ebnf", "root ::= root", timeout_s=60)
    finally:
        backend.workers.ship_bytes = bound
    assert backend.compiled_bytes(again) == backend.compiled_bytes(shipped)
    assert np.array_equal(first_mask(again), first_mask(shipped))


def test_close_kills_busy_workers(backend) -> None:
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            backend.compile("ebnf", slow_grammar(), 120)
        except GrammarCompileError as e:
            errors.append(e)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    wait_until(lambda: backend.workers.busy() == 1)
    (pid,) = backend.workers.pids()
    backend.close()
    assert done.wait(30) and "shutting down" in str(errors[0])
    wait_until(lambda: not alive(pid), 10)
    with pytest.raises(GrammarCompileError, match="shutting down"):
        backend.compile("regex", "a", 10)


# A server process that holds a pool (without importing xgrammar itself) and a compile that would run for minutes.
_SERVER = """
import sys, threading
from tierlm.backends.grammar.worker_pool import CompileWorkerPool
info, grammar = sys.stdin.readline(), sys.stdin.readline()
pool = CompileWorkerPool(info, size=1)
pool.compile("regex", "a", 60)
print(pool.pids()[0], flush=True)
threading.Thread(target=pool.compile, args=("ebnf", grammar, 600), daemon=True).start()
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_server_killed_with_sigkill_leaves_no_worker(backend) -> None:
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd="/")
    try:
        server.stdin.write(backend.tokenizer_info.serialize_json() + "\n" + slow_grammar() + "\n")
        server.stdin.flush()
        pid = int(server.stdout.readline())
        time.sleep(0.5)  # the slow compile is under way in the worker
        server.kill()
        server.wait()
        wait_until(lambda: not alive(pid), 15)  # the worker notices its parent is gone within a second
    finally:
        server.kill()


def test_a_compiler_that_could_not_start_is_not_remembered_against_the_grammar() -> None:
    """The server's failure (no compiler process) answers that request, and the next request with the same
    grammar compiles it again; a grammar's own failure stays cached."""
    from tierlm.backends.base import GrammarBackend, GrammarCompileError, GrammarCompilerUnavailable
    from tierlm.runtime.grammar.manager import GrammarError, GrammarManager
    from tierlm.runtime.grammar.spec import GrammarSpec

    class Flaky(GrammarBackend):
        name = "flaky"
        calls = 0

        def compile(self, kind, text, timeout_s=None):
            Flaky.calls += 1
            if text == "bad":
                raise GrammarCompileError("the grammar's own fault")
            if Flaky.calls == 1:
                raise GrammarCompilerUnavailable("the grammar compiler process could not start")
            return object()

        def matcher(self, compiled):  # not reached
            raise AssertionError

    manager = GrammarManager(Flaky())
    try:
        spec = GrammarSpec("regex", "a+", "regex")
        with pytest.raises(GrammarError, match="could not start"):
            manager.compile(spec).result(10)
        assert manager.compile(spec).result(10) is not None  # compiled again, this time it works
        bad = GrammarSpec("regex", "bad", "regex")
        for _ in range(2):
            with pytest.raises(GrammarError, match="own fault"):
                manager.compile(bad).result(10)
        assert Flaky.calls == 3  # the grammar's own failure was not compiled twice
    finally:
        manager.close()


def test_compile_workers_run_below_the_servers_cpu_priority() -> None:
    """On a machine with few cores a compile must not take the cores the model and HTTP threads need (a plain
    request slowed 3.4x during two compiles before; 1.17x with the workers niced)."""
    from tierlm.backends.grammar.compile_worker import COMPILE_NICENESS

    backend = demo_backend(workers=1)
    try:
        backend.compile("regex", "a", 10)
        (pid,) = backend.workers.pids()
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, pid) >= min(19, own + COMPILE_NICENESS)
    finally:
        backend.close()
