"""How many threads a CPU backend computes with when the user did not say (OMP_NUM_THREADS): the decision, from
the machine's facts, so that the torch backend and the benchmarks (which size a memory-bandwidth bound by it)
take the same one. Why one core is left over: backends/torch/cpu/threads.py."""
from __future__ import annotations

import os
from typing import Mapping

from tierlm.platforms.cpu_features import CpuFeatures, this_cpu


def usable_cores(cpu: CpuFeatures | None = None, logical: int | None = None,
                 total: int | None = None) -> tuple[int, str]:
    """(physical cores this process may run on, how counted): its affinity mask (a container's cpuset), else
    os.cpu_count(), divided by the hardware threads per core where cpuinfo shows SMT."""
    if logical is None:
        try:
            logical = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # macOS and Windows have no affinity masks
            logical = os.cpu_count() or 1
    total = total or os.cpu_count() or logical
    physical = (cpu or this_cpu()).physical_cores
    if physical and physical < total:
        per_core = total // physical
        cores = max(1, logical // per_core)
        return cores, f"{logical} usable CPUs = {cores} cores x {per_core} hardware threads"
    return logical, f"{logical} usable cores"


def cpu_thread_count(env: Mapping[str, str], cores: int, counted: str = "") -> tuple[int | None, str]:
    """(threads to set, why); None when OMP_NUM_THREADS is set (torch already follows it)."""
    explicit = str(env.get("OMP_NUM_THREADS", "")).strip()
    if explicit:
        return None, f"OMP_NUM_THREADS={explicit}"
    n = max(1, cores - 1)
    return n, (f"{counted or f'{cores} usable cores'}, one left to the server's own threads (OpenMP teams collapse "
               "on a busy core); set OMP_NUM_THREADS to choose")
