"""One Claude Code session's requests, built from its recorded shape (shapes.py) as Claude Code 2.1 sends them:

- per session: a fresh session id (metadata.user_id's session_id, the X-Claude-Code-Session-Id header) and a fresh
  3-hex suffix of the billing header (constant within the session; a sub-agent has its own);
- turn k appends the tool round the client appends (assistant [thinking, text, tool_use Read] + user [tool_result]
  with the file as Read returns it: numbered lines);
- cache_control sits on the last block of the last user message only: appending a turn takes it off the earlier one;
- ``--subagent``: at turn 1 the main session calls the Agent tool; the Explore sub-agent's own requests (its own
  system blocks and 17 tools, no thinking, Read rounds) go first, then the main session appends the Agent call and
  its tool_result;
- the continued turn (``claude -p --continue``) appends the final answer and the new prompt.
The assistant turns are scripted (the recorded ones): the replay never feeds back what the model generated.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from tierlm.server.commands.bench.agent.files import RepoFile, claude_read_output
from tierlm.server.commands.bench.agent.ids import Ids, substituted
from tierlm.server.commands.bench.agent.plan import CONTINUED, MAIN, SIDE, SUBAGENT, PlannedRequest, SessionPlan
from tierlm.server.commands.bench.agent.shapes import Shape

BILLING_RE = re.compile(r"(cc_version=[0-9]+(?:\.[0-9]+)*\.)([0-9a-f]{3})(;)")
SESSION_HEADER = "x-claude-code-session-id"
AGENT_HEADER = "x-claude-code-agent-id"
EPHEMERAL = {"type": "ephemeral"}
SIDE_SYSTEM = ("Summarize this coding session in a short, sentence-case title of at most ten words. Reply with the "
               "title only.")


def _billed(body: dict[str, Any], suffix: str) -> dict[str, Any]:
    """``body`` with its billing header's 3-hex suffix set to ``suffix``."""
    for block in body.get("system") or []:
        block["text"] = BILLING_RE.sub(lambda m: m.group(1) + suffix + m.group(3), block["text"], count=1)
    return body


