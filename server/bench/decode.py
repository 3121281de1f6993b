"""`tierlm bench decode`: decode tokens/s through the server (1 stream, N staggered streams) next to transformers'
`generate` on the same weights and dtype, mlx-lm / llama-cpp-python when importable, and the memory-bandwidth
ceiling (weight bytes / measured bandwidth: each decode step of one sequence reads every weight once).

Everything runs one after the other in this process's run, never at the same time, so no engine steals the
other's cores: first the bandwidth probe, then the server, then the in-process baselines.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import time
from typing import Any

import numpy as np

from tierlm.backends.model_source.folder_facts import model_size
from tierlm.server.bench.context import BenchContext, random_tokens
from tierlm.server.bench.report import Column, Report, Table, Target, environment
from tierlm.server.bench.server_process import BenchServer, run_concurrent, run_one
from tierlm.server.bench.stats import median, ratio

TARGET_BATCH1 = 1.0  # x transformers' decode tokens/s at batch 1 (issue 6)
TARGET_STREAMS = 2.5  # x transformers' aggregate tokens/s for the same streams (issue 6)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("decode benchmark")
    g.add_argument("--prompt-tokens", type=int, default=64)
    g.add_argument("--new-tokens", type=int, default=64, help="tokens generated per stream (EOS ignored)")
    g.add_argument("--streams", type=int, default=8, help="concurrent streams for the throughput row")
    g.add_argument("--stagger-ms", type=float, default=100.0, help="delay between the starts of the streams")
    g.add_argument("--repeats", type=int, default=1, help="batch-1 runs per engine (median reported)")
    g.add_argument("--no-baseline", action="store_true", help="skip transformers, mlx-lm and llama.cpp rows")
    g.add_argument("--gguf", default=None, help="GGUF file of the same model for the llama-cpp-python row")
    g.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size of the memory bandwidth probe")


# ---------------------------------------------------------------- ceiling
def memory_bandwidth(mib: int = 512, rounds: int = 5) -> float:
    """Bytes/s of a numpy copy (read + write counted), best of ``rounds``: what one decode step can stream."""
    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


# ---------------------------------------------------------------- tierlm server
def server_rows(ns: argparse.Namespace, ctx: BenchContext, bar) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ps, P, N, S = ctx.page_size, ns.prompt_tokens, ns.new_tokens, ns.streams
    per_req = -(-(P + N) // ps) * ps + ps
    args = ctx.server_args("--max-total-tokens", str(per_req * S + 4 * ps),
                           "--max-running-requests", str(max(S, 1)))
    rng = np.random.default_rng(ctx.seed)
    rows: list[dict[str, Any]] = []
    with BenchServer(args, log_dir=ctx.work_dir, name="decode-server") as server:
        bar.set_description("decode: starting server")
        server.start()
        info = server.info()
        run_one(server.url, random_tokens(rng, P, ctx.vocab_size), 4)  # first request off the clock
        bar.update()
        bar.set_description("decode: tierlm 1 stream")
        singles = [run_one(server.url, random_tokens(rng, P, ctx.vocab_size), N) for _ in range(ns.repeats)]
        bar.update()
        rows.append({"engine": "tierlm server", "shape": "1 stream",
                     "decode_tps": median([r.decode_tokens_per_s for r in singles]),
                     "aggregate_tps": median([r.completion_tokens / r.latency for r in singles]),
                     "ttft_s": median([r.ttft for r in singles]),
                     "tokens": singles[0].completion_tokens})
        bar.set_description(f"decode: tierlm {S} streams")
        prompts = [random_tokens(rng, P, ctx.vocab_size) for _ in range(S)]
        results, t0, t1 = run_concurrent(server.url, prompts, N, ns.stagger_ms / 1000)
        bar.update()
        total = sum(r.completion_tokens for r in results)
        rows.append({"engine": "tierlm server", "shape": f"{S} streams, {ns.stagger_ms:g} ms apart",
                     "decode_tps": median([r.decode_tokens_per_s for r in results]),
                     "aggregate_tps": total / (t1 - t0), "ttft_s": median([r.ttft for r in results]),
                     "tokens": total})
    return rows, info


# ---------------------------------------------------------------- in-process baselines
def transformers_rows(ns: argparse.Namespace, ctx: BenchContext, bar) -> list[dict[str, Any]]:
    from tierlm.server.bench.hf_baseline import HFBaseline

    rng = np.random.default_rng(ctx.seed + 1)
    bar.set_description("decode: loading transformers")
    hf = HFBaseline(ctx.model_dir, ctx.dtype)
    rows = []
    try:
        bar.set_description("decode: transformers batch 1")
        ones = [hf.time_generate([random_tokens(rng, ns.prompt_tokens, ctx.vocab_size)], ns.new_tokens)
                for _ in range(ns.repeats)]
        bar.update()
        rows.append({"engine": f"transformers generate ({hf.dtype_name}, sdpa)", "shape": "batch 1",
                     "decode_tps": median([t.decode_tokens_per_s for t in ones]),
                     "aggregate_tps": median([t.aggregate_tokens_per_s for t in ones]),
                     "ttft_s": median([t.first_token_s for t in ones]), "tokens": ns.new_tokens, "baseline": "hf1"})
        bar.set_description(f"decode: transformers batch {ns.streams}")
        prompts = [random_tokens(rng, ns.prompt_tokens, ctx.vocab_size) for _ in range(ns.streams)]
        t = hf.time_generate(prompts, ns.new_tokens)
        bar.update()
        rows.append({"engine": f"transformers generate ({hf.dtype_name}, sdpa)", "shape": f"batch {ns.streams}",
                     "decode_tps": t.decode_tokens_per_s, "aggregate_tps": t.aggregate_tokens_per_s,
                     "ttft_s": t.first_token_s, "tokens": ns.streams * ns.new_tokens, "baseline": "hfN"})
    finally:
        hf.close()
        del hf
        gc.collect()
    return rows


def mlx_lm_row(ns: argparse.Namespace, ctx: BenchContext) -> dict[str, Any]:
    """mlx-lm's generate_step at batch 1, greedy (its default sampler)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(ctx.model_dir))
    if ctx.dtype in ("bfloat16", "float16"):
        model.set_dtype(getattr(mx, ctx.dtype))
    rng = np.random.default_rng(ctx.seed + 2)

    def once(n: int) -> tuple[float, float]:
        prompt = mx.array(random_tokens(rng, ns.prompt_tokens, ctx.vocab_size))
        t0 = time.perf_counter()
        first = None
        for i, (tok, _) in enumerate(generate_step(prompt, model, max_tokens=n)):
            int(tok)  # forces evaluation
            if i == 0:
                first = time.perf_counter()
        return first - t0, time.perf_counter() - t0

    once(2)  # warm-up
    runs = [once(ns.new_tokens) for _ in range(ns.repeats)]
    decode = [(ns.new_tokens - 1) / (total - first) for first, total in runs if total > first]
    model = None  # free the weights before the next row loads its own
    gc.collect()
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return {"engine": f"mlx-lm generate_step ({device})", "shape": "batch 1",
            "decode_tps": median(decode), "aggregate_tps": median([ns.new_tokens / t for _, t in runs]),
            "ttft_s": median([f for f, _ in runs]), "tokens": ns.new_tokens}


