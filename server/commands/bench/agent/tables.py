"""`tierlm bench agent`'s report: one row per request, TTFT per turn side by side, and a summary per server (with
ratios to the first server when there are several).

Per request: TTFT; prompt tokens (the server's usage); new tokens (this prompt minus the previous request's of the
same conversation); cached tokens per tier and in all; computed (prompt - cached); "diverged at" (where tierlm's
rendering of this prompt first differs from the previous one's: the most a prefix cache can reuse); "ideal" (the
new tokens alone at the session's cold prefill rate: its first request's computed tokens over its TTFT).
"""
from __future__ import annotations

import argparse
from typing import Any

from tierlm.server.commands.bench.agent.options import OWN
from tierlm.server.commands.bench.agent.plan import CONTINUED, MAIN, RESUMED, SIDE, SUBAGENT
from tierlm.server.commands.bench.agent.prompts import diverged_at
from tierlm.server.commands.bench.agent.replay import Record, ServerRun
from tierlm.server.commands.bench.agent.targets import targets
from tierlm.server.commands.bench.agent.workload import Workload
from tierlm.server.commands.bench.context import BenchContext
from tierlm.server.commands.bench.quiet_machine import MAX_WAIT_S, MIN_WAIT_S
from tierlm.server.commands.bench.report import Column, Report, Table, environment
from tierlm.server.commands.bench.stats import median, percentile, ratio

# (key, label, unit, better) of the summary; unit: "ms" (seconds shown in ms), "s", "x", "pct", "n"
SUMMARY = (("sessions_wall_s", "all sessions, wall", "s", "<"),
           ("session_mean_s", "one session, mean", "s", "<"),
           ("first_ttft_s", "first requests TTFT, median", "ms", "<"),
           ("main_ttft_p50_s", "main turns TTFT p50", "ms", "<"),
           ("main_ttft_p90_s", "main turns TTFT p90", "ms", "<"),
           ("later_vs_ideal", "later main turns: TTFT / ideal (sums)", "x", "<"),
           ("subagent_ttft_s", "sub-agent requests TTFT, median", "ms", "<"),
           ("side_ttft_s", "side requests TTFT with the first requests, median", "ms", "<"),
           ("side_solo_ttft_s", "side request TTFT alone", "ms", "<"),
           ("side_vs_solo", "side requests: with the first requests / alone", "x", "<"),
           ("continued_ttft_s", "continued turns TTFT, median", "ms", "<"),
           ("cached_share", "later main turns: prompt tokens read from cache", "pct", ">"),
           ("computed_tokens", "prompt tokens computed, all requests", "n", "<"))


def request_rows(run: ServerRun, w: Workload, rates: dict[int, float | None]) -> list[dict[str, Any]]:
    """One row per request of ``run``, in the order they were sent (``rates``: session_rates)."""
    by_req = {id(r.req): r for r in run.records}
    rows = []
    for rec in sorted(run.records, key=lambda r: r.out.sent):
        prev_req = w.previous.get(id(rec.req))
        prev = by_req.get(id(prev_req)) if prev_req is not None else None
        rows.append(row(run.name, rec, prev, w, rates.get(rec.req.session)))
    return rows


def cold_rate(rec: Record) -> float | None:
    """Tokens per second of a session's first request: what it computed over its TTFT; None where it computed less
    than half its prompt (a server that had it cached: a long-lived peer still holding an earlier run's prompts)."""
    prompt = rec.out.prompt_tokens or 0
    computed = prompt - (rec.out.cached_tokens or 0)
    return computed / rec.out.ttft if computed > 0 and 2 * computed >= prompt and rec.out.ttft > 0 else None


def session_rates(run: ServerRun) -> tuple[dict[int, float | None], list[str]]:
    """Each session's cold prefill rate (its first request's), the median of the others' for a session whose first
    request was no cold prefill; and a note for those."""
    firsts = {r.req.session: r for r in run.records if r.req.kind == MAIN and r.req.turn == 0}
    rates = {s: cold_rate(r) for s, r in firsts.items()}
    warm = sorted(s for s, v in rates.items() if v is None)
    if not warm:
        return rates, []
    fallback = median([v for v in rates.values() if v is not None])
    rates = {s: v if v is not None else fallback for s, v in rates.items()}
    what = (f"use the median rate of {run.name}'s other sessions" if fallback is not None else
            "have no ideal time (no session's first request was a cold prefill)")
    return rates, [f"{run.name}: the first request of {', '.join(f's{s}' for s in warm)} found most of its prompt "
                   f"cached (the tools and instructions another session computed first, or a server kept up since an earlier run "
                   f"with the same --seed): those sessions {what}"]


