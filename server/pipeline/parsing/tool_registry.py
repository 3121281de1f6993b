"""``--tool-call-parser``: the names (SGLang's, plus vLLM's where they differ), what each parses, and the grammar a
forced call is constrained to in each format. Without the flag the engine chooses from the model
(runtime/chat_format.py, detect_tool_call_parser)."""
from __future__ import annotations

import json
from typing import Any

from tierlm.server.pipeline.parsing.base import OutputParser
from tierlm.server.pipeline.parsing.tool_parsers import (HermesToolParser, JsonListToolParser, JsonToolParser,
                                                         Llama3ToolParser, MistralToolParser)

HARMONY = "harmony"  # gpt-oss: the harmony parser (channels) reads the calls; it runs alone
_FORMATS: dict[str, type[JsonToolParser] | str] = {
    "hermes": HermesToolParser, "llama3": Llama3ToolParser, "mistral": MistralToolParser, HARMONY: HARMONY,
}
# flag value -> format
TOOL_CALL_PARSERS: dict[str, str] = {
    "qwen25": "hermes", "qwen": "hermes", "qwen3": "hermes", "hermes": "hermes",
    "llama3": "llama3", "llama3_json": "llama3",
    "mistral": "mistral",
    "gpt-oss": HARMONY, "openai": HARMONY,
}


def tool_format(name: str | None) -> str | None:
    return TOOL_CALL_PARSERS.get(name) if name else None


def json_parser_class(fmt: str | None) -> type[JsonToolParser] | None:
    """The parser class of a JSON tool format (hermes, llama3, mistral); None for harmony and for no format."""
    cls = _FORMATS.get(fmt) if fmt else None
    return cls if isinstance(cls, type) else None


def tool_parser_for(name: str | None) -> OutputParser | None:
    """A fresh JSON-format parser for the flag value ``name``; None for none, and for gpt-oss (harmony: the
    pipeline's harmony parser reads its calls)."""
    cls = json_parser_class(tool_format(name))
    return cls() if cls is not None else None


# ---------------------------------------------------------------- forced calls (tool_choice required / named)

def _call_format(fmt: str | None, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """One call as an xgrammar structural-tag format: the model's call syntax around the arguments' schema."""
    n = json.dumps(name, ensure_ascii=False)
    schema = {"type": "json_schema", "json_schema": parameters if parameters else {"type": "object"}}
    if fmt == HARMONY:  # the harmony spec's call: a commentary message to the function, JSON arguments
        begin, end = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", "<|call|>"
    elif fmt == "hermes":
        begin, end = f'<tool_call>\n{{"name": {n}, "arguments": ', "}\n</tool_call>"
    elif fmt == "mistral":
        begin, end = f'{{"name": {n}, "arguments": ', "}"
    else:  # llama3 and the bare JSON list
        begin, end = f'{{"name": {n}, "parameters": ', "}"
    return {"type": "sequence", "elements": [{"type": "const_string", "value": begin}, schema,
                                             {"type": "const_string", "value": end}]}


_SEPARATORS = {"hermes": "\n", "llama3": "; ", "mistral": ", ", None: ", "}
_AROUND = {"mistral": ("[TOOL_CALLS][", "]"), None: ("[", "]")}


def forced_call_grammar(fmt: str | None, functions: list[dict[str, Any]], parallel: bool) -> str:
    """The structural tag (JSON text, SamplingParams.structural_tag) of an output that is one call (or, with
    ``parallel``, one or more) of ``functions`` (OpenAI function objects: name, parameters) in format ``fmt``
    (None: the bare JSON list of JsonListToolParser)."""
    calls = [_call_format(fmt, f["name"], f.get("parameters")) for f in functions]
    one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    body = one
    if parallel and fmt != HARMONY:  # a harmony message holds one call, and <|call|> ends the generation
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": _SEPARATORS[fmt]}, one]}
        body = {"type": "sequence", "elements": [one, {"type": "star", "content": more}]}
    if fmt in _AROUND:
        begin, end = _AROUND[fmt]
        body = {"type": "sequence", "elements": [{"type": "const_string", "value": begin}, body,
                                                 {"type": "const_string", "value": end}]}
    return json.dumps({"type": "structural_tag", "format": body}, ensure_ascii=False)


def forced_call_parser(fmt: str | None) -> OutputParser:
    """The parser of what forced_call_grammar(fmt, ...) generates."""
    return (json_parser_class(fmt) or JsonListToolParser)()