def llama_cpp_row(ns: argparse.Namespace, ctx: BenchContext) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=ns.gguf, n_ctx=ns.prompt_tokens + ns.new_tokens + 8, verbose=False)
    rng = np.random.default_rng(ctx.seed + 3)
    vocab = llm.n_vocab()
    prompt = random_tokens(rng, ns.prompt_tokens, vocab)
    t0 = time.perf_counter()
    first = None
    count = 0
    for tok in llm.generate(prompt, temp=0.0):
        count += 1
        if first is None:
            first = time.perf_counter()
        if count >= ns.new_tokens:
            break
    total = time.perf_counter() - t0
    return {"engine": "llama-cpp-python", "shape": "batch 1",
            "decode_tps": (count - 1) / (total - (first - t0)) if count > 1 else None,
            "aggregate_tps": count / total, "ttft_s": first - t0, "tokens": count}


def _optional_rows(ns: argparse.Namespace, ctx: BenchContext, notes: list[str]) -> list[dict[str, Any]]:
    rows = []
    if importlib.util.find_spec("mlx_lm") is not None:
        try:
            rows.append(mlx_lm_row(ns, ctx))
        except Exception as e:  # noqa: BLE001 - an optional comparison must not sink the benchmark
            notes.append(f"mlx-lm is installed but its run failed: {type(e).__name__}: {e}")
    else:
        notes.append("mlx-lm row skipped: not installed (the bench never installs it)")
    if importlib.util.find_spec("llama_cpp") is None:
        notes.append("llama-cpp-python row skipped: not installed (the bench never installs it)")
    elif not ns.gguf:
        notes.append("llama-cpp-python is installed: pass --gguf FILE (the same model as GGUF) for its row")
    else:
        try:
            rows.append(llama_cpp_row(ns, ctx))
        except Exception as e:  # noqa: BLE001
            notes.append(f"llama-cpp-python run failed: {type(e).__name__}: {e}")
    return rows


