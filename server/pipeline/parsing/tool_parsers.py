"""Incremental tool-call parsers for the JSON tool formats (SGLang's names in tool_registry.py):

- hermes / qwen25: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- llama3: the output is ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), calls
  separated by ``;``;
- mistral: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}`` (or one object);
- json_list: the output is a bare JSON list of ``{"name": ..., "parameters": {...}}``: what a forced call
  (``tool_choice`` required or named) is constrained to when the model has no tool-call parser (vLLM's form).

Each parser keeps the contract of base.py: it is fed any split of the text and returns what is certain; a call is
streamed as OpenAI streams it (its first piece carries id and name once ``{"name": "...", "arguments": `` is seen,
then argument fragments as they are generated). Text that is not a call stays content: a marker followed by
something that is not a call object, or a call object that is not valid JSON, is given back as content,
markers included. Only whitespace between or after calls is dropped. A call object whose keys come in another
order (or without arguments) is recognised once it is complete, and then sent in one piece.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from tierlm.server.pipeline.parsing.base import ParsedDelta, StepParser, ToolCallDelta

_WS = " \t\r\n"
ARGS_KEYS = ('"arguments"', '"parameters"')


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is the beginning of ``marker`` (text to hold back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _More(Exception):
    """The text so far may still become what is expected."""


class _No(Exception):
    """The text so far can no longer become what is expected."""


def call_header(text: str) -> tuple[str, int]:
    """``{"name": "NAME", "arguments": `` (or ``"parameters"``) at the start of ``text``, whitespace anywhere JSON
    allows it: (NAME, index of the first character of the arguments value). Raises _More while ``text`` is a
    beginning of such a header (or ends before the value starts), _No when it cannot be one."""
    i = 0
    n = len(text)

    def ws() -> None:
        nonlocal i
        while i < n and text[i] in _WS:
            i += 1
        if i == n:
            raise _More

    def lit(options: tuple[str, ...]) -> None:
        nonlocal i
        for o in options:
            if text.startswith(o, i):
                i += len(o)
                return
        if any(o.startswith(text[i:]) for o in options):
            raise _More
        raise _No

    def string() -> str:
        nonlocal i
        if text[i] != '"':
            raise _No
        j = i + 1
        while j < n:
            c = text[j]
            if c == "\\":
                j += 2
                continue
            if c == '"':
                try:
                    value = json.loads(text[i:j + 1])
                except ValueError:
                    raise _No from None
                i = j + 1
                return value
            j += 1
        raise _More

    ws(); lit(("{",)); ws(); lit(('"name"',)); ws(); lit((":",)); ws()
    name = string()
    ws(); lit((",",)); ws(); lit(ARGS_KEYS); ws(); lit((":",)); ws()
    return name, i


class ValueScan:
    """Where one JSON object or array ends, fed piece by piece (strings and escapes understood)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False

    def feed(self, s: str) -> int | None:
        """Characters of ``s`` up to and including the value's last one, or None when it goes on."""
        for k, c in enumerate(s):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return k + 1
        return None


def call_from_json(value: Any, require_args: bool) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a parsed call object, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in ("arguments", "parameters") if k in value), None)
    if key is None and require_args:
        return None
    return value["name"], arguments_text(value.get(key) if key else None)


def arguments_text(args: Any) -> str:
    if args is None:
        return "{}"
    if isinstance(args, str):
        return args  # some models write the arguments as JSON text already
    return json.dumps(args, ensure_ascii=False)


