"""`tierlm bench multiturn`: C clients x R rounds of growing conversations, radix-only vs HiCache.

At most ``--concurrency`` requests are in flight; clients take turns for those slots. Every client keeps a
conversation: a shared system prompt, its own context document, then per round a new user
turn; the answer the server generated is appended before the next turn (as a chat client does). The device
pool (L1) holds only a fraction of all conversations, so with the radix cache alone most of a conversation is
gone from L1 when its next turn arrives and is prefilled again; HiCache keeps it in host memory (L2) and, with
a smaller host tier, in files (L3). The same prompts run on a fresh server per mode.

``--schedule-policies fcfs,lpm`` runs every mode once per scheduling policy (--schedule-policy of the server) and
adds a table comparing them. Ordering only matters when requests queue inside the server, so give it fewer
running slots than requests in flight (``--max-running 2 --concurrency 16 --clients 16``): a client's next turn
then arrives while its conversation is still in L1, and lpm admits it ahead of older requests whose
conversations fcfs has to prefill again.

``--radix-eviction-policies lru,lfu,slru`` does the same per server --radix-eviction-policy (the order the device
and host tiers evict in) and adds a table of hits per tier and TTFT per policy; ``--workload shared-docs``
(shared_docs.py) swaps the conversations for one-shot questions over a few shared documents.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from typing import Any

import httpx
import numpy as np

from tierlm.runtime.server_args import RADIX_EVICTION_POLICIES, SCHEDULE_POLICIES
from tierlm.server.commands.bench import shared_docs
from tierlm.server.commands.bench.context import BenchContext, random_tokens
from tierlm.server.commands.bench.report import Column, Report, Table, Target, environment, load_average
from tierlm.server.commands.bench.server_process import (REQUEST_TIMEOUT_S, BenchServer, RequestResult, run_one,
                                                         stream_generate)
from tierlm.server.commands.bench.stats import median, percentile, ratio

MODES = ("radix", "hicache-l2", "hicache-l2+l3")
TARGET_RATIO = 0.3  # HiCache mean TTFT vs radix-only (issue 6)
TIER_OF_MODE = {"hicache-l2": "host", "hicache-l2+l3": "storage"}  # the tier a mode adds, which must be hit
L3_VS_L2_TARGET = 1.1  # hicache-l2+l3 mean TTFT of rounds >= 2 vs hicache-l2's, with L2 hits (issue 20)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-turn benchmark")
    g.add_argument("--clients", type=int, default=8, help="conversations")
    g.add_argument("--concurrency", type=int, default=2,
                   help="requests in flight at once (a client waits for a slot); L1 holds this many requests")
    g.add_argument("--rounds", type=int, default=3, help="turns per conversation")
    g.add_argument("--system-tokens", type=int, default=64, help="system prompt shared by all clients")
    g.add_argument("--context-tokens", type=int, default=256, help="per-client document before the first turn")
    g.add_argument("--turn-tokens", type=int, default=32, help="new user tokens per round")
    g.add_argument("--answer-tokens", type=int, default=16, help="tokens generated per round")
    g.add_argument("--l1-fraction", type=float, default=0.25,
                   help="device pool as a share of all conversations' final length (at least --max-running "
                        "requests)")
    g.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="host tier of the L2+L3 mode, as a multiple of L1 (the L2 mode's host holds everything)")
    g.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    g.add_argument("--max-running", type=int, default=None,
                   help="the servers' --max-running-requests (default: --concurrency); below --concurrency, "
                        "requests queue in the server and its --schedule-policy decides their order")
    g.add_argument("--schedule-policies", default=None, metavar="P1,P2",
                   help="run each mode once per server --schedule-policy (e.g. fcfs,lpm) and compare them; "
                        f"choose from {','.join(SCHEDULE_POLICIES)} (default: the server's own, one run per mode)")
    g.add_argument("--radix-eviction-policies", default=None, metavar="P1,P2",
                   help="run each mode once per server --radix-eviction-policy (e.g. lru,lfu,slru) and compare hits "
                        f"per tier; choose from {','.join(RADIX_EVICTION_POLICIES)} (default: the server's own)")
    shared_docs.add_arguments(g)


def plan_sizes(ns: argparse.Namespace, page_size: int) -> dict[str, int]:
    C, R = ns.clients, ns.rounds
    conversation = ns.context_tokens + R * (ns.turn_tokens + ns.answer_tokens)
    working_set = ns.system_tokens + C * conversation
    longest = ns.system_tokens + conversation + page_size  # the last round's prompt and answer
    up = lambda n: -(-int(n) // page_size) * page_size  # noqa: E731
    # L1 must at least run `concurrency` requests side by side, or requests queue behind each other's decode
    # and TTFT measures the queue instead of the cache.
    l1 = max(up(ns.l1_fraction * working_set), running_slots(ns) * up(longest) + 2 * page_size)
    # The L2 mode's host tier holds every conversation with room for page fragments.
    l2_ratio = max(2.0, math.ceil(1.5 * working_set / l1))
    return {"working_set": working_set, "l1": l1, "longest": longest, "l2_ratio": l2_ratio}


def running_slots(ns: argparse.Namespace) -> int:
    """Requests the server runs side by side: --max-running, else --concurrency."""
    return min(ns.max_running or ns.concurrency, ns.concurrency)


def mode_server_args(mode: str, ctx: BenchContext, ns: argparse.Namespace, sizes: dict[str, int],
                     policy: str | None = None, eviction: str | None = None) -> list[str]:
    base = ["--max-total-tokens", str(sizes["l1"]), "--max-running-requests", str(running_slots(ns))]
    if policy is not None:
        base += ["--schedule-policy", policy]
    if eviction is not None:
        base += ["--radix-eviction-policy", eviction]
    if mode == "radix":
        return ctx.server_args(*base)
    if mode == "hicache-l2":
        return ctx.server_args(*base, "--enable-hierarchical-cache", "--hicache-ratio", str(sizes["l2_ratio"]))
    return ctx.server_args(*base, "--enable-hierarchical-cache", "--hicache-ratio", str(ns.hicache_ratio),
                           "--hicache-storage-backend", "file")


async def _conversations(url: str, system: list[int], contexts: list[list[int]], turns: list[list[list[int]]],
                         answer_tokens: int, concurrency: int, on_done) -> list[tuple[int, int, RequestResult]]:
    results: list[tuple[int, int, RequestResult]] = []
    limits = httpx.Limits(max_connections=len(contexts) + 4)
    slots = asyncio.Semaphore(concurrency)  # FIFO: clients take turns, so every conversation ages in the cache

    async def client(c: int, http: httpx.AsyncClient) -> None:
        history = system + contexts[c]
        for r, turn in enumerate(turns[c]):
            prompt = history + turn
            async with slots:  # TTFT counts from the send, not from the wait for a slot
                res = await stream_generate(http, url, prompt, answer_tokens)
            results.append((c, r, res))
            history = prompt + res.output_ids
            on_done()

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        await asyncio.gather(*(client(c, http) for c in range(len(contexts))))
    return results


def run_mode(mode: str, ns: argparse.Namespace, ctx: BenchContext, sizes: dict[str, int], prompts: dict[str, Any],
             bar, policy: str | None = None, eviction: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    label = "/".join([mode] + [p for p in (policy, eviction) if p is not None])
    slug = label.replace("/", "-")
    storage = ctx.work_dir / f"l3-{slug}" if mode == "hicache-l2+l3" else None
    server = BenchServer(mode_server_args(mode, ctx, ns, sizes, policy, eviction), storage_dir=storage,
                         log_dir=ctx.work_dir, name=f"multiturn-{slug}")
    with server:
        bar.set_description(f"multiturn: starting {label}")
        server.start()
        info = server.info()
        rng = np.random.default_rng(ctx.seed + 99)
        run_one(server.url, random_tokens(rng, 16, ctx.vocab_size), 1)  # first HTTP request, off the clock
        bar.set_description(f"multiturn: {label}")
        t0 = time.perf_counter()
        results = asyncio.run(_conversations(server.url, prompts["system"], prompts["contexts"], prompts["turns"],
                                             ns.answer_tokens, ns.concurrency, lambda: bar.update()))
        wall = time.perf_counter() - t0
        load = load_average()  # other work on the machine skews one mode against another: shown per mode
        end = server.info().get("tiers", {})
        rss = server.rss_bytes()
    if ns.workload == "shared-docs":
        results = shared_docs.document_uses(results, ns.docs)
    summary = summarize_mode(mode, results, wall, info, end, rss)
    summary.update(load_avg_1m=load, policy=policy, eviction=eviction, label=label)
    return summary, info


def summarize_mode(mode: str, results: list[tuple[int, int, RequestResult]], wall: float, info: dict[str, Any],
                   end_tiers: dict[str, Any], rss: int | None) -> dict[str, Any]:
    res = [r for _, _, r in results]
    later = [r for _, rnd, r in results if rnd > 0]
    prompt_total = sum(r.prompt_tokens for r in res) or 1
    tiers = info.get("tiers", {})
    host = end_tiers.get("host", {})
    page_bytes = host.get("total_bytes", 0) / max(host.get("total_pages", 1), 1)
    ttfts = [r.ttft for r in res]
    return {
        "mode": mode, "requests": len(res),
        "l1_tokens": info.get("kv_pool", {}).get("total_tokens"),
        "l2_tokens": tiers.get("host", {}).get("total_tokens"),
        "mean_ttft_s": sum(ttfts) / len(ttfts), "p90_ttft_s": percentile(ttfts, 90),
        "p50_ttft_s": median(ttfts), "p99_ttft_s": percentile(ttfts, 99),
        "mean_ttft_later_s": sum(r.ttft for r in later) / len(later) if later else None,
        "requests_per_s": len(res) / wall, "output_tps": sum(r.completion_tokens for r in res) / wall,
        "prompt_tps": prompt_total / wall, "wall_s": wall,
        "hit_device": sum(r.cached["device"] for r in res) / prompt_total,
        "hit_host": sum(r.cached["host"] for r in res) / prompt_total,
        "hit_storage": sum(r.cached["storage"] for r in res) / prompt_total,
        "hit_all": sum(sum(r.cached.values()) for r in res) / prompt_total,
        "hit_tokens": {t: sum(r.cached[t] for r in res) for t in ("device", "host", "storage")},
        "prompt_tokens": prompt_total,
        "host_ram_bytes": int(host.get("used_pages", 0) * page_bytes) if host else None,
        "l3_read_bytes": end_tiers.get("storage", {}).get("bytes_read"),
        "server_rss_bytes": rss,
        "per_request": [{"client": c, "round": rnd, "ttft_s": r.ttft, "latency_s": r.latency,
                         "prompt_tokens": r.prompt_tokens, "cached": r.cached} for c, rnd, r in results],
    }


def run(ns: argparse.Namespace, ctx: BenchContext) -> Report:
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"tierlm bench multiturn: unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    policies = _policy_list(ns.schedule_policies, SCHEDULE_POLICIES, "schedule policy")
    evictions = _policy_list(ns.radix_eviction_policies, RADIX_EVICTION_POLICIES, "radix eviction policy")
    if min(ns.clients, ns.concurrency, ns.rounds, ns.turn_tokens, ns.answer_tokens, ns.max_running or 1, ns.docs,
           ns.doc_tokens, ns.requests) < 1 or not 0 < ns.l1_fraction <= 1:
        raise SystemExit("tierlm bench multiturn: --clients, --concurrency, --rounds, --turn-tokens, "
                         "--answer-tokens, --docs, --doc-tokens, --requests must be >= 1 and --l1-fraction in (0, 1]")
    docs = ns.workload == "shared-docs"
    if docs:
        sizes = shared_docs.plan_sizes(ns, ctx.page_size, running_slots(ns))
        prompts = shared_docs.prompts(ns, ctx.seed, ctx.vocab_size)
    else:
        sizes = plan_sizes(ns, ctx.page_size)
        prompts = conversation_prompts(ns, ctx.seed, ctx.vocab_size)
    per_run = sum(len(t) for t in prompts["turns"])
    bar = ctx.progress_bar(total=len(modes) * len(policies) * len(evictions) * per_run, desc="multiturn")
    summaries = []
    infos = []
    for mode in modes:
        for policy in policies:
            for eviction in evictions:
                summary, info = run_mode(mode, ns, ctx, sizes, prompts, bar, policy, eviction)
                summaries.append(summary)
                infos.append(info)
    bar.close()
    same_variant = lambda a, b: a["policy"] == b["policy"] and a["eviction"] == b["eviction"]  # noqa: E731
    for s in summaries:
        radix = next((r for r in summaries if r["mode"] == "radix" and same_variant(r, s)), None)
        s["ttft_vs_radix"] = ratio(s["mean_ttft_s"], radix["mean_ttft_s"]) if radix else None
        s["later_vs_radix"] = ratio(s["mean_ttft_later_s"], radix["mean_ttft_later_s"]) if radix else None
        s["confirmed"] = confirm(s)
        l2 = next((r for r in summaries if r["mode"] == "hicache-l2" and same_variant(r, s)), None)
        s["later_vs_l2"] = ratio(s["mean_ttft_later_s"], l2["mean_ttft_later_s"]) \
            if l2 and s["mode"] == "hicache-l2+l3" else None
    if docs:
        title = (f"shared documents: {ns.requests} requests over {ns.docs} documents x {ns.doc_tokens} tokens "
                 f"(question {ns.turn_tokens}, answer {ns.answer_tokens} tokens), {ns.concurrency} in flight, "
                 f"L1 = {sizes['l1']} of {sizes['working_set']} tokens, L2 = {ns.hicache_ratio:g} x L1; r>=2: a "
                 "document's later uses")
    else:
        title = (f"multi-turn: {ns.clients} clients x {ns.rounds} rounds, {ns.concurrency} in flight, "
                 f"{running_slots(ns)} running (context {ns.context_tokens}, turn {ns.turn_tokens}, answer "
                 f"{ns.answer_tokens} tokens), L1 = {sizes['l1']} of {sizes['working_set']} working-set tokens")
    tables = [Table(
        title,
        [Column("label", "mode"), Column("l1_tokens", "L1 tok"), Column("l2_tokens", "L2 tok"),
         Column("mean_ttft_s", "mean TTFT ms", "ms"), Column("p90_ttft_s", "p90 TTFT ms", "ms"),
         Column("mean_ttft_later_s", "mean TTFT r>=2 ms", "ms"), Column("ttft_vs_radix", "mean vs radix", "x"), Column("later_vs_radix", "r>=2 vs radix", "x"),
         Column("requests_per_s", "req/s"), Column("output_tps", "out tok/s"),
         Column("hit_device", "hit L1", "pct"), Column("hit_host", "hit L2", "pct"),
         Column("hit_storage", "hit L3", "pct"), Column("confirmed", "tier confirmed"),
         Column("host_ram_bytes", "L2 used MiB", "mb"), Column("l3_read_bytes", "L3 read MiB", "mb"),
         Column("wall_s", "wall s"), Column("load_avg_1m", "load 1m")],
        [{k: v for k, v in s.items() if k != "per_request"} for s in summaries],
        notes=["hit %: prompt tokens served from each tier / all prompt tokens, from the responses' "
               "cached_tokens_details", "round 1 of every conversation is cold in every mode (no earlier turn to "
               "reuse), so the mean over all rounds includes those cold prefills; r>=2 excludes them",
               "load 1m: the machine's load average when the mode finished (other work slows a mode down)"])]
    if policies != [None]:
        tables.append(policy_table(summaries))
    if evictions != [None]:
        tables.append(eviction_table(summaries))
    keys = ("docs", "doc_tokens", "requests") if docs else ("clients", "rounds", "system_tokens", "context_tokens")
    settings = {k: getattr(ns, k) for k in ("workload", *keys, "concurrency", "turn_tokens", "answer_tokens",
                                            "l1_fraction", "hicache_ratio")}
    settings.update(sizes, server_extra=ctx.server_extra, max_running=running_slots(ns),
                    schedule_policies=[p for p in policies if p], radix_eviction_policies=[p for p in evictions if p])
    return Report("multiturn", ctx.command, environment(ctx.model_label, infos[0], ctx.load_at_start), settings, tables,
                  [] if docs else targets(summaries), raw={s["label"]: s["per_request"] for s in summaries})


def _policy_list(value: str | None, allowed: tuple[str, ...], what: str) -> list[str | None]:
    """``--schedule-policies`` / ``--radix-eviction-policies``: the names, or [None] (the server's own)."""
    if not value:
        return [None]
    names = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in names if p not in allowed]
    if bad or not names:
        raise SystemExit(f"tierlm bench multiturn: unknown {what} {bad}; choose from {', '.join(allowed)}")
    return names