def row(server: str, rec: Record, prev: Record | None, w: Workload, rate: float | None) -> dict[str, Any]:
    o, req = rec.out, rec.req
    prompt = o.prompt_tokens
    new = prompt - prev.out.prompt_tokens if prev is not None and prompt is not None and \
        prev.out.prompt_tokens is not None else prompt
    rendered = w.rendered[id(req)].ids
    prev_ids = w.rendered[id(prev.req)].ids if prev is not None else None
    tiers = o.tiers or {}
    return {"server": server, "client": req.client, "session": req.label, "session_index": req.session,
            "kind": rec.kind,
            "planned_kind": req.kind, "turn": req.turn, "chain": req.chain, "phase": rec.phase, "ttft_s": o.ttft,
            "latency_s": o.latency, "prompt_tokens": prompt, "new_tokens": new,
            "cached_device": tiers.get("device"), "cached_host": tiers.get("host"),
            "cached_storage": tiers.get("storage"), "cached_tokens": o.cached_tokens,
            "computed_tokens": prompt - (o.cached_tokens or 0) if prompt is not None else None,
            "diverged_at": diverged_at(prev_ids, rendered), "tierlm_prompt_tokens": len(rendered),
            "ideal_s": new / rate if rate and new is not None else None, "path": o.path,
            "completion_tokens": o.completion_tokens, "first_delta": o.first is not None,
            "tier_source": o.tier_source}


