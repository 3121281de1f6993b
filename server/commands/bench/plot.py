"""`tierlm bench ... --plot DIR`: each table of a report as a bar chart (PNG), next to the text tables.

One chart per table: a group of bars per row (its label: the row's text cells, e.g. the case, the mode, the
engine), one bar per measured column. Which columns: the times (TTFT, "ms" columns) where the table has any, else
its plain numbers (tokens/s); ratios and percentages are left to the table. `bench peers` tables (a ratio per
peer in every row) chart those ratios instead, with a line at 1. matplotlib is an
optional extra (pip install 'tierlm[plot]'); without it --plot stops before the benchmark runs, saying so.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tierlm.server.commands.bench.report import Column, Report, Table

MAX_SERIES = 4
PLOT_HINT = "--plot needs matplotlib: pip install 'tierlm[plot]' (or pip install matplotlib)"


def plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _numeric(table: Table, col: Column) -> bool:
    values = [r.get(col.key) for r in table.rows]
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def chart_columns(table: Table) -> list[Column]:
    """The columns a table's chart shows (see the module docstring)."""
    numeric = [c for c in table.columns if _numeric(table, c)]
    times = [c for c in numeric if c.fmt == "ms"]
    plain = [c for c in numeric if c.fmt not in ("x", "pct", "mb")]
    return (times or plain)[:MAX_SERIES]


def row_label(table: Table, row: dict[str, Any]) -> str:
    """The row's leading text cells (case; mode; engine and shape; metric), up to the first measured column."""
    texts = []
    for col in table.columns:
        if _numeric(table, col):
            break
        if isinstance(row.get(col.key), str):
            texts.append(row[col.key])
    return " / ".join(texts[:2]) or "?"


def _ratio_series(table: Table) -> tuple[list[str], list[tuple[str, list[float]]]]:
    """`bench peers`: per metric, the reference server / each peer (each row says which side of 1 is better)."""
    peers = sorted({p for r in table.rows for p in r["ratios"]})
    labels = [f"{r['metric']} ({'<' if r['better'].startswith('<') else '>'} 1 better)" for r in table.rows]
    return labels, [(f"ratio to {p}", [r["ratios"].get(p) or 0.0 for r in table.rows]) for p in peers]


def _bar_chart(plt, path: Path, title: str, labels: list[str], series: list[tuple[str, list[float]]], ylabel: str,
               baseline: float | None = None) -> Path:
    """Grouped bars: one group per label, one bar per series."""
    width = 0.8 / max(1, len(series))
    rotate = len(labels) > 4
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) + 2), 4.2), layout="constrained")
    for i, (name, values) in enumerate(series):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width, label=name)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=20 if rotate else 0, ha="right" if rotate else "center",
                  fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title if len(title) <= 90 else title[:87] + "...", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "table"


def write_plots(report: Report, folder: Path) -> list[Path]:
    """One PNG per table that has something to chart, named <benchmark>-<n>-<title>.png; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for n, table in enumerate(report.tables, 1):
        path = folder / f"{report.benchmark}-{n}-{_slug(table.title)}.png"
        if table.rows and all(isinstance(r.get("ratios"), dict) for r in table.rows):  # bench peers
            labels, series = _ratio_series(table)
            written.append(_bar_chart(plt, path, table.title, labels, series, "ratio", baseline=1.0))
            continue
        columns = chart_columns(table)
        if not columns or not table.rows:
            continue
        series = [(col.title, [(r[col.key] * (1000.0 if col.fmt == "ms" else 1.0))
                               if isinstance(r.get(col.key), (int, float)) else 0.0 for r in table.rows])
                  for col in columns]
        written.append(_bar_chart(plt, path, table.title, [row_label(table, r) for r in table.rows], series,
                                  "ms" if all(c.fmt == "ms" for c in columns) else "value"))
    return written
