"""Where the time of cache hits goes, summed over requests since startup: the stages between a request's arrival
and its first token, so a slow hit (an L3 hit on some machine) names its stage. `tierlm bench prefix` prints the
difference of two snapshots around one request per tier row; /server_info (tiers.stages) and /metrics show them.

  scheduler_wait   arrival at the scheduler to the end of admission, less the copies timed below (the L3 read
                   of a waiting request runs inside it, also where admission copies pages while the rest arrive)
  storage_read     inside L3 reads: open, read, close (the storage's read_seconds less the two parts below)
  checksum         inside L3 reads: verifying each page's header and checksum
  host_copy        copying read bytes into host pages (pages a store could not read straight into them)
  host_to_device   copying host (L2) pages, read from L3 or kept there, into device (L1) pages at admission
  forward          admission to the first token: the prefill forward of what was not cached (the suffix of a hit)
"""
from __future__ import annotations

import threading
import time
from typing import Any, Mapping

STAGES = ("scheduler_wait", "storage_read", "checksum", "host_copy", "host_to_device", "forward")
# Timed by the cache manager itself (the storage stages come from the store's own stats, read_part_seconds).
OWN_STAGES = ("scheduler_wait", "host_copy", "host_to_device", "forward")


class HitStages:
    """Seconds per stage (OWN_STAGES), added on the scheduler thread, read from any thread."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(OWN_STAGES, 0.0)
        self._lock = threading.Lock()
        self._admitted: dict[int, float] = {}  # id(req) -> perf_counter at the end of its first admission

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] += seconds

    def copies(self) -> float:
        """Seconds of copies so far (host_copy + host_to_device): admission subtracts its own from its wait."""
        with self._lock:
            return self._seconds["host_copy"] + self._seconds["host_to_device"]

    def admitted(self, req: object, arrival: float, copies_before: float) -> None:
        """A request's first admission ends now; it arrived at ``arrival`` (perf_counter) and the copies made
        during its admission are the ones past ``copies_before`` (copies())."""
        now = time.perf_counter()
        self.add("scheduler_wait", max(0.0, now - arrival - (self.copies() - copies_before)))
        self._admitted[id(req)] = now

    def released(self, req: object, first_token_time: float | None) -> None:
        """The request leaves: its forward ran from admission to its first token (when it got one)."""
        at = self._admitted.pop(id(req), None)
        if at is not None and first_token_time is not None:
            self.add("forward", max(0.0, first_token_time - at))

    def snapshot(self, storage_stats: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Seconds per stage (STAGES); the storage stages from ``storage_stats`` (a KVStorage.stats())."""
        with self._lock:
            out = dict(self._seconds)
        st = storage_stats or {}
        checksum, copy = float(st.get("checksum_seconds", 0.0)), float(st.get("copy_seconds", 0.0))
        out["storage_read"] = max(0.0, float(st.get("read_seconds", 0.0)) - checksum - copy)
        out["checksum"] = checksum
        out["host_copy"] += copy
        return {stage: out[stage] for stage in STAGES}