class _CallReader:
    """One call object, from its ``{`` to its ``}``: streams name and arguments once the header is certain,
    otherwise waits for the whole object. ``owner.next_index()`` numbers the call when it is committed."""

    def __init__(self, owner: "JsonToolParser", require_args: bool) -> None:
        self.owner = owner
        self.require_args = require_args
        self.text = ""
        self.scan = ValueScan()
        self.state = "header"  # header | args | tail | whole | whole_named
        self.args_scan: ValueScan | None = None
        self.args_pos = 0
        self.index: int | None = None
        self.malformed = False

    @property
    def committed(self) -> bool:
        return self.index is not None

    def feed(self, s: str, out: ParsedDelta) -> tuple[int, bool]:
        """Consume ``s`` up to the object's end: (characters consumed, whether the object ended)."""
        end = self.scan.feed(s)
        take = s if end is None else s[:end]
        self.text += take
        self._advance(out)
        if end is not None:
            self._close(out)
        return len(take), end is not None

    def _commit(self, name: str, out: ParsedDelta, arguments: str = "") -> None:
        self.index = self.owner.next_index()
        out.tool_calls.append(ToolCallDelta(index=self.index, id=new_call_id(), name=name, arguments=arguments))

    def _advance(self, out: ParsedDelta) -> None:
        if self.state == "header":
            try:
                name, start = call_header(self.text)
            except _More:
                return
            except _No:
                self.state = "whole"
                return
            self._commit(name, out)
            if self.text[start] in "{[":
                self.state, self.args_scan, self.args_pos = "args", ValueScan(), start
            else:  # a string or other value: sent whole when the object is complete
                self.state = "whole_named"
        if self.state == "args":
            new = self.text[self.args_pos:]
            end = self.args_scan.feed(new)
            piece = new if end is None else new[:end]
            if piece:
                out.tool_calls.append(ToolCallDelta(index=self.index, arguments=piece))
            self.args_pos += len(piece)
            if end is not None:
                self.state = "tail"

    def _close(self, out: ParsedDelta) -> None:
        if self.state in ("header", "whole"):
            try:
                call = call_from_json(json.loads(self.text), self.require_args)
            except ValueError:
                call = None
            if call is None:
                self.malformed = True
            else:
                self._commit(call[0], out, call[1])
        elif self.state == "whole_named":
            self._send_whole_arguments(out)

    def _send_whole_arguments(self, out: ParsedDelta) -> None:
        try:
            value = json.loads(self.text)
        except ValueError:
            value = None
        call = call_from_json(value, False) if value is not None else None
        out.tool_calls.append(ToolCallDelta(index=self.index, arguments=call[1] if call else "{}"))

    def finish(self, out: ParsedDelta) -> None:
        """The output ended inside the object: a committed call keeps what it streamed; otherwise malformed."""
        if not self.committed:
            self.malformed = True
        elif self.state == "whole_named":
            self._send_whole_arguments(out)


