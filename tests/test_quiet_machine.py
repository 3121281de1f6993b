"""server/commands/bench/quiet_machine.py: the machine's busy cores from /proc/stat, and the wait before a server's
round in `tierlm bench peers` (until the other servers' leftover work is done, or a limit)."""
from __future__ import annotations

import asyncio

import pytest

from tierlm.server.commands.bench import quiet_machine as qm

STAT = "cpu  100 5 50 800 20 3 2 0 0 0\ncpu0 50 2 25 400 10 1 1 0 0 0\nintr 12345\n"


def test_busy_and_total_ticks_come_from_the_first_line(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert qm.cpu_jiffies(str(stat)) == (100 + 5 + 50 + 3 + 2, 980)  # idle and iowait are not busy
    assert qm.cpu_jiffies(str(tmp_path / "absent")) is None  # macOS: no /proc/stat
    stat.write_text("intr 1\n")
    assert qm.cpu_jiffies(str(stat)) is None


def test_busy_cores_is_the_busy_share_times_the_cores():
    assert qm.busy_cores((100, 1000), (150, 1100), cores=2) == pytest.approx(1.0)  # half of 2 cores
    assert qm.busy_cores((100, 1000), (100, 1000), cores=2) == 0.0  # no time passed


def _reader(busy_per_window: list[float], cores: int = 2):
    """A /proc/stat stand-in: each call advances 100 ticks, ``busy`` cores' worth of them busy."""
    state = {"busy": 0, "total": 0, "i": 0}

    def read():
        if state["i"] > 0:
            b = busy_per_window[min(state["i"] - 1, len(busy_per_window) - 1)]
            state["busy"] += round(100 * b / cores)
            state["total"] += 100
        state["i"] += 1
        return state["busy"], state["total"]
    return read


def test_waits_until_a_window_is_quiet():
    q = asyncio.run(qm.wait_until_quiet(min_s=0.01, max_s=5, below_cores=0.1, window_s=0.01,
                                        read=_reader([1.0, 1.0, 0.5, 0.02]), cores=2))
    assert q.quiet and q.busy_cores == pytest.approx(0.02) and q.waited_s < 5


def test_a_machine_that_stays_busy_is_reported_after_the_limit():
    q = asyncio.run(qm.wait_until_quiet(min_s=0.01, max_s=0.1, below_cores=0.1, window_s=0.01,
                                        read=_reader([0.8]), cores=2))
    assert not q.quiet and q.busy_cores == pytest.approx(0.8) and q.waited_s >= 0.1
    assert q.to_dict() == {"waited_s": round(q.waited_s, 2), "busy_cores": 0.8, "quiet": False}


def test_without_proc_stat_only_the_minimum_wait():
    q = asyncio.run(qm.wait_until_quiet(min_s=0.05, max_s=5, read=lambda: None))
    assert q.quiet and q.busy_cores is None and 0.05 <= q.waited_s < 1