# ---------------------------------------------------------------- report
def run(ns: argparse.Namespace, ctx: BenchContext) -> Report:
    if ns.prompt_tokens < 1 or ns.new_tokens < 2 or ns.streams < 1 or ns.repeats < 1:
        raise SystemExit("tierlm bench decode: need --prompt-tokens >= 1, --new-tokens >= 2, --streams >= 1, "
                         "--repeats >= 1")
    notes: list[str] = []
    bar = ctx.progress_bar(total=3 + (0 if ns.no_baseline else 2), desc="decode")
    bar.set_description("decode: memory bandwidth")
    bandwidth = memory_bandwidth(ns.bandwidth_mib)
    rows, info = server_rows(ns, ctx, bar)
    dtype = info.get("dtype", "float32")
    wbytes = model_size(ctx.model_dir, dtype).weight_bytes
    if not ns.no_baseline:
        rows += transformers_rows(ns, ctx, bar)
        rows += _optional_rows(ns, ctx, notes)
    bar.close()
    ceiling = bandwidth / wbytes
    rows.append({"engine": "ceiling: weight bytes / memory bandwidth", "shape": "batch 1",
                 "decode_tps": ceiling, "aggregate_tps": None, "ttft_s": None, "tokens": None})
    hf1 = next((r for r in rows if r.get("baseline") == "hf1"), None)
    hfN = next((r for r in rows if r.get("baseline") == "hfN"), None)
    for r in rows:
        r["decode_vs_hf"] = ratio(r["decode_tps"], hf1["decode_tps"]) if hf1 else None
        r["of_ceiling"] = ratio(r["decode_tps"], ceiling) if r["ttft_s"] is not None else None
    notes += [f"weights {wbytes / 2**20:.1f} MiB ({dtype}); memory bandwidth {bandwidth / 1e9:.2f} GB/s "
              f"(numpy copy of {ns.bandwidth_mib} MiB, read + write): decode of one sequence cannot beat "
              f"{ceiling:.1f} tokens/s",
              "decode tok/s: tokens after the first over the time after the first (prefill excluded), per stream; "
              "aggregate: all new tokens over the whole run (prefill and stagger included)"]
    table = Table(f"decode throughput: {ns.prompt_tokens}-token prompts, {ns.new_tokens} new tokens, greedy",
                  [Column("engine", "engine"), Column("shape", "shape"),
                   Column("decode_tps", "decode tok/s"), Column("aggregate_tps", "aggregate tok/s"),
                   Column("ttft_s", "TTFT ms", "ms"), Column("decode_vs_hf", "decode vs HF b1", "x"),
                   Column("of_ceiling", "of ceiling", "pct")],
                  rows, notes)
    settings = {"prompt_tokens": ns.prompt_tokens, "new_tokens": ns.new_tokens, "streams": ns.streams,
                "stagger_ms": ns.stagger_ms, "repeats": ns.repeats, "weight_bytes": wbytes,
                "memory_bandwidth_bytes_per_s": bandwidth, "server_extra": ctx.server_extra}
    return Report("decode", ctx.command, environment(ctx.model_label, info, ctx.load_at_start), settings, [table],
                  targets(rows, hf1, hfN, ns.streams), raw={})


def targets(rows: list[dict[str, Any]], hf1: dict | None, hfN: dict | None, streams: int) -> list[Target]:
    if hf1 is None:
        return []
    one, many = rows[0], rows[1]
    out = []
    r1 = ratio(one["decode_tps"], hf1["decode_tps"])
    if r1 is not None:
        out.append(Target("decode at batch 1", f">= {TARGET_BATCH1:.1f}x transformers", f"{r1:.2f}x",
                          r1 >= TARGET_BATCH1,
                          f"{one['decode_tps']:.1f} vs {hf1['decode_tps']:.1f} tok/s"))
    # transformers has no concurrent streams: a generate-based server answers them one after another,
    # so its aggregate is the batch-1 rate; a static batch of the same size is shown alongside.
    rN = ratio(many["aggregate_tps"], hf1["aggregate_tps"])
    if rN is not None:
        note = (f"{many['aggregate_tps']:.1f} vs {hf1['aggregate_tps']:.1f} tok/s (transformers serving the "
                f"streams one generate at a time)")
        if hfN is not None:
            note += f"; vs a static batch-{streams} generate ({hfN['aggregate_tps']:.1f} tok/s): " \
                    f"{ratio(many['aggregate_tps'], hfN['aggregate_tps']):.2f}x"
        out.append(Target(f"aggregate with {streams} streams", f">= {TARGET_STREAMS:.1f}x transformers",
                          f"{rN:.2f}x", rN >= TARGET_STREAMS, note))
    return out
