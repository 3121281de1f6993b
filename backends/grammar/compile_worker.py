"""The grammar compile worker: a child process (started by worker_pool.py) that compiles grammars for one
tokenizer and sends each back serialized. It exists so that a compile past its time limit can be stopped: xgrammar's
native compile cannot be interrupted inside the server's process (xgrammar issue #298), a process can be killed.

Protocol over the connection (multiprocessing.connection framing, pickled tuples):
  server -> worker  ("init", tokenizer_info_json, max_threads)     once, first
  worker -> server  ("ready", pid)
  server -> worker  ("compile", kind, text, ship_bytes)            then one answer each:
  worker -> server  ("ok", compiled_grammar_json) | ("compiled", memory_size_bytes) | ("error", message)
"compiled" answers a grammar larger than ``ship_bytes`` in memory: it compiled within the limit and passed the
checks, and the server compiles it again itself, which costs less than xgrammar's JSON round trip of a large grammar
(a 32 MB grammar: 1.3 s to compile, 4.3 s to serialize and send, 1.6 s to deserialize).
The worker exits when the server closes the connection or the server process is gone.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection


def _exit_with_parent(parent: int) -> None:
    """A server killed with SIGKILL closes nothing: leave when the parent process is no longer ours (a compile
    in progress would otherwise run to its end, or forever)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


COMPILE_NICENESS = 10  # added to the worker's CPU niceness (lower priority than the server)


def serve(conn: Connection, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server stops us
    # Serving comes first: on a machine with few cores a compile takes what the model and the HTTP threads leave.
    try:
        os.nice(COMPILE_NICENESS)
    except OSError:
        pass
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    import xgrammar as xgr

    from tierlm.backends.base import GrammarCompileError
    from tierlm.backends.grammar.xgrammar_backend import compile_checked

    _, info_json, max_threads = conn.recv()
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            _, kind, text, ship_bytes = conn.recv()
        except EOFError:
            return  # the server closed the connection
        try:
            compiled = compile_checked(compiler, kind, text)
            size = compiled.memory_size_bytes
            answer = ("ok", compiled.serialize_json()) if size <= ship_bytes else ("compiled", size)
        except GrammarCompileError as e:
            answer = ("error", str(e))
        except Exception as e:  # noqa: BLE001 - any other compiler failure is this grammar's 400
            answer = ("error", f"the compiler failed: {type(e).__name__}: {e}")
        conn.send(answer)


def main(argv: list[str]) -> None:
    """``argv``: the connection's file descriptor and the server's pid."""
    serve(Connection(int(argv[0])), int(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
