"""`tierlm bench peers`: one client workload against tierlm's own server and any OpenAI-compatible servers given
with ``--against NAME=URL`` (vLLM, SGLang, llama.cpp's server, another tierlm), in one table with ratios to
tierlm measured in the same run.

In rounds (``--repeats``), each round visiting every server in turn with the same prompts, so that a machine
that speeds up or slows down for minutes at a time affects all servers alike (tierlm is started here and stopped
at the end; the peers are the user's own processes and stay up). Per round and server:
  cold TTFT    a ``--prompt-tokens`` prompt of random words no server has seen, 1 token, streamed;
  warm TTFT    a long prefix sent once (priming), then again with a new short suffix each time;
  1 stream     ``--decode-tokens`` tokens (EOS ignored) after a short prompt: end to end, and decode tok/s: the
               tokens after the first over (that request's time - a 1-token request's time on a prompt of the
               same length). Not from stream events: servers differ in how many tokens one event carries (tierlm
               sends none for a token whose text is still empty, vLLM may merge tokens when the client lags);
  N streams    ``--streams`` such requests at once: all their tokens over the wall time;
  long context the 1-stream decode after a ``--long-context-tokens`` prompt, sent once before (its KV cached),
               so that its 1-token and N-token requests both hit and their difference is decode alone.
Every server gets the same prompts, drawn afresh for each run (a peer that stays up between runs would otherwise
find the last run's "cold" prompts in its prefix cache). Each server's round starts once the machine is quiet
(quiet_machine.py: the last server's leftover work, such as vLLM's 1 s of busy-polling after each request, took
the next server's core). Token counts come from the servers' usage; a server that returns fewer tokens than asked
stops the run, since a ratio to it would mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import secrets
from typing import Any

import numpy as np

from tierlm.backends.dtypes import DTYPE_BYTES
from tierlm.backends.model_source.folder_facts import model_size
from tierlm.backends.model_source.model_folder import as_model_folder
from tierlm.backends.weight_format import input_embedding_shape, safetensors_shapes
from tierlm.server.commands.bench.context import BenchContext
from tierlm.server.commands.bench.decode import read_bandwidth
from tierlm.server.commands.bench.openai_load import (Completion, Endpoint, PromptBuilder, Session, discover,
                                                    discover_peers)
from tierlm.server.commands.bench.quiet_machine import (MAX_WAIT_S, MIN_WAIT_S, QUIET_BELOW_CORES, QuietWait,
                                                        wait_until_quiet)
from tierlm.server.commands.bench.report import Column, Report, Table, Target, environment
from tierlm.server.commands.bench.server_process import BenchServer
from tierlm.server.commands.bench.stats import median, ratio

WARM_SUFFIX_TOKENS = 16  # the new part of each warm request; the rest is the shared prefix
DECODE_PROMPT_TOKENS = 32  # the short prompt of the decode rows
OWN = "tierlm"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# (key, label, unit scale, better when the ratio reference/peer is ...)
ROWS = (("cold_ttft_s", "cold TTFT ms", 1000.0, "< 1 (lower TTFT)"),
        ("warm_ttft_s", "warm TTFT ms (shared prefix)", 1000.0, "< 1 (lower TTFT)"),
        ("decode_tps", "1-stream decode tok/s", 1.0, "> 1 (more tokens/s)"),
        ("e2e_tps", "1-stream end-to-end tok/s", 1.0, "> 1 (more tokens/s)"),
        ("streams_tps", "N-stream aggregate tok/s", 1.0, "> 1 (more tokens/s)"),
        ("long_decode_tps", "1-stream decode tok/s, long context", 1.0, "> 1 (more tokens/s)"))
# Issue #27's goals for tierlm against each peer (the ratio tierlm/peer of the row), and for 1-stream decode
# against the memory-bandwidth bound (weight bytes / measured bandwidth: one decode step reads every weight).
PEER_GOALS = (("decode_tps", 1.2, "1-stream decode"), ("streams_tps", 1.5, "N-stream decode"),
              ("cold_ttft_s", 0.8, "cold TTFT"), ("warm_ttft_s", 0.5, "warm TTFT"),
              ("long_decode_tps", 1.0, "long-context decode"))
BOUND_SHARE_GOAL = 0.6


def parse_against(spec: str) -> tuple[str, str]:
    """NAME=URL -> (name, url); an argparse error that says what is wrong otherwise."""
    name, sep, url = spec.partition("=")
    name, url = name.strip(), url.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"{spec!r} has no '=': write NAME=URL, e.g. vllm=http://127.0.0.1:8000")
    if not name:
        raise argparse.ArgumentTypeError(f"{spec!r} has an empty name: write NAME=URL, e.g. vllm=http://127.0.0.1:8000")
    if not NAME_RE.match(name):
        raise argparse.ArgumentTypeError(f"name {name!r} in {spec!r}: use letters, digits, '.', '_' and '-'")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{spec!r}: the URL must start with http:// or https:// "
                                         "(the server root, e.g. http://127.0.0.1:8000)")
    return name, url


class AgainstAction(argparse.Action):
    """Repeatable --against; a name given twice is an error (each name is one column)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        peers = list(getattr(namespace, self.dest, None) or [])
        if any(value[0] == name for name, _ in peers):
            parser.error(f"argument --against: the name {value[0]!r} is given twice; each peer needs its own name")
        setattr(namespace, self.dest, peers + [value])


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peers benchmark (the peer must serve the same model folder; --dtype sets tierlm's only)")
    g.add_argument("--against", action=AgainstAction, type=parse_against, default=[], metavar="NAME=URL",
                   help="an OpenAI-compatible server to measure next to tierlm, e.g. vllm=http://127.0.0.1:8000 "
                        "(repeatable)")
    g.add_argument("--no-tierlm", action="store_true",
                   help="measure only the peers (ratios are then to the first peer)")
    g.add_argument("--prompt-tokens", type=int, default=2016, help="prompt length of the TTFT rows")
    g.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per stream (EOS ignored)")
    g.add_argument("--streams", type=int, default=8, help="concurrent requests of the N-stream row")
    g.add_argument("--repeats", type=int, default=3, help="measurements per row and server (medians reported)")
    g.add_argument("--long-context-tokens", type=int, default=3900,
                   help="prompt length of the long-context decode row (prompt + --decode-tokens must fit the "
                        "servers' context; 0: no such row)")


# ---------------------------------------------------------------- the workload
def build_workload(ns: argparse.Namespace, ctx: BenchContext) -> dict[str, Any]:
    """Every prompt of the run, built once so every server gets the same ones."""
    from tierlm.backends.model_source.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ctx.model_dir)
    # verbose=False: no warning when a draft prompt passes the tokenizer's model_max_length on the way to its size
    # The peers are long-lived processes with prefix caches: a prompt of an earlier run would be a warm hit there.
    # So each run draws its own words (the same for every server in the run): --seed and a fresh nonce.
    rng = np.random.default_rng([ctx.seed, secrets.randbits(64)])
    b = PromptBuilder(lambda text: tokenizer.encode(text, verbose=False), rng)
    P, R = ns.prompt_tokens, ns.repeats
    prefix = b.text(P - WARM_SUFFIX_TOKENS)
    return {"first": b.text(DECODE_PROMPT_TOKENS),  # off the clock: a server's first request may compile
            "cold": [b.text(P) for _ in range(R)],
            "warm": [b.text(P, head=prefix) for _ in range(R + 1)],  # [0] primes the cache
            "single": [b.text(DECODE_PROMPT_TOKENS) for _ in range(R)],
            "single_first": [b.text(DECODE_PROMPT_TOKENS) for _ in range(R)],  # its 1-token twins (TTFT)
            # decode over a long cached context (primed first; see _round)
            "long": [b.text(ns.long_context_tokens) for _ in range(R)] if ns.long_context_tokens else [],
            "streams": [[b.text(DECODE_PROMPT_TOKENS) for _ in range(ns.streams)] for _ in range(R)]}