def recached(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with cache_control on the last block of the last user message only (Claude Code's rule)."""
    for m in messages:
        if isinstance(m["content"], list):
            for block in m["content"]:
                block.pop("cache_control", None)
    last = max((i for i, m in enumerate(messages) if m["role"] == "user" and isinstance(m["content"], list)),
               default=None)
    if last is not None and messages[last]["content"]:
        messages[last]["content"][-1]["cache_control"] = dict(EPHEMERAL)
    return messages


def appended(body: dict[str, Any], turn: list[dict[str, Any]]) -> dict[str, Any]:
    """A copy of ``body`` with the turn's messages appended (cache_control moved to the new last user block)."""
    out = json.loads(json.dumps(body))
    out["messages"] = recached(out["messages"] + json.loads(json.dumps(turn)))
    return out


def _prompted(body: dict[str, Any], prompt: str) -> dict[str, Any]:
    """The first user message's last text block (the user's prompt) set to ``prompt``."""
    first = next(m for m in body["messages"] if m["role"] == "user")
    texts = [b for b in first["content"] if b.get("type") == "text"] if isinstance(first["content"], list) else []
    if texts:
        texts[-1]["text"] = prompt
    else:
        first["content"] = prompt
    return body


class ClaudeCodeSession:
    """Builds the requests of session ``index`` (see the module docstring)."""

    def __init__(self, shape: Shape, index: int, ids: Ids, max_new_tokens: int) -> None:
        self.shape, self.index, self.ids, self.max_new = shape, index, ids, max_new_tokens
        self.session_id = ids.uuid4()
        self.suffix = ids.hex(3)
        self.chain = f"s{index}"

    # ------------------------------------------------------------ pieces
    def _sent(self, body: dict[str, Any]) -> dict[str, Any]:
        """What the replay changes in every body it sends: a short answer, greedy."""
        body["max_tokens"] = self.max_new
        body["temperature"] = 0
        return body

    def _fresh(self, part: str, recorded_session: str, suffix: str) -> Any:
        obj = substituted(self.shape.part(part), {recorded_session: self.session_id})
        return _billed(obj, suffix) if isinstance(obj, dict) and "system" in obj else obj

    def headers(self, key: str = "headers", agent_id: str | None = None) -> dict[str, str]:
        h = {k: str(v) for k, v in self.shape.part(key).items()}
        h[SESSION_HEADER] = self.session_id
        if agent_id is not None:
            h[AGENT_HEADER] = agent_id
        return h

    def request(self, kind: str, turn: int, chain: str, body: dict[str, Any],
                headers: dict[str, str]) -> PlannedRequest:
        path, _, query = self.shape.endpoint.partition("?")
        return PlannedRequest(self.index, kind, turn, chain, path, query, headers, body, self.shape.client)

    def tool_round(self, f: RepoFile, thinking: bool) -> list[dict[str, Any]]:
        """The recorded Read round for ``f`` with fresh ids (without its thinking block where the requests have no
        thinking, as the sub-agent's)."""
        assistant, user = self.shape.part("tool_turn")
        tool_id = "toolu_" + self.ids.hex(24)
        blocks = []
        for b in assistant["content"]:
            if b["type"] == "thinking":
                if not thinking:
                    continue
                b["signature"] = "sig" + self.ids.hex(32)
            elif b["type"] == "tool_use":
                b["id"], b["input"] = tool_id, {**b["input"], "file_path": f.path}
            blocks.append(b)
        assistant["content"] = blocks
        for b in user["content"]:
            if b["type"] == "tool_result":
                b["tool_use_id"], b["content"] = tool_id, claude_read_output(f.text)
        return [assistant, user]

    def agent_call(self, prompt: str, description: str) -> list[dict[str, Any]]:
        """The main session's Agent call and the sub-agent's answer as its tool_result, with fresh ids."""
        assistant, user = self.shape.part("subagent_call")
        tool_id = "toolu_" + self.ids.hex(24)
        for b in assistant["content"]:
            if b["type"] == "thinking":
                b["signature"] = "sig" + self.ids.hex(32)
            elif b["type"] == "tool_use":
                b["id"], b["input"] = tool_id, {**b["input"], "prompt": prompt, "description": description}
        for b in user["content"]:
            if b["type"] == "tool_result":
                b["tool_use_id"] = tool_id
        return [assistant, user]

    def final_turn(self) -> list[dict[str, Any]]:
        turn = self.shape.part("final_turn")
        for m in turn:
            for b in m["content"] if isinstance(m["content"], list) else []:
                if b["type"] == "thinking":
                    b["signature"] = "sig" + self.ids.hex(32)
        return turn

    # ------------------------------------------------------------ the session
    def first_request(self, prompt: str) -> dict[str, Any]:
        recorded = self.shape.data["headers"][SESSION_HEADER]
        body = _prompted(self._fresh("first_request", recorded, self.suffix), prompt)
        body["messages"] = recached(body["messages"])
        return self._sent(body)

    def subagent(self, prompt: str, reads: list[RepoFile]) -> list[PlannedRequest]:
        """The Explore sub-agent's requests: its first request, then one per Read round."""
        recorded = self.shape.data["subagent_headers"][SESSION_HEADER]
        body = _prompted(self._fresh("subagent_first_request", recorded, self.ids.hex(3)), prompt)
        body["messages"] = recached(body["messages"])
        body = self._sent(body)
        headers = self.headers("subagent_headers", agent_id="a" + self.ids.hex(16))
        chain = f"{self.chain}/agent"
        thinking = bool(body.get("thinking"))
        out = [self.request(SUBAGENT, 0, chain, body, headers)]
        for k, f in enumerate(reads, 1):
            body = appended(body, self.tool_round(f, thinking))
            out.append(self.request(SUBAGENT, k, chain, body, headers))
        return out

    def build(self, main_reads: list[RepoFile], agent_reads: list[RepoFile], turns: int, continued: bool,
              side_text: str | None) -> SessionPlan:
        """``turns`` tool rounds after the first request (with sub-agent reads: the first is the Agent call),
        the continued turn, and the side request with ``side_text``."""
        prompt = f"Review {main_reads[0].rel if main_reads else agent_reads[0].rel}"
        body = self.first_request(prompt)
        headers = self.headers()
        requests = [self.request(MAIN, 0, self.chain, body, headers)]
        reads = iter(main_reads)
        for k in range(1, turns + 1):
            if k == 1 and agent_reads:
                target = agent_reads[0].rel
                ask = f"Read {target} and summarize what it holds."
                requests += self.subagent(ask, agent_reads)
                turn = self.agent_call(ask, f"Summarize {target.rsplit('/', 1)[-1]}")
            else:
                turn = self.tool_round(next(reads), bool(body.get("thinking")))
            body = appended(body, turn)
            requests.append(self.request(MAIN, k, self.chain, body, headers))
        plan = SessionPlan(self.index, requests, files=[f.rel for f in [*main_reads, *agent_reads]])
        if continued:
            plan.continued = self.request(CONTINUED, turns + 1, self.chain, appended(body, self.final_turn()),
                                          headers)
        if side_text is not None:
            plan.side = self.request(SIDE, 0, f"{self.chain}/side", self.side_body(side_text), headers)
        return plan

    def side_body(self, text: str) -> dict[str, Any]:
        """A short request without tools, as Claude Code's title and summary requests in interactive use: the
        session's billing header, a one-line instruction, the text."""
        first = self.shape.data["first_request"]
        billing = [dict(b) for b in first.get("system") or [] if BILLING_RE.search(b.get("text", ""))][:1]
        body = {"model": first.get("model"), "system": [*_billed({"system": billing}, self.suffix)["system"],
                                                        {"type": "text", "text": SIDE_SYSTEM}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
                "metadata": substituted(first.get("metadata") or {},
                                        {self.shape.data["headers"][SESSION_HEADER]: self.session_id}),
                "stream": True}
        return self._sent(body)


def build_claude_code(shape: Shape, index: int, ids: Ids, max_new_tokens: int, main_reads: list[RepoFile],
                      agent_reads: list[RepoFile], turns: int, continued: bool,
                      side_text: Callable[[RepoFile], str] | None) -> SessionPlan:
    """Session ``index`` of Claude Code (see the module docstring)."""
    s = ClaudeCodeSession(shape, index, ids, max_new_tokens)
    source = (main_reads or agent_reads)[0]
    return s.build(main_reads, agent_reads, turns, continued, side_text(source) if side_text else None)
