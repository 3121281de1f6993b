"""One choice's output parsing: the reasoning parser (optional) first, then the tool-call parser (optional) over
the content it leaves. gpt-oss's harmony parser yields reasoning, content and tool calls by itself and runs alone
(as ``reasoning``, with ``tools`` None)."""
from __future__ import annotations

from tierlm.server.pipeline.parsing.base import OutputParser, ParsedDelta, ToolCallDelta


class ChoiceParser:
    """Keeps OutputParser's contract (feed any split, finish flushes). With ``parallel_tool_calls`` False only the
    first call is kept (OpenAI: at most one call)."""

    def __init__(self, reasoning: OutputParser | None = None, tools: OutputParser | None = None,
                 parallel_tool_calls: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel_tool_calls
        self.called = False  # a tool call was produced: finish_reason "tool_calls"

    def feed(self, text: str) -> ParsedDelta:
        if self.reasoning is None:
            return self._keep(self._tools(ParsedDelta(content=text), final=False))
        return self._keep(self._tools(self.reasoning.feed(text), final=False))

    def finish(self) -> ParsedDelta:
        d = self.reasoning.finish() if self.reasoning is not None else ParsedDelta()
        return self._keep(self._tools(d, final=True))

    def _tools(self, d: ParsedDelta, final: bool) -> ParsedDelta:
        if self.tools is None:
            return d
        out = ParsedDelta(reasoning=d.reasoning, tool_calls=list(d.tool_calls))
        if d.content:
            out.extend(self.tools.feed(d.content))
        if final:
            out.extend(self.tools.finish())
        return out

    def _keep(self, d: ParsedDelta) -> ParsedDelta:
        if not self.parallel:
            d.tool_calls = [t for t in d.tool_calls if t.index == 0]
        if d.tool_calls:
            self.called = True
        d.tool_calls = merge_call_deltas(d.tool_calls)
        return d


def merge_call_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of the same call as one piece (its id and name, if any, first)."""
    merged: list[ToolCallDelta] = []
    for t in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.index == t.index and t.id is None and t.name is None:
            last.arguments += t.arguments
        else:
            merged.append(ToolCallDelta(index=t.index, id=t.id, name=t.name, arguments=t.arguments))
    return merged


def assemble_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """Complete calls (OpenAI's message.tool_calls) from all pieces of one choice, in index order."""
    calls: dict[int, dict] = {}
    for t in deltas:
        c = calls.setdefault(t.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if t.id:
            c["id"] = t.id
        if t.name:
            c["function"]["name"] = t.name
        c["function"]["arguments"] += t.arguments
    for c in calls.values():
        if not c["function"]["arguments"].strip():
            c["function"]["arguments"] = "{}"
    return [calls[i] for i in sorted(calls)]
