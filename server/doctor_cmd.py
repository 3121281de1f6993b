"""`tierlm doctor [--json]`: what this machine is, which backend tierlm would pick and why, the KV tier sizes
it would use, the install command for this platform, and the warnings worth acting on.

Takes the same flags as `tierlm serve` (so `tierlm doctor --device cuda --enable-hierarchical-cache` checks
exactly that launch) plus --json and --backend. Exit status 1 when that launch could not start here.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from tierlm.backends.model_source.folder_facts import model_size
from tierlm.backends.verified_architectures import UnverifiedArchitectureError, assess_architecture
from tierlm.platforms import (BackendChoiceError, Facts, MemoryPlanError, choose_backend, detect, install_command,
                              pitfalls, plan_memory_for_args)
from tierlm.server.cli_args import build_parser, namespace_to_server_args


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


def model_sizes(model_path: str | None, dtype: str, device: str) -> dict[str, Any] | None:
    """KV bytes per token and weight bytes of a local model folder as served on ``device`` (None when it is
    not a local folder)."""
    if not model_path or not (Path(model_path) / "config.json").is_file():
        return None
    return model_size(Path(model_path), dtype, device).to_dict()


def model_architecture(args, backend: str) -> tuple[dict[str, Any] | None, str | None]:
    """Whether ``backend`` serves the local model folder's architecture verified, from config.json, as `serve`
    checks it: (architecture, model_type, verified; None when not a local folder) and serve's refusal message,
    or its warning under --trust-unverified-architecture (None when verified)."""
    if not args.model_path or not (Path(args.model_path) / "config.json").is_file():
        return None, None
    try:
        check = assess_architecture(args.model_path, backend, args.trust_remote_code)
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
        "platform": facts.platform_kind,
        "install_command": install_command(facts),
        "decision": None,
        "model": None,
        "architecture": None,
        "memory": None,
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
    report["architecture"], arch_note = model_architecture(args, decision.backend)
    if arch_note:  # serve refuses it (an error), or loads it only because of --trust-unverified-architecture
        report["warnings" if args.trust_unverified_architecture and report["architecture"] else "errors"].append(
            arch_note)

    try:
        sizes = model_sizes(args.model_path, args.dtype, decision.device)
    except (KeyError, TypeError, ValueError) as e:  # a config without the usual fields (e.g. Nemotron-H's layers)
        sizes = None
        report["warnings"].append(f"cannot size {args.model_path} from its config.json (no usable {e}): tier sizes "
                                  "are shown in bytes")
    else:
        if args.model_path and sizes is None:
            report["warnings"].append(
                f"--model-path {args.model_path} is not a local folder with config.json: tier sizes are shown in "
                "bytes"
            )
    report["model"] = sizes
    # Without a model, plan in bytes: 1 "token" = 1 byte, so the sizes read as byte budgets.
    per_token = sizes["kv_bytes_per_token"] if sizes else 1
    weights = sizes["weight_bytes"] if sizes else 0
    if not sizes:
        args.page_size, args.max_total_tokens = 1, None
    try:
        plan = plan_memory_for_args(facts, decision, args, weight_bytes=weights, kv_bytes_per_token=per_token)
    except MemoryPlanError as e:
        report["errors"].append(str(e))
        return report
    report["memory"] = plan.to_dict()
    report["warnings"] += plan.warnings
    return report


def _gb(n: float | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / 1e6:.2f} MB" if abs(n) < 1e9 else f"{n / 1e9:.2f} GB"


def render_text(report: dict[str, Any]) -> str:
    f = report["facts"]
    lines = ["tierlm doctor", "", f"Machine ({report['platform']})"]
    lines.append(f"  OS / CPU         {f['os_name']} {f['arch']}, {f['cpu_count']} cores, Python {f['python_version']}"
                 + (" (Rosetta)" if f["rosetta"] else ""))
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
    else:
        lines.append("Backend            cannot start as configured (see Errors)")

    m = report["memory"]
    if m:
        model = report["model"]
        lines.append("")
        if model:
            lines.append(f"KV tiers           {model['path']} ({model['dtype']}): {model['kv_bytes_per_token']} bytes/token, "
                         f"weights {_gb(model['weight_bytes'])}")
            lines.append(f"  device KV (L1)   {m['device_kv_tokens']} tokens, {_gb(m['device_kv_bytes'])}")
            host = (f"{m['host_kv_tokens']} tokens, {_gb(m['host_kv_bytes'])} (ratio {m['hicache_ratio']:g})"
                    if m["hicache_ratio"] is not None else "off (--enable-hierarchical-cache to size it)")
        else:
            lines.append("KV tiers           byte budgets before weights (pass --model-path for token counts)")
            lines.append(f"  device KV (L1)   {_gb(m['device_kv_bytes'])}")
            host = (f"{_gb(m['host_kv_bytes'])} (ratio {m['hicache_ratio']:g})"
                    if m["hicache_ratio"] is not None else "off (--enable-hierarchical-cache to size it)")
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
        report = diagnose(detect(), dict(os.environ), argv)
    except ValueError as e:  # a flag value ServerArgs rejects
        print(f"tierlm doctor: error: {e}", file=sys.stderr)
        return 2
    as_json = report.pop("json")
    print(json.dumps(report, indent=2) if as_json else render_text(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
