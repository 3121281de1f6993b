"""The contract every chat output parser keeps (reasoning parsers, tool-call parsers, the harmony parser).

A parser is fed the generated text of one choice in the pieces the engine streams (any split, even mid-token
text) and returns what can be said for sure so far; ``finish`` flushes what it held back. Concatenating every
returned part gives the same result as parsing the whole text at once, and no text is ever lost: what is not
reasoning and not a tool call is content.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCallDelta:
    """A piece of one tool call: the first piece of call ``index`` carries its id and name, later ones only
    fragments of the JSON arguments text (OpenAI's streaming shape)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: "ParsedDelta") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


class OutputParser(Protocol):
    def feed(self, text: str) -> ParsedDelta:
        """The parts that the text generated so far (this piece included) determines."""

    def finish(self) -> ParsedDelta:
        """Everything still held back, at the end of the generation."""


class StepParser:
    """The loop the stateful parsers share: the text is buffered in ``_buf`` and ``_step`` consumes what the buffer
    determines until it reports no more progress; at the end ``_flush`` handles what the state machine left."""

    _buf: str

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        self._flush(out)
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """Consume what the buffer determines; True when there may be more to do."""
        raise NotImplementedError

    def _flush(self, out: ParsedDelta) -> None:
        """What is still held at the end of the generation (nothing, unless a parser says otherwise)."""
