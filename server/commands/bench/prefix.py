"""`tierlm bench prefix`: time to first token for a shared prefix served cold, from L1, from L2 and from L3.

One server with HiCache (host tier + file storage) and a device pool just big enough for one request:
  cold    prefix + suffix on a fresh server: the whole prompt is prefilled;
  L1 hit  the same prefix + a new suffix right after: the prefix's KV is still on the device;
  L2 hit  after a filler prompt that needs the whole device pool (the prefix is demoted to the host tier);
  L3 hit  after a restart on the same storage folder (device and host are empty, the files remain);
  L3 other instance  a second server on a shared Mooncake store serves prefixes a first one computed
          (shared_l3.py; needs tierlm[mooncake], skipped with the reason where absent).
Each row shows the per-tier hit tokens the response itself reported; a row whose statistics do not show the
whole prefix coming from its tier is flagged and not credited against the targets. A second table splits each
row's TTFT into the stages the server timed (runtime/cache/hit_stages.py: scheduler wait, L3 read, checksum, copy
into host pages, host -> device copy, forward), so a slow tier names its stage.
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from tierlm.server.commands.bench import shared_l3
from tierlm.server.commands.bench.context import BenchContext, random_tokens
from tierlm.server.commands.bench.report import Column, Report, Table, Target, environment
from tierlm.server.commands.bench.server_process import BenchServer, RequestResult, run_one
from tierlm.server.commands.bench.stats import median, ratio

CASES = ("cold", "L1 hit", "L2 hit", "L3 hit", shared_l3.CASE)
EXPECTED_TIER = {"cold": None, "L1 hit": "device", "L2 hit": "host", "L3 hit": "storage", shared_l3.CASE: "storage"}
# TTFT vs cold, from issue 6 (and issue 16 for a page another instance computed)
TARGET_RATIO = {"L1 hit": 0.02, "L2 hit": 0.03, "L3 hit": 0.05, shared_l3.CASE: 0.05}
L3_VS_L2_TARGET = 1.15  # issue 20: an L3 hit costs bytes / bandwidth, so its TTFT stays near the L2 hit's
L3_EXTRA_TARGET_BYTES_S = 1.5e9  # issue 34: the L3 hit's extra time over the L2 hit, for its bytes, page-cached
# The server's stage timers (runtime/cache/hit_stages.STAGES), as /server_info's tiers.stages names them.
STAGES = ("scheduler_wait", "storage_read", "checksum", "host_copy", "host_to_device", "forward")
STAGE_TITLES = {"scheduler_wait": "wait ms", "storage_read": "L3 read ms", "checksum": "checksum ms",
                "host_copy": "to host ms", "host_to_device": "host->dev ms", "forward": "forward ms"}
WARM_REQUEST_TOKENS = 64
DEFAULT_PREFIX_TOKENS = 2048
POOL_MARGIN_PAGES = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefix benchmark")
    g.add_argument("--prefix-tokens", type=int, default=None,
                   help=f"length of the shared prefix (default {DEFAULT_PREFIX_TOKENS}, or less where the model's "
                        "context is shorter: the prefix, a suffix, the new tokens and the filler prompt must fit it)")
    g.add_argument("--suffix-tokens", type=int, default=16, help="length of each distinct suffix")
    g.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per request")
    g.add_argument("--repeats", type=int, default=1, help="prefixes measured (medians are reported)")
    g.add_argument("--hicache-ratio", type=float, default=4.0,
                   help="host tier size as a multiple of the device pool (must hold prefix and filler)")
    g.add_argument("--l3-other-instance", choices=("auto", "on", "off"), default="auto",
                   help="measure the 'L3 other instance' row (two servers sharing a Mooncake store); auto: when "
                        "tierlm[mooncake] is installed")


def max_prefix_tokens(context: int, suffix: int, new: int, page_size: int) -> int:
    """The longest prefix whose runs fit ``context``: the filler prompt (the device pool less one page, plus
    ``new`` tokens) is the longest request, and the pool is prefix + suffix + new rounded up to pages + a margin."""
    return (context // page_size - POOL_MARGIN_PAGES + 1) * page_size - suffix - new


def fit_prefix_tokens(requested: int | None, suffix: int, new: int, page_size: int, context: int | None) -> int:
    """--prefix-tokens, or its default fitted to the model's context; SystemExit naming the fix when it cannot
    fit."""
    if context is None:
        return DEFAULT_PREFIX_TOKENS if requested is None else requested
    most = max_prefix_tokens(context, suffix, new, page_size)
    if requested is None:
        if most < page_size:
            raise SystemExit(f"tierlm bench prefix: the model's context ({context} tokens) leaves no room for a "
                             f"prefix of one page besides --suffix-tokens {suffix}, --max-new-tokens {new} and the "
                             f"filler prompt; lower those or --page-size")
        return min(DEFAULT_PREFIX_TOKENS, most)
    if requested > most:
        raise SystemExit(f"tierlm bench prefix: --prefix-tokens {requested} does not fit the model's context "
                         f"({context} tokens) with --suffix-tokens {suffix}, --max-new-tokens {new} and the filler "
                         f"prompt that pushes it out of L1; use --prefix-tokens {max(most, 0)} or less")
    return requested


def context_length(ctx: BenchContext) -> int | None:
    """The context the servers will have: --context-length among the server flags, else the model's
    max_position_embeddings (None: unknown)."""
    extra = list(ctx.server_extra)
    for i, flag in enumerate(extra):
        if flag == "--context-length" and i + 1 < len(extra):
            return int(extra[i + 1])
        if flag.startswith("--context-length="):
            return int(flag.split("=", 1)[1])
    from tierlm.backends.model_source.model_folder import ModelFolder

    value = ModelFolder.read(ctx.model_dir).text_config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def pool_tokens(prefix: int, suffix: int, new: int, page_size: int) -> int:
    """A device pool that holds one request plus a few pages: the next long prompt must evict the prefix."""
    need = prefix + suffix + new
    return -(-need // page_size) * page_size + POOL_MARGIN_PAGES * page_size


def confirm(case: str, res: RequestResult, full_prefix: int) -> tuple[str, bool]:
    """('yes' | why not, confirmed?) from the response's own per-tier hit counts."""
    tier = EXPECTED_TIER[case]
    c = res.cached
    if tier is None:
        total = res.cached_total
        return ("yes", True) if total == 0 else (f"NO: {total} tokens were already cached", False)
    got = c[tier]
    others = {k: v for k, v in c.items() if k != tier and v}
    if got == full_prefix and not others:
        return "yes", True
    other_txt = ", ".join(f"{k} {v}" for k, v in others.items())
    kind = "PARTIAL" if got else "NO"
    return f"{kind}: {tier} {got} of {full_prefix}" + (f" ({other_txt})" if other_txt else ""), False


