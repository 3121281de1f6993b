"""What one request's grammar may ask for, checked before it compiles (a compile cannot be interrupted once it runs,
so the bound is on its input): the size of the grammar text, a JSON schema's nesting, enum values and properties,
a regex's length; and a JSON schema's ``$ref`` must be local (``#/...``): tierlm fetches nothing.

The numbers follow OpenAI's structured-output limits where it has one (docs/api.md states them); within them a
grammar compiles in well under a second on a 150k-token vocabulary.
"""
from __future__ import annotations

import json
from typing import Any

MAX_GRAMMAR_CHARS = 128 * 1024  # JSON schema, EBNF or structural tag text
MAX_REGEX_CHARS = 4096
MAX_SCHEMA_DEPTH = 64  # JSON objects and arrays inside one another (one object level is two: "properties", the schema)
MAX_ENUM_VALUES = 1000  # enum and const values in one schema, all together (OpenAI's limit)
MAX_SCHEMA_PROPERTIES = 5000  # object properties in one schema, all together (OpenAI's limit)


class GrammarLimitError(ValueError):
    """A grammar over one of the limits; the message names the limit."""


def check_grammar_limits(kind: str, text: str) -> None:
    """Raise GrammarLimitError when ``text`` (a grammar of ``kind``) is over a limit or a schema has a $ref that is
    not local. Text that is not JSON passes here: the compiler says what is wrong with it."""
    if kind == "regex":
        if len(text) > MAX_REGEX_CHARS:
            raise GrammarLimitError(f"the regex is {len(text)} characters long; at most {MAX_REGEX_CHARS} are allowed")
        return
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarLimitError(f"the {kind} is {len(text)} characters long; at most {MAX_GRAMMAR_CHARS} are allowed")
    if kind not in ("json_schema", "structural_tag"):  # a structural tag holds the tools' JSON schemas
        return
    try:
        schema = json.loads(text)
    except RecursionError:
        raise GrammarLimitError(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep; at most "
                                f"{MAX_SCHEMA_DEPTH} are allowed") from None
    except ValueError:
        return
    _check_schema(schema)


def _check_schema(schema: Any) -> None:
    enums = properties = 0
    stack: list[tuple[Any, int]] = [(schema, 0)]  # iterative: the depth is what is being checked
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarLimitError(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep; at most "
                                    f"{MAX_SCHEMA_DEPTH} are allowed")
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):  # not "#name" anchors either
            raise GrammarLimitError(f"the JSON schema refers to {ref!r}: only local references ('#/...') are "
                                    "resolved; put the referenced schema under $defs and refer to '#/$defs/...'")
        enum = node.get("enum")
        enums += len(enum) if isinstance(enum, list) else 0
        enums += 1 if "const" in node else 0
        if enums > MAX_ENUM_VALUES:
            raise GrammarLimitError(f"the JSON schema has more than {MAX_ENUM_VALUES} enum and const values; at most "
                                    f"{MAX_ENUM_VALUES} are allowed")
        props = node.get("properties")
        properties += len(props) if isinstance(props, dict) else 0
        if properties > MAX_SCHEMA_PROPERTIES:
            raise GrammarLimitError(f"the JSON schema has more than {MAX_SCHEMA_PROPERTIES} object properties; at most "
                                    f"{MAX_SCHEMA_PROPERTIES} are allowed")
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):  # values, not schemas
                stack.append((value, depth + 1))