def conversation_prompts(ns: argparse.Namespace, seed: int, vocab: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"system": random_tokens(rng, ns.system_tokens, vocab),
            "contexts": [random_tokens(rng, ns.context_tokens, vocab) for _ in range(ns.clients)],
            "turns": [[random_tokens(rng, ns.turn_tokens, vocab) for _ in range(ns.rounds)]
                      for _ in range(ns.clients)]}


def policy_table(summaries: list[dict[str, Any]]) -> Table:
    """One row per (mode, policy): cache hits and TTFT, each next to fcfs on the same mode."""
    rows = []
    for s in summaries:
        base = next((r for r in summaries if r["mode"] == s["mode"] and r["policy"] == "fcfs"
                     and r.get("eviction") == s.get("eviction")), None)
        rows.append({"label": s["label"], "hit_all": s["hit_all"], "mean_ttft_s": s["mean_ttft_s"],
                     "p50_ttft_s": s["p50_ttft_s"], "p99_ttft_s": s["p99_ttft_s"], "wall_s": s["wall_s"],
                     "ttft_vs_fcfs": ratio(s["mean_ttft_s"], base["mean_ttft_s"]) if base else None,
                     "p99_vs_fcfs": ratio(s["p99_ttft_s"], base["p99_ttft_s"]) if base else None,
                     "hit_vs_fcfs": ratio(s["hit_all"], base["hit_all"]) if base else None,
                     "wall_vs_fcfs": ratio(s["wall_s"], base["wall_s"]) if base else None})
    return Table(
        "schedule policies (server --schedule-policy), same prompts on a fresh server each",
        [Column("label", "mode/policy"), Column("hit_all", "prefix hit", "pct"),
         Column("mean_ttft_s", "mean TTFT ms", "ms"), Column("p50_ttft_s", "p50 TTFT ms", "ms"),
         Column("p99_ttft_s", "p99 TTFT ms", "ms"), Column("ttft_vs_fcfs", "mean vs fcfs", "x"),
         Column("p99_vs_fcfs", "p99 vs fcfs", "x"), Column("hit_vs_fcfs", "hit vs fcfs", "x"),
         Column("wall_s", "wall s"), Column("wall_vs_fcfs", "wall vs fcfs", "x")],
        rows,
        notes=["prefix hit: prompt tokens served from any cache tier / all prompt tokens (from the responses)",
               "TTFT counts from the send, so it includes the wait in the server's queue, which the policy orders",
               "vs fcfs: ratio to the fcfs run of the same mode (below 1: faster, or for hits: fewer)"])


