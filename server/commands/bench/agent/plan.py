"""What a replay sends: every request of every session, built before the first one is sent (the assistant turns are
scripted, so the whole sequence is known in advance), in the order one session sends them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# kinds of request, in the report's words
MAIN = "main"
SUBAGENT = "subagent"
SIDE = "side"
CONTINUED = "continued"
RESUMED = "resumed-after-restart"  # a continued turn sent to the restarted server (--restart)
KINDS = (MAIN, SUBAGENT, SIDE, CONTINUED, RESUMED)


@dataclass
class PlannedRequest:
    """One request as the client sends it. ``chain`` names the conversation whose previous request it extends
    (the main session, a sub-agent, a side request alone): new tokens and "diverged at" compare within a chain."""

    session: int
    kind: str
    turn: int
    chain: str
    path: str  # /v1/messages or /v1/responses
    query: str  # e.g. beta=true, as the client sends it
    headers: dict[str, str]
    body: dict[str, Any]
    client: str = ""  # claude-code or codex

    @property
    def label(self) -> str:
        return f"s{self.session}" if self.session >= 0 else "solo"


@dataclass
class SessionPlan:
    """One session's requests in the order it sends them, the side request sent with its first one, and the
    continued turn (sent last, or after the restart)."""

    index: int
    requests: list[PlannedRequest]
    side: PlannedRequest | None = None
    continued: PlannedRequest | None = None
    files: list[str] = field(default_factory=list)  # the repository paths its tool rounds read

    def all_requests(self) -> list[PlannedRequest]:
        return [*self.requests, *([self.side] if self.side else []), *([self.continued] if self.continued else [])]
