"""Everything a replay sends, built once before any server starts: the (trimmed) shapes, the sessions of each
client, the solo side requests, every request's prompt as tierlm renders it (prompts.py), and the context length
the longest one needs. Every server gets the same requests."""
from __future__ import annotations

import argparse
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierlm.server.commands.bench.agent.files import default_repo, pick_files
from tierlm.server.commands.bench.agent.options import clients, side_requests
from tierlm.server.commands.bench.agent.plan import PlannedRequest, SessionPlan
from tierlm.server.commands.bench.agent.prompts import PromptRenderer, Rendered, previous_in_chain, render_all
from tierlm.server.commands.bench.agent.sessions import SessionOptions, build_sessions, files_needed
from tierlm.server.commands.bench.agent.shapes import Shape, load_shape, trim
from tierlm.server.commands.bench.context import BenchContext

log = logging.getLogger("tierlm.bench")
ALLOW_LONGER = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


@dataclass
class Workload:
    shapes: dict[str, Shape]
    plans: list[SessionPlan]
    solos: dict[str, PlannedRequest]  # client -> its side request measured alone
    rendered: dict[int, Rendered]  # id(request) -> tierlm's prompt
    previous: dict[int, PlannedRequest]  # id(request) -> the previous request of its conversation
    repo: Path
    notes: list[str] = field(default_factory=list)

    def requests(self) -> list[PlannedRequest]:
        return [r for p in self.plans for r in p.all_requests()] + list(self.solos.values())

    @property
    def paths(self) -> list[str]:
        return sorted({r.path for r in self.requests()})

    @property
    def longest(self) -> int:
        return max(len(r.ids) for r in self.rendered.values())


def build_workload(ns: argparse.Namespace, ctx: BenchContext, renderer: PromptRenderer) -> Workload:
    """The requests of every session of every client asked for (see the module docstring). Files follow --seed;
    session ids are fresh in every run, as the real clients make them."""
    file_rng = np.random.default_rng(ctx.seed)
    id_rng = np.random.default_rng([ctx.seed, secrets.randbits(64)])
    repo = Path(ns.repo).resolve() if ns.repo else default_repo()
    shapes: dict[str, Shape] = {}
    plans: list[SessionPlan] = []
    solos: dict[str, PlannedRequest] = {}
    for client in clients(ns):
        shape = trim(load_shape(client), ns.trim_tools, ns.instructions_chars)
        shapes[client] = shape
        agent_reads = ns.subagent_reads if ns.subagent else 0
        if ns.subagent and client != "claude-code":
            log.warning("agent: --subagent: only Claude Code's sub-agent shape is recorded; %s sessions run without",
                        client)
        o = SessionOptions(ns.sessions, ns.turns, agent_reads, ns.continued, side_requests(ns, client),
                           ns.max_new_tokens)
        files = pick_files(repo, files_needed(client, o), file_rng, ns.max_file_chars)
        mine, solo = build_sessions(shape, o, files, id_rng, lambda t: renderer.fit(t, ns.side_tokens), len(plans))
        plans += mine
        if solo is not None:
            solos[client] = solo
    every = [r for p in plans for r in p.all_requests()] + list(solos.values())
    rendered = render_all(renderer, every)
    w = Workload(shapes, plans, solos, rendered, previous_in_chain(every), repo)
    folded = sum(r.folded for r in rendered.values())
    if folded:
        w.notes.append(f"{folded} Claude Code prompts had their mid-conversation system message folded into a user "
                       "turn (this chat template refuses a late system message; tierlm's route does the same)")
    log.info("agent: %d requests planned; the longest prompt is %d tokens", len(every), w.longest)
    return w


def given_context(extra: list[str]) -> int | None:
    """--context-length among the server flags (--server-arg), if any."""
    for i, flag in enumerate(extra):
        if flag == "--context-length" and i + 1 < len(extra):
            return int(extra[i + 1])
        if flag.startswith("--context-length="):
            return int(flag.split("=", 1)[1])
    return None


def model_context(ctx: BenchContext) -> int | None:
    from tierlm.backends.model_source.model_folder import ModelFolder

    value = ModelFolder.read(ctx.model_dir).text_config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def context_plan(ns: argparse.Namespace, ctx: BenchContext, longest: int) -> tuple[list[str], dict[str, str], str]:
    """(server flags, environment, note): the context tierlm's server needs for the longest prompt plus
    --max-new-tokens, raised over the model's own where that is shorter (SGLang's override variable)."""
    need = longest + ns.max_new_tokens
    model = model_context(ctx)
    given = ns.context_length or given_context(ctx.server_extra)
    if given is not None:
        if given < need:
            raise SystemExit(f"tierlm bench agent: the longest prompt is {longest} tokens; with --max-new-tokens "
                             f"{ns.max_new_tokens} it needs a context of {need}, more than the {given} given; raise "
                             "--context-length or trim the shape (--trim-tools, --instructions-chars, "
                             "--max-file-chars, fewer --turns)")
        flags = ["--context-length", str(given)] if ns.context_length else []
        env = {ALLOW_LONGER: "1"} if model is not None and given > model else {}
        longer = f"; longer than the model's own ({model}), with {ALLOW_LONGER}=1" if env else ""
        return flags, env, f"context length {given} (given){longer}; the longest prompt is {longest} tokens"
    if model is None or model >= need:
        return [], {}, f"context length: the model's own ({model}); the longest prompt is {longest} tokens"
    page = ctx.page_size
    length = -(-need // page) * page
    log.info("agent: the longest prompt (%d tokens) + %d new tokens needs more than the model's context (%d): "
             "serving with --context-length %d (%s=1)", longest, ns.max_new_tokens, model, length, ALLOW_LONGER)
    return (["--context-length", str(length)], {ALLOW_LONGER: "1"},
            f"context length raised to {length} (the model's is {model}; the longest prompt is {longest} tokens + "
            f"{ns.max_new_tokens} new) with {ALLOW_LONGER}=1: positions past the model's own are untrained")
