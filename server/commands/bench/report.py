"""Benchmark reports: an environment header (machine, backend, dtype, threads, versions), tables, targets.

One ``Report`` per `tierlm bench` run; printed as aligned text tables, or as JSON with ``--json``. Numbers are
kept raw in JSON (seconds, bytes, tokens) and formatted only for the text view.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

VERSIONED_PACKAGES = ("tierlm", "torch", "transformers", "numpy", "mlx", "mlx-lm", "llama-cpp-python")


@dataclass
class Column:
    key: str
    title: str
    fmt: str = "{}"  # applied to non-None values; "ms" / "mb" / "x" / "pct" are shorthands
    scale: float = 1.0


@dataclass
class Table:
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "rows": self.rows, "notes": self.notes}


@dataclass
class Target:
    """A goal from the issue next to the measured value. ``met`` is None when the measurement cannot count."""

    name: str
    goal: str
    measured: str
    met: bool | None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "goal": self.goal, "measured": self.measured, "met": self.met, "note": self.note}


@dataclass
class Report:
    benchmark: str
    command: str
    environment: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)  # per-request details, JSON only

    def to_dict(self) -> dict[str, Any]:
        return {"benchmark": self.benchmark, "command": self.command, "environment": self.environment,
                "settings": self.settings, "tables": [t.to_dict() for t in self.tables],
                "targets": [t.to_dict() for t in self.targets], "raw": self.raw}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def render(self) -> str:
        env = self.environment
        lines = [f"tierlm bench {self.benchmark}", f"  command: {self.command}"]
        for key in ("machine", "model", "backend", "threads", "versions"):
            if key in env:
                lines.append(f"  {key}: {_inline(env[key])}")
        if self.settings:
            lines.append(f"  settings: {_inline(self.settings)}")
        for table in self.tables:
            lines += ["", render_table(table)]
        if self.targets:
            lines += ["", "targets (ratios measured side by side in this run):"]
            for t in self.targets:
                verdict = {True: "met", False: "MISSED", None: "NOT CREDITED"}[t.met]
                lines.append(f"  {t.name}: goal {t.goal}, measured {t.measured} -> {verdict}"
                             + (f" ({t.note})" if t.note else ""))
        return "\n".join(lines)


def render_table(table: Table) -> str:
    header = [c.title for c in table.columns]
    body = [[format_cell(row.get(c.key), c) for c in table.columns] for row in table.rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    out = [table.title, "  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)),
           "  " + "  ".join("-" * w for w in widths)]
    out += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in body]
    out += [f"  note: {n}" for n in table.notes]
    return "\n".join(out)


def format_cell(value: Any, col: Column) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if col.fmt == "ms":
        return f"{value * 1000:.1f}"
    if col.fmt == "mb":
        return f"{value / 2**20:.1f}"
    if col.fmt == "x":
        return f"{value:.3f}x"
    if col.fmt == "pct":
        return f"{value * 100:.1f}%"
    if isinstance(value, float) and col.fmt == "{}":
        return f"{value:.2f}"
    return col.fmt.format(value * col.scale if col.scale != 1.0 else value)


def _inline(obj: Any) -> str:
    if isinstance(obj, dict):
        return ", ".join(f"{k}={_inline(v)}" for k, v in obj.items() if v is not None)
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(_inline(v) for v in obj) + "]"
    return str(obj)


# ---------------------------------------------------------------- environment
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions(names: Sequence[str] = VERSIONED_PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None  # not installed: shown as absent, never installed by the bench
    out["tierlm_commit"] = source_commit()
    return out


def source_commit() -> str | None:
    """`git describe --always --dirty` of the tierlm checkout, when running from one (editable installs)."""
    import subprocess

    import tierlm

    root = Path(tierlm.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def thread_settings() -> dict[str, Any]:
    """Thread counts the server's torch will use: its defaults are this process's (same machine, same env)."""
    threads: dict[str, Any] = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if "torch" in sys.modules or _importable("torch"):
        import torch

        threads["torch_intra_op"] = torch.get_num_threads()
        threads["torch_inter_op"] = torch.get_num_interop_threads()
    return threads


def _importable(name: str) -> bool:
    from importlib.util import find_spec

    return find_spec(name) is not None


def machine_facts() -> dict[str, Any]:
    import psutil

    return {"os": f"{platform.system()} {platform.release()}", "arch": platform.machine(), "cpu": cpu_model(),
            "logical_cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "load_avg_1m_at_end": load_average()}


def load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def environment(model_label: str, server_info: dict[str, Any] | None, load_at_start: float | None = None
                ) -> dict[str, Any]:
    """Everything needed to compare two reports: machine, model, backend/device/dtype, threads, versions.

    The 1-minute load average before the run and at its end says how much other work shared the CPU.
    """
    backend: dict[str, Any] = {}
    if server_info:
        backend = {k: server_info.get(k) for k in ("backend", "device", "dtype", "architecture")}
        backend["page_size"] = server_info.get("kv_pool", {}).get("page_size")
        backend["kv_bytes_per_token"] = server_info.get("kv_pool", {}).get("bytes_per_token")
    machine = machine_facts()
    machine["load_avg_1m_at_start"] = load_at_start
    return {"machine": machine, "model": model_label, "backend": backend, "threads": thread_settings(),
            "versions": package_versions()}


def emit(report: Report, json_target: str | None) -> None:
    """Print the text report; with ``--json`` print JSON instead (``--json FILE``: write JSON there, print text)."""
    if json_target in (None, ""):
        print(report.render())
    elif json_target == "-":
        print(report.to_json())
    else:
        Path(json_target).write_text(report.to_json() + "\n")
        print(report.render())
        print(f"\nJSON written to {json_target}")
