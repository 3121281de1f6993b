"""Which grammar a request's sampling params ask for (one of SGLang's json_schema, regex, ebnf, structural_tag),
and RequestGrammar, that grammar's state on the request (runtime/grammar/manager.py drives it)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierlm.backends.base import GrammarMatcher

if TYPE_CHECKING:
    from tierlm.runtime.sampling_params import SamplingParams

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SamplingParams fields, SGLang's names
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what response_format {"type": "json_object"} becomes (as in SGLang)


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json_schema" | "regex" | "ebnf" | "structural_tag"
    text: str
    param: str  # the request field it came from, named by the 400 when it does not compile

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The grammar of a SamplingParams, or None for an unconstrained request (at most one field is set:
    SamplingParams.verify checks it)."""
    for kind in GRAMMAR_FIELDS:
        text = getattr(params, kind)  # the field named by ``kind``
        if text is not None:
            return GrammarSpec(kind, text, params.grammar_param or kind)
    return None


@dataclass(eq=False)
class RequestGrammar:
    """One request's grammar inside the scheduler: the compile future, then its matcher."""

    spec: GrammarSpec
    future: Future[object]  # the backend's compiled grammar (GrammarManager.compile)
    matcher: GrammarMatcher | None = None
    error: str | None = None
    finished: bool = field(default=False)
