"""`tierlm doctor [--json]`: what this machine is, which backend tierlm would pick and why, the KV tier sizes
it would use, the install command for this platform, and the warnings worth acting on.

Takes the same flags as `tierlm serve` (so `tierlm doctor --device cuda --enable-hierarchical-cache` checks
exactly that launch) plus --json and --backend. Exit status 1 when that launch could not start here.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from tierlm.backends.base import BackendPlan, PlanFacts
from tierlm.backends.dtypes import HALF_DTYPES, dtype_decision
from tierlm.backends.model_source import ModelSourceError, resolve_model_path
from tierlm.backends.model_source.builtin_model import BUILTIN_MODEL_NAME, builtin_model_dir
from tierlm.backends.model_source.chat_templates import folder_chat_template
from tierlm.backends.model_source.hub import cached_snapshot
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.model_source.resolve import looks_like_path
from tierlm.backends.verified_architectures import UnverifiedArchitectureError, assess_architecture
from tierlm.backends.weight_format import WeightFormatError, check_backend_kind, device_refusal, parse_weight_quant
from tierlm.platforms import (BackendChoiceError, Decision, Facts, MemoryPlanError, choose_backend, detect,
                              install_command, pitfalls, size_kv_tiers)
from tierlm.platforms.huge_pages import this_machine as huge_page_plan
from tierlm.runtime.engine_setup import ram_bound
from tierlm.runtime.errors import StartupError
from tierlm.runtime.load_plan import (LoadPlan, chat_format_for, check_context_length, model_max_context, plan_backend,
                                      plan_load)
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.commands.cli_args import build_parser, namespace_to_server_args

BUILTIN_LABEL = f"built-in model ({BUILTIN_MODEL_NAME})"


def _parser():
    p = build_parser(prog="tierlm doctor")
    p.description = (
        "Check this machine: facts, the backend/device tierlm would choose and why, KV tier sizes, "
        "the install command, warnings. Accepts the same flags as `tierlm serve`."
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--backend", default=None, choices=["torch", "mlx"],
                   help="force a backend (same as TIERLM_BACKEND)")
    return p


@contextlib.contextmanager
def model_folder(args: ServerArgs) -> Iterator[tuple[Path | None, str, str | None, str | None]]:
    """The model folder serve would load, found without network: (folder or None, how to name it, a warning why
    sizes are in bytes only, serve's refusal). No --model-path: the built-in model shipped in the package. A hub
    id: the local Hugging Face cache only."""
    if args.model_path is None:
        try:
            folder, refusal = builtin_model_dir(), None
        except ModelSourceError as e:  # an install that lost its package data
            folder, refusal = None, str(e)
        yield folder, BUILTIN_LABEL, None, refusal
        return
    given = args.model_path
    if Path(given).expanduser().exists() or looks_like_path(given):
        try:  # a local folder: checked as serve checks it, no network
            yield resolve_model_path(given), given, None, None
        except ModelSourceError as e:
            yield None, given, None, str(e)
        return
    cache = Path(args.download_dir).expanduser() if args.download_dir else None
    folder = cached_snapshot(given, args.revision, str(cache) if cache else None)
    why = None if folder else (
        f"--model-path {given} is not in the local Hugging Face cache (serve would download it): its config.json "
        "is unknown, so tier sizes are byte budgets only, not tokens")
    yield folder, given, why, None


def backend_plan(folder: ModelFolder, args: ServerArgs, decision: Decision, env: dict[str, str], facts: Facts,
                 architecture: str = "") -> BackendPlan:
    """The chosen backend's part of serve's load plan (runtime/load_plan.plan_backend) on the machine of ``facts``:
    dtype, the model as it will be held, the CPU kernel plan (or its refusal), the compiled decode step."""
    quant = parse_weight_quant(args.quantization, args.torchao_config)
    return plan_backend(decision.backend, PlanFacts(
        folder, decision.device, args.dtype, args.kv_cache_dtype, decision.native_bf16, quant, env,
        architecture=architecture, compute_capability=facts.compute_capability,
        enable_torch_compile=args.enable_torch_compile, static_decode=args.cuda_graph_max_bs is not None,
        cpu=facts.cpu))


def model_architecture(args: ServerArgs, folder: ModelFolder, backend: str
                       ) -> tuple[dict[str, Any] | None, str | None]:
    """Whether ``backend`` serves the model folder's architecture verified, from config.json, as `serve` checks
    it: (architecture, model_type, verified) and serve's refusal message, or its warning under
    --trust-unverified-architecture (None when verified)."""
    try:
        check = assess_architecture(folder, backend, args.trust_remote_code)
    except UnverifiedArchitectureError as e:  # config.json unreadable
        return None, str(e)
    facts = {"architecture": check.architecture, "model_type": check.model_type, "verified": check.verified}
    return facts, check.warning if args.trust_unverified_architecture else check.refusal


def diagnose(facts: Facts, env: dict[str, str], argv: Sequence[str]) -> dict[str, Any]:
    """Everything the doctor reports, as one JSON-able dict (the text view prints this)."""
    ns = _parser().parse_args(list(argv))
    as_json, backend = ns.json, ns.backend
    del ns.json, ns.backend
    args = namespace_to_server_args(ns)
    args.check()
    report: dict[str, Any] = {
        "facts": facts.to_dict(),
        "cpu": facts.cpu.to_dict(),
        "cpu_kernels": None,  # torch on CPU: the execution plan serve will build (platforms/cpu_plan.py)
        "platform": facts.platform_kind,
        "install_command": install_command(facts),
        "decision": None,
        "model": None,
        "architecture": None,
        "memory": None,
        "plan": None,  # serve's load plan, each choice with its reason (runtime/load_plan.py)
        "errors": [],
        "warnings": pitfalls(facts, env),
        "json": as_json,
    }
    try:
        decision = choose_backend(facts, env, args.device, backend)
    except BackendChoiceError as e:
        report["errors"].append(str(e))
        return report
    report["decision"] = decision.to_dict()
    quant = parse_weight_quant(args.quantization, args.torchao_config)
    if quant is not None:  # what serve refuses before loading (the other backend's names, a device without kernels)
        try:
            check_backend_kind(quant, decision.backend)
            refusal = device_refusal(quant, decision.device, facts.compute_capability)
        except WeightFormatError as e:
            refusal = str(e)
        if refusal:
            report["errors"].append(refusal)
    part = None
    with model_folder(args) as (folder, label, bytes_only_why, refusal):
        if refusal:
            report["errors"].append(refusal)
        if bytes_only_why:
            report["warnings"].append(bytes_only_why)
        if folder is not None:
            part = _check_model(report, args, folder, label, decision, env, facts)
    sizes = report["model"]
    if decision.backend == "torch" and decision.device == "cpu" and sizes and part is not None:
        if part.kernels is not None:
            report["cpu_kernels"] = {name: f"{c.value} ({c.why})" for name, c in part.kernels.items()}
            on = part.compile
            report["cpu_kernels"]["decode_step"] = f"{'compiled by torch.compile' if on.value else 'eager'} ({on.why})"
            report["cpu_kernels"]["weight_pages"] = huge_page_plan(env).why
        if sizes["dtype"] in HALF_DTYPES and not decision.native_bf16:  # runs, but slower than float32 here
            report["warnings"].append(dtype_decision(args.dtype, "cpu", None, cpu_bf16=False)[1])
    # The same rule serve sizes its pools by (runtime/load_plan.size_tiers): same inputs, same pages.
    try:
        tiers = size_kv_tiers(facts, decision, args, weight_bytes=sizes["weight_bytes"] if sizes else 0,
                              kv_bytes_per_token=sizes["kv_bytes_per_token"] if sizes else None,
                              context_length=sizes["context_length"] if sizes else None,
                              state_slot_bytes=sizes.get("state_slot_bytes", 0) if sizes else 0)
    except MemoryPlanError as e:
        report["errors"].append(str(e))
        return report
    report["memory"] = tiers.to_dict()
    report["warnings"] += tiers.warnings
    return report


def serve_plan(args: ServerArgs, facts: Facts, folder: ModelFolder, env: dict[str, str], decision: Decision
               ) -> LoadPlan | None:
    """serve's load plan (runtime/load_plan.py) for this launch, with the chat format the model folder's template
    gives (serve reads it from the loaded tokenizer): what serve will build, each choice with its reason. None where
    serve would stop before loading (the checks of this report say why)."""
    try:
        plan = plan_load(args, facts, folder, env, decision)
    except StartupError:
        return None
    if args.chat_template is None and args.tokenizer_path is None:
        plan = replace(plan, chat_format=chat_format_for(args, folder, *folder_chat_template(folder)))
    return plan


def _check_model(report: dict[str, Any], args: ServerArgs, path: Path, label: str, decision: Decision,
                 env: dict[str, str], facts: Facts) -> BackendPlan:
    """The architecture check, serve's load plan, the model's sizes and the context length, as serve finds them;
    the backend's part of the plan."""
    folder = ModelFolder.read(path)  # config.json read once, as serve reads it
    report["architecture"], arch_note = model_architecture(args, folder, decision.backend)
    if arch_note:  # serve refuses it (an error), or loads it only because of --trust-unverified-architecture
        report["warnings" if args.trust_unverified_architecture and report["architecture"] else "errors"].append(
            arch_note)
    plan = serve_plan(args, facts, folder, env, decision)
    # where serve would stop before loading, the backend's part alone still sizes the model for this report
    part = plan.backend if plan is not None else backend_plan(
        folder, args, decision, env, facts, (report["architecture"] or {}).get("architecture") or "")
    if part.refusal:  # a CPU plan override this machine or model cannot run: serve refuses it before loading
        report["errors"].append(part.refusal)
    if part.sizes is None:  # a config without the usual fields (e.g. Nemotron-H's layers)
        report["warnings"].append(f"cannot size {label} from its config.json ({part.sizes_why}): tier sizes are "
                                  "byte budgets only, not tokens")
        return part
    sizes = {"path": label, **part.sizes.to_dict(), "max_position_embeddings": model_max_context(folder)}
    try:
        sizes["context_length"] = check_context_length(args.context_length, sizes["max_position_embeddings"], env)
    except StartupError as e:
        report["errors"].append(str(e))
        sizes["context_length"] = args.context_length
    else:
        if args.context_length and args.context_length > sizes["max_position_embeddings"]:
            report["warnings"].append(
                f"--context-length {args.context_length} exceeds the model's max_position_embeddings "
                f"{sizes['max_position_embeddings']} (allowed by SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN)")
    report["model"] = sizes
    report["plan"] = plan.to_dict() if plan is not None else None
    return part


def _gb(n: float | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / 1e6:.2f} MB" if abs(n) < 1e9 else f"{n / 1e9:.2f} GB"


def render_text(report: dict[str, Any]) -> str:
    f = report["facts"]
    lines = ["tierlm doctor", "", f"Machine ({report['platform']})"]
    lines.append(f"  OS / CPU         {f['os_name']} {f['arch']}, {f['cpu_count']} cores, Python {f['python_version']}"
                 + (" (Rosetta)" if f["rosetta"] else ""))
    c = report["cpu"]
    if c["features"] or c["model_name"]:
        lines.append(f"  CPU              {c['model_name'] or 'unknown model'}: level {c['level']}"
                     + (f" (capped by TIERLM_CPU_ISA={c['cap']})" if c["cap"] else "")
                     + f", native bf16 {c['native_bf16'] or 'none'}, {c['physical_cores'] or '?'} physical cores")
        lines.append(f"  CPU features     {' '.join(c['features'])}")
    lines.append(f"  RAM              {_gb(f['ram_total_bytes'])} total, {_gb(f['ram_available_bytes'])} available")
    if f["accelerator"] == "none":
        lines.append("  Accelerator      none")
    else:
        cap = f["compute_capability"]
        lines.append(
            f"  Accelerator      {f['device_name']} ({f['accelerator']}"
            + (f", sm_{cap[0]}{cap[1]}" if cap else "") + (f", x{f['device_count']}" if f["device_count"] > 1 else "")
            + f"), memory {_gb(f['device_memory_total_bytes'])}"
            + (f", driver {f['driver_version']}" if f["driver_version"] else "")
        )
    lines.append(f"  Unified memory   {'yes' if f['unified_memory'] else 'no'}"
                 + (f" ({f['board_model']})" if f["board_model"] else ""))
    if f["torch_version"]:
        build = f"CUDA {f['torch_cuda_version']}" if f["torch_cuda_version"] else "CPU build"
        lines.append(f"  torch            {f['torch_version']} ({build}, CUDA usable: {'yes' if f['torch_cuda_available'] else 'no'})")
    else:
        lines.append(f"  torch            not importable{': ' + f['torch_error'] if f['torch_error'] else ''}")
    if f["mlx_version"]:
        lines.append(f"  mlx              {f['mlx_version']} ({'Metal' if f['mlx_metal_available'] else 'CPU only'}), "
                     f"mlx-lm {f['mlx_lm_version'] or 'not installed'}")
    else:
        lines.append(f"  mlx              not importable{': ' + f['mlx_error'] if f['mlx_error'] else ''}")

    d = report["decision"]
    lines.append("")
    if d:
        lines.append(f"Backend            {d['backend']} on {d['device']}")
        lines += [f"  - {r}" for r in d["reasons"]]
        a = report.get("architecture")
        if a:
            lines.append(f"Architecture       {a['architecture']} ({a['model_type'] or 'no model_type'}): "
                         + ("verified on " + d["backend"] if a["verified"]
                            else f"NOT verified on {d['backend']} (docs/models.md)"))
        labels = {"kernel_library": "kernel library", "bf16_linear": "bf16 linears", "decode_products": "decode products",
                  "pack_tied_lm_head": "tied lm_head", "f32_products": "f32 products", "f32_16bit_weights": "16-bit weights",
                  "int8_products": "int8 products", "prefill_attention": "prefill attn", "decode_attention": "decode attn",
                  "extend_attention": "extend attn", "extend_kernel": "extend kernel", "compiled_ops": "compiled ops",
                  "compiled_attention": "compiled attn", "fused_projections": "fused q/k/v", "decode_step": "decode step",
                  "weight_pages": "weight pages"}
        for layer, kernel in (report.get("cpu_kernels") or {}).items():
            lines.append(f"  {labels.get(layer, layer):<17}{kernel}")
    else:
        lines.append("Backend            cannot start as configured (see Errors)")
    plan = report.get("plan")
    if plan:  # serve's load plan: the choices the builder executes (runtime/load_plan.py)
        lines += ["", "Load plan"]
        fmt = plan["chat_format"] or {}
        for label, c in (("attention", plan["attention"]), ("dtype", plan["dtype"]),
                         ("quantization", plan["weight_quantization"]), ("compiled decode", plan["compile"]),
                         ("context length", plan["context_length"]),
                         ("reasoning parser", fmt.get("reasoning_parser")),
                         ("tool-call parser", fmt.get("tool_call_parser"))):
            if c is not None:
                v = c["value"]
                value = ("yes" if v else "no") if isinstance(v, bool) else "none" if v is None else v
                lines.append(f"  {label:<17}{value} ({c['why']})")

    m = report["memory"]
    if m:
        model = report["model"]
        lines.append("")
        ratio = f" (ratio {m['hicache_ratio']:g})" if m["hicache_ratio"] is not None else ""
        if m["sized_in"] == "tokens":
            lines.append(f"KV tiers           {model['path']} ({model['dtype']}, KV {model['kv_cache_dtype']}): "
                         f"{m['kv_bytes_per_token']} bytes/token, weights {_gb(m['weight_bytes'])} "
                         f"({model.get('weight_format', 'none')}), "
                         f"context length {m['context_length']}")
            if model.get("mxfp4_experts"):
                lines.append(f"  MXFP4 experts    {model['mxfp4_experts']['mode']}: {model['mxfp4_experts']['why']}")
            lines.append(f"  device KV (L1)   {m['device_pages']} pages x {m['page_size']} = {m['device_kv_tokens']} "
                         f"tokens, {_gb(m['device_kv_bytes'])}")
            host = (f"{m['host_pages']} pages x {m['page_size']} = {m['host_kv_tokens']} tokens, "
                    f"{_gb(m['host_kv_bytes'])}{ratio}")
        else:
            lines.append("KV tiers           byte budgets only, before weights and token caps (see Warnings)")
            lines.append(f"  device KV (L1)   {_gb(m['device_kv_bytes'])}")
            host = f"{_gb(m['host_kv_bytes'])}{ratio}"
        if m["hicache_ratio"] is None:
            host = "off (--enable-hierarchical-cache to size it)"
        lines.append(f"  host KV (L2)     {host}")
        lines.append(f"  memory           {m['memory_kind']}, sized from {_gb(m['available_bytes'])}, "
                     f"{_gb(m['headroom_bytes'])} RAM kept free, mem_fraction_static {m['mem_fraction_static']:g}")
        lines += [f"  - {r}" for r in m["reasons"]]

    lines += ["", f"Install            {report['install_command']}  (from the repository root)"]
    lines += ["", "Warnings" + ("" if report["warnings"] else "           none")]
    lines += [f"  ! {w}" for w in report["warnings"]]
    if report["errors"]:
        lines += ["", "Errors"] + [f"  x {e}" for e in report["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        report = diagnose(ram_bound(detect()), dict(os.environ), argv)  # a container's memory limit, as serve
    except ValueError as e:  # a flag value ServerArgs rejects
        print(f"tierlm doctor: error: {e}", file=sys.stderr)
        return 2
    as_json = report.pop("json")
    print(json.dumps(report, indent=2) if as_json else render_text(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
