"""The L3 storage contract: a namespaced key -> page-bytes store that a HiCache controller can back up to and
prefetch from. Backends (file today; a remote store such as mooncake later) implement ``KVStorage``.

Rules every backend keeps: ``get`` returns either the exact bytes that ``set`` stored for that key in this
namespace or None (never partial or foreign bytes); a damaged entry is a miss, counted in ``errors``; all
methods are safe to call from several threads at once.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

# Keys of stats(): counts since this object was created, except files/bytes (current content it knows of).
STAT_FIELDS = (
    "files",  # entries currently stored in this namespace
    "bytes",  # bytes they occupy (headers included)
    "reads",  # get() calls that returned a payload
    "writes",  # set() calls that stored a new entry
    "bytes_read",  # payload bytes returned by get()
    "bytes_written",  # bytes written for new entries (headers included)
    "misses",  # get() calls that returned None (absent, or damaged)
    "errors",  # damaged entries found (bad header, checksum, truncated) and failed I/O
    "evictions",  # entries removed to keep within the size bound
)


class KVStorage(ABC):
    """A namespaced store of KV pages, each page an opaque byte string of a fixed size."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is (believed to be) stored. A True may still miss on get() (evicted meanwhile)."""

    def batch_exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored: the number of pages a prefetch can hope to load."""
        n = 0
        for hit in self.exists(keys):
            if not hit:
                break
            n += 1
        return n

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The payload stored under key, verified; None on a miss or a damaged entry."""

    def known(self, keys: Sequence[str]) -> list[bool]:
        """Like exists(), but from what this object already knows, without I/O: the scheduler thread asks this,
        and must never wait on a disk. Backends with no in-memory index answer with exists()."""
        return self.exists(keys)

    def probe(self, key: str) -> bytes | None:
        """get() for a key this object does not know of (another process may have stored it): an absent entry
        is an expected answer, not a miss."""
        return self.get(key)

    @abstractmethod
    def set(self, key: str, payload: bytes | bytearray | memoryview) -> bool:
        """Store payload under key (a no-op returning True when it is already stored). False when not stored."""

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def batch_set(self, keys: Sequence[str], payloads: Sequence[bytes | bytearray | memoryview]) -> list[bool]:
        if len(keys) != len(payloads):
            raise ValueError(f"batch_set got {len(keys)} keys but {len(payloads)} payloads")
        return [self.set(k, p) for k, p in zip(keys, payloads)]

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove key; True when something was removed."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every entry of this namespace; returns how many were removed."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """A snapshot with at least the STAT_FIELDS keys."""

    def health(self) -> dict[str, Any]:
        """{"state": "online" | "degraded", "last_error": str | None}; degraded while writes fail."""
        return {"state": "online", "last_error": None}

    @abstractmethod
    def close(self) -> None:
        """Release resources; idempotent. Later calls other than stats() raise RuntimeError."""

    def __enter__(self) -> "KVStorage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
