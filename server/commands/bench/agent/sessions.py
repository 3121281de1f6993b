"""Every session of a replay, built before the first request is sent: the files each session's tool rounds read
(distinct between sessions, so parallel sessions share only the client's tools + instructions prefix, as real
ones do), the per-session ids, the side requests, and one side request of its own shape to measure alone."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from tierlm.server.commands.bench.agent.claude_code import ClaudeCodeSession, build_claude_code
from tierlm.server.commands.bench.agent.codex import CodexSession, build_codex
from tierlm.server.commands.bench.agent.files import RepoFile
from tierlm.server.commands.bench.agent.ids import Ids
from tierlm.server.commands.bench.agent.plan import SIDE, PlannedRequest, SessionPlan
from tierlm.server.commands.bench.agent.shapes import Shape

log = logging.getLogger("tierlm.bench")
SIDE_LEAD = "Conversation so far:\n\n"


@dataclass(frozen=True)
class SessionOptions:
    """What shapes every session of one client."""

    sessions: int
    turns: int
    subagent_reads: int  # 0: no sub-agent
    continued: bool
    side: bool
    max_new_tokens: int


def reads_per_session(client: str, o: SessionOptions) -> tuple[int, int]:
    """(main-session reads, sub-agent reads): with a sub-agent, turn 1 is the Agent call instead of a Read; at least
    one file per session (its prompt names one)."""
    agent = o.subagent_reads if client == "claude-code" and o.turns >= 1 else 0
    main = o.turns - (1 if agent else 0)
    return max(main, 0 if agent else 1), agent


def files_needed(client: str, o: SessionOptions) -> int:
    """Files one client's sessions read, plus one for the solo side request."""
    main, agent = reads_per_session(client, o)
    return o.sessions * (main + agent) + 1


def side_text(fit: Callable[[str], str]) -> Callable[[RepoFile], str]:
    """A side request's text: the head of a file the session reads, cut to the side size by ``fit``."""
    return lambda f: fit(f"{SIDE_LEAD}Review {f.rel}\n\n{f.text}")


def build_sessions(shape: Shape, o: SessionOptions, files: list[RepoFile], rng: Any,
                   fit_side: Callable[[str], str], first_index: int = 0
                   ) -> tuple[list[SessionPlan], PlannedRequest | None]:
    """The sessions of ``shape``'s client, numbered from ``first_index``, and the solo side request (None without
    side requests)."""
    ids = Ids(rng)
    main_n, agent_n = reads_per_session(shape.client, o)
    pool = iter(files)
    texts = side_text(fit_side) if o.side else None
    plans = []
    for i in range(first_index, first_index + o.sessions):
        main = [next(pool) for _ in range(main_n)]
        agent = [next(pool) for _ in range(agent_n)]
        if shape.client == "claude-code":
            plans.append(build_claude_code(shape, i, ids, o.max_new_tokens, main, agent, o.turns, o.continued, texts))
        else:
            plans.append(build_codex(shape, i, ids, o.max_new_tokens, main, o.turns, o.continued, texts))
    solo = None
    if texts is not None:
        solo = solo_side(shape, ids, o.max_new_tokens, texts(next(pool)))
    log.info("agent: %s: %d sessions x %d requests planned (%d tool rounds, sub-agent reads %d, continued turn %s, "
             "side requests %s)", shape.client, len(plans), len(plans[0].all_requests()) if plans else 0, o.turns,
             agent_n, "yes" if o.continued else "no", "yes" if o.side else "no")
    return plans, solo


def solo_side(shape: Shape, ids: Ids, max_new_tokens: int, text: str) -> PlannedRequest:
    """A side request of a session of its own, measured alone before the sessions start (its solo TTFT)."""
    maker = ClaudeCodeSession if shape.client == "claude-code" else CodexSession
    s = maker(shape, -1, ids, max_new_tokens)
    return s.request(SIDE, 0, f"solo:{shape.client}/side", s.side_body(text), s.headers())
