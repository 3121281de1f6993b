"""Issue 59's targets next to what one `tierlm bench agent` run measured (tierlm's rows only, peers for the last):

- reuse: every request after the first of its conversation computes at most its new tokens plus one page (the
  cache read all of the previous prompt that this one repeats);
- fairness: a side request sent with its session's first (long) request gets its first token within its own solo
  TTFT plus two chunk times (a chunk: --chunked-prefill-size tokens at the session's cold prefill rate);
- resume: a continued turn on the restarted server reads its prefix from L3, TTFT at most 15 % of that turn's cold
  TTFT (its prompt at the session's cold prefill rate);
- side by side (with --against): tierlm's wall time over all sessions and its p50 and p90 main-turn TTFT below each
  peer's.
"""
from __future__ import annotations

from typing import Any

from tierlm.server.commands.bench.agent.options import OWN
from tierlm.server.commands.bench.agent.plan import RESUMED, SIDE
from tierlm.server.commands.bench.report import Target

RESUME_TARGET = 0.15
SIDE_CHUNKS = 2


def targets(rows: dict[str, list[dict[str, Any]]], values: dict[str, dict[str, Any]], rates: dict[int, float | None],
            page_size: int, chunk: int | None) -> list[Target]:
    own = rows.get(OWN, [])
    out = [_reuse(own, page_size), _fairness(own, rates, chunk), _resume(own, rates)]
    out += [_ahead(values, peer) for peer in values if peer != OWN]
    return [t for t in out if t is not None]


def _reuse(rows: list[dict[str, Any]], page_size: int) -> Target | None:
    later = [r for r in rows if r["phase"] != "solo" and r["kind"] != SIDE and r["new_tokens"] is not None
             and r["new_tokens"] != r["prompt_tokens"] and r["computed_tokens"] is not None]
    if not later:
        return None
    worst = max(later, key=lambda r: r["computed_tokens"] - r["new_tokens"])
    over = [r for r in later if r["computed_tokens"] > r["new_tokens"] + page_size]
    return Target("appended turns reuse the previous prompt", f"computed <= new + one page ({page_size}) on every "
                  "request after its conversation's first", f"{len(later) - len(over)} of {len(later)} (worst: "
                  f"{worst['session']} {worst['kind']} {worst['turn']}: {worst['computed_tokens']} computed, "
                  f"{worst['new_tokens']} new)", not over)


def _fairness(rows: list[dict[str, Any]], rates: dict[int, float | None], chunk: int | None) -> Target | None:
    side = [r for r in rows if r["kind"] == SIDE and r["phase"] != "solo"]
    solo = [r["ttft_s"] for r in rows if r["phase"] == "solo"]
    known = [rate for rate in rates.values() if rate]
    if not side or not solo or not chunk or not known:
        return None
    chunk_s = chunk / (sum(known) / len(known))
    bound = max(solo) + SIDE_CHUNKS * chunk_s
    worst = max(r["ttft_s"] for r in side)
    return Target("a side request during a long prefill", f"TTFT <= its solo TTFT + {SIDE_CHUNKS} chunks "
                  f"({chunk} tokens each, {chunk_s * 1000:.0f} ms at the cold rate): {bound * 1000:.0f} ms",
                  f"worst of {len(side)}: {worst * 1000:.0f} ms (alone {max(solo) * 1000:.0f} ms)", worst <= bound)


def _resume(rows: list[dict[str, Any]], rates: dict[int, float | None]) -> Target | None:
    resumed = [r for r in rows if r["kind"] == RESUMED]
    if not resumed:
        return None
    parts, met = [], True
    for r in resumed:
        rate = rates.get(r["session_index"])
        cold = r["prompt_tokens"] / rate if rate and r["prompt_tokens"] else None
        share = r["ttft_s"] / cold if cold else None
        from_l3 = (r["cached_storage"] or 0) > 0
        met = met and share is not None and share <= RESUME_TARGET and from_l3
        parts.append(f"{r['session']}: {r['ttft_s'] * 1000:.0f} ms = "
                     + (f"{share * 100:.0f} %" if share is not None else "?")
                     + f" of cold, {r['cached_storage'] or 0} tokens from L3")
    return Target("a session resumed after a restart", f"TTFT <= {RESUME_TARGET:.0%} of its cold TTFT, prefix "
                  "from L3", "; ".join(parts), met)


def _ahead(values: dict[str, dict[str, Any]], peer: str) -> Target:
    keys = (("sessions_wall_s", "total session time"), ("main_ttft_p50_s", "p50 turn TTFT"),
            ("main_ttft_p90_s", "p90 turn TTFT"))
    mine, theirs = values[OWN], values[peer]
    parts, met = [], True
    for key, label in keys:
        a, b = mine.get(key), theirs.get(key)
        if a is None or b is None:
            met = False
            parts.append(f"{label}: -")
            continue
        met = met and a < b
        parts.append(f"{label} {a:.2f} vs {b:.2f} s ({a / b:.2f}x)")
    return Target(f"ahead of {peer}", "total session time, p50 and p90 main-turn TTFT below the peer's",
                  "; ".join(parts), met)
