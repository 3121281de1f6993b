"""Structured output in the HTTP layer: request fields -> SamplingParams' one grammar, and the 400 for a grammar
that does not compile, raised before a request is queued or a response starts.

Why the handlers compile first: a stream's status line (200) goes out with its first byte, so a compile error found
later could only be an error event inside a 200 stream. ``EngineAPI.compile_grammar`` runs the compiler on the
engine's grammar pool (not the event loop, not the tokenizer pool) and caches the result by grammar text, so the
scheduler then finds the grammar compiled and admits the request at once.
"""
from __future__ import annotations

import json
from typing import Any

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.grammar.spec import JSON_OBJECT_SCHEMA
from tierlm.runtime.io_struct import GenerateRequest

# (request field, SamplingParams field) in the order they are read; a request may set at most one
_OPENAI_ALIASES = (("json_schema", "json_schema"), ("regex", "regex"), ("ebnf", "ebnf"),
                   ("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_grammar", "ebnf"))


def choice_grammar(choices: list[str]) -> str:
    """vLLM's guided_choice as an EBNF grammar: exactly one of the strings (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def openai_grammar_fields(req: Any) -> dict[str, Any]:
    """The SamplingParams grammar fields (json_schema | regex | ebnf, and grammar_param naming the request field)
    of an OpenAI-route request; 400 when it sets more than one constraint."""
    for refused, what in (("structural_tag", "structural tags"),
                          ("guided_whitespace_pattern", "a custom JSON whitespace pattern")):
        if getattr(req, refused, None) is not None:
            raise RequestError(f"{what} ({refused}) is not supported; remove '{refused}' from the request", 400,
                               param=refused, code="unsupported_parameter")
    found: list[tuple[str, str, str]] = []  # (kind, text, request field)
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("json_schema", JSON_OBJECT_SCHEMA, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        found.append(("json_schema", json.dumps(rf.json_schema.schema_), "response_format"))
    for name, kind in _OPENAI_ALIASES:
        value = getattr(req, name, None)
        if value is not None:
            found.append((kind, _schema_text(value), name))
    if getattr(req, "guided_choice", None) is not None:
        found.append(("ebnf", choice_grammar(req.guided_choice), "guided_choice"))
    if len(found) > 1:
        raise RequestError(f"send at most one structured-output constraint; got {', '.join(f[2] for f in found)}",
                           400, param=found[1][2], code="conflicting_constraints")
    if not found:
        return {}
    kind, text, param = found[0]
    return {kind: text, "grammar_param": param}


def native_grammar_param(fields: dict[str, Any]) -> dict[str, Any]:
    """/generate: name the sampling_params field of the grammar in its errors."""
    for kind in ("json_schema", "regex", "ebnf"):
        if fields.get(kind) is not None:
            return {"grammar_param": f"sampling_params.{kind}"}
    return {}


async def check_grammars(engine: EngineAPI, reqs: list[GenerateRequest]) -> None:
    """400 (param: the request field) when a request's grammar does not compile; compiles each distinct grammar
    once (n choices and prompt batches share it)."""
    seen: set[tuple[Any, ...]] = set()
    for r in reqs:
        p = r.sampling_params
        key = (p.json_schema, p.regex, p.ebnf, p.structural_tag)
        if key != (None, None, None, None) and key not in seen:
            seen.add(key)
            await engine.compile_grammar(p)
