"""Which grammar a request's sampling params ask for: one of SGLang's json_schema, regex or ebnf."""
from __future__ import annotations

from dataclasses import dataclass

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


def grammar_spec(params) -> GrammarSpec | None:
    """The grammar of a SamplingParams, or None for an unconstrained request (at most one field is set:
    SamplingParams.verify checks it)."""
    for kind in GRAMMAR_FIELDS:
        text = getattr(params, kind, None)
        if text is not None:
            return GrammarSpec(kind, text, getattr(params, "grammar_param", None) or kind)
    return None