def eviction_table(summaries: list[dict[str, Any]]) -> Table:
    """One row per (mode, eviction policy): hits per tier and TTFT, next to lru on the same mode."""
    rows = []
    for s in summaries:
        base = next((r for r in summaries if r["mode"] == s["mode"] and r["eviction"] == "lru"
                     and r["policy"] == s["policy"]), None)
        rows.append({k: s[k] for k in ("label", "hit_device", "hit_host", "hit_storage", "hit_all", "mean_ttft_s",
                                       "mean_ttft_later_s", "later_vs_l2", "load_avg_1m")}
                    | {"later_vs_lru": ratio(s["mean_ttft_later_s"], base["mean_ttft_later_s"]) if base else None})
    return Table(
        "radix eviction policies (server --radix-eviction-policy: device and host tiers), same prompts on a fresh "
        "server each",
        [Column("label", "mode/policy"), Column("hit_device", "hit L1", "pct"), Column("hit_host", "hit L2", "pct"),
         Column("hit_storage", "hit L3", "pct"), Column("hit_all", "hit all", "pct"),
         Column("mean_ttft_s", "mean TTFT ms", "ms"), Column("mean_ttft_later_s", "TTFT r>=2 ms", "ms"),
         Column("later_vs_lru", "r>=2 vs lru", "x"), Column("later_vs_l2", "r>=2 vs hicache-l2", "x"),
         Column("load_avg_1m", "load 1m")],
        rows,
        notes=["hit Ln: prompt tokens served from that tier / all prompt tokens (from the responses)",
               "r>=2 vs hicache-l2: the L2+L3 row's TTFT of rounds >= 2 over the hicache-l2 row's with the same "
               f"policy (issue 20: <= {L3_VS_L2_TARGET}x with L2 hits > 0)"])


