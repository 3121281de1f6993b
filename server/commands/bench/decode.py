"""`tierlm bench decode`: decode tokens/s through the server (1 stream, N staggered streams) next to transformers'
`generate` on the same weights and dtype, mlx-lm / llama-cpp-python when importable, and the memory-bandwidth
ceiling (weight bytes / measured bandwidth: each decode step of one sequence reads every weight once).

With ``--kv-cache-dtypes auto,fp8_e4m3``: KV cache dtypes side by side instead, one server each with the same KV
memory: pool tokens, decode tokens/s and greedy agreement with the first dtype. With ``--weight-formats``: weight
formats side by side instead (weight_formats.py).

Everything runs one after the other in this process's run, never at the same time, so no engine steals the
other's cores: first the bandwidth probe, then the server, then the in-process baselines.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tierlm.backends.model_source.folder_facts import model_size
from tierlm.server.commands.bench.context import BenchContext, random_tokens
from tierlm.server.commands.bench.report import Column, Report, Table, Target, environment
from tierlm.server.commands.bench.server_process import BenchServer, run_concurrent, run_one
from tierlm.server.commands.bench.stats import median, ratio

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
    k = p.add_argument_group("KV cache dtype side by side (--kv-cache-dtypes)")
    k.add_argument("--kv-cache-dtypes", default=None, metavar="LIST",
                   help="comma-separated --kv-cache-dtype values, e.g. auto,bf16,fp8_e4m3: instead of the throughput "
                        "table, one server per value with the same KV memory (--kv-budget-mib); pool tokens, decode "
                        "tok/s and greedy agreement with the first value, side by side")
    k.add_argument("--kv-budget-mib", type=float, default=64.0, help="device KV memory of every server in that mode")
    k.add_argument("--agreement-prompts", type=int, default=8,
                   help="prompts whose greedy --new-tokens continuations are compared across KV dtypes or weight "
                        "formats")
    w = p.add_argument_group("weight formats side by side (--weight-formats)")
    w.add_argument("--weight-formats", default=None, metavar="LIST",
                   help="comma-separated DTYPE or DTYPE:TORCHAO_CONFIG entries, e.g. "
                        "float32,bfloat16,bfloat16:int8wo,bfloat16:int4wo-128: instead of the throughput table, one "
                        "server per entry; 1-stream decode tok/s (--repeats rounds), weight bytes against bytes per "
                        "parameter x parameters, greedy agreement with the unquantized model, side by side")


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


def read_bandwidth(mib: int = 512, rounds: int = 5, threads: int = 1) -> float:
    """Bytes/s ``threads`` threads read together (numpy's vectorized max over float32, one slice each; numpy lets go
    of the GIL inside it), best of ``rounds``: the rate a decode step streams its weights at with that many compute
    threads. A copy (memory_bandwidth) writes as much as it reads: on the AMX Xeon VM one core read 9-10 GB/s this
    way where a copy moved 14-17 GB/s in all."""
    src = np.ones(mib * 2**20 // 4, np.float32)
    slices = np.array_split(src, max(1, threads))
    best = float("inf")
    with ThreadPoolExecutor(len(slices)) as pool:
        for _ in range(rounds):
            t0 = time.perf_counter()
            list(pool.map(np.max, slices))
            best = min(best, time.perf_counter() - t0)
    return src.nbytes / best


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
    from tierlm.server.commands.bench.hf_baseline import HFBaseline

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


# ---------------------------------------------------------------- KV cache dtypes side by side
def _serving_device() -> str:
    """The device a server started now would run on (what --dtype auto and KV bytes depend on)."""
    import os

    from tierlm.platforms import choose_backend, detect

    try:
        return choose_backend(detect(), os.environ, None).device
    except Exception:  # noqa: BLE001 - sizing falls back to the CPU rule; the table shows what was allocated
        return "cpu"


def teacher_forced_top1(url: str, prompt: list[int], continuation: list[int]) -> list[int]:
    """The greedy token the server predicts at each position of ``continuation`` when it reads ``prompt`` +
    ``continuation`` (prompt logprobs, top 1): the per-step agreement, without one difference changing the rest."""
    import httpx

    body = {"input_ids": list(prompt) + list(continuation), "return_logprob": True, "top_logprobs_num": 1,
            "logprob_start_len": len(prompt) - 1, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    r = httpx.post(f"{url}/generate", json=body, timeout=300.0)
    r.raise_for_status()
    tops = r.json()["meta_info"]["input_top_logprobs"][1:]  # the entry of the last prompt token is null
    return [int(t[0][1]) for t in tops]


def kv_dtype_rows(ns: argparse.Namespace, ctx: BenchContext, kv_dtypes: list[str]
                  ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """One server per --kv-cache-dtype with the same device KV bytes: pool tokens, decode rates, greedy outputs."""
    ps, P, N, S = ctx.page_size, ns.prompt_tokens, ns.new_tokens, ns.streams
    budget = int(ns.kv_budget_mib * 2**20)
    device = _serving_device()
    rng = np.random.default_rng(ctx.seed)
    single_prompts = [random_tokens(rng, P, ctx.vocab_size) for _ in range(ns.repeats)]
    stream_prompts = [random_tokens(rng, P, ctx.vocab_size) for _ in range(S)]
    agree_prompts = [random_tokens(rng, P, ctx.vocab_size) for _ in range(ns.agreement_prompts)]
    rows, outputs, forced, info, first_info = [], {}, {}, {}, {}
    bar = ctx.progress_bar(total=len(kv_dtypes), desc="decode: KV dtypes")
    for kv in kv_dtypes:
        per_token = model_size(ctx.model_dir, ctx.dtype, device, kv_cache_dtype=kv).kv_bytes_per_token
        tokens = budget // per_token // ps * ps
        if tokens < S * (-(-(P + N) // ps) + 1) * ps:
            raise SystemExit(f"tierlm bench decode: --kv-budget-mib {ns.kv_budget_mib:g} holds {tokens} tokens of "
                             f"{kv} KV, too few for {S} streams of {P} + {N} tokens; raise it")
        args = ctx.server_args("--kv-cache-dtype", kv, "--max-total-tokens", str(tokens),
                               "--max-running-requests", str(max(S, 1)))
        bar.set_description(f"decode: --kv-cache-dtype {kv}")
        with BenchServer(args, log_dir=ctx.work_dir, name=f"decode-kv-{kv}") as server:
            server.start()
            info = server.info()
            pool = info.get("kv_pool", {})
            run_one(server.url, random_tokens(rng, P, ctx.vocab_size), 4)  # first request off the clock
            singles = [run_one(server.url, p, N) for p in single_prompts]
            results, t0, t1 = run_concurrent(server.url, stream_prompts, N, ns.stagger_ms / 1000)
            # One at a time, so batching never differs between the servers compared.
            outputs[kv] = [run_one(server.url, p, N).output_ids for p in agree_prompts]
            first_info = first_info or info
            # Every dtype reads the first dtype's continuations (the first itself: a check, ~100%).
            forced[kv] = [teacher_forced_top1(server.url, p, o) for p, o in zip(agree_prompts, outputs[kv_dtypes[0]])]
        bar.update()
        rows.append({"kv_cache_dtype": kv, "kv_dtype": pool.get("kv_dtype"),
                     "bytes_per_token": pool.get("bytes_per_token"), "pool_tokens": pool.get("total_tokens"),
                     "pool_bytes": pool.get("total_bytes"),
                     "decode_tps": median([r.decode_tokens_per_s for r in singles]),
                     "aggregate_tps": sum(r.completion_tokens for r in results) / (t1 - t0)})
    bar.close()
    ref = outputs[kv_dtypes[0]]
    base_tokens = rows[0]["pool_tokens"]
    for row in rows:
        out = outputs[row["kv_cache_dtype"]]
        same = sum(a == b for x, y in zip(out, ref) for a, b in zip(x, y))
        row["agreement"] = same / max(1, sum(len(y) for y in ref))
        row["identical"] = f"{sum(x == y for x, y in zip(out, ref))}/{len(ref)}"
        tf = forced.get(row["kv_cache_dtype"])
        row["step_agreement"] = None if tf is None else \
            sum(a == b for x, y in zip(tf, ref) for a, b in zip(x, y)) / max(1, sum(len(y) for y in ref))
        row["tokens_vs_first"] = ratio(row["pool_tokens"], base_tokens)
    return rows, first_info, outputs


def run_kv_dtypes(ns: argparse.Namespace, ctx: BenchContext) -> Report:
    kv_dtypes = [k.strip() for k in ns.kv_cache_dtypes.split(",") if k.strip()]
    if len(kv_dtypes) < 2 or ns.agreement_prompts < 1 or ns.kv_budget_mib <= 0:
        raise SystemExit("tierlm bench decode --kv-cache-dtypes: name at least two values (e.g. auto,fp8_e4m3), "
                         "with --agreement-prompts >= 1 and --kv-budget-mib > 0")
    rows, info, outputs = kv_dtype_rows(ns, ctx, kv_dtypes)
    notes = [f"every server gets {ns.kv_budget_mib:g} MiB of device KV (--max-total-tokens = budget / KV bytes per "
             "token); pool tokens, bytes per token and the stored dtype are read back from /server_info",
             f"decode tok/s: 1 stream, median of {ns.repeats}; aggregate: {ns.streams} streams "
             f"{ns.stagger_ms:g} ms apart",
             f"agreement: {ns.agreement_prompts} random {ns.prompt_tokens}-token prompts x {ns.new_tokens} greedy "
             f"tokens, run one at a time; the share of tokens equal at their position to --kv-cache-dtype "
             f"{kv_dtypes[0]} (a token that differs changes the continuation after it), and the continuations "
             "identical end to end; per step: the share of those tokens each dtype predicts greedily when it reads "
             f"{kv_dtypes[0]}'s continuation (prompt logprobs, top 1: the per-step error without its knock-on)"]
    table = Table(f"KV cache dtype side by side: {ns.prompt_tokens}-token prompts, {ns.new_tokens} new tokens, "
                  "greedy, same KV memory",
                  [Column("kv_cache_dtype", "--kv-cache-dtype"), Column("kv_dtype", "stored as"),
                   Column("bytes_per_token", "KV bytes/token"), Column("pool_tokens", "pool tokens"),
                   Column("tokens_vs_first", "tokens vs first", "x"), Column("pool_bytes", "pool MiB", "mb"),
                   Column("decode_tps", "decode tok/s"), Column("aggregate_tps", f"aggregate tok/s ({ns.streams})"),
                   Column("agreement", "greedy agreement", "pct"), Column("identical", "identical"),
                   Column("step_agreement", "per-step agreement", "pct")],
                  rows, notes)
    settings = {"prompt_tokens": ns.prompt_tokens, "new_tokens": ns.new_tokens, "streams": ns.streams,
                "stagger_ms": ns.stagger_ms, "repeats": ns.repeats, "kv_cache_dtypes": kv_dtypes,
                "kv_budget_mib": ns.kv_budget_mib, "agreement_prompts": ns.agreement_prompts,
                "server_extra": ctx.server_extra}
    return Report("decode", ctx.command, environment(ctx.model_label, info, ctx.load_at_start), settings, [table],
                  [], raw={"greedy_outputs": outputs})


# ---------------------------------------------------------------- report
def run(ns: argparse.Namespace, ctx: BenchContext) -> Report:
    if ns.prompt_tokens < 1 or ns.new_tokens < 2 or ns.streams < 1 or ns.repeats < 1:
        raise SystemExit("tierlm bench decode: need --prompt-tokens >= 1, --new-tokens >= 2, --streams >= 1, "
                         "--repeats >= 1")
    if getattr(ns, "kv_cache_dtypes", None):
        return run_kv_dtypes(ns, ctx)
    if getattr(ns, "weight_formats", None):
        from tierlm.server.commands.bench.weight_formats import run_weight_formats

        return run_weight_formats(ns, ctx)
    notes: list[str] = []
    bar = ctx.progress_bar(total=3 + (0 if ns.no_baseline else 2), desc="decode")
    bar.set_description("decode: memory bandwidth")
    bandwidth = memory_bandwidth(ns.bandwidth_mib)
    rows, info = server_rows(ns, ctx, bar)
    dtype = info.get("dtype", "float32")
    wbytes = info.get("weight_bytes") or model_size(ctx.model_dir, dtype).weight_bytes  # quantized: as resident
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