class JsonToolParser(StepParser):
    """The state machine shared by the JSON tool formats. Configuration (class attributes):

    - ``markers``: texts that open a call region anywhere in the output;
    - ``bare_start``: ``{`` or ``[`` when a call region may open at the start of the output without a marker;
    - ``container``: ``block`` (one object, then ``end_marker``), ``list`` (a JSON list of objects, or one
      object) or ``semicolon`` (objects separated by ``;``);
    - ``require_args``: a complete object without arguments/parameters is not a call (formats without a marker,
      where a JSON answer must stay content).
    """

    markers: tuple[str, ...] = ()
    bare_start: str | None = None
    container = "block"
    end_marker = ""
    require_args = False

    def __init__(self) -> None:
        self._buf = ""
        self.mode = "text"  # text | open | list_item | call | after
        self.raw = ""  # consumed call-region text not yet given back or used by a call
        self.at_start = self.bare_start is not None
        self.in_list = False
        self.reader: _CallReader | None = None
        self.calls = 0
        self.pending_ws = ""

    def _flush(self, out: ParsedDelta) -> None:
        if self.mode == "call" and self.reader is not None:
            self.reader.finish(out)
            if self.reader.malformed:
                self._content(out, self.raw + self.reader.text)
            self.raw = ""
        elif self.mode in ("open", "list_item"):
            self._content(out, self.raw)  # a marker with no call after it
        if self._buf:
            self._content(out, self._buf)
        self._buf, self.raw, self.pending_ws = "", "", ""

    # ---------------------------------------------------------------- helpers
    def next_index(self) -> int:
        index = self.calls
        self.calls += 1
        self.pending_ws = ""  # whitespace between calls is not content
        return index

    def _content(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        if self.calls:  # after a call, whitespace alone is held: dropped unless more text follows
            text = self.pending_ws + text
            if not text.strip():
                self.pending_ws = text
                return
            self.pending_ws = ""
        out.content += text

    def _malformed(self, out: ParsedDelta) -> None:
        self._content(out, self.raw)
        self.raw, self.mode, self.in_list = "", "text", False

    def _skip_ws(self) -> bool:
        """Move leading whitespace of buf into raw; False when nothing else is buffered yet."""
        s = self._buf.lstrip(_WS)
        self.raw += self._buf[:len(self._buf) - len(s)]
        self._buf = s
        return bool(s)

    # ---------------------------------------------------------------- states
    def _step(self, out: ParsedDelta, final: bool) -> bool:
        return getattr(self, f"_{self.mode}")(out, final)

    def _text(self, out: ParsedDelta, final: bool) -> bool:
        if self.at_start:
            s = self._buf.lstrip(_WS)
            if not s:
                if final:
                    self._content(out, self._buf)
                    self._buf = ""
                return False
            self.at_start = False
            if s[0] == self.bare_start:
                self.raw, self._buf, self.mode = self._buf[:len(self._buf) - len(s)], s, "open"
                return True
        found = [(self._buf.find(m), m) for m in self.markers]
        found = [(i, m) for i, m in found if i >= 0]
        if found:
            i, m = min(found)
            self._content(out, self._buf[:i])
            self.raw, self._buf, self.mode = m, self._buf[i + len(m):], "open"
            return True
        hold = 0 if final else max((partial_marker_len(self._buf, m) for m in self.markers), default=0)
        self._content(out, self._buf[:len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold:]
        return False

    def _open(self, out: ParsedDelta, final: bool) -> bool:
        if not self._skip_ws():
            return False
        c = self._buf[0]
        if self.container == "list" and c == "[" and not self.in_list:
            self.raw += c
            self._buf, self.in_list, self.mode = self._buf[1:], True, "list_item"
            return True
        if c == "{":
            self.reader, self.mode = _CallReader(self, self.require_args), "call"
            return True
        self._malformed(out)
        return True

    def _list_item(self, out: ParsedDelta, final: bool) -> bool:
        if not self._skip_ws():
            return False
        c = self._buf[0]
        if c == "{":
            self.reader, self.mode = _CallReader(self, self.require_args), "call"
            return True
        if c == "]":
            self._buf = self._buf[1:]
            self.raw, self.mode, self.in_list = "", "text", False  # an empty list: nothing to say
            return True
        self._malformed(out)
        return True

    def _call(self, out: ParsedDelta, final: bool) -> bool:
        if not self._buf:
            return False
        consumed, ended = self.reader.feed(self._buf, out)
        self._buf = self._buf[consumed:]
        if not ended:
            return False
        if self.reader.malformed:
            self.raw += self.reader.text
            self._malformed(out)
        else:
            self.raw, self.mode = "", "after"
        self.reader = None
        return True

    def _after(self, out: ParsedDelta, final: bool) -> bool:
        s = self._buf.lstrip(_WS)
        if not s:
            self._buf = "" if final else self._buf
            return False
        if self.container == "block":
            if s.startswith(self.end_marker):
                self._buf, self.mode = s[len(self.end_marker):], "text"
                return True
            if self.end_marker.startswith(s) and not final:
                return False  # maybe the end marker, still arriving
            self._buf, self.mode = s, "text"  # no end marker: what follows is content
            return True
        sep = "," if self.container == "list" else ";"
        if s[0] == sep and (self.in_list or self.container == "semicolon"):
            self._buf, self.mode = s[1:], ("list_item" if self.container == "list" else "open")
            return True
        if s[0] == "]" and self.in_list:
            self._buf, self.mode, self.in_list = s[1:], "text", False
            return True
        self._buf, self.mode, self.in_list = s, "text", False
        return True


class HermesToolParser(JsonToolParser):
    """hermes / qwen25 (Qwen2.5, Qwen3, Hermes models)."""

    markers = ("<tool_call>",)
    container = "block"
    end_marker = "</tool_call>"


class Llama3ToolParser(JsonToolParser):
    """llama3 (Llama 3.1-3.3 JSON tool calls): the output starts with the call object, or with
    ``<|python_tag|>``; calls separated by ``;``."""

    markers = ("<|python_tag|>",)
    bare_start = "{"
    container = "semicolon"
    require_args = True


class MistralToolParser(JsonToolParser):
    """mistral: ``[TOOL_CALLS]`` (a special token in Mistral's tokenizers) then a JSON list of calls."""

    markers = ("[TOOL_CALLS]",)
    container = "list"


class JsonListToolParser(JsonToolParser):
    """The bare JSON list a forced call is constrained to when the model has no tool-call parser."""

    bare_start = "["
    container = "list"
    require_args = True
