"""Grammar compiles in the server's process vs in a compile worker process (backends/grammar/worker_pool.py), side
by side in one run: a worker's start, and for each grammar the in-process compile (with the emptiness checks), the
two ways a worker hands it back (serialized, then deserialized here; or "compiled in time", then compiled again
here), and which one tierlm takes. A synthetic vocabulary of --vocab tokens.

    python scripts/bench_grammar_compile.py --vocab 32000
"""
from __future__ import annotations

import argparse
import json
import random
import string
import time

import xgrammar as xgr

from tierlm.backends.grammar.worker_pool import SHIP_BYTES, CompileWorkerPool
from tierlm.backends.grammar.xgrammar_backend import _compile, compile_checked

GRAMMARS = {
    "typical schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                       "required": ["name", "age"]},
    "1,000-value enum": {"enum": [f"value-{i}" for i in range(1000)]},
    "1,000 long values": {"enum": ["".join(chr(97 + (i * 7 + j) % 26) for j in range(120)) for i in range(1000)]},
    "10,000-value enum": {"enum": [f"value-{i}" for i in range(10000)]},  # over the request limit of 1,000
}


def synthetic_vocab(n: int) -> list[str]:
    rng = random.Random(0)
    vocab: set[str] = set()
    while len(vocab) < n:
        vocab.add("".join(rng.choice(string.ascii_letters + ' "{}:,0123456789') for _ in range(rng.randint(1, 8))))
    return sorted(vocab)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    info = xgr.TokenizerInfo(synthetic_vocab(args.vocab), stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    pool = CompileWorkerPool(info.serialize_json(), size=1)
    t = time.perf_counter()
    pool.compile("regex", "a", None)
    print(f"worker start (first compile of a one-token regex): {time.perf_counter() - t:.2f} s")
    print(f"{'grammar':<20}{'MB':>6}{'in-process':>12}{'worker':>9}{'+deserialize':>13}{'=shipped':>10}"
          f"{'worker':>9}{'+compile':>10}{'=recompiled':>12}  tierlm takes")
    for name, schema in GRAMMARS.items():
        text = json.dumps(schema)
        t = time.perf_counter()
        size = compile_checked(compiler, "json_schema", text).memory_size_bytes
        local = time.perf_counter() - t
        pool.ship_bytes = 2**62  # always serialized
        t = time.perf_counter()
        data = pool.compile("json_schema", text, None)
        ship = time.perf_counter() - t
        t = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(data, info)
        deser = time.perf_counter() - t
        pool.ship_bytes = 0  # always compiled again here
        t = time.perf_counter()
        assert pool.compile("json_schema", text, None) is None
        proven = time.perf_counter() - t
        t = time.perf_counter()
        _compile(compiler, "json_schema", text)
        again = time.perf_counter() - t
        path = "shipped" if size <= SHIP_BYTES else "recompiled"
        print(f"{name:<20}{size / 1e6:>6.1f}{local:>11.3f}s{ship:>8.3f}s{deser:>12.3f}s{ship + deser:>9.3f}s"
              f"{proven:>8.3f}s{again:>9.3f}s{proven + again:>11.3f}s  {path}")
    pool.close()


if __name__ == "__main__":
    main()
