"""`tierlm bench agent`: coding-agent sessions replayed in the exact wire shapes of the real clients (Claude Code on
/v1/messages, Codex CLI on /v1/responses), against tierlm and, with ``--against``, other servers, one at a time.

Per server:
  1. each client's endpoints are probed with a short request (off the clock; chat completions where a peer lacks
     the client's own endpoint);
  2. one side request alone (its solo TTFT);
  3. every session at once: its first (long) request together with its side request, then its turns one after
     the other (a sub-agent's requests in between, as Claude Code sends them), then its continued turn;
  4. with ``--restart`` (tierlm only): once the sessions are done and its L3 writes finished, the server restarts on
     the same L3 folder and each session's continued turn is sent to it, one after the other: its prefix can come
     only from L3 (peers get the same turns without a restart).
tierlm's server runs with HiCache (host tier) and the file L3 store in the work folder. Each request's TTFT, prompt
and cached tokens per tier are read from its own answer (client.py); where a lone request's answer gives no split
per tier, tierlm's /metrics counters around it do.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tierlm.server.commands.bench.agent.client import TIERS, Outcome, Route, probe, routes, send
from tierlm.server.commands.bench.agent.options import OWN, check
from tierlm.server.commands.bench.agent.plan import RESUMED, PlannedRequest, SessionPlan
from tierlm.server.commands.bench.agent.prompts import PromptRenderer, server_args_of
from tierlm.server.commands.bench.agent.workload import Workload, build_workload, context_plan
from tierlm.server.commands.bench.context import BenchContext
from tierlm.server.commands.bench.openai_load import Endpoint, PeerError, discover, discover_peers
from tierlm.server.commands.bench.quiet_machine import QuietWait, wait_until_quiet
from tierlm.server.commands.bench.report import Report
from tierlm.server.commands.bench.server_process import REQUEST_TIMEOUT_S, BenchServer

log = logging.getLogger("tierlm.bench")
HIT_METRIC = 'tierlm_cache_hit_tokens_total{tier="%s"}'


@dataclass
class Record:
    """One request sent to one server, and what came back."""

    req: PlannedRequest
    kind: str  # the plan's kind, or resumed-after-restart
    out: Outcome
    phase: str  # solo, sessions, after restart, continued


@dataclass
class ServerRun:
    """One server's replay."""

    name: str
    url: str
    route: Route
    records: list[Record] = field(default_factory=list)
    sessions_wall_s: float = 0.0
    session_s: dict[int, float] = field(default_factory=dict)
    restarted: bool = False
    quiet: QuietWait | None = None
    info: dict[str, Any] | None = None


