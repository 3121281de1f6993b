"""How many threads torch's CPU kernels use when the user did not say (OMP_NUM_THREADS).

torch's own default is one OpenMP thread per core. OpenMP threads wait for each other at every kernel's barrier,
so when any core is busy with something else (the server's HTTP and scheduler threads, the tokenizer, another
process) the whole team waits for the slowest thread: on a 2-core machine with the other core loaded, 2 threads
ran a bf16 decode step 5x and a 512-token prefill 3x slower than 1 thread (issue #18). One core is
therefore left to the rest of the server, as vLLM CPU reserves one for its frontend. SMT siblings count as one
core (platforms/cpu_features.py reads the core ids): two threads on one core share its vector units and memory
port, so a second one adds a barrier wait, not bandwidth.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

import torch

from tierlm.platforms.thread_count import cpu_thread_count, usable_cores

log = logging.getLogger(__name__)


def configure_cpu_threads(env: Mapping[str, str] | None = None) -> int:
    """Apply the default (logged with its reason); returns the thread count torch now uses."""
    cores, counted = usable_cores()
    n, why = cpu_thread_count(os.environ if env is None else env, cores, counted)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    log.info("CPU threads: %d (%s)", torch.get_num_threads(), why)
    return torch.get_num_threads()


_helper_pool: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def helper_threads(n: int) -> ThreadPoolExecutor:
    """At least ``n`` Python threads that run slices of a C kernel (ctypes releases the GIL during the call) while
    the caller runs one slice itself: how the C kernels scale with torch's intra-op threads (one pool for all)."""
    global _helper_pool
    with _helper_lock:
        if _helper_pool is None or _helper_pool._max_workers < n:
            _helper_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="tierlm-cpu-kernel")
        return _helper_pool


def column_threads(weights: int, min_weights_per_thread: int) -> int:
    """Threads for a product of ``weights`` weights: torch's intra-op count, but at least ``min_weights_per_thread``
    each (a hand-off costs ~30 us)."""
    return max(1, min(torch.get_num_threads(), weights // min_weights_per_thread))


def split_columns(call, N: int, threads: int) -> None:
    """``call(n0, n1)`` over N output columns: whole on the calling thread when ``threads`` is 1, else in slices of
    whole 4-column tiles between ``threads`` threads, the caller running the first (int8_gemv.py,
    f32_gemv.py)."""
    if threads == 1:
        call(0, N)
        return
    cuts = [min(N, (N * t // threads + 3) // 4 * 4) for t in range(threads)] + [N]
    futures = [helper_threads(threads - 1).submit(call, cuts[t], cuts[t + 1]) for t in range(1, threads)]
    call(cuts[0], cuts[1])
    for f in futures:
        f.result()