def summarize(run: ServerRun, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's summary values (see SUMMARY)."""
    def of(*kinds: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["kind"] in kinds and r["phase"] != "solo"]

    main = of(MAIN)
    later = [r for r in main if r["turn"] > 0]
    side, solo = of(SIDE), [r for r in rows if r["phase"] == "solo"]
    ideal = sum(r["ideal_s"] or 0 for r in later)
    prompt_later = sum(r["prompt_tokens"] or 0 for r in later)
    side_ttft = median([r["ttft_s"] for r in side])
    solo_ttft = median([r["ttft_s"] for r in solo])
    return {"sessions_wall_s": run.sessions_wall_s,
            "session_mean_s": sum(run.session_s.values()) / len(run.session_s) if run.session_s else None,
            "first_ttft_s": median([r["ttft_s"] for r in main if r["turn"] == 0]),
            "main_ttft_p50_s": percentile([r["ttft_s"] for r in main], 50),
            "main_ttft_p90_s": percentile([r["ttft_s"] for r in main], 90),
            "later_vs_ideal": ratio(sum(r["ttft_s"] for r in later), ideal) if later and ideal else None,
            "subagent_ttft_s": median([r["ttft_s"] for r in of(SUBAGENT)]),
            "side_ttft_s": side_ttft, "side_solo_ttft_s": solo_ttft, "side_vs_solo": ratio(side_ttft, solo_ttft),
            "continued_ttft_s": median([r["ttft_s"] for r in of(CONTINUED, RESUMED)]),
            "cached_share": ratio(sum(r["cached_tokens"] or 0 for r in later), prompt_later),
            "computed_tokens": sum(r["computed_tokens"] or 0 for r in rows)}


def _cell(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    return {"ms": f"{value * 1000:.1f} ms", "s": f"{value:.2f} s", "x": f"{value:.2f}x",
            "pct": f"{value * 100:.1f}%", "n": f"{value:.0f}"}[unit]


def summary_table(runs: list[ServerRun], values: dict[str, dict[str, Any]]) -> Table:
    names = [r.name for r in runs]
    ref = names[0]
    rows = []
    for key, label, unit, better in SUMMARY:
        vals = {n: values[n][key] for n in names}
        if all(v is None for v in vals.values()):
            continue
        row: dict[str, Any] = {"metric": label, "key": key, "values": vals,
                               "better": f"{better} 1 (lower)" if better == "<" else f"{better} 1 (higher)"}
        for n in names:
            r = ratio(vals[n], vals[ref]) if n != ref else None
            row[f"cell:{n}"] = _cell(vals[n], unit) + (f" ({r:.2f}x)" if r is not None else "")
        if len(names) > 1:  # the chart of `--plot`: each server's ratio to the first
            row["ratios"] = {n: ratio(vals[n], vals[ref]) for n in names[1:]}
        rows.append(row)
    columns = [Column("metric", "metric")] + [Column(f"cell:{n}", n) for n in names]
    notes = [f"(N.NNx) after a value: that server's value / {ref}'s; the last column says which side of 1 is "
             "better for the other server"] if len(names) > 1 else []
    if len(names) > 1:
        columns.append(Column("better", f"server/{ref} better if"))
    notes += ["main turns: the sessions' own requests (not sub-agent, side or continued ones); later: after each "
              "session's first", "ideal: the new tokens of a request alone at its session's cold prefill rate "
              "(the session's first request: tokens computed / TTFT)",
              "side requests: sent at the same moment as their session's first (long) request; alone: one measured "
              "before the sessions with nothing else in flight"]
    return Table("Per server" + (f" (ratios to {ref})" if len(names) > 1 else ""), columns, rows, notes)


def turns_table(runs: list[ServerRun], per_server: dict[str, list[dict[str, Any]]], both: bool) -> Table:
    """TTFT of every request, one column per server (the chart of `--plot`), session by session in the order the
    first server got them (a continued turn is one row, sent after a restart or not)."""
    order: list[tuple[str, str, str, int]] = []
    cells: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for run in runs:
        for r in per_server[run.name]:
            key = (r["client"], r["session"], r["planned_kind"], r["turn"])
            if key not in cells:
                order.append(key)
                cells[key] = {}
            cells[key][f"ttft:{run.name}"] = r["ttft_s"]
    rank = {key: i for i, key in enumerate(order)}
    order.sort(key=lambda k: (k[1] != "solo", int(k[1][1:]) if k[1][1:].isdigit() else -1, rank[k]))
    rows = [{"request": " ".join(([c] if both else []) + [s, k, str(t)]), **cells[(c, s, k, t)]}
            for c, s, k, t in order]
    return Table("TTFT per request and server", [Column("request", "request")] +
                 [Column(f"ttft:{run.name}", f"{run.name} TTFT ms", "ms") for run in runs], rows)


def request_table(rows: list[dict[str, Any]], both: bool) -> Table:
    columns = [Column("server", "server")] + ([Column("client", "client")] if both else []) + [
        Column("session", "session"), Column("kind", "kind"), Column("turn", "turn"),
        Column("ttft_s", "TTFT ms", "ms"), Column("prompt_tokens", "prompt"), Column("new_tokens", "new"),
        Column("cached_device", "L1 hit"), Column("cached_host", "L2 hit"), Column("cached_storage", "L3 hit"),
        Column("cached_tokens", "cached"), Column("computed_tokens", "computed"),
        Column("diverged_at", "diverged at"), Column("ideal_s", "ideal ms", "ms")]
    return Table("Every request (in the order sent)", columns, rows)


def notes(ns: argparse.Namespace, w: Workload, runs: list[ServerRun], per_server: dict[str, list[dict[str, Any]]],
          context_note: str, template: str | None) -> list[str]:
    out = [f"{shape.label} ({shape.data.get('recorded', 'recorded')}): {shape.client} sessions replay its "
           f"recorded requests (tools, instructions, turn structure, per-session ids); the assistant turns are the "
           f"recorded scripted ones, so no server's generated text changes what follows"
           for shape in w.shapes.values()]
    out += [f"TRIMMED shape ({shape.client}): {t}" for shape in w.shapes.values() for t in shape.trimmed]
    out.append(f"{ns.sessions} session(s) per client at once, {ns.turns} tool round(s) each"
               + (f", a sub-agent with {ns.subagent_reads} Read round(s) at turn 1" if ns.subagent else "")
               + (", then a continued turn" if ns.continued else "")
               + f"; files read from {w.repo} (picked with --seed {ns.seed}, at most {ns.max_file_chars} chars "
               "each, different for every session)")
    out.append(context_note)
    out.append("TTFT: to the first content delta (Anthropic content_block_delta, Responses *.delta, chat "
               "completions delta); every request asks for --max-new-tokens "
               f"{ns.max_new_tokens} at temperature 0")
    out.append("diverged at: where tierlm's own rendering of the prompt (its converters and the chat template"
               + (f" of {template}" if template else "") + ") first differs from the previous request's of the same "
               "conversation (session, sub-agent); the same for every server, as tierlm renders it (another server "
               "may render, and keep the billing header, otherwise)"
               + ("; Responses requests are rendered whole, as tierlm renders a request without encrypted_content "
                  "(the replay sends none back: its assistant turns are scripted)" if "codex" in w.shapes else ""))
    out.append("new: prompt tokens minus the previous request's of the same conversation; cached per tier: the "
               "answer's own split (tierlm: L1 device, L2 host, L3 storage); computed: prompt - cached")
    metrics = sum(1 for rows in per_server.values() for r in rows if r["tier_source"] == "metrics")
    if metrics:
        out.append(f"{metrics} request(s) sent alone had their split per tier from tierlm's /metrics counters around "
                   "them (their answer reports only the total)")
    for run in runs:
        if run.route.translated():
            out.append(f"{run.name} has no {', '.join(run.route.translated())}: those requests went to "
                       "/v1/chat/completions, converted by tierlm's own converters (tools as function tools, blocks "
                       "and items as chat messages, the billing header kept)")
        if run.restarted:
            out.append(f"{run.name} was restarted after the sessions (L3 writes finished first) on the same L3 "
                       "folder; each continued turn was then sent alone: its prefix could come from L3 only")
        elif ns.restart:
            out.append(f"{run.name} is not restarted (not started by the bench): its continued turns were sent alone "
                       "after the sessions, from its own cache")
    for run in runs:
        rows = per_server[run.name]
        if run.name != OWN and rows and not any(r["cached_tokens"] for r in rows):
            out.append(f"{run.name}'s answers report no prompt tokens read from cache (its prefix cache may still "
                       "hit): its 'computed' counts every prompt token, an upper bound")
    out += mismatch_notes(per_server)
    quiet = [(run.name, run.quiet) for run in runs if run.quiet is not None]
    if quiet:
        out.append(f"before each peer the bench waited for a quiet machine (at least {MIN_WAIT_S:g} s, at most "
                   f"{MAX_WAIT_S:g} s): " + ", ".join(f"{n} {q.waited_s:.1f} s{'' if q.quiet else ' (BUSY)'}"
                                                    for n, q in quiet))
    return out + w.notes


def mismatch_notes(per_server: dict[str, list[dict[str, Any]]]) -> list[str]:
    """tierlm counting other prompt tokens than the bench rendered means the bench's rendering is not the server's."""
    rows = per_server.get(OWN, [])
    bad = [r for r in rows if r["prompt_tokens"] != r["tierlm_prompt_tokens"]]
    if not bad:
        return []
    first = bad[0]
    return [f"WARNING: tierlm counted other prompt tokens than the bench rendered for {len(bad)} request(s) (e.g. "
            f"{first['session']} {first['kind']} {first['turn']}: {first['prompt_tokens']} vs "
            f"{first['tierlm_prompt_tokens']}); 'diverged at' is then approximate"]


def build_report(ns: argparse.Namespace, ctx: BenchContext, w: Workload, runs: list[ServerRun], context_note: str,
                 template: str | None) -> Report:
    rates = {run.name: session_rates(run) for run in runs}
    per_server = {run.name: request_rows(run, w, rates[run.name][0]) for run in runs}
    values = {run.name: summarize(run, per_server[run.name]) for run in runs}
    every = [r for run in runs for r in per_server[run.name]]
    both = ns.client == "both"
    tables = [summary_table(runs, values), turns_table(runs, per_server, both), request_table(every, both)]
    tables[2].notes = notes(ns, w, runs, per_server, context_note, template) + [
        n for run in runs for n in rates[run.name][1]]
    info = next((run.info for run in runs if run.info), None)
    settings = {"client": ns.client, "sessions": ns.sessions, "turns": ns.turns, "subagent": ns.subagent,
                "subagent_reads": ns.subagent_reads if ns.subagent else 0,
                "side_requests": {c: bool(w.solos.get(c)) for c in w.shapes}, "side_tokens": ns.side_tokens,
                "continued": ns.continued, "restart": ns.restart, "max_new_tokens": ns.max_new_tokens,
                "trim_tools": ns.trim_tools, "instructions_chars": ns.instructions_chars, "repo": str(w.repo),
                "max_file_chars": ns.max_file_chars, "longest_prompt_tokens": w.longest,
                "server_extra": ctx.server_extra,
                "servers": {run.name: {"url": run.url, "paths": run.route.paths, "restarted": run.restarted}
                            for run in runs}}
    servers = {run.name: {"sessions_wall_s": run.sessions_wall_s,
                          "session_s": {f"s{k}": v for k, v in run.session_s.items()},
                          "quiet_wait": run.quiet.to_dict() if run.quiet else None,
                          "requests": per_server[run.name]} for run in runs}
    raw = {"summary": values, "trimmed": {c: list(s.trimmed) for c, s in w.shapes.items()}, "context": context_note,
           "servers": servers}
    own_rates = rates[OWN][0] if OWN in rates else {}
    goals = targets(per_server, values, own_rates, ctx.page_size, prefill_chunk(info))
    return Report("agent", ctx.command, environment(ctx.model_label, info, ctx.load_at_start), settings, tables,
                  targets=goals, raw=raw)


def prefill_chunk(info: dict[str, Any] | None) -> int | None:
    """tierlm's prefill tokens per step (--chunked-prefill-size, capped by --max-prefill-tokens), from /server_info."""
    args = (info or {}).get("server_args") or {}
    sizes = [v for v in (args.get("chunked_prefill_size"), args.get("max_prefill_tokens")) if isinstance(v, int)]
    return min(sizes) if sizes else None
