"""`tierlm bench decode --weight-formats float32,bfloat16,bfloat16:int8wo,bfloat16:int4wo-128`: weight formats
side by side, one server each: decode tokens/s at 1 stream, the resident weight bytes (/server_info) against
bytes-per-parameter x parameters, and greedy agreement with the unquantized model.

All servers are up at once and the 1-stream runs go round-robin over them (round r runs every server once before
round r + 1), so a noisy neighbour slows every format alike instead of whichever ran during it; medians reported.
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any

import numpy as np

from tierlm.backends.model_source.folder_facts import model_size
from tierlm.server.commands.bench.context import BenchContext, random_tokens
from tierlm.server.commands.bench.report import Column, Report, Table, environment, load_average
from tierlm.server.commands.bench.server_process import BenchServer, run_one
from tierlm.server.commands.bench.stats import median, ratio

# Nominal bytes per parameter of each format (scales and zero points excluded): what the weights should approach.
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
QUANT_BYTES = {"int8wo": 1.0, "int8dq": 1.0, "fp8wo": 1.0, "fp8dq-per_row": 1.0, "w8a8_int8": 1.0, "fp8": 1.0}


def parse_entries(text: str) -> list[tuple[str, str | None]]:
    """"float32,bfloat16:int8wo" -> [("float32", None), ("bfloat16", "int8wo")]; SystemExit naming a bad entry."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        dtype, _, quant = item.partition(":")
        if dtype not in DTYPE_BYTES:
            raise SystemExit(f"tierlm bench decode --weight-formats: {item!r}: start each entry with a dtype "
                             f"({', '.join(DTYPE_BYTES)}), optionally :<--torchao-config name>, e.g. bfloat16:int8wo")
        out.append((dtype, quant or None))
    if len(out) < 2:
        raise SystemExit("tierlm bench decode --weight-formats: name at least two entries, e.g. "
                         "float32,bfloat16,bfloat16:int8wo,bfloat16:int4wo-128")
    return out


def nominal_bytes(dtype: str, quant: str | None) -> float:
    if quant is None:
        return DTYPE_BYTES[dtype]
    if quant.startswith("int4wo"):
        return 0.5
    return QUANT_BYTES.get(quant, DTYPE_BYTES[dtype])


def _label(dtype: str, quant: str | None) -> str:
    return dtype if quant is None else f"{dtype} + {quant}"


def _reference(entries: list[tuple[str, str | None]], i: int) -> int:
    """The entry a format's outputs are compared with: the unquantized one of the same dtype, else the first."""
    dtype = entries[i][0]
    return next((j for j, (d, q) in enumerate(entries) if d == dtype and q is None), 0)