def _tier_snapshot(server: BenchServer) -> dict[str, Any]:
    tiers = server.info().get("tiers", {})
    host = tiers.get("host", {})
    page_bytes = host.get("total_bytes", 0) / max(host.get("total_pages", 1), 1)
    return {"host_used_bytes": int(host.get("used_pages", 0) * page_bytes),
            "host_total_bytes": host.get("total_bytes"),
            "l3_bytes_read": tiers.get("storage", {}).get("bytes_read", 0),
            "l3_read_seconds": tiers.get("storage", {}).get("read_seconds", 0.0),
            "l3_bytes": tiers.get("storage", {}).get("bytes", 0),
            "stages": tiers.get("stages", {})}


def _measure(server: BenchServer, case: str, repeat: int, ids: list[int], new: int, full_prefix: int
             ) -> dict[str, Any]:
    server.wait_storage_idle()  # earlier rows' L3 writes must not share the CPU with this one
    before = _tier_snapshot(server)
    res = run_one(server.url, ids, new)
    after = _tier_snapshot(server)
    confirmed, ok = confirm(case, res, full_prefix)
    return {"case": case, "repeat": repeat, "ttft_s": res.ttft, "completion_s": res.latency,
            "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "hit_device": res.cached["device"], "hit_host": res.cached["host"], "hit_storage": res.cached["storage"],
            "confirmed": confirmed, "ok": ok, "host_ram_bytes": after["host_used_bytes"],
            "l3_read_bytes": after["l3_bytes_read"] - before["l3_bytes_read"],
            "l3_read_mib_s": _read_rate(after["l3_bytes_read"] - before["l3_bytes_read"],
                                        after["l3_read_seconds"] - before["l3_read_seconds"]),
            "server_rss_bytes": server.rss_bytes(), **_stage_deltas(before["stages"], after["stages"])}