REQUEST_KINDS = ("cold", "warm", "single_first", "single", "streams", "long_first", "long")  # raw per server


async def _round(s: Session, w: dict[str, Any], ns: argparse.Namespace, r: int, raw: dict[str, list]) -> None:
    """Round ``r`` of every row on one server, appended to ``raw``."""
    N = ns.decode_tokens
    await s.one(w["warm"][0], 1)  # the shared prefix again, off the clock: the last round's long prompts may have
    raw["warm"].append(await s.one(w["warm"][r + 1], 1))  # pushed it out of a small prefix cache
    raw["cold"].append(await s.one(w["cold"][r], 1))
    raw["single_first"].append(await s.one(w["single_first"][r], 1))
    raw["single"].append(await s.one(w["single"][r], N))
    raw["streams"].append(await s.concurrent(w["streams"][r], N))
    if w["long"]:
        # The long prompt's KV is cached first (a cold prefill, off the clock), then a 1-token and an N-token
        # request on it both hit: their difference is decode alone. Cold twins put two multi-second prefills, each
        # +-10 % on this kind of VM, into a difference of a few seconds.
        await s.one(w["long"][r], 1)
        raw["long_first"].append(await s.one(w["long"][r], 1))
        raw["long"].append(await s.one(w["long"][r], N))