def run_weight_formats(ns: argparse.Namespace, ctx: BenchContext) -> Report:
    entries = parse_entries(ns.weight_formats)
    ps, P, N = ctx.page_size, ns.prompt_tokens, ns.new_tokens
    params = model_size(ctx.model_dir, "float32").weight_bytes // 4
    rng = np.random.default_rng(ctx.seed)
    agree_prompts = [random_tokens(rng, P, ctx.vocab_size) for _ in range(ns.agreement_prompts)]
    round_prompts = [random_tokens(rng, P, ctx.vocab_size) for _ in range(ns.repeats)]
    tokens = (-(-(P + N) // ps) + 2) * ps * 2
    bar = ctx.progress_bar(total=len(entries) * (2 + ns.repeats), desc="decode: weight formats")
    rows: list[dict[str, Any]] = []
    outputs: list[list[list[int]]] = []
    rates: list[list[float]] = [[] for _ in entries]
    info: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        servers = []
        for dtype, quant in entries:
            args = ["--model-path", str(ctx.model_dir), "--dtype", dtype, "--page-size", str(ps),
                    "--random-seed", str(ctx.seed), "--max-total-tokens", str(tokens), "--max-running-requests", "1",
                    *(["--torchao-config", quant] if quant else []), *ctx.server_extra]
            name = f"decode-{dtype}-{quant or 'none'}"
            bar.set_description(f"decode: starting {_label(dtype, quant)}")
            server = stack.enter_context(BenchServer(args, log_dir=ctx.work_dir, name=name))
            server.start()
            servers.append(server)
            info = info or server.info()
            s_info = server.info()
            run_one(server.url, random_tokens(rng, P, ctx.vocab_size), 4)  # first request off the clock
            outputs.append([run_one(server.url, p, N).output_ids for p in agree_prompts])
            bar.update(2)
            rows.append({"weights": _label(dtype, quant), "weight_format": s_info.get("weight_format"),
                         "linear": (s_info.get("kernels") or {}).get("linear"),
                         "weight_bytes": s_info.get("weight_bytes"),
                         "nominal_bytes": params * nominal_bytes(dtype, quant)})
        for prompt in round_prompts:
            for i, server in enumerate(servers):
                rates[i].append(run_one(server.url, prompt, N).decode_tokens_per_s)
                bar.update()
    bar.close()
    for i, row in enumerate(rows):
        row["decode_tps"] = median(rates[i])
        row["decode_min"], row["decode_max"] = min(rates[i]), max(rates[i])
        row["vs_first"] = ratio(row["decode_tps"], rows[0]["decode_tps"])
        row["of_nominal"] = ratio(row["weight_bytes"], row["nominal_bytes"])
        ref = _reference(entries, i)
        same = sum(a == b for x, y in zip(outputs[i], outputs[ref]) for a, b in zip(x, y))
        row["compared_with"] = rows[ref]["weights"]
        row["agreement"] = same / max(1, sum(len(y) for y in outputs[ref]))
        row["identical"] = f"{sum(x == y for x, y in zip(outputs[i], outputs[ref]))}/{len(agree_prompts)}"
    notes = [f"parameters {params / 1e6:.1f} M (safetensors headers); nominal = parameters x bytes per parameter "
             "of the format (4, 2, 1, 0.5; scales excluded); weights = /server_info weight_bytes (resident, scales, "
             "zero points, norms and any embedding left unquantized included; on CPU int8wo / int4wo quantize the "
             "embedding too, one table shared with a tied lm_head)",
             f"decode tok/s: 1 stream, {P}-token prompts, {N} new tokens; median (min-max) of {ns.repeats} "
             "rounds, each round running every server once in turn",
             f"agreement: {ns.agreement_prompts} random prompts x {N} greedy tokens, share of tokens equal at "
             "their position to the unquantized model of the same dtype (else the first entry), and the "
             "continuations identical end to end",
             f"1-minute load average at the end: {load_average()}"]
    table = Table(f"weight formats side by side: {ctx.model_label}",
                  [Column("weights", "weights"), Column("weight_format", "format"),
                   Column("weight_bytes", "weights MiB", "mb"), Column("nominal_bytes", "nominal MiB", "mb"),
                   Column("of_nominal", "of nominal", "x"), Column("decode_tps", "decode tok/s"),
                   Column("decode_min", "min"), Column("decode_max", "max"),
                   Column("vs_first", f"vs {rows[0]['weights']}", "x"),
                   Column("compared_with", "agreement vs"), Column("agreement", "greedy agreement", "pct"),
                   Column("identical", "identical"), Column("linear", "linear kernel")],
                  rows, notes)
    settings = {"prompt_tokens": P, "new_tokens": N, "repeats": ns.repeats, "weight_formats": ns.weight_formats,
                "agreement_prompts": ns.agreement_prompts, "parameters": params, "server_extra": ctx.server_extra}
    return Report("decode", ctx.command, environment(ctx.model_label, info, ctx.load_at_start), settings, [table],
                  [], raw={"greedy_outputs": outputs, "decode_tps_per_round": rates})
