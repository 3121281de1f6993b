"""Structured output on both backends with the random demo model (nothing but the grammar makes its output
valid): JSON schemas, regexes, choices, streaming, mixed batches, every sampling parameter under a grammar, and the
400s of grammars that do not compile, through the engine and through the HTTP routes."""
from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
from backends_under_test import BACKENDS
from engine_harness import pool_is_clean, run, start_engine
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from http_helpers import LOCAL, assert_error, sse_events

from tierlm.backends.model_source.demo import ensure_demo_model
from tierlm.runtime.errors import RequestError
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.server.app import create_app
from tierlm.server.pipeline.structured_output import choice_grammar

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}}, "required": ["id", "email"]}},
     "required": ["user"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y", "z"]},
                                               "minItems": 2, "maxItems": 4}}, "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"enum": [1, 2, 3]}}, "required": ["color", "size"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}}, "required": ["ok", "note"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"points": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}}, "required": ["points"]},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]},
                                      "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
     "required": ["level", "flags"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "string", "enum": ["deep"]}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"id": {"type": "string", "minLength": 2, "maxLength": 4},
                                      "count": {"type": "integer", "minimum": 10, "maximum": 20}},
     "required": ["id", "count"]},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
]

MAX_TOKENS = 96


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request):
    e = start_engine(ensure_demo_model(), request.param, max_total_tokens=8192)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode("Tell me about the weather")


def constrained(**kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw).normalize()


def check_json(result, schema) -> None:
    assert result.last.finish_reason == "stop", (result.text, result.last)
    jsonschema.validate(json.loads(result.text), schema)


def test_every_json_schema_response_parses_and_validates(engine, prompt) -> None:
    # greedy and seeded sampling rows for every schema, all in one batch
    params = [constrained(json_schema=json.dumps(s)) for s in SCHEMAS]
    params += [constrained(json_schema=json.dumps(s), temperature=1.0, seed=i) for i, s in enumerate(SCHEMAS)]
    results = run(engine, [prompt] * len(params), params)
    for r, s in zip(results, SCHEMAS + SCHEMAS):
        check_json(r, s)
    assert pool_is_clean(engine)


def test_json_object_regex_and_choice(engine, prompt) -> None:
    choices = ["sunny", "rain \"heavy\"", "snow\\ice"]
    params = [constrained(json_schema='{"type": "object"}', max_new_tokens=200, temperature=0.0),
              constrained(regex=r"[0-9]{3}-[a-z]{2,4}", temperature=0.9, seed=1),
              constrained(regex=r"(cat|dog)s?", temperature=0.0),
              constrained(ebnf=choice_grammar(choices), temperature=1.0, seed=2),
              constrained(ebnf=choice_grammar(choices), temperature=0.0)]
    obj, num, pet, c1, c2 = run(engine, [prompt] * len(params), params)
    if obj.last.finish_reason == "stop":  # any object: the random model may run out of tokens inside it
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", num.text) and num.last.finish_reason == "stop"
    assert re.fullmatch(r"(cat|dog)s?", pet.text) and pet.last.finish_reason == "stop"
    assert c1.text in choices and c2.text in choices


def test_a_vanishing_repetition_penalty_never_samples_a_banned_token(engine, prompt) -> None:
    """A repetition penalty valid by the API (> 0) but below float32's range must not turn the grammar's banned
    (-inf) logits into NaN, which the argmax would pick."""
    params = [constrained(regex=r"(cat|dog)s?", repetition_penalty=5e-324),
              constrained(ebnf=choice_grammar(["", "no"]), repetition_penalty=1e-45)]
    pet, choice = run(engine, [prompt + prompt] * len(params), params)
    assert re.fullmatch(r"(cat|dog)s?", pet.text) and pet.last.finish_reason == "stop"
    assert choice.text in ("", "no") and choice.last.finish_reason == "stop" and not choice.last.error


def test_streamed_deltas_concatenate_to_a_valid_document(engine, prompt) -> None:
    schema = SCHEMAS[7]
    streamed, = run(engine, [prompt], constrained(json_schema=json.dumps(schema)), stream=True)
    whole, = run(engine, [prompt], constrained(json_schema=json.dumps(schema)))
    assert streamed.increments > 2
    assert streamed.text == whole.text
    check_json(streamed, schema)


def test_mixed_batch_leaves_unconstrained_outputs_unchanged(engine, prompt) -> None:
    prompts = [engine.tokenizer.encode(t) for t in ("one", "two two", "three three three", "four")]
    free = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True).normalize(),
            SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, ignore_eos=True).normalize()]
    alone = run(engine, prompts, [free[i % 2] for i in range(4)])
    schema = SCHEMAS[0]
    params, batch_prompts = [], []
    for i in range(4):  # interleaved: constrained, unconstrained, ...
        params += [constrained(json_schema=json.dumps(schema), temperature=0.7 * (i % 2), seed=i), free[i % 2]]
        batch_prompts += [prompt, prompts[i]]
    mixed = run(engine, batch_prompts, params)
    for i in range(4):
        check_json(mixed[2 * i], schema)
        assert mixed[2 * i + 1].token_ids == alone[i].token_ids


def test_constrained_sampling_keeps_every_sampling_parameter(engine, prompt) -> None:
    schema = SCHEMAS[2]
    variants = [dict(temperature=1.3, top_p=0.8, seed=1), dict(temperature=1.0, top_k=3, seed=2),
                dict(temperature=1.0, min_p=0.2, seed=3), dict(temperature=0.0, repetition_penalty=1.5),
                dict(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, seed=4),
                dict(temperature=0.0, ignore_eos=True)]
    results = run(engine, [prompt] * len(variants), [constrained(json_schema=json.dumps(schema), **v)
                                                     for v in variants])
    for r in results:  # ignore_eos too: a complete grammar ends the request with "stop"
        check_json(r, schema)
    # seeded constrained sampling is reproducible
    again = run(engine, [prompt], constrained(json_schema=json.dumps(schema), **variants[0]))
    assert again[0].token_ids == results[0].token_ids