async def _measure_all(endpoints: list[Endpoint], w: dict[str, Any], ns: argparse.Namespace,
                       bar) -> dict[str, dict[str, Any]]:
    """Every round visits every server in turn: this kind of VM moves between fast and slow spells (2x apart,
    minutes long), and servers measured one after the other would each get a different spell."""
    raws: dict[str, dict[str, list]] = {ep.name: {kind: [] for kind in REQUEST_KINDS} for ep in endpoints}
    waits: dict[str, list[QuietWait]] = {ep.name: [] for ep in endpoints}
    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(Session(ep, ns.streams)) for ep in endpoints]
        for s in sessions:  # off the clock: a server's first request may compile
            await s.one(w["first"], 4)
        for r in range(ns.repeats):
            for s in sessions:
                bar.set_description(f"peers: round {r + 1}/{ns.repeats}, {s.ep.name}: waiting for a quiet machine")
                waits[s.ep.name].append(await wait_until_quiet())  # the last server's leftover work done
                bar.set_description(f"peers: round {r + 1}/{ns.repeats}, {s.ep.name}")
                await _round(s, w, ns, r, raws[s.ep.name])
                bar.update()
    out = {name: _result(raw) for name, raw in raws.items()}
    for name, result in out.items():  # in the raw JSON, and the report's notes from there (quiet_note)
        result["raw"]["quiet_waits"] = [q.to_dict() for q in waits[name]]
    return out


def _result(raw: dict[str, list]) -> dict[str, Any]:
    """One server's row values and its raw requests."""
    out = summarize(raw["cold"], raw["warm"], raw["single"], raw["streams"], raw["single_first"])
    out["long_decode_tps"] = decode_rate(raw["long"], raw["long_first"])
    out["completion_tokens"]["long"] = _same([c.completion_tokens for c in raw["long"]]) if raw["long"] else None
    out["prompt_tokens"]["long"] = _same([c.prompt_tokens for c in raw["long"]]) if raw["long"] else None
    return out | {"raw": {
        **{kind: [c.to_dict() for c in raw[kind]] for kind in REQUEST_KINDS if kind != "streams"},
        "streams": [{"wall_s": wall, "requests": [c.to_dict() for c in cs]} for cs, wall in raw["streams"]]}}


def summarize(cold: list[Completion], warm: list[Completion], single: list[Completion],
              runs: list[tuple[list[Completion], float]], first: list[Completion]) -> dict[str, Any]:
    """One server's row values (medians over repeats) and the token counts each row's requests came back with.
    ``first``: 1-token requests on prompts as long as ``single``'s, whose time is taken off theirs for decode."""
    return {"cold_ttft_s": median([c.ttft for c in cold]), "warm_ttft_s": median([c.ttft for c in warm]),
            "decode_tps": decode_rate(single, first),
            "e2e_tps": median([c.end_to_end_tokens_per_s for c in single]),
            "streams_tps": median([sum(c.completion_tokens for c in cs) / wall for cs, wall in runs if wall > 0]),
            "prompt_tokens": {"cold": _same([c.prompt_tokens for c in cold]),
                              "warm": _same([c.prompt_tokens for c in warm])},
            "completion_tokens": {"cold": _same([c.completion_tokens for c in cold]),
                                  "warm": _same([c.completion_tokens for c in warm]),
                                  "single": _same([c.completion_tokens for c in single]),
                                  "streams": _same([sum(c.completion_tokens for c in cs) for cs, _ in runs]),
                                  "long": None},  # filled by _result when the long-context row runs
            "warm_cached_tokens": median([c.cached_tokens for c in warm]) if warm[0].cached_tokens is not None
            else None}


