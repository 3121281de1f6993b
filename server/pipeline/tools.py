"""Tool calling on /v1/chat/completions: the request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ->
what the chat template sees, the grammar of a forced call, and each choice's output parser
(server/pipeline/parsing/pipeline.py); the parsers and formats are in server/pipeline/parsing/tool_registry.py.

- ``tools`` reach the chat template as ``tools`` (transformers' apply_chat_template), also with ``tool_choice: none``
  (as vLLM and OpenAI: the model knows the tools but calls are not read out of its output).
- ``auto`` (the default with tools): the server's tool-call parser reads calls out of the output; without one
  (no ``--tool-call-parser`` and none detected) the output stays content.
- ``required`` and a named function are enforced by a grammar (SamplingParams.structural_tag) in the parser's format,
  arguments following the function's ``parameters`` schema; without a parser the output is constrained to a JSON
  list ``[{"name": ..., "parameters": {...}}]`` (vLLM's form) and read back as calls. gpt-oss (harmony) calls are
  read but not enforced.
- assistant messages' ``tool_calls`` reach the template with ``arguments`` as a dict (what Qwen's, Llama's and
  Mistral's templates expect; a string that is not a JSON object stays a string).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.grammar.spec import grammar_spec
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.runtime.tokenizer_protocol import Tokenizer
from tierlm.server.api.openai.protocol import (ChatCompletionRequest, ChatMessage, DeltaFunctionCall, DeltaToolCall,
                                               FunctionCallOut, ToolCallOut)
from tierlm.server.pipeline.parsing.base import OutputParser, ToolCallDelta
from tierlm.server.pipeline.parsing.pipeline import ChoiceParser, assemble_calls, merge_call_deltas
from tierlm.server.pipeline.parsing.tool_parsers import new_call_id
from tierlm.server.pipeline.parsing.tool_registry import (HARMONY, forced_call_grammar, forced_call_parser,
                                                          json_parser_class, tool_format)


@dataclass
class ToolPlan:
    """What one request does about tools (the same for each of its choices)."""

    parse: bool = False  # read calls out of the output
    fmt: str | None = None  # tool_registry format: hermes | llama3 | mistral | harmony | None (bare JSON list)
    grammar: str | None = None  # the structural tag of a forced call
    parallel: bool = True
    harmony: bool = False  # the server's reasoning parser is harmony's (ChatFormat.harmony), which reads calls too

    def parser(self, reasoning: OutputParser | None) -> ChoiceParser | None:
        """A fresh parser for one choice; ``reasoning``: the server's reasoning parser for it (or None)."""
        if not self.parse:
            return None if reasoning is None else ChoiceParser(reasoning)
        if self.fmt == HARMONY:
            if reasoning is None or not self.harmony:
                reasoning = _harmony_parser() or reasoning
            return ChoiceParser(reasoning, None, self.parallel)
        if reasoning is not None and self.harmony:
            return ChoiceParser(reasoning, None, self.parallel)  # harmony reads the calls itself
        cls = json_parser_class(self.fmt)
        tools = forced_call_parser(self.fmt) if self.grammar else (cls() if cls is not None else None)
        return ChoiceParser(reasoning, tools, self.parallel)


def _harmony_parser() -> OutputParser | None:
    try:
        from tierlm.server.pipeline.parsing.harmony import HarmonyParser
    except ImportError:
        return None
    return HarmonyParser()


def check_tools(body: ChatCompletionRequest) -> None:
    """400s as vLLM and OpenAI answer them: tool_choice without tools, a named function that is not a tool."""
    choice = body.tool_choice
    if choice is not None and not body.tools:
        raise RequestError("tool_choice is only allowed when tools are given", 400, param="tool_choice")
    if choice is not None and not isinstance(choice, str):
        names = [t.function.name for t in body.tools or []]
        if choice.function.name not in names:
            raise RequestError(f"tool_choice names the function '{choice.function.name}', which is not in tools "
                               f"({', '.join(names)})", 400, param="tool_choice")


def tool_plan(engine: EngineAPI, body: ChatCompletionRequest) -> ToolPlan:
    check_tools(body)
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    parallel = body.parallel_tool_calls is not False
    if not body.tools or choice == "none":
        return ToolPlan(parallel=parallel)
    fmt, harmony = tool_format(engine.chat_format.tool_call_parser), engine.chat_format.harmony
    if choice == "auto":
        return ToolPlan(parse=fmt is not None, fmt=fmt, parallel=parallel, harmony=harmony)
    if fmt == HARMONY:
        parallel = False  # one commentary message per call; <|call|> ends the generation
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    if choice != "required":
        functions = [f for f in functions if f["name"] == choice.function.name]
        parallel = False
    return ToolPlan(parse=True, fmt=fmt, grammar=forced_call_grammar(fmt, functions, parallel), parallel=parallel,
                    harmony=harmony)


def keeps_special_tokens(plan: ToolPlan, tokenizer: Tokenizer) -> bool:
    """The format's markers are special tokens of this tokenizer (Mistral's [TOOL_CALLS], Llama's <|python_tag|>):
    decode with them, or the parser never sees them."""
    if plan.parse and plan.fmt == HARMONY:
        return True  # harmony's channel markers
    cls = json_parser_class(plan.fmt) if plan.parse else None
    if cls is None:
        return False
    special = set(tokenizer.all_special_tokens)
    return any(m in special for m in (*cls.markers, cls.end_marker) if m)


def apply_tool_grammar(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """A forced call's grammar onto one choice's checked SamplingParams; 400 next to another constraint."""
    if plan.grammar is None:
        return params
    spec = grammar_spec(params)
    if spec is not None:
        raise RequestError("tool_choice 'required' or a named function is enforced with a grammar, so it cannot be "
                           f"combined with '{spec.param}'", 400, param="tool_choice", code="conflicting_constraints")
    params.structural_tag = plan.grammar
    params.grammar_param = "tools"  # a parameters schema that does not compile is named by its 400
    return params


def template_tools(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's ``tools`` keyword (none without tools)."""
    if not body.tools:
        return {}
    return {"tools": [t.model_dump(exclude_none=True) for t in body.tools]}


def template_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Messages with the arguments of assistant tool calls as dicts, as chat templates read them."""
    out = []
    for m in messages:
        if m.tool_calls:
            m = m.model_copy(update={"tool_calls": [_with_dict_arguments(c) for c in m.tool_calls]})
        out.append(m)
    return out


def _with_dict_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}


def delta_tool_calls(deltas: list[ToolCallDelta]) -> list[DeltaToolCall] | None:
    """A streamed chunk's ``delta.tool_calls`` (OpenAI's shape) from a parser's pieces; None without any."""
    if not deltas:
        return None
    return [DeltaToolCall(index=t.index, id=t.id, type="function" if t.id else None,
                          function=DeltaFunctionCall(name=t.name, arguments=t.arguments))
            for t in merge_call_deltas(deltas)]


def message_tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCallOut] | None:
    """``message.tool_calls`` from all pieces of one choice; None without calls."""
    calls = assemble_calls(deltas)
    if not calls:
        return None
    return [ToolCallOut(id=c["id"] or new_call_id(), function=FunctionCallOut(**c["function"])) for c in calls]


def tool_finish_reason(parser: ChoiceParser | None, reason: str | None) -> str | None:
    """``tool_calls`` when the choice called a tool and ended on its own (not at max_tokens)."""
    if reason == "stop" and parser is not None and parser.called:
        return "tool_calls"
    return reason
