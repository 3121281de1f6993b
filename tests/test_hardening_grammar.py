"""Structured output cannot starve the server (issue #33): per-request limits with 400s that name them, only local
$refs, empty languages refused when they compile, a compile time limit that stops the compile (its worker process
killed) and fails the request while the server keeps serving, and a compiled-grammar cache bounded by bytes (LRU)
shown in /server_info and /metrics. A real engine (the random demo model) behind the real HTTP app, the openai
client as client."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import jsonschema
import openai
import pytest
from engine_harness import start_engine
from fastapi.testclient import TestClient
from http_helpers import LOCAL, assert_error

from tierlm.backends.model_source.demo import ensure_demo_model
from tierlm.runtime.grammar.limits import MAX_ENUM_VALUES, MAX_REGEX_CHARS, MAX_SCHEMA_DEPTH
from tierlm.server.app import create_app


@pytest.fixture(scope="module")
def engine():
    e = start_engine(ensure_demo_model(), "torch", max_total_tokens=4096)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def client(engine) -> TestClient:
    return TestClient(create_app(engine), base_url=LOCAL)


@pytest.fixture(scope="module")
def oai(client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{LOCAL}/v1", api_key="none", http_client=client, max_retries=0)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def refused(oai: openai.OpenAI, **extra: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                    extra_body=extra)
    return e.value.body


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("extra,says", [
    ({"response_format": schema_format({"enum": list(range(MAX_ENUM_VALUES + 1))})}, f"{MAX_ENUM_VALUES} enum"),
    ({"guided_json": {"type": "object", "properties": {
        f"p{i}": {"const": i} for i in range(MAX_ENUM_VALUES + 1)}}}, f"{MAX_ENUM_VALUES} enum"),
    ({"regex": "a" * (MAX_REGEX_CHARS + 1)}, f"at most {MAX_REGEX_CHARS}"),
    ({"response_format": schema_format(nested(MAX_SCHEMA_DEPTH))}, f"more than {MAX_SCHEMA_DEPTH} levels"),
    ({"ebnf": "root ::= " + " | ".join(f'"{i}"' for i in range(30000))}, "characters long; at most"),
])
def test_a_grammar_over_a_limit_is_a_400_that_names_it(oai, engine, extra: dict, says: str) -> None:
    compiled = engine.parts.grammar.compiled
    err = refused(oai, **extra)
    assert err["code"] == "grammar_too_large" and says in err["message"], err
    assert engine.parts.grammar.compiled == compiled  # refused before the compiler saw it


@pytest.mark.parametrize("ref", ["https://example.com/schema.json", "other.json#/$defs/x", "file:///etc/passwd",
                                 "#an-anchor"])
def test_only_local_refs_are_resolved(oai, client, ref: str) -> None:
    err = refused(oai, response_format=schema_format({"type": "object", "properties": {"a": {"$ref": ref}},
                                                      "required": ["a"]}))
    assert err["param"] == "response_format" and "only local references" in err["message"] and ref in err["message"]
    local = {"$defs": {"p": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                     "maximum": 9}}, "required": ["n"]}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                                                   "temperature": 0, "response_format": schema_format(local)})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), local)


EMPTY = "no text matches this grammar"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field,grammar,says", [
    ("ebnf", "root ::= root", EMPTY),
    ("ebnf", 'root ::= "a" root', EMPTY),
    ("ebnf", "root ::= a\na ::= b\nb ::= a", EMPTY),
    ("ebnf", "root ::= [^\\x00-\\U0010FFFF]", EMPTY),
    ("guided_json", {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                     "required": ["next"]}}, "$ref": "#/$defs/n"}, EMPTY),
    # not empty ("a" matches), but a sampled "b" would enter a rule that never ends: no token allowed after it
    ("ebnf", 'root ::= "a" | [b-z] c\nc ::= c "d"', "no text matches the grammar's rule 'c'"),
])
def test_an_empty_language_is_refused_when_it_compiles(client, field: str, grammar: Any, says: str,
                                                        stream: bool) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": stream, field: grammar})
    err = assert_error(r, 400, param=field, contains=says)
    assert err["code"] == "invalid_grammar"
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4, "ebnf": "root ::= root"}})
    assert_error(r, 400, param="sampling_params.ebnf", contains="no text matches")


def slow_grammar(alternatives: int = 800) -> str:
    """An EBNF of a few KB, under every limit, that xgrammar compiles for minutes even on the demo's 285-token
    vocabulary (400 alternatives took 31 s): character-class runs of every length that the loop lets restart."""
    return "root ::= (" + " | ".join(f'[a-z]{{{i}}} "{i % 10}"' for i in range(1, alternatives)) + ")+"


def threads_in_xgrammar() -> list[str]:
    """Names of the threads whose stack is inside xgrammar (a compile still running in this process)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    busy = []
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            if f"{os.sep}xgrammar{os.sep}" in frame.f_code.co_filename:
                busy.append(names.get(ident, str(ident)))
                break
            frame = frame.f_back
    return busy