def decode_rate(runs: list[Completion], firsts: list[Completion]) -> float | None:
    """Tokens after the first over (the median time of ``runs`` - that of their 1-token twins ``firsts``): decode
    speed whatever tokens each stream event carries; None without runs."""
    if not runs or not firsts:
        return None
    n = _same([c.completion_tokens for c in runs])
    decode_s = median([c.latency for c in runs]) - median([c.latency for c in firsts])
    return (n - 1) / decode_s if isinstance(n, int) and n > 1 and decode_s > 0 else None


def _same(xs: list[Any]) -> Any:
    """The value when every request agrees, else the list (a visible disagreement)."""
    return xs[0] if all(x == xs[0] for x in xs) else xs


def measure_all(endpoints: list[Endpoint], w: dict[str, Any], ns: argparse.Namespace,
                bar) -> dict[str, dict[str, Any]]:
    return asyncio.run(_measure_all(endpoints, w, ns, bar))


# ---------------------------------------------------------------- run
def _check(ns: argparse.Namespace) -> None:
    if not ns.against and ns.no_tierlm:
        raise SystemExit("tierlm bench peers: --no-tierlm needs at least one --against NAME=URL")
    if not ns.against:
        raise SystemExit("tierlm bench peers: nothing to compare; pass --against NAME=URL (repeatable), e.g. "
                         "--against vllm=http://127.0.0.1:8000")
    if not ns.no_tierlm and any(name == OWN for name, _ in ns.against):
        raise SystemExit(f"tierlm bench peers: the name {OWN!r} is tierlm's own column; give the peer another name")
    if ns.long_context_tokens < 0:
        raise SystemExit("tierlm bench peers: --long-context-tokens must be >= 0 (0: no long-context row)")
    if ns.prompt_tokens < 2 * WARM_SUFFIX_TOKENS or ns.decode_tokens < 2 or ns.streams < 1 or ns.repeats < 1:
        raise SystemExit(f"tierlm bench peers: need --prompt-tokens >= {2 * WARM_SUFFIX_TOKENS}, --decode-tokens "
                         ">= 2, --streams >= 1 and --repeats >= 1")


def run(ns: argparse.Namespace, ctx: BenchContext) -> Report:
    _check(ns)
    peers = discover_peers(ns.against, "peers")
    workload = build_workload(ns, ctx)
    bar = ctx.progress_bar(total=ns.repeats * (len(peers) + (0 if ns.no_tierlm else 1)), desc="peers")
    info = None
    bar.set_description("peers: memory bandwidth")
    threads = compute_threads()
    bandwidth = read_bandwidth(threads=threads)  # before any server runs: the machine to itself
    with contextlib.ExitStack() as stack:
        endpoints: list[Endpoint] = []
        if not ns.no_tierlm:
            extra = ["--max-running-requests", str(ns.streams)] if ns.streams > 32 else []
            server = stack.enter_context(BenchServer(ctx.server_args(*extra), log_dir=ctx.work_dir,
                                                     name="peers-tierlm-server"))
            bar.set_description("peers: starting tierlm")
            server.start()
            info = server.info()
            endpoints.append(discover(OWN, server.url))
        endpoints += peers
        results = measure_all(endpoints, workload, ns, bar)
    bar.close()
    return _report(ns, ctx, info, endpoints, results, bandwidth, threads)