def confirm(summary: dict[str, Any]) -> str:
    tier = TIER_OF_MODE.get(summary["mode"])
    if tier is None:
        return "yes" if summary["hit_tokens"]["host"] == summary["hit_tokens"]["storage"] == 0 else "NO: off-device hits"
    n = summary["hit_tokens"][tier]
    return "yes" if n > 0 else f"NO: 0 tokens from {tier}"


def targets(summaries: list[dict[str, Any]]) -> list[Target]:
    out = []
    for s in summaries:
        if s["mode"] == "radix" or s["ttft_vs_radix"] is None:
            continue
        measured = f"{s['ttft_vs_radix']:.2f}x radix-only mean TTFT"
        name = s.get("label") or s["mode"]
        if s["confirmed"] != "yes":
            out.append(Target(f"{name} mean TTFT", f"<= {TARGET_RATIO}x radix-only", measured, None,
                              s["confirmed"]))
        else:
            out.append(Target(f"{name} mean TTFT", f"<= {TARGET_RATIO}x radix-only", measured,
                              s["ttft_vs_radix"] <= TARGET_RATIO))
    for s in summaries:
        if s.get("later_vs_l2") is not None:
            host = s["hit_tokens"]["host"]
            out.append(Target(f"{s['label']} TTFT r>=2 vs hicache-l2", f"<= {L3_VS_L2_TARGET}x, L2 hits > 0",
                              f"{s['later_vs_l2']:.2f}x, {host} tokens from L2",
                              s["later_vs_l2"] <= L3_VS_L2_TARGET and host > 0))
    return out