def test_a_compile_past_the_time_limit_is_stopped_and_the_server_keeps_serving(engine, client) -> None:
    grammar = engine.parts.grammar
    limit = grammar.compile_timeout_s
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "regex": "warm|up"})
    assert ok.status_code == 200, ok.text  # a compile worker is up
    workers = grammar.backend.workers
    before_pids, before = workers.pids(), grammar.cache_info()
    grammar.compile_timeout_s = 2.0
    slow: dict[str, Any] = {}
    try:
        caller = threading.Thread(target=lambda: slow.update(r=client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 4, "ebnf": slow_grammar()})))
        caller.start()
        while grammar.cache_info()["compiled"] == before["compiled"] and caller.is_alive():
            time.sleep(0.01)
        # while it compiles, the event loop and the scheduler serve on
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        caller.join(60)
        err = assert_error(slow["r"], 400, param="ebnf",
                           contains="longer than the 2 s limit (--grammar-compile-timeout)")
        assert err["code"] == "grammar_compile_timeout"
        # nothing keeps compiling it: the worker that ran it is gone (the others idle) and no thread of the
        # server is in xgrammar
        gone = [pid for pid in before_pids if pid not in workers.pids()]
        assert len(gone) == 1 and not _process_alive(gone[0]), (before_pids, workers.pids())
        assert workers.busy() == 0 and threads_in_xgrammar() == []
        after = grammar.cache_info()
        assert after["bytes"] == before["bytes"] and after["timed_out"] == before["timed_out"] + 1
        assert_error(client.post("/v1/completions", json={"prompt": "hi", "ebnf": slow_grammar()}), 400,
                     param="ebnf", contains="2 s limit")  # the failure is cached: no second compile
        assert grammar.cache_info()["compiled"] == after["compiled"]
        # the next grammar compiles on a fresh worker
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "regex": "next|one"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("next", "one"), r.text
        assert workers.pids() and gone[0] not in workers.pids()
    finally:
        grammar.compile_timeout_s = limit


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the pool reaps what it kills, so a stopped worker's pid is gone
    except ProcessLookupError:
        return False
    return True


def test_the_grammar_cache_is_bounded_by_bytes_lru(engine, client) -> None:
    grammar = engine.parts.grammar
    bound = grammar.cache_bytes

    def use(n: int) -> None:
        schema = {"type": "object", "properties": {"v": {"enum": [f"value-{n}-{i}" for i in range(200)]}},
                  "required": ["v"]}
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 48, "temperature": 0,
                                                 "guided_json": schema})
        assert r.status_code == 200, r.text

    try:
        use(0)
        one = grammar.cache_info()["bytes"]
        assert one > 0
        grammar.cache_bytes = one * 3 + one // 2  # room for three grammars of this size
        for n in range(1, 6):
            use(n)
            info = client.get("/server_info").json()["grammar_cache"]
            assert info["bytes"] <= grammar.cache_bytes and info["limit_bytes"] == grammar.cache_bytes
        compiled = grammar.compiled
        use(5)  # the most recent: still cached
        assert grammar.compiled == compiled
        use(1)  # evicted (least recently used): compiled again
        assert grammar.compiled == compiled + 1
        metrics = client.get("/metrics").text
        line = next(ln for ln in metrics.splitlines() if ln.startswith("tierlm_grammar_cache_bytes{"))
        assert float(line.rsplit(" ", 1)[1]) == grammar.cache_info()["bytes"]
    finally:
        grammar.cache_bytes = bound


def test_the_flags_reach_the_grammar_cache() -> None:
    from tierlm.server.commands.cli_args import parse_args

    args = parse_args(["--grammar-compile-timeout", "2.5", "--grammar-cache-mb", "64"])
    assert (args.grammar_compile_timeout, args.grammar_cache_mb) == (2.5, 64)
    with pytest.raises(SystemExit):
        parse_args(["--grammar-compile-timeout", "0"])


def test_a_body_nested_too_deep_says_the_limit(client) -> None:
    body = '{"prompt": "hi", "max_tokens": 1, "x": ' + "[" * 5000 + "]" * 5000 + "}"
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, contains="keep nesting under 500 levels")