def test_bad_grammars_fail_with_the_compilers_message(engine, prompt) -> None:
    with pytest.raises(RequestError) as e:
        asyncio.run(engine.compile_grammar(constrained(regex="([a-z")))
    assert e.value.status == 400 and e.value.param == "regex" and "Unclosed" in e.value.message
    with pytest.raises(RequestError) as e:
        asyncio.run(engine.compile_grammar(constrained(json_schema='{"type": "objec"}',
                                                       grammar_param="response_format")))
    assert e.value.param == "response_format" and "objec" in e.value.message
    # a request queued without the check ends with the same message instead of running unconstrained
    r, ok = run(engine, [prompt, prompt], [constrained(ebnf="root ::= "), constrained(regex="ab")])
    assert r.last.error and "EBNF" in r.last.error and r.token_ids == []
    assert ok.text == "ab"
    assert pool_is_clean(engine)


def test_a_compiling_grammar_does_not_hold_up_the_queue(engine, prompt) -> None:
    grammar = engine.parts.grammar
    real_compile = grammar.backend.compile
    release = threading.Event()

    def slow_compile(kind, text, **kw):
        if text == "slow|grammar":
            release.wait(30)
        return real_compile(kind, text, **kw)

    grammar.backend.compile = slow_compile
    try:
        async def main():
            slow = asyncio.ensure_future(_collect_text(engine, prompt, constrained(regex="slow|grammar")))
            await asyncio.sleep(0.05)
            fast = await _collect_text(engine, prompt, SamplingParams(max_new_tokens=4, temperature=0,
                                                                      ignore_eos=True).normalize())
            assert not slow.done()  # the unconstrained request finished while the grammar still compiles
            release.set()
            return fast, await slow

        fast, slow = asyncio.run(main())
    finally:
        grammar.backend.compile = real_compile
        release.set()
    assert len(fast) > 0 and slow in ("slow", "grammar")


async def _collect_text(engine, prompt, params) -> str:
    from tierlm.runtime.io_struct import GenerateRequest

    text = ""
    async for out in engine.generate(GenerateRequest(rid=f"q{id(params)}", input_ids=list(prompt),
                                                     sampling_params=params)):
        text += out.text
    return text


# ---------------------------------------------------------------- HTTP routes on a real engine (torch and mlx)
@pytest.fixture(scope="module")
def client(engine) -> TestClient:
    return TestClient(create_app(engine), base_url=LOCAL)


def _chat(client, **body):
    body = {"model": "default", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **body}
    return client.post("/v1/chat/completions", json=body)


def test_http_response_format_and_aliases(client) -> None:
    schema = SCHEMAS[3]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    r = _chat(client, response_format=rf, n=2, temperature=1.0, seed=3)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
    r = client.post("/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": MAX_TOKENS,
                                             "temperature": 0, "response_format": rf})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)
    for body, check in (({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
                        ({"json_schema": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema)),
                        ({"guided_regex": "[ab]{3}"}, lambda t: re.fullmatch("[ab]{3}", t)),
                        ({"regex": "[ab]{3}"}, lambda t: re.fullmatch("[ab]{3}", t)),
                        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
                        ({"guided_grammar": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch("x[0-9]", t)),
                        ({"ebnf": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch("x[0-9]", t))):
        r = _chat(client, **body)
        assert r.status_code == 200, (body, r.text)
        assert check(r.json()["choices"][0]["message"]["content"]) is not False, body
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"regex": "[0-9]{4}", "temperature": 0,
                                                                        "max_new_tokens": 16}})
    assert re.fullmatch("[0-9]{4}", r.json()["text"]) and r.json()["meta_info"]["finish_reason"]["type"] == "stop"


def test_http_stream_concatenates_to_a_valid_document(client) -> None:
    schema = SCHEMAS[1]
    r = _chat(client, stream=True, response_format={"type": "json_schema", "json_schema": {"name": "u",
                                                                                            "schema": schema}})
    events = sse_events(r)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    jsonschema.validate(json.loads(text), schema)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_http_bad_grammars_are_400s_naming_the_field(client) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    assert_error(_chat(client, response_format=bad_schema), 400, param="response_format", contains="objec")
    assert_error(_chat(client, response_format=bad_schema, stream=True), 400, param="response_format")
    assert_error(client.post("/v1/completions", json={"prompt": "a", "guided_regex": "(["}), 400,
                 param="guided_regex", contains="regex")
    assert_error(client.post("/generate", json={"text": "a", "sampling_params": {"ebnf": "root ::= "}}), 400,
                 param="sampling_params.ebnf", contains="EBNF")
    assert_error(_chat(client, regex="a", guided_choice=["b"]), 400, param="guided_choice", contains="at most one")
    err = assert_error(_chat(client, response_format={"type": "json_schema"}), 400, contains="json_schema")
    assert err["param"].startswith("response_format")
    assert_error(_chat(client, response_format={"type": "xml"}), 400)


def test_grammar_backend_none_refuses_constraints() -> None:
    client = TestClient(create_app(FakeEngine()), base_url=LOCAL)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                  "response_format": {"type": "json_object"}})
    assert_error(r, 400, param="response_format", contains="turned off")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                  "response_format": {"type": "text"}})
    assert r.status_code == 200
