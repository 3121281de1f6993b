"""`tierlm bench ... --plot DIR`: each report table as a bar chart; the columns charted; the missing extra stops the
run before it measures anything."""
from __future__ import annotations

import pytest

from tierlm.server.commands.bench import command as bench_cmd
from tierlm.server.commands.bench import plot
from tierlm.server.commands.bench.report import Column, Report, Table

PREFIX = Table("TTFT per cache tier", [
    Column("case", "case"), Column("ttft_s", "TTFT ms", "ms"), Column("ttft_vs_cold", "TTFT/cold", "x"),
    Column("hit_device", "hit L1"), Column("host_ram_bytes", "L2 used MiB", "mb")],
    [{"case": "cold", "ttft_s": 0.20, "ttft_vs_cold": 1.0, "hit_device": 0, "host_ram_bytes": 0},
     {"case": "L1 hit", "ttft_s": 0.02, "ttft_vs_cold": 0.1, "hit_device": 64, "host_ram_bytes": 0},
     {"case": "L2 hit", "ttft_s": 0.05, "ttft_vs_cold": 0.25, "hit_device": 0, "host_ram_bytes": 2**20}])
PEERS = Table("tierlm next to peers", [
    Column("metric", "metric"), Column("cell:tierlm", "tierlm"), Column("cell:vllm", "vllm"),
    Column("better", "tierlm/peer better if")],
    [{"metric": "decode tok/s", "cell:tierlm": 120.0, "cell:vllm": 100.0, "better": "higher"},
     {"metric": "TTFT s", "cell:tierlm": 0.1, "cell:vllm": None, "better": "lower"}])
EMPTY = Table("nothing numeric", [Column("name", "name")], [{"name": "a"}])


def test_the_chart_shows_times_where_there_are_any_else_plain_numbers() -> None:
    assert [c.key for c in plot.chart_columns(PREFIX)] == ["ttft_s"]
    assert [c.key for c in plot.chart_columns(PEERS)] == ["cell:tierlm", "cell:vllm"]
    assert plot.chart_columns(EMPTY) == []
    assert plot.row_label(PEERS, PEERS.rows[0]) == "decode tok/s"  # the "better" hint is not a label
    assert plot.row_label(PREFIX, PREFIX.rows[1]) == "L1 hit"


def test_write_plots_writes_one_png_per_chartable_table(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    report = Report("prefix", "tierlm bench prefix", {}, tables=[PREFIX, EMPTY, PEERS])
    paths = plot.write_plots(report, tmp_path / "charts")
    assert [p.name for p in paths] == ["prefix-1-ttft-per-cache-tier.png", "prefix-3-tierlm-next-to-peers.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_plot_without_matplotlib_stops_before_the_run(monkeypatch, capsys) -> None:
    monkeypatch.setattr(plot, "plotting_available", lambda: False)
    ran = []
    monkeypatch.setattr(bench_cmd, "resolve_model", lambda *a: ran.append(a))
    with pytest.raises(SystemExit) as e:
        bench_cmd.main(["prefix", "--synthetic", "tiny", "--plot", "charts"])
    assert e.value.code == 2 and ran == []
    assert "pip install 'tierlm[plot]'" in capsys.readouterr().err


def test_a_peers_table_is_charted_as_its_ratios(tmp_path, monkeypatch) -> None:
    """`bench peers` rows carry each server's value as text cells and a ratio per peer: the chart shows the
    ratios (one bar per metric and peer), not the text."""
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    rows = [{"metric": "cold TTFT ms", "better": "< 1 (lower TTFT)", "ratios": {"vllm": 0.4, "llama": 1.3}},
            {"metric": "1-stream decode tok/s", "better": "> 1 (more tokens/s)",
             "ratios": {"vllm": 0.7, "llama": None}}]
    drawn = []
    real = plot._bar_chart
    monkeypatch.setattr(plot, "_bar_chart", lambda plt, *a, **kw: drawn.append((a, kw)) or real(plt, *a, **kw))
    paths = plot.write_plots(Report("peers", "cmd", {}, tables=[Table("tierlm vs vllm vs llama", [], rows)]), tmp_path)
    assert len(paths) == 1 and paths[0].stat().st_size > 1000
    (_path, _title, labels, series, ylabel), kw = drawn[0]
    assert ylabel == "ratio" and kw == {"baseline": 1.0} and labels[0] == "cold TTFT ms (< 1 better)"
    assert series == [("ratio to llama", [1.3, 0.0]), ("ratio to vllm", [0.4, 0.7])]
