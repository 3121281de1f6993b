"""Captured requests of a client's recorded runs -> the shape file the replay reads (shapes.py's format): the
headers without secrets, the first request whole, and what each kind of turn appends, with the file a tool read
replaced by ``$PATH`` / ``$FILE``. A run that did not go as scripted is an ExtractError saying what was seen."""
from __future__ import annotations

import copy
import json
from typing import Any

from tierlm.server.commands.bench.agent.capture import Captured

SECRET_HEADERS = frozenset({"x-api-key", "authorization", "cookie", "proxy-authorization", "openai-organization",
                            "openai-project", "chatgpt-account-id"})
TRANSPORT_HEADERS = frozenset({"host", "content-length", "connection", "accept-encoding", "transfer-encoding"})


class ExtractError(RuntimeError):
    pass


def clean_headers(headers: dict[str, str]) -> dict[str, str]:
    """The client's own headers: secrets and the transport's (host, length, encoding) removed."""
    return {k: v for k, v in headers.items() if k.lower() not in SECRET_HEADERS | TRANSPORT_HEADERS}


def _calls(captured: list[Captured], path: str) -> list[Captured]:
    return [c for c in captured if c.method == "POST" and c.path == path and isinstance(c.body, dict)]


def _describe(calls: list[Captured]) -> str:
    return "; ".join(f"{c.path} with {len(c.body.get('messages') or c.body.get('input') or [])} messages/items"
                     for c in calls) or "none"


def _is_subagent(c: Captured) -> bool:
    return "x-claude-code-agent-id" in {k.lower() for k in c.headers} or any(
        "cc_is_subagent=true" in str(b.get("text", "")) for b in c.body.get("system") or [] if isinstance(b, dict))


def claude_code(first_run: list[Captured], continued_run: list[Captured], agent_run: list[Captured],
                client: str, recorded: str) -> dict[str, Any]:
    """The Claude Code shape from three runs: a session with Read rounds, its --continue, a sub-agent session."""
    main = [c for c in _calls(first_run, "/v1/messages") if c.body.get("tools")]
    cont = [c for c in _calls(continued_run, "/v1/messages") if c.body.get("tools")]
    agent = [c for c in _calls(agent_run, "/v1/messages") if c.body.get("tools")]
    sub = [c for c in agent if _is_subagent(c)]
    agent_main = [c for c in agent if not _is_subagent(c)]
    if len(main) < 2 or not cont or not sub or len(agent_main) < 2:
        raise ExtractError("Claude Code did not run the scripted sessions: first run: " + _describe(main)
                           + "; --continue run: " + _describe(cont) + "; sub-agent run: " + _describe(agent))
    tool_turn = copy.deepcopy(main[1].body["messages"][-2:])
    for block in tool_turn[0]["content"]:
        if block.get("type") == "tool_use":
            block["input"]["file_path"] = "$PATH"
    for block in tool_turn[1]["content"]:
        if block.get("type") == "tool_result":
            block["content"] = "$FILE"
    return {"client": client, "recorded": recorded, "endpoint": _endpoint(main[0]),
            "headers": clean_headers(main[0].headers), "first_request": main[0].body, "tool_turn": tool_turn,
            "final_turn": cont[-1].body["messages"][-2:], "subagent_first_request": sub[0].body,
            "subagent_call": agent_main[-1].body["messages"][-2:], "subagent_headers": clean_headers(sub[0].headers)}


def codex(first_run: list[Captured], resumed_run: list[Captured], client: str, recorded: str) -> dict[str, Any]:
    """The Codex shape from two runs: `codex exec` with exec_command rounds, then `codex exec resume --last`."""
    main = _calls(first_run, "/v1/responses")
    resumed = _calls(resumed_run, "/v1/responses")
    if len(main) < 2 or not resumed:
        raise ExtractError("Codex did not run the scripted session: exec run: " + _describe(main)
                           + "; resume run: " + _describe(resumed))
    first_items = main[0].body["input"]
    tool_turn = copy.deepcopy(main[1].body["input"][len(first_items):])
    for item in tool_turn:
        if item.get("type") == "function_call":
            args = json.loads(item["arguments"])
            item["arguments"] = json.dumps({**args, "cmd": "cat $PATH"})
        elif item.get("type") == "function_call_output":
            item["output"] = "$FILE"
    final = resumed[-1].body["input"][len(main[-1].body["input"]):]
    return {"client": client, "recorded": recorded, "endpoint": _endpoint(main[0]),
            "headers": clean_headers(main[0].headers), "first_request": main[0].body, "tool_turn": tool_turn,
            "final_turn": final}


def _endpoint(c: Captured) -> str:
    return c.path + (f"?{c.query}" if c.query else "")
