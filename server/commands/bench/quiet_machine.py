"""Waiting for a quiet machine before a server's measurements, in side-by-side runs.

Why: a server keeps the CPU busy for a while after its last answer. vLLM's workers busy-poll their message queue
for 1 s after each read (``SpinCondition``, sched_yield in a loop), and its first rounds after a start ran other
work at 10-20 % of a core for tens of seconds. On a 2-core machine that is half of the core the next server
computes on: measured on the AMD EPYC VM, tierlm's 1-stream decode read 175-181 tok/s right after vLLM's rounds and
223-232 tok/s right after another tierlm's, whose idle costs ~0.

How: at least ``min_s``, then 0.25 s windows of the machine's busy time from /proc/stat until a window is below
``below_cores`` cores (every process: the bench itself sleeps meanwhile), or ``max_s`` has passed; where
/proc/stat is absent (macOS) only the minimum wait. The wait is reported, so a round that began on a busy machine
is visible in the report instead of hidden in a median.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Callable

PROC_STAT = "/proc/stat"
MIN_WAIT_S = 1.5  # longer than vLLM's 1 s busy-poll after its last read
MAX_WAIT_S = 20.0
QUIET_BELOW_CORES = 0.1
WINDOW_S = 0.25


@dataclass(frozen=True)
class QuietWait:
    waited_s: float
    busy_cores: float | None  # over the last window; None where the machine's busy time cannot be read
    quiet: bool  # the last window was below the threshold (True where it cannot be read)

    def to_dict(self) -> dict[str, float | bool | None]:
        return {"waited_s": round(self.waited_s, 2),
                "busy_cores": None if self.busy_cores is None else round(self.busy_cores, 3), "quiet": self.quiet}


def cpu_jiffies(path: str = PROC_STAT) -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot from /proc/stat's first line; None where it is absent."""
    try:
        with open(path, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks)


def busy_cores(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """Cores busy on average between two cpu_jiffies readings."""
    total = after[1] - before[1]
    return 0.0 if total <= 0 else (after[0] - before[0]) / total * cores


async def wait_until_quiet(min_s: float = MIN_WAIT_S, max_s: float = MAX_WAIT_S,
                           below_cores: float = QUIET_BELOW_CORES, window_s: float = WINDOW_S,
                           read: Callable[[], tuple[int, int] | None] = cpu_jiffies,
                           cores: int | None = None) -> QuietWait:
    """Sleep ``min_s``, then until a ``window_s`` window of the machine is below ``below_cores`` busy cores or
    ``max_s`` has passed in all (module docstring)."""
    cores = cores or os.cpu_count() or 1
    t0 = time.monotonic()
    await asyncio.sleep(min_s)
    prev = read()
    if prev is None:
        return QuietWait(time.monotonic() - t0, None, True)
    while True:
        await asyncio.sleep(window_s)
        cur = read()
        if cur is None:
            return QuietWait(time.monotonic() - t0, None, True)
        busy = busy_cores(prev, cur, cores)
        prev = cur
        waited = time.monotonic() - t0
        if busy < below_cores or waited >= max_s:
            return QuietWait(waited, busy, busy < below_cores)