def _stage_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Seconds the server spent in each hit stage during one request (None where the server reports none)."""
    return {f"stage_{s}_s": (after[s] - before.get(s, 0.0)) if s in after else None for s in STAGES}


def _read_rate(nbytes: int, seconds: float) -> float | None:
    """L3 read rate of one request in MiB/s: page bytes read over the time spent inside the reads (open, read,
    verify); None when it read nothing."""
    return nbytes / 2**20 / seconds if nbytes and seconds and seconds > 0 else None


def run(ns: argparse.Namespace, ctx: BenchContext) -> Report:
    S, new, R, ps = ns.suffix_tokens, ns.max_new_tokens, ns.repeats, ctx.page_size
    P = ns.prefix_tokens = fit_prefix_tokens(ns.prefix_tokens, S, new, ps, context_length(ctx))
    if P < ps or S < 1 or new < 1 or R < 1:
        raise SystemExit("tierlm bench prefix: need --prefix-tokens >= page size, --suffix-tokens, "
                         "--max-new-tokens and --repeats >= 1")
    l1 = pool_tokens(P, S, new, ps)
    filler_len = l1 - new - ps  # needs every page but one: everything cached so far leaves the device
    full_prefix = (P // ps) * ps  # the cache works in whole pages
    rng = np.random.default_rng(ctx.seed)
    V = ctx.vocab_size
    prefixes = [random_tokens(rng, P, V) for _ in range(R)]
    server = BenchServer(ctx.server_args("--max-total-tokens", str(l1), "--enable-hierarchical-cache",
                                         "--hicache-ratio", str(ns.hicache_ratio),
                                         "--hicache-storage-backend", "file"),
                         storage_dir=ctx.work_dir / "l3", log_dir=ctx.work_dir, name="prefix-server")
    rows: list[dict[str, Any]] = []
    other_why = None if ns.l3_other_instance == "on" else "--l3-other-instance off" \
        if ns.l3_other_instance == "off" else shared_l3.unavailable()
    bar = ctx.progress_bar(total=2 + 4 * R + R + (0 if other_why else 1), desc="prefix")

    def step(desc: str) -> None:
        bar.set_description(f"prefix: {desc}")

    with server:
        step("starting server")
        server.start()
        info = server.info()
        run_one(server.url, random_tokens(rng, WARM_REQUEST_TOKENS, V), 1)  # first HTTP request, off the clock
        bar.update()
        for r, prefix in enumerate(prefixes):
            for case in ("cold", "L1 hit"):
                step(f"{case} ({r + 1}/{R})")
                rows.append(_measure(server, case, r, prefix + random_tokens(rng, S, V), new, full_prefix))
                bar.update()
            step(f"filling L1 ({r + 1}/{R})")
            run_one(server.url, random_tokens(rng, filler_len, V), new)
            bar.update()
            step(f"L2 hit ({r + 1}/{R})")
            rows.append(_measure(server, "L2 hit", r, prefix + random_tokens(rng, S, V), new, full_prefix))
            bar.update()
        step("restarting on the same L3 folder")
        l3_files = _tier_snapshot(server)["l3_bytes"]
        server.restart()
        run_one(server.url, random_tokens(rng, WARM_REQUEST_TOKENS, V), 1)
        bar.update()
        for r, prefix in enumerate(prefixes):
            step(f"L3 hit ({r + 1}/{R})")
            rows.append(_measure(server, "L3 hit", r, prefix + random_tokens(rng, S, V), new, full_prefix))
            bar.update()
    if other_why is None:
        rows += shared_l3.measure(
            lambda *flags: ctx.server_args("--max-total-tokens", str(l1), "--enable-hierarchical-cache",
                                           "--hicache-ratio", str(ns.hicache_ratio), *flags),
            ctx.work_dir, prefixes, lambda prefix: prefix + random_tokens(rng, S, V),
            random_tokens(rng, WARM_REQUEST_TOKENS, V), info["tiers"]["device"]["bytes_per_page"], ps,
            lambda srv, case, r, ids: _measure(srv, case, r, ids, new, full_prefix), run_one, new, step)
        bar.update()
    bar.close()
    return _report(ns, ctx, info, rows, l1, filler_len, l3_files, other_why)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case: median times over repeats, the worst repeat's hit counts, ratios to cold."""
    out = []
    for case in CASES:
        mine = [r for r in rows if r["case"] == case]
        if not mine:
            continue
        tier = EXPECTED_TIER[case]
        worst = min(mine, key=lambda r: r[f"hit_{tier}"]) if tier else max(mine, key=lambda r: r["hit_device"])
        bad = [r for r in mine if not r["ok"]]
        out.append({"case": case, "ttft_s": median([r["ttft_s"] for r in mine]),
                    "completion_s": median([r["completion_s"] for r in mine]),
                    "hit_device": worst["hit_device"], "hit_host": worst["hit_host"],
                    "hit_storage": worst["hit_storage"], "confirmed": bad[0]["confirmed"] if bad else "yes",
                    "ok": not bad, "host_ram_bytes": max(r["host_ram_bytes"] for r in mine),
                    "l3_read_bytes": median([r["l3_read_bytes"] for r in mine]),
                    "l3_read_mib_s": median(rates) if (rates := [r["l3_read_mib_s"] for r in mine
                                                                 if r.get("l3_read_mib_s")]) else None,
                    "server_rss_bytes": max((r["server_rss_bytes"] or 0) for r in mine) or None,
                    "repeats": len(mine), **_stage_medians(mine)})
    cold = next((r for r in out if r["case"] == "cold"), None)
    for r in out:
        r["ttft_vs_cold"] = ratio(r["ttft_s"], cold["ttft_s"]) if cold else None
        r["completion_vs_cold"] = ratio(r["completion_s"], cold["completion_s"]) if cold else None
    return out


