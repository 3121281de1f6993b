"""One Codex CLI session's requests, built from its recorded shape (shapes.py) as Codex 0.171 sends them to
/v1/responses:

- per session: fresh time-ordered ids (the session id, which is also the prompt_cache_key, the window and turn ids
  in client_metadata and in the headers, the ids of the session's own input items);
- turn k appends a reasoning item, an exec_command function_call ``cat <file>`` and its function_call_output (Codex's
  header, then the file, its middle cut out past 10000 characters as Codex does);
- the continued turn (``codex exec resume --last``) appends the last reasoning, the assistant's answer and the new
  user prompt.
Codex sends store: false and no encrypted_content back here: the assistant turns are scripted (the recorded ones),
so the server renders each request's whole conversation.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from tierlm.server.commands.bench.agent.files import RepoFile, codex_exec_output
from tierlm.server.commands.bench.agent.ids import Ids, session_scoped_uuids, substituted
from tierlm.server.commands.bench.agent.plan import CONTINUED, MAIN, SIDE, PlannedRequest, SessionPlan
from tierlm.server.commands.bench.agent.shapes import Shape

SESSION_HEADER = "session-id"
SIDE_INSTRUCTIONS = "Summarize this coding session in a short title of at most ten words. Reply with the title only."


def appended(body: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """A copy of ``body`` with ``items`` appended to its input."""
    out = json.loads(json.dumps(body))
    out["input"] = out["input"] + json.loads(json.dumps(items))
    return out


class CodexSession:
    """Builds the requests of session ``index`` (see the module docstring)."""

    def __init__(self, shape: Shape, index: int, ids: Ids, max_new_tokens: int) -> None:
        self.shape, self.index, self.ids, self.max_new = shape, index, ids, max_new_tokens
        recorded = str(shape.data["headers"][SESSION_HEADER])
        self.prefix = ids.hex(8)
        scoped = session_scoped_uuids({"h": shape.data["headers"], "b": shape.data["first_request"]}, recorded)
        self.mapping = {u: ids.uuid7(self.prefix) for u in scoped}
        self.session_id = self.mapping.get(recorded, ids.uuid7(self.prefix))
        self.chain = f"s{index}"

    def _sent(self, body: dict[str, Any]) -> dict[str, Any]:
        body["max_output_tokens"] = self.max_new
        body["temperature"] = 0
        return body

    def headers(self) -> dict[str, str]:
        return {k: str(v) for k, v in substituted(self.shape.part("headers"), self.mapping).items()}

    def request(self, kind: str, turn: int, chain: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> PlannedRequest:
        path, _, query = self.shape.endpoint.partition("?")
        return PlannedRequest(self.index, kind, turn, chain, path, query, headers or self.headers(), body,
                              self.shape.client)

    def first_request(self, prompt: str) -> dict[str, Any]:
        body = substituted(self.shape.part("first_request"), self.mapping)
        users = [it for it in body["input"] if it.get("type") == "message" and it.get("role") == "user"]
        users[-1]["content"] = [{"type": "input_text", "text": prompt}]
        return self._sent(body)

    def tool_round(self, f: RepoFile) -> list[dict[str, Any]]:
        """The recorded reasoning + exec_command call + its output for ``f``, with fresh ids."""
        items = self.shape.part("tool_turn")
        call_id = "call_" + self.ids.hex(20)
        for it in items:
            kind = it.get("type")
            if kind == "reasoning":
                it["id"] = "rs_" + self.ids.hex(20)
            elif kind == "function_call":
                it["id"], it["call_id"] = "fc_" + self.ids.hex(20), call_id
                it["arguments"] = it["arguments"].replace("$PATH", json.dumps(f.path)[1:-1])
            elif kind == "function_call_output":
                it["id"], it["call_id"] = "fco_" + self.ids.uuid7(self.prefix), call_id
                it["output"] = codex_exec_output(f.text, self.ids.hex(6))
        return items

    def final_turn(self) -> list[dict[str, Any]]:
        items = self.shape.part("final_turn")
        for it in items:
            if it.get("type") == "reasoning":
                it["id"] = "rs_" + self.ids.hex(20)
            elif it.get("role") == "assistant":
                it["id"] = "msg_" + self.ids.hex(20)
            elif it.get("role") == "user":
                it["id"] = "msg_" + self.ids.uuid7(self.prefix)
        return items

    def side_body(self, text: str) -> dict[str, Any]:
        """A short request without tools (Codex sends none such itself; asked for with --side-requests)."""
        first = self.shape.data["first_request"]
        return self._sent({"model": first.get("model"), "instructions": SIDE_INSTRUCTIONS,
                           "input": [{"type": "message", "role": "user",
                                      "content": [{"type": "input_text", "text": text}]}],
                           "stream": True, "store": False, "prompt_cache_key": self.session_id})

    def build(self, reads: list[RepoFile], turns: int, continued: bool, side_text: str | None) -> SessionPlan:
        body = self.first_request(f"Review {reads[0].rel}")
        requests = [self.request(MAIN, 0, self.chain, body)]
        for k in range(1, turns + 1):
            body = appended(body, self.tool_round(reads[k - 1]))
            requests.append(self.request(MAIN, k, self.chain, body))
        plan = SessionPlan(self.index, requests, files=[f.rel for f in reads[:turns]])
        if continued:
            plan.continued = self.request(CONTINUED, turns + 1, self.chain, appended(body, self.final_turn()))
        if side_text is not None:
            plan.side = self.request(SIDE, 0, f"{self.chain}/side", self.side_body(side_text))
        return plan


def build_codex(shape: Shape, index: int, ids: Ids, max_new_tokens: int, reads: list[RepoFile], turns: int,
                continued: bool, side_text: Callable[[RepoFile], str] | None) -> SessionPlan:
    """Session ``index`` of Codex (see the module docstring)."""
    s = CodexSession(shape, index, ids, max_new_tokens)
    return s.build(reads, turns, continued, side_text(reads[0]) if side_text else None)