def table_rows(names: list[str], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per metric: the raw values and ratios (first server / each other), and display cells."""
    ref = names[0]
    rows = []
    for key, label, scale, better in ROWS:
        values = {n: results[n][key] for n in names}
        ratios = {n: ratio(values[ref], values[n]) for n in names[1:]}
        row = {"metric": label, "key": key, "better": better, "values": values, "ratios": ratios}
        for n in names:
            cell = "-" if values[n] is None else f"{values[n] * scale:.1f}"
            if n != ref and ratios[n] is not None:
                cell += f" ({ratios[n]:.2f}x)"
            row[f"cell:{n}"] = cell
        rows.append(row)
    return rows


def compute_threads() -> int:
    """The threads tierlm's server computes with: OMP_NUM_THREADS (``--threads`` sets it), else its own default."""
    from tierlm.platforms.thread_count import cpu_thread_count, usable_cores

    n, _ = cpu_thread_count(os.environ, *usable_cores())
    if n is not None:
        return n
    explicit = os.environ["OMP_NUM_THREADS"].strip()
    return max(1, int(explicit)) if explicit.isdigit() else 1


def bytes_read_per_token(model_dir, dtype: str) -> int:
    """Weight bytes one decode step of one stream reads: all of them but an untied input embedding, of which only
    the looked-up row is read (a tied one is read whole as the lm_head)."""
    total = model_size(model_dir, dtype).weight_bytes
    shapes = safetensors_shapes(list(as_model_folder(model_dir).weight_files))
    embedding = input_embedding_shape(shapes)
    has_lm_head = any(name.endswith("lm_head.weight") for name, _ in shapes)
    if embedding is None or not has_lm_head:
        return total
    return total - math.prod(embedding) * DTYPE_BYTES.get(dtype, 4)


def goals(rows: list[dict[str, Any]], names: list[str], bound_tps: float | None) -> list[Target]:
    """tierlm's goals next to each peer's measured ratio, and its 1-stream decode as a share of the bound."""
    if not names or names[0] != OWN:
        return []
    out = []
    by_key = {r["key"]: r for r in rows}
    for key, goal, label in PEER_GOALS:
        lower = key.endswith("ttft_s")
        for peer in names[1:]:
            r = by_key[key]["ratios"].get(peer)
            out.append(Target(f"{label} vs {peer}", f"{'<=' if lower else '>='} {goal:g}x",
                              "-" if r is None else f"{r:.2f}x",
                              None if r is None else (r <= goal if lower else r >= goal)))
    own = by_key["decode_tps"]["values"].get(OWN)
    if bound_tps and own:
        share = own / bound_tps
        out.append(Target("1-stream decode of the bandwidth bound", f">= {BOUND_SHARE_GOAL:.0%}", f"{share:.0%}",
                          share >= BOUND_SHARE_GOAL, f"bound {bound_tps:.1f} tok/s"))
    return out


def _report(ns: argparse.Namespace, ctx: BenchContext, info: dict[str, Any] | None, endpoints: list[Endpoint],
            results: dict[str, dict[str, Any]], bandwidth: float | None = None, threads: int = 1) -> Report:
    names = [ep.name for ep in endpoints]
    ref = names[0]
    rows = table_rows(names, results)
    for row in rows:  # the token counts behind each row, per server (checked against what was asked)
        part = {"cold_ttft_s": "cold", "warm_ttft_s": "warm", "decode_tps": "single", "e2e_tps": "single",
                "streams_tps": "streams", "long_decode_tps": "long"}[row["key"]]
        row["completion_tokens"] = {n: results[n]["completion_tokens"][part] for n in names}
        if part in ("cold", "warm", "long"):
            row["prompt_tokens"] = {n: results[n]["prompt_tokens"][part] for n in names}
    rows[1]["cached_tokens"] = {n: results[n]["warm_cached_tokens"] for n in names}
    notes = [f"(N.NNx) after a value is {ref}/that server for the row; the last column says which side of 1 "
             f"favours {ref}",
             f"cold: a {ns.prompt_tokens}-token prompt of random words, new for every request, 1 token; warm: the "
             f"same {ns.prompt_tokens - WARM_SUFFIX_TOKENS}-token prefix after one priming request, a new "
             f"{WARM_SUFFIX_TOKENS}-token suffix each time; both streamed, TTFT = first streamed choice",
             f"decode: {ns.decode_tokens} tokens (ignore_eos) after a {DECODE_PROMPT_TOKENS}-token prompt; decode "
             "tok/s: the tokens after the first over (that request's time - a 1-token request's on an equally long "
             "prompt), whatever tokens each stream event carries; end to end includes TTFT; N-stream: "
             f"{ns.streams} such requests at once, all their tokens over the wall time",
             (f"long context: the same decode after a {ns.long_context_tokens}-token prompt (attention over a long "
              "cached context at every step); that prompt is sent once first, so the 1-token and the N-token "
              "request on it are both prefix hits and no prefill time enters the difference"
              if ns.long_context_tokens else "long context: not measured (--long-context-tokens 0)"),
             f"medians of {ns.repeats} rounds, each round measuring every server in turn with the same prompts; "
             "token counts from each server's usage; one request per server before the clock starts, and in "
             "every round the warm row's prefix and the long prompt sent once off the clock",
             "prompts are sized with this model folder's tokenizer; every server must serve the same folder; "
             + (f"tierlm served {info.get('dtype')} (--dtype {ctx.dtype}) and each peer the dtype it was started "
                "with (vLLM CPU's auto: bf16): the same dtype on both sides compares the same numerics, each "
                "server's default compares defaults" if info else
                "each server computes in the dtype it was started with (tierlm's --dtype does not apply to peers)")]
    notes += _mismatch_notes(ns, names, results)
    notes.append(quiet_note(names, results))
    bound = None
    if info and bandwidth:
        held = info.get("weight_bytes_per_token")  # as the server holds them (bf16-held, quantized)
        wbytes = held or bytes_read_per_token(ctx.model_dir, info.get("dtype", "float32"))
        bound = bandwidth / wbytes
        notes.append(f"bandwidth bound: weights read per token {wbytes / 2**20:.1f} MiB ("
                     + ("as tierlm's /server_info weight_bytes_per_token holds them" if held else info.get('dtype'))
                     + f"; an untied input embedding left out: one row of it is read) / read bandwidth "
                     f"{bandwidth / 1e9:.2f} GB/s "
                     f"({threads} thread(s), as tierlm computes) = {bound:.1f} tok/s for one stream")
    columns = [Column("metric", "metric")] + [Column(f"cell:{n}", n) for n in names] + \
        [Column("better", f"{ref}/peer better if")]
    title = (f"{' vs '.join(names)}: {ns.prompt_tokens}-token TTFT prompts, {ns.decode_tokens}-token decodes, "
             f"{ns.streams} streams, greedy")
    settings = {"prompt_tokens": ns.prompt_tokens, "decode_tokens": ns.decode_tokens, "streams": ns.streams,
                "repeats": ns.repeats, "warm_suffix_tokens": WARM_SUFFIX_TOKENS,
                "decode_prompt_tokens": DECODE_PROMPT_TOKENS, "reference": ref, "tierlm_dtype": ctx.dtype,
                "servers": {ep.name: {"url": ep.url, "model": ep.model,
                                      **{k: ep.models_entry[k] for k in ("root", "max_model_len", "owned_by")
                                         if k in ep.models_entry}} for ep in endpoints},
                "server_extra": ctx.server_extra, "read_bandwidth_bytes_per_s": bandwidth,
                "bandwidth_bound_tps": bound}
    env = environment(ctx.model_label, info, ctx.load_at_start)
    return Report("peers", ctx.command, env, settings, [Table(title, columns, rows, notes)], goals(rows, names, bound),
                  raw={n: results[n]["raw"] for n in names})


def quiet_note(names: list[str], results: dict[str, dict[str, Any]]) -> str:
    """How long the rounds waited for the machine to be quiet, and any that began on a busy machine."""
    waits = {n: results[n]["raw"].get("quiet_waits") or [] for n in names}
    every = [q for n in names for q in waits[n]]
    text = (f"before each server's round the bench waited until the machine was quiet (at least {MIN_WAIT_S:g} s, "
            f"then until a quarter second had < {QUIET_BELOW_CORES:g} of a core busy, at most {MAX_WAIT_S:g} s): a "
            "server still busy after its own round (vLLM busy-polls for 1 s after each request) would otherwise "
            "take the next server's core")
    if every:
        text += f"; waits {min(q['waited_s'] for q in every):.1f}-{max(q['waited_s'] for q in every):.1f} s"
    busy = [f"{n} round {i + 1} ({q['busy_cores']:.2f} cores busy)" for n in names
            for i, q in enumerate(waits[n]) if not q["quiet"]]
    if busy:
        text += "; began on a busy machine: " + ", ".join(busy)
    return text


def _mismatch_notes(ns: argparse.Namespace, names: list[str], results: dict[str, dict[str, Any]]) -> list[str]:
    """A server that counts another number of prompt tokens does not tokenize like this model folder."""
    out = []
    for n in names:
        got = results[n]["prompt_tokens"]
        if got["cold"] != ns.prompt_tokens or got["warm"] != ns.prompt_tokens:
            out.append(f"WARNING: {n} counted {got['cold']} prompt tokens for the {ns.prompt_tokens}-token prompts: it "
                       "does not tokenize like this model folder (another model or tokenizer?); its TTFT rows are "
                       "not comparable")
    return out