def _stage_medians(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for s in STAGES:
        values = [r[f"stage_{s}_s"] for r in rows if r.get(f"stage_{s}_s") is not None]
        out[f"stage_{s}_s"] = median(values) if values else None
    timed = [out[f"stage_{s}_s"] for s in ("scheduler_wait", "host_copy", "host_to_device", "forward")]
    # What the stages do not cover: HTTP, tokenizing, sampling, the first token's way back (the L3 read and its
    # checksum run inside the scheduler wait, so they are not subtracted again).
    ttft = median([r["ttft_s"] for r in rows])
    out["stage_other_s"] = ttft - sum(timed) if None not in timed else None
    return out


def l3_extra(summary: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(seconds the L3 hit took over the L2 hit, the L3 row's bytes read per such second); None without both."""
    by_case = {row["case"]: row for row in summary}
    l2, l3 = by_case.get("L2 hit"), by_case.get("L3 hit")
    if not (l2 and l3 and l3["l3_read_bytes"]):
        return None
    extra = l3["ttft_s"] - l2["ttft_s"]
    return extra, (l3["l3_read_bytes"] / extra if extra > 0 else float("inf"))


def targets(summary: list[dict[str, Any]]) -> list[Target]:
    out = []
    for row in summary:
        goal = TARGET_RATIO.get(row["case"])
        if goal is None or row["ttft_vs_cold"] is None:
            continue
        measured = f"{row['ttft_vs_cold'] * 100:.1f}% of cold TTFT"
        if not row["ok"]:
            out.append(Target(f"{row['case']} TTFT", f"<= {goal:.0%} of cold", measured, None,
                              f"hit statistics do not confirm the tier: {row['confirmed']}"))
        else:
            out.append(Target(f"{row['case']} TTFT", f"<= {goal:.0%} of cold", measured,
                              row["ttft_vs_cold"] <= goal))
    by_case = {row["case"]: row for row in summary}
    l2, l3 = by_case.get("L2 hit"), by_case.get("L3 hit")
    if l2 and l3 and l2["ttft_s"]:
        rel = l3["ttft_s"] / l2["ttft_s"]
        measured = f"{rel:.2f}x the L2 hit's TTFT"
        if not (l2["ok"] and l3["ok"]):
            out.append(Target("L3 hit TTFT vs L2 hit", f"<= {L3_VS_L2_TARGET:.2f}x", measured, None,
                              "hit statistics do not confirm the tiers"))
        else:
            out.append(Target("L3 hit TTFT vs L2 hit", f"<= {L3_VS_L2_TARGET:.2f}x", measured,
                              rel <= L3_VS_L2_TARGET))
    extra = l3_extra(summary)
    if extra is not None:
        seconds, rate = extra
        goal = f">= {L3_EXTRA_TARGET_BYTES_S / 1e9:.1f} GB/s"
        measured = (f"{l3['l3_read_bytes'] / 2**20:.0f} MiB in {seconds * 1e3:.0f} ms over the L2 hit = "
                    f"{rate / 1e9:.2f} GB/s" if seconds > 0 else
                    f"no extra time ({seconds * 1e3:.0f} ms against the L2 hit)")
        ok = l2["ok"] and l3["ok"]
        out.append(Target("L3 extra read rate", goal, measured, rate >= L3_EXTRA_TARGET_BYTES_S if ok else None,
                          "" if ok else "hit statistics do not confirm the tiers"))
    return out


def _report(ns: argparse.Namespace, ctx: BenchContext, info: dict[str, Any], rows: list[dict[str, Any]], l1: int,
            filler_len: int, l3_file_bytes: int, other_why: str | None) -> Report:
    summary = summarize(rows)
    tiers = info.get("tiers", {})
    host_tokens = tiers.get("host", {}).get("total_tokens")
    table = Table(
        f"TTFT per cache tier: {ns.prefix_tokens}-token shared prefix + {ns.suffix_tokens}-token suffix, "
        f"{ns.max_new_tokens} new tokens (median of {ns.repeats})",
        [Column("case", "case"), Column("ttft_s", "TTFT ms", "ms"), Column("ttft_vs_cold", "TTFT/cold", "x"),
         Column("completion_s", "done ms", "ms"), Column("completion_vs_cold", "done/cold", "x"),
         Column("hit_device", "hit L1"), Column("hit_host", "hit L2"), Column("hit_storage", "hit L3"),
         Column("confirmed", "tier confirmed"), Column("host_ram_bytes", "L2 used MiB", "mb"),
         Column("l3_read_bytes", "L3 read MiB", "mb"), Column("l3_read_mib_s", "L3 read MiB/s", "{:.0f}"),
         Column("server_rss_bytes", "server RSS MiB", "mb")],
        summary,
        notes=[f"L1 (device pool) {l1} tokens, L2 (host pool) {host_tokens} tokens; a {filler_len}-token filler "
               "prompt pushes the prefix out of L1 before the L2 row",
               f"L3 row: server restarted on the same folder ({l3_file_bytes / 2**20:.1f} MiB of pages); files "
               "written moments before are read from the OS page cache",
               "each row starts once the L3 writer is idle (earlier rows' page writes do not overlap it)",
               "hit columns are the response's usage cached_tokens_details (tokens per tier)",
               "L3 read MiB/s: page bytes read over the time spent inside the L3 reads (open, read into host "
               "memory, checksum) during that request",
               f"{shared_l3.CASE}: not measured ({other_why})" if other_why else
               shared_l3.layout_note()])
    stage_table = Table(
        "Where each row's TTFT goes (server-side stage timers, median of the repeats)",
        [Column("case", "case"), Column("ttft_s", "TTFT ms", "ms"),
         *[Column(f"stage_{s}_s", STAGE_TITLES[s], "ms") for s in STAGES], Column("stage_other_s", "other ms", "ms")],
        summary,
        notes=["wait: the request's arrival at the scheduler to its admission, less the copies below; the L3 read "
               "and checksum of a waiting request run inside it (on the L3 I/O thread), so they overlap it",
               "L3 read: inside the store's reads less the checksum (open, read into host pages, close); to host: "
               "copies of read bytes into host pages (pages not read straight into them)",
               "host->dev: host (L2) pages into device (L1) pages at admission; forward: admission to the first "
               "token (the prefill of the uncached suffix)",
               "other: TTFT less wait, to host, host->dev and forward (HTTP, tokenizing, the first token's way "
               "back)"])
    settings = {"prefix_tokens": ns.prefix_tokens, "suffix_tokens": ns.suffix_tokens,
                "max_new_tokens": ns.max_new_tokens, "repeats": ns.repeats, "l1_tokens": l1,
                "hicache_ratio": ns.hicache_ratio,
                "prefetch_policy": info.get("server_args", {}).get("hicache_storage_prefetch_policy"),
                "server_extra": ctx.server_extra}
    return Report("prefix", ctx.command, environment(ctx.model_label, info, ctx.load_at_start), settings, [table, stage_table],
                  targets(summary),
                  raw={"requests": rows})