class Replay:
    """Sends one workload to one server (module docstring, steps 1-4)."""

    def __init__(self, ep: Endpoint, w: Workload, ns: argparse.Namespace, server: BenchServer | None,
                 bar: Any) -> None:
        self.ep, self.w, self.ns, self.server, self.bar = ep, w, ns, server, bar
        self.after_sessions = ns.restart  # continued turns wait for the restart (peers: for the same moment)
        self.run = ServerRun(ep.name, ep.url, Route())

    async def one(self, http: httpx.AsyncClient, req: PlannedRequest, phase: str, kind: str | None = None) -> Outcome:
        out = await send(http, self.ep, req, self.run.route.paths[req.path], self.ns.max_new_tokens)
        out.tier_source = "usage" if out.tiers is not None else None
        self.run.records.append(Record(req, kind or req.kind, out, phase))
        self.bar.update()
        return out

    async def lone(self, http: httpx.AsyncClient, req: PlannedRequest, phase: str, kind: str | None = None) -> None:
        """A request with nothing else in flight: on tierlm's own server its tiers from /metrics where its answer
        gives no split."""
        before = await asyncio.to_thread(self.server.metrics) if self.server else None
        out = await self.one(http, req, phase, kind)
        if self.server is not None and out.tiers is None and before is not None:
            after = await asyncio.to_thread(self.server.metrics)
            out.tiers = {t: int(after.get(HIT_METRIC % t, 0) - before.get(HIT_METRIC % t, 0)) for t in TIERS}
            out.tier_source = "metrics"

    async def session(self, http: httpx.AsyncClient, plan: SessionPlan) -> None:
        start = time.perf_counter()
        first, *rest = plan.requests
        if plan.side is not None:  # sent at the same moment: its TTFT under the first request's long prefill
            await asyncio.gather(self.one(http, first, "sessions"), self.one(http, plan.side, "sessions"))
        else:
            await self.one(http, first, "sessions")
        for req in rest:
            await self.one(http, req, "sessions")
        if plan.continued is not None and not self.after_sessions:
            await self.one(http, plan.continued, "sessions")
        self.run.session_s[plan.index] = time.perf_counter() - start

    async def replay(self) -> ServerRun:
        n = len(self.w.plans) * 2 + 8
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
            self.bar.set_description(f"agent: {self.ep.name}: probing {', '.join(self.w.paths)}")
            self.run.route = await routes(http, self.ep, self.w.paths)
            for solo in self.w.solos.values():
                self.bar.set_description(f"agent: {self.ep.name}: a side request alone")
                await self.lone(http, solo, "solo")
            self.bar.set_description(f"agent: {self.ep.name}: {len(self.w.plans)} sessions")
            start = time.perf_counter()
            await asyncio.gather(*(self.session(http, p) for p in self.w.plans))
            self.run.sessions_wall_s = time.perf_counter() - start
            if self.after_sessions:
                await self.continued_after(http)
        return self.run

    async def continued_after(self, http: httpx.AsyncClient) -> None:
        """Step 4: restart tierlm (its L3 writes done first), then each continued turn alone."""
        kind = None
        if self.server is not None:
            self.bar.set_description(f"agent: {self.ep.name}: waiting for L3 writes, restarting")
            await asyncio.to_thread(self.server.restart)  # waits for the L3 writer to be idle first
            self.ep.url = self.run.url = self.server.url
            self.run.restarted = True
            for path in self.w.paths:  # the restarted server's first requests, off the clock
                await probe(http, self.ep, path)
            kind = RESUMED
            log.info("agent: %s restarted on the same L3 folder; sending each session's continued turn", self.ep.name)
        for plan in self.w.plans:
            if plan.continued is not None:
                self.bar.set_description(f"agent: {self.ep.name}: continued turn of s{plan.index}")
                await self.lone(http, plan.continued, "after restart" if kind else "continued", kind)


def _tierlm_server(ns: argparse.Namespace, ctx: BenchContext, flags: list[str], env: dict[str, str]) -> BenchServer:
    storage = ctx.work_dir / "agent-l3"
    shutil.rmtree(storage, ignore_errors=True)  # an earlier run's pages would be hits on "cold" first requests
    return BenchServer(ctx.server_args(*hicache_flags(ns), *flags), storage_dir=storage, log_dir=ctx.work_dir,
                       name="agent-tierlm-server", env=env)


def hicache_flags(ns: argparse.Namespace) -> list[str]:
    return ["--enable-hierarchical-cache", "--hicache-ratio", str(ns.hicache_ratio),
            "--hicache-storage-backend", "file"]


def run(ns: argparse.Namespace, ctx: BenchContext) -> Report:
    from tierlm.server.commands.bench.agent.tables import build_report

    check(ns)
    peers = discover_peers(ns.against, "agent")
    renderer = PromptRenderer(server_args_of(ctx.server_args(*hicache_flags(ns))), ctx.model_dir)
    w = build_workload(ns, ctx, renderer)
    flags, env, context_note = context_plan(ns, ctx, w.longest)
    per_server = len(w.requests())
    bar = ctx.progress_bar(total=per_server * (1 + len(peers)), desc="agent")
    runs: list[ServerRun] = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(_tierlm_server(ns, ctx, flags, env))
        bar.set_description("agent: starting tierlm")
        server.start()
        info = server.info()
        own = discover(OWN, server.url)
        run_ = asyncio.run(Replay(own, w, ns, server, bar).replay())
        run_.info = info
        runs.append(run_)
    for ep in peers:  # tierlm's server is stopped: the peer has the machine to itself
        bar.set_description(f"agent: {ep.name}: waiting for a quiet machine")
        quiet = asyncio.run(wait_until_quiet())
        try:
            run_ = asyncio.run(Replay(ep, w, ns, None, bar).replay())
        except PeerError as e:  # the other servers' measurements stand; this one is named in the report
            log.error("agent: %s failed, left out of the report: %s", ep.name, e)
            w.notes.append(f"{ep.name} LEFT OUT: the replay against it failed: {e}")
            continue
        run_.quiet = quiet
        runs.append(run_)
    bar.close()
    return build_report(ns, ctx, w, runs, context_note, renderer.template_source)
