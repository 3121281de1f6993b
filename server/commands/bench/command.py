"""`tierlm bench prefix|multiturn|decode|spec|peers|agent`: argument parsing, model selection, dispatch, output.

Each benchmark starts its own server processes (so it controls pool sizes, restarts and the L3 folder) and
prints a report with the machine, backend, dtype, threads and versions. Timings are measured side by side in
one run; hit statistics are read back from the responses.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from tierlm.backends.model_source import ModelSourceError
from tierlm.backends.model_source.folder_facts import model_size
from tierlm.server.commands.bench.context import BenchContext

log = logging.getLogger("tierlm.bench")

BENCH = "tierlm.server.commands.bench"
SUBCOMMANDS = {
    "prefix": (f"{BENCH}.prefix", "TTFT per cache tier for a shared prefix: cold, L1, L2, L3 hit"),
    "multiturn": (f"{BENCH}.multiturn", "C clients x R rounds of growing conversations, radix vs HiCache"),
    "decode": (f"{BENCH}.decode", "decode tokens/s at batch 1 and N streams, next to transformers"),
    "spec": (f"{BENCH}.spec", "NGRAM speculative decoding vs plain decode (tokens/s, acceptance) and the "
                              "cost of a 1 + k-token verify forward"),
    "peers": (f"{BENCH}.peers", "the same client workload against tierlm and OpenAI-compatible peers "
                                "(--against NAME=URL): TTFT, decode tok/s, ratios"),
    "agent": (f"{BENCH}.agent", "coding-agent sessions (Claude Code, Codex) replayed in the real clients' wire shapes: "
                                "TTFT and cache tiers per turn, sub-agents, side requests, resume after a restart"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierlm bench", description=(
        "Benchmark tierlm on this machine: TTFT per cache tier (prefix), multi-turn reuse (multiturn), decode "
        "throughput next to transformers (decode), NGRAM speculative decoding (spec), the same workload against "
        "OpenAI-compatible peers such as vLLM or llama.cpp (peers), coding-agent sessions in the real clients' wire "
        "shapes (agent). Each starts its own server processes."),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="benchmark", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_common_arguments(sp)
        _module(module_name).add_arguments(sp)
    return p


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    from tierlm.backends.model_source.synthetic import synthetic_names

    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model-path", default=None, help="model folder or Hugging Face id")
    src.add_argument("--synthetic", default=None, choices=synthetic_names(),
                     help="random weights in a real architecture's shape, built offline and cached")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    m.add_argument("--quantization", default=None,
                   help="load-time weight quantization of every server started (serve's flag: w8a8_int8, fp8, q4, "
                        "q8, ...; docs/models.md); in-process baselines keep the checkpoint's weights")
    m.add_argument("--torchao-config", default=None,
                   help="torchao load-time quantization of every server started (serve's flag: int8wo, int8dq, "
                        "int4wo-<group>, ...)")
    g = p.add_argument_group("run")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="extra flag for every server started, e.g. --server-arg=--chunked-prefill-size=512 "
                        "(repeatable)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the servers and the in-process baselines (sets OMP_NUM_THREADS); "
                        "default: torch's own choice")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print JSON instead of tables; with FILE write JSON there and print the tables")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--plot", default=None, metavar="DIR",
                   help="also write each table as a bar chart (PNG) into DIR (needs the plot extra: matplotlib)")
    g.add_argument("--work-dir", default=None,
                   help="folder for server logs and the L3 cache (default: a temporary folder, removed after)")


def _module(name: str):
    import importlib

    return importlib.import_module(name)


def resolve_model(ns: argparse.Namespace, progress: bool) -> tuple[Path, str]:
    if ns.synthetic:
        from tierlm.backends.model_source.synthetic import ensure_synthetic_model

        bar = None

        def on_progress(done: int, total: int) -> None:
            nonlocal bar
            if bar is None:
                from tqdm import tqdm

                bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"building {ns.synthetic}",
                           disable=not progress, file=sys.stderr, leave=False)
            bar.update(done - bar.n)

        path = ensure_synthetic_model(ns.synthetic, progress=on_progress)
        if bar is not None:
            bar.close()
        return path, f"synthetic {ns.synthetic} (seeded random weights, published shapes; {path})"
    from tierlm.backends.model_source import resolve_model_path

    path = resolve_model_path(ns.model_path)
    return path, str(path)


def resolve_dtype(requested: str, model_dir: Path) -> str:
    """``--dtype auto`` made concrete as `serve` would resolve it on this machine for the torch backend (the
    native-bf16 rule on a CPU), so the servers and the in-process baselines of one run compute in the same dtype.
    For MLX it stays auto (the MLX backend resolves it)."""
    import os

    from tierlm.backends.model_source.model_folder import ModelFolder
    from tierlm.platforms import choose_backend, detect
    from tierlm.runtime.load_plan import choose_dtype
    from tierlm.runtime.server_args import ServerArgs

    if requested != "auto":
        return requested
    decision = choose_backend(detect(), os.environ)
    folder = ModelFolder.read(model_dir)
    return choose_dtype(ServerArgs(model_path=str(model_dir), dtype=requested), decision, folder)[0]  # MLX: auto


def _quant_flags(ns: argparse.Namespace) -> list[str]:
    """--quantization / --torchao-config, passed on to every server."""
    out = []
    for flag, value in (("--quantization", ns.quantization), ("--torchao-config", ns.torchao_config)):
        if value:
            out += [flag, value]
    return out


def set_threads(n: int) -> None:
    """Same thread count for server subprocesses (they inherit the environment) and in-process baselines."""
    import os

    os.environ["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.benchmark is None:
        parser.print_help()
        return 2
    module = _module(SUBCOMMANDS[ns.benchmark][0])
    if not getattr(module, "needs_model", lambda _ns: True)(ns):  # e.g. `bench agent --record`: no model, no server
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return module.run_without_model(ns)
    if not ns.model_path and not ns.synthetic:
        parser.exit(2, f"tierlm bench {ns.benchmark}: pass --model-path DIR, or --synthetic NAME for random weights "
                       "in a real shape (e.g. --synthetic qwen2.5-0.5b)\n")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tierlm.server.commands.bench.plot import PLOT_HINT, plotting_available, write_plots
    from tierlm.server.commands.bench.report import emit, load_average

    if ns.plot and not plotting_available():  # before the run, not after minutes of measuring
        parser.exit(2, f"tierlm bench {ns.benchmark}: {PLOT_HINT}\n")

    load_at_start = load_average()  # before this run adds its own load
    if ns.threads:
        set_threads(ns.threads)
    progress = not ns.no_progress
    try:
        model_dir, label = resolve_model(ns, progress)
    except ModelSourceError as e:
        print(f"tierlm bench {ns.benchmark}: {e}", file=sys.stderr)
        return 1
    own_work_dir = ns.work_dir is None
    work_dir = Path(ns.work_dir or tempfile.mkdtemp(prefix="tierlm-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    ctx = BenchContext(model_dir=model_dir, model_label=label, dtype=resolve_dtype(ns.dtype, model_dir),
                       page_size=ns.page_size,
                       server_extra=list(ns.server_arg) + _quant_flags(ns), seed=ns.seed, progress=progress,
                       work_dir=work_dir,
                       command="tierlm bench " + shlex.join(argv), vocab_size=model_size(model_dir).vocab_size or 0,
                       load_at_start=load_at_start)
    from tierlm.server.commands.bench.server_process import BenchServerError

    try:
        report = module.run(ns, ctx)
    except BenchServerError as e:
        print(f"tierlm bench {ns.benchmark}: {e}\n(server logs kept in {work_dir})", file=sys.stderr)
        return 1
    if own_work_dir:
        shutil.rmtree(work_dir, ignore_errors=True)
    emit(report, ns.json)
    if ns.plot:
        for path in write_plots(report, Path(ns.plot)):
            print(f"chart: {path}", file=sys.stderr)
    return 0
