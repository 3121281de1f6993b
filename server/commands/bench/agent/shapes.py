"""The recorded wire shapes of real coding agents (recorded/*.json, written by `tierlm bench agent --record`), and
their trimmed variants.

A shape file holds what one client sent to a capture server (record.py): the request headers (secrets removed), the
endpoint, the full first request of a session, and the messages or items each kind of turn appends (``$PATH`` and
``$FILE`` where the file a tool read goes). Claude Code's also holds an Explore sub-agent's first request and the
main session's Agent call. The replay (sessions.py) builds every request from these, so what a server sees is the
client's real tools, instructions and turn structure.

Trimming (``--trim-tools``, ``--instructions-chars``) keeps the structure (every block, message and item stays where
the client puts it, the tools the replay calls stay) and cuts the size: a CPU test cannot prefill Claude Code's
~65k-token first request in seconds.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

CLIENTS = ("claude-code", "codex")
SHAPE_FILES = {"claude-code": "claude_code.json", "codex": "codex.json"}
# the tools the replay calls: kept by --trim-tools whatever N is
CALLED_TOOLS = {"claude-code": ("Read", "Agent"), "codex": ("exec_command",)}
BILLING_PREFIX = "x-anthropic-billing-header:"
REQUIRED_KEYS = {"claude-code": ("headers", "endpoint", "first_request", "tool_turn", "final_turn",
                                 "subagent_first_request", "subagent_call", "subagent_headers"),
                 "codex": ("headers", "endpoint", "first_request", "tool_turn", "final_turn")}


class ShapeError(ValueError):
    """A shape file that does not hold what the replay needs."""


@dataclass(frozen=True)
class Shape:
    """One client's recorded shape (the JSON file's fields), plus what trimming did to it."""

    client: str
    data: dict[str, Any]
    trimmed: tuple[str, ...] = field(default_factory=tuple)  # what was cut, for the report

    @property
    def endpoint(self) -> str:
        return str(self.data["endpoint"])

    @property
    def path(self) -> str:
        """The endpoint without its query (``/v1/messages?beta=true`` -> ``/v1/messages``)."""
        return self.endpoint.split("?", 1)[0]

    def part(self, key: str) -> Any:
        """A deep copy of one field: builders change their copy, never the shape."""
        return copy.deepcopy(self.data[key])

    @property
    def label(self) -> str:
        return str(self.data.get("client") or self.client)


def shape_text(client: str) -> str:
    """The packaged shape file's text (``recorded/<name>.json`` inside tierlm)."""
    if client not in SHAPE_FILES:
        raise ShapeError(f"no recorded shape for {client!r}; recorded clients: {', '.join(CLIENTS)}")
    return resources.files(__package__).joinpath("recorded").joinpath(SHAPE_FILES[client]).read_text(encoding="utf-8")


def load_shape(client: str, text: str | None = None) -> Shape:
    """The recorded shape of ``client`` (or the shape in ``text``), checked for the fields the replay reads."""
    data = json.loads(shape_text(client) if text is None else text)
    missing = [k for k in REQUIRED_KEYS[client] if k not in data]
    if missing:
        raise ShapeError(f"the {client} shape lacks {', '.join(missing)}; record it again with "
                         f"`tierlm bench agent --record {client} --record-out FILE`")
    return Shape(client, data)


# ---------------------------------------------------------------- trimming
def trim(shape: Shape, tools: int | None, chars: int | None) -> Shape:
    """``shape`` with at most ``tools`` tools per request (the called ones kept) and every instruction text (system
    blocks but the billing header, mid-conversation system messages, developer messages, the environment context,
    tool descriptions) cut to ``chars`` characters; the user's prompts and the turns are left as they are."""
    if tools is None and chars is None:
        return shape
    data = copy.deepcopy(shape.data)
    requests = [data["first_request"]] + ([data["subagent_first_request"]] if "subagent_first_request" in data
                                          else [])
    notes = []
    for body in requests:
        before = _size(body)
        if tools is not None:
            body["tools"] = _kept_tools(body.get("tools") or [], CALLED_TOOLS[shape.client], tools)
        if chars is not None:
            _cut_instructions(body, chars, shape.client)
        notes.append(f"{_name(body)}: {before} -> {_size(body)} JSON chars")
    what = ([f"{tools} tools per request (the ones the replay calls kept)"] if tools is not None else []) + \
        ([f"instructions and tool descriptions cut to {chars} chars"] if chars is not None else [])
    return replace(shape, data=data, trimmed=(", ".join(what) + " (" + "; ".join(notes) + ")",))


def _size(body: dict[str, Any]) -> int:
    return len(json.dumps(body))


def _name(body: dict[str, Any]) -> str:
    system = body.get("system")
    if isinstance(system, list) and any("cc_is_subagent=true" in str(b.get("text", "")) for b in system):
        return "sub-agent first request"
    return "first request"


def _tool_name(tool: dict[str, Any]) -> str:
    return str(tool.get("name") or tool.get("type") or "")


def _kept_tools(tools: list[dict[str, Any]], called: tuple[str, ...], n: int) -> list[dict[str, Any]]:
    """The called tools plus the first others, in the client's order, up to ``n`` (never fewer than the called)."""
    keep = {id(t) for t in tools if _tool_name(t) in called}
    for t in tools:
        if len(keep) >= n:
            break
        keep.add(id(t))
    return [t for t in tools if id(t) in keep]


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars]


def _cut_instructions(body: dict[str, Any], chars: int, client: str) -> None:
    """In place: see ``trim``."""
    for tool in body.get("tools") or []:
        _cut_descriptions(tool, chars)
    if client == "claude-code":
        for block in body.get("system") or []:
            if not str(block.get("text", "")).startswith(BILLING_PREFIX):
                block["text"] = _cut(block["text"], chars)
        for m in body.get("messages") or []:
            if m["role"] == "system" and isinstance(m["content"], str):
                m["content"] = _cut(m["content"], chars)
            elif m["role"] == "user" and isinstance(m["content"], list):
                for block in m["content"][:-1]:  # the reminders; the last block is the user's prompt
                    if block.get("type") == "text":
                        block["text"] = _cut(block["text"], chars)
        return
    items = body.get("input") or []
    prompt = max((i for i, it in enumerate(items) if it.get("role") == "user"), default=-1)
    for i, item in enumerate(items):
        if item.get("type") == "message" and item.get("role") in ("developer", "system", "user") and i != prompt:
            for part in item.get("content") or []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = _cut(part["text"], chars)
    if isinstance(body.get("instructions"), str):
        body["instructions"] = _cut(body["instructions"], chars)


def _cut_descriptions(tool: dict[str, Any], chars: int) -> None:
    if isinstance(tool.get("description"), str):
        tool["description"] = _cut(tool["description"], chars)
    for inner in tool.get("tools") or []:  # a Responses namespace group
        if isinstance(inner, dict):
            _cut_descriptions(inner, chars)
