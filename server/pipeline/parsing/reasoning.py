"""Reasoning parsers (``--reasoning-parser``, SGLang's names): the model's thinking text -> ``reasoning_content``,
the answer -> ``content``.

- ``qwen3``: ``<think>...</think>`` at the start of the output; an output that does not open with ``<think>`` is all
  content (``enable_thinking: false``). When the prompt already ends with ``<think>`` (templates that open the
  block themselves, e.g. Qwen3 thinking-2507), the output starts inside it. ``<tool_call>`` before ``</think>``
  also ends the thinking (the call stays in the content, for the tool-call parser).
- ``qwen3-thinking``: as qwen3, always starting inside the thinking block.
- ``deepseek-r1``: the template adds ``<think>\\n`` to the prompt, so the output starts inside the thinking and
  ends it at ``</think>``; a leading ``<think>`` the model repeats (R1-0528) is dropped.
- ``gpt-oss``: the harmony channels (server/pipeline/parsing/harmony.py), which also yields tool calls.

Thinking that never ends (``max_tokens`` reached, malformed output) is all reasoning. The newlines the formats put
around the tags (``<think>\\n``, ``\\n</think>\\n\\n``) are formatting, not text: they are dropped from the edges of
the reasoning and from the start of the content (as the models' own templates do when they render a previous
turn); every other character reaches the client.
"""
from __future__ import annotations

from tierlm.server.pipeline.parsing.base import OutputParser, ParsedDelta, StepParser
from tierlm.server.pipeline.parsing.harmony import HarmonyParser

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSER_NAMES = ("deepseek-r1", "gpt-oss", "qwen3", "qwen3-thinking")
HARMONY = "gpt-oss"  # the reasoning parser that is also the tool-call parser


class ThinkTagParser(StepParser):
    """Reasoning between ``<think>`` and ``</think>`` at the start of the output (an OutputParser)."""

    def __init__(self, in_reasoning: bool = False, implicit_ends: tuple[str, ...] = ()) -> None:
        self._forced = in_reasoning  # the output starts inside the thinking (the prompt opened it)
        self._implicit_ends = implicit_ends  # markers that end the thinking and stay in the content
        self._state = "start"  # start | reasoning | content_start | content
        self._buf = ""
        self._reasoning_started = False  # leading newlines of the reasoning are dropped until text comes

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        if self._state == "start":
            head = buf.lstrip()
            if head.startswith(THINK_START):
                self._buf, self._state = head[len(THINK_START):], "reasoning"
                return True
            if THINK_START.startswith(head) and not final:
                return False  # "", "<", "<thi", ...: wait for the next piece
            self._state = "reasoning" if self._forced else "content"
            return True
        if self._state == "reasoning":
            return self._reasoning(out, final)
        if self._state == "content_start":
            rest = buf.lstrip("\n")
            if not rest:
                if final:
                    self._buf = ""
                return False
            self._buf, self._state = rest, "content"
            return True
        out.content += buf
        self._buf = ""
        return False

    def _reasoning(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        if not self._reasoning_started:
            buf = self._buf = buf.lstrip("\n")
            if not buf:
                return False
            self._reasoning_started = True
        hits = [(buf.find(m), m) for m in (THINK_END, *self._implicit_ends)]
        hits = [(i, m) for i, m in hits if i != -1]
        if hits:
            i, marker = min(hits)
            out.reasoning += buf[:i].rstrip("\n")
            self._buf = buf[i + len(THINK_END):] if marker == THINK_END else buf[i:]
            self._state = "content_start"
            return True
        if final:
            out.reasoning += buf.rstrip("\n")
            self._buf = ""
            return False
        keep = _partial_suffix(buf, (THINK_END, *self._implicit_ends))
        ready = buf[:len(buf) - keep]
        ready_trimmed = ready.rstrip("\n")  # newlines right before </think> are dropped: hold them
        out.reasoning += ready_trimmed
        self._buf = buf[len(ready_trimmed):]
        return False


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(text), len(m) - 1), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ReasoningAsContent:
    """A parser whose reasoning is handed out as content (``separate_reasoning: false`` with gpt-oss)."""

    def __init__(self, inner: OutputParser) -> None:
        self._inner = inner

    def feed(self, text: str) -> ParsedDelta:
        return self._merge(self._inner.feed(text))

    def finish(self) -> ParsedDelta:
        return self._merge(self._inner.finish())

    @staticmethod
    def _merge(d: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(content=d.reasoning + d.content, tool_calls=d.tool_calls)


class HeldReasoning:
    """A parser whose reasoning is handed out in one piece, when it ends (``stream_reasoning: false``)."""

    def __init__(self, inner: OutputParser) -> None:
        self._inner = inner
        self._held = ""

    def feed(self, text: str) -> ParsedDelta:
        return self._hold(self._inner.feed(text), final=False)

    def finish(self) -> ParsedDelta:
        return self._hold(self._inner.finish(), final=True)

    def _hold(self, d: ParsedDelta, final: bool) -> ParsedDelta:
        self._held += d.reasoning
        d.reasoning = ""
        if self._held and (final or d.content or d.tool_calls):
            d.reasoning, self._held = self._held, ""
        return d


def reasoning_parser_for(name: str, *, separate_reasoning: bool = True, stream_reasoning: bool = True,
                         starts_in_reasoning: bool | None = None) -> OutputParser | None:
    """A fresh parser for one choice; None when nothing is to be separated.

    ``stream_reasoning=False`` (SGLang's field): the reasoning comes in one piece when it ends, before the first
    content. The other arguments are described in ``_parser``."""
    parser = _parser(name, separate_reasoning, starts_in_reasoning)
    if parser is not None and separate_reasoning and not stream_reasoning:
        return HeldReasoning(parser)
    return parser


def _parser(name: str, separate_reasoning: bool, starts_in_reasoning: bool | None) -> OutputParser | None:
    """A fresh parser for one choice; None when nothing is to be separated.

    ``separate_reasoning=False`` (a request's choice, as SGLang's field): the ``<think>`` formats return the text
    as generated (None), gpt-oss puts the analysis text into the content (markers are always removed).
    ``starts_in_reasoning``: True when the prompt already opened the thinking block (``prompt_opens_thinking``);
    None keeps the format's default.
    """
    if name == HARMONY:
        return HarmonyParser() if separate_reasoning else ReasoningAsContent(HarmonyParser())
    if name not in REASONING_PARSER_NAMES:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSER_NAMES)}")
    if not separate_reasoning:
        return None
    if name == "deepseek-r1":
        return ThinkTagParser(in_reasoning=True)
    if name == "qwen3-thinking":
        return ThinkTagParser(in_reasoning=True, implicit_ends=("<tool_call>",))
    return ThinkTagParser(in_reasoning=bool(starts_in_reasoning), implicit_ends=("<tool_call>",))


def prompt_opens_thinking(prompt_text_tail: str) -> bool:
    """Whether a rendered prompt (its last characters suffice) ends inside an opened ``<think>`` block."""
    tail = prompt_text_tail.rstrip()
    return tail.endswith(THINK_START)


def needs_special_tokens(name: str | None, special_tokens: list[str] | tuple[str, ...]) -> bool:
    """Whether requests parsed by ``name`` must decode with special tokens kept: harmony's markers are special
    tokens; ``<think>``/``</think>`` are ordinary added tokens in Qwen3's and DeepSeek-R1's tokenizers, but a
    tokenizer that marks them special would otherwise drop them."""
    if not name:
        return False
    if name == HARMONY:
        return True
    return THINK_START in special_tokens or THINK_END in special_tokens
