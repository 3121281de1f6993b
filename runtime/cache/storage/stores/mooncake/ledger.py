"""What one Mooncake store knows and counts: the keys it believes stored (``known()`` answers from them, as it
must not touch the network), bounded to the most recently used, and its counters and read times for stats()."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

MAX_KNOWN_KEYS = 1 << 20  # keys remembered as stored
COUNTS = ("reads", "writes", "bytes_read", "bytes_written", "misses", "errors", "evictions",
          "zero_copy_reads", "zero_copy_writes", "shm_reads", "shm_writes")


class Ledger:
    """The known keys (least recently used first) and the counters, under one lock."""

    def __init__(self, max_known: int = MAX_KNOWN_KEYS) -> None:
        self._lock = threading.Lock()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._max_known = max_known
        self._counts = dict.fromkeys(COUNTS, 0)
        self._read_ns = 0
        self._checksum_ns = 0  # parts of _read_ns: verifying pages, copying them into the caller's buffers
        self._copy_ns = 0

    # --- the known keys ---
    def known(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._known for key in keys]

    def used(self, key: str) -> bool:
        """Whether ``key`` is known (then it is the most recently used)."""
        with self._lock:
            if key in self._known:
                self._known.move_to_end(key)
                return True
            return False

    def remember(self, key: str) -> None:
        with self._lock:
            self._remember_locked(key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._known.pop(key, None)

    def forget_all(self) -> None:
        with self._lock:
            self._known.clear()

    def found(self, keys: Sequence[str], hits: Sequence[bool]) -> None:
        """What the store answered for ``keys``: each remembered (hit) or forgotten."""
        with self._lock:
            for key, hit in zip(keys, hits):
                if hit:
                    self._remember_locked(key)
                else:
                    self._known.pop(key, None)

    def _remember_locked(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self._max_known:
            self._known.popitem(last=False)

    # --- the counters ---
    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d

    def absent(self, key: str, miss: bool) -> None:
        """``key`` was not there: forgotten, and a miss when ``miss``."""
        with self._lock:
            self._known.pop(key, None)
            self._counts["misses"] += int(miss)

    def unusable(self, key: str) -> None:
        """The value of ``key`` was damaged or foreign (removed): an error and a miss."""
        with self._lock:
            self._known.pop(key, None)
            self._counts["errors"] += 1
            self._counts["misses"] += 1

    def read(self, key: str, nbytes: int, read_ns: int, checksum_ns: int, path: str | None) -> None:
        """A verified page of ``nbytes`` read (and counted under ``path`` too, when given)."""
        with self._lock:
            self._remember_locked(key)
            self._counts["reads"] += 1
            if path is not None:
                self._counts[path] += 1
            self._counts["bytes_read"] += nbytes
            self._read_ns += read_ns + checksum_ns
            self._checksum_ns += checksum_ns

    def wrote(self, key: str, nbytes: int) -> None:
        with self._lock:
            self._remember_locked(key)
            self._counts["writes"] += 1
            self._counts["bytes_written"] += nbytes

    def copied(self, copy_ns: int) -> None:
        """Time copying a read page into the caller's buffers: copy time, and read time (the read is not done until
        it lands)."""
        with self._lock:
            self._copy_ns += copy_ns
            self._read_ns += copy_ns

    def snapshot(self, value_bytes: int, errors: int) -> dict[str, Any]:
        """stats()'s counts: ``value_bytes`` per known key, ``errors`` more errors (failed calls, counted by
        Health)."""
        with self._lock:
            out: dict[str, Any] = {"files": len(self._known), "bytes": len(self._known) * value_bytes}
            out.update(self._counts)
            out["errors"] += errors
            out["read_seconds"] = self._read_ns / 1e9
            out["checksum_seconds"] = self._checksum_ns / 1e9
            out["copy_seconds"] = self._copy_ns / 1e9
        return out
