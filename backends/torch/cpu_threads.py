"""How many threads torch's CPU kernels use when the user did not say (OMP_NUM_THREADS).

torch's own default is one OpenMP thread per core. OpenMP threads wait for each other at every kernel's barrier,
so when any core is busy with something else (the server's HTTP and scheduler threads, the tokenizer, another
process) the whole team waits for the slowest thread: on a 2-core machine with the other core loaded, 2 threads
ran a bf16 decode step 5x and a 512-token prefill 3x slower than 1 thread (issue #18). One core is
therefore left to the rest of the server, as vLLM CPU reserves one for its frontend.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

import torch

log = logging.getLogger(__name__)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's cpuset), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


def cpu_thread_count(env: Mapping[str, str], cores: int) -> tuple[int | None, str]:
    """(threads to set, why); None when OMP_NUM_THREADS is set (torch already follows it)."""
    explicit = str(env.get("OMP_NUM_THREADS", "")).strip()
    if explicit:
        return None, f"OMP_NUM_THREADS={explicit}"
    n = max(1, cores - 1)
    return n, (f"{cores} usable cores, one left to the server's own threads (OpenMP teams collapse on a busy core); "
               "set OMP_NUM_THREADS to choose")


def configure_cpu_threads(env: Mapping[str, str] | None = None) -> int:
    """Apply the default (logged with its reason); returns the thread count torch now uses."""
    n, why = cpu_thread_count(os.environ if env is None else env, usable_cores())
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    log.info("CPU threads: %d (%s)", torch.get_num_threads(), why)
    return torch.get_num_threads()
