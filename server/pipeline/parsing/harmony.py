"""gpt-oss's harmony output -> reasoning (analysis channel), content (final channel) and tool calls (commentary
channel addressed ``to=functions.NAME``), parsed from the text of the model's own special tokens.

The harmony format (OpenAI's "harmony response format" guide): a message is
``<|start|>{role}{header}<|message|>{text}{end}`` where the header names the channel (``<|channel|>analysis``,
``commentary`` or ``final``), optionally a recipient (``to=functions.get_weather``, in the role part or after the
channel name) and a content type (``<|constrain|>json`` or a bare ``json``), and ``{end}`` is ``<|end|>``,
``<|call|>`` (the message is a tool call; generation stops) or ``<|return|>`` (the final answer is done; generation
stops). The prompt ends with ``<|start|>assistant``, so the output begins inside the first header, e.g.::

    <|channel|>analysis<|message|>User asks weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The server decodes with special tokens kept while this parser is active (``skip_special_tokens=False``); the
markers never reach the client. ``<|call|>`` and ``<|return|>`` are stop tokens, so their text is usually absent
and ``finish`` closes the open message. The openai-harmony library is not used: it downloads its vocabulary
file on first use, which an offline machine cannot do.

What goes where: analysis -> reasoning; final -> content; commentary addressed to ``functions.NAME`` -> a tool
call named NAME whose arguments are the message text; commentary without a recipient (a "preamble" the model
shows the user) -> content; a message addressed to any other recipient (built-in tools such as ``browser.search``
or ``python``) -> reasoning. Text outside any message (an output that is not harmony at all) is content.
"""
from __future__ import annotations

import re
import uuid
from typing import Callable

from tierlm.server.pipeline.parsing.base import ParsedDelta, StepParser, ToolCallDelta

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
# What a header may begin with: the first one follows the prompt's "<|start|>assistant".
_HEADER_OPENINGS = (CHANNEL, START, " to=", "to=", CONSTRAIN)
MAX_HEADER_CHARS = 256  # a longer "header" without <|message|> is not one: its text is content
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)")

_REASONING, _CONTENT, _TOOL = "reasoning", "content", "tool"


def _held_marker_prefix(text: str) -> int:
    """How many trailing characters of ``text`` could be the start of a marker split across pieces."""
    start = text.rfind("<", max(0, len(text) - max(map(len, MARKERS)) + 1))
    while start != -1:
        tail = text[start:]
        if any(m.startswith(tail) for m in MARKERS):
            return len(tail)
        start = text.find("<", start + 1)
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class HarmonyParser(StepParser):
    """An OutputParser (server/pipeline/parsing/base.py) for one gpt-oss choice."""

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        self._call_id = call_id
        self._buf = ""
        self._state = "header"  # header | body | outside
        self._first_header = True  # the first header follows the prompt; it must look like one
        self._kind = _CONTENT  # the current body's destination
        self._tool_index = -1

    def _flush(self, out: ParsedDelta) -> None:
        # What is left is an unterminated header (generation stopped inside one): markup, not text.
        self._buf = ""

    # ---------------------------------------------------------------- states
    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """Consume what the buffer determines; True when the state changed and there may be more to do."""
        if self._state == "header":
            return self._header(out, final)
        if self._state == "outside":
            return self._outside(out, final)
        return self._body(out, final)

    def _header(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        if self._first_header and not _could_open_header(buf):
            self._to_body(_CONTENT)  # not harmony: plain text is content
            return True
        i = buf.find(MESSAGE)
        if i == -1:
            if "\n" in buf or len(buf) > MAX_HEADER_CHARS:  # not a header: its text is content
                self._to_body(_CONTENT)
                return True
            return False
        header, self._buf = buf[:i], buf[i + len(MESSAGE):]
        self._first_header = False
        channel, recipient = parse_header(header)
        if recipient and recipient.startswith("functions."):
            self._tool_index += 1
            out.tool_calls.append(ToolCallDelta(index=self._tool_index, id=self._call_id(),
                                                name=recipient[len("functions."):]))
            self._to_body(_TOOL)
        elif recipient or channel == "analysis":
            self._to_body(_REASONING)
        else:  # final, a commentary preamble, or a channel harmony does not define
            self._to_body(_CONTENT)
        return True

    def _outside(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        if not buf:
            return False
        if buf.startswith(START):
            self._buf = buf[len(START):]
            self._state = "header"
            return True
        if buf.startswith(CHANNEL):  # "<|start|>assistant" left out: the header starts at the channel
            self._state = "header"
            return True
        if START.startswith(buf) or CHANNEL.startswith(buf):
            if final:
                self._buf = ""
            return False
        self._to_body(_CONTENT)  # text between messages
        return True

    def _body(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        hits = [(buf.find(m), m) for m in (END, CALL, RETURN, START, CHANNEL, MESSAGE, CONSTRAIN)]
        hits = [(i, m) for i, m in hits if i != -1]
        if not hits:
            keep = 0 if final else _held_marker_prefix(buf)
            self._emit(out, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        i, marker = min(hits)
        self._emit(out, buf[:i])
        rest = buf[i + len(marker):]
        if marker in (END, CALL, RETURN):
            self._buf, self._state = rest, "outside"
        elif marker == START:  # a new message without the end of this one
            self._buf, self._state = rest, "header"
        elif marker == CHANNEL:
            self._buf, self._state = buf[i:], "header"
        else:  # a stray <|message|> or <|constrain|> inside a message: drop the marker, keep the text
            self._buf = rest
        return True

    # ---------------------------------------------------------------- helpers
    def _to_body(self, kind: str) -> None:
        self._state, self._kind, self._first_header = "body", kind, False

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        if self._kind == _REASONING:
            out.reasoning += text
        elif self._kind == _TOOL:
            out.tool_calls.append(ToolCallDelta(index=self._tool_index, arguments=text))
        else:
            out.content += text


def _could_open_header(buf: str) -> bool:
    return any(buf.startswith(o) or o.startswith(buf) for o in _HEADER_OPENINGS)


def parse_header(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of a message header such as ``assistant<|channel|>commentary to=functions.f
    <|constrain|>json`` (the role part may hold the recipient instead: ``assistant to=functions.f<|channel|>...``)."""
    _, _, channel_part = header.partition(CHANNEL)
    m = _CHANNEL_NAME.match(channel_part)
    channel = m.group(1) if m and not channel_part.lstrip().startswith("to=") else ""
    r = _RECIPIENT.search(header)
    return channel, (r.group(1) if r else None)
