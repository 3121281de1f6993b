"""The L3 storage contract: a namespaced key -> page-bytes store that the HiCache manager backs up to and
prefetches from. The stores (stores/file/, stores/mooncake/) implement ``KVStorage`` and are chosen by name in
registry.py.

Rules every backend keeps: ``get`` (and ``get_into``) returns either the exact bytes that ``set`` stored for
that key in this namespace or None (never partial or foreign bytes); a damaged entry is a miss, counted in
``errors``; all methods are safe to call from several threads at once.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence, TypedDict, Union

from tierlm.runtime.cache.storage.page_keys import is_page_key

# One buffer of a page: a numpy array (rows of a host page), a memoryview, bytes or a bytearray. typing has no
# buffer type before Python 3.12 (collections.abc.Buffer), and numpy declares none for older Pythons: Any until then.
PageBuffer = Any

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
    "read_seconds",  # time spent in get()/get_into() calls that returned a page: bytes_read / this = read rate
)
# Parts of read_seconds a backend may also report (absent: 0), so a slow hit names its stage (hit_stages.py).
READ_PART_FIELDS = (
    "checksum_seconds",  # verifying pages (header and checksum)
    "copy_seconds",  # copying read bytes into the caller's buffers (a backend that cannot read into them)
)


class HealthState(TypedDict):
    """KVStorage.health() (and StorageIO.health()): "online" or "degraded", and the latest error."""
    state: str  # "online" | "degraded"
    last_error: str | None


class BorrowedPage:
    """A page to store that stays in the caller's memory (e.g. a host pool page): ``views`` are written in order
    without being joined or copied, and ``valid()`` (true while that memory still holds the page) is checked once
    they are written, before the entry is published; a False there drops the write. Before the caller reuses the
    memory of a write still pending it calls ``detach()``: the page is copied then (only then), and the write goes
    on from the copy. ``bytes(page)`` joins the views for backends that need one byte string."""

    __slots__ = ("views", "valid", "nbytes", "detached", "_lock")

    def __init__(self, views: Sequence[PageBuffer], valid: Callable[[], bool]) -> None:
        self.views = [memoryview(v).cast("B") for v in views]
        self.valid = valid
        self.nbytes = sum(v.nbytes for v in self.views)
        self.detached = False
        self._lock = threading.Lock()

    def detach(self) -> None:
        """Copy the page out of the caller's memory (which must still hold it); later writes use the copy."""
        with self._lock:
            if not self.detached:
                self.views = [memoryview(b"".join(self.views))]
                self.valid = _always
                self.detached = True

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.views)


def _always() -> bool:
    return True


# A page to store (KVStorage.set): one buffer, a list or tuple of buffers whose concatenation is the page, or a
# BorrowedPage.
PagePayload = Union[bytes, bytearray, memoryview, BorrowedPage, Sequence[PageBuffer]]


def byte_views(payload: PagePayload) -> list[memoryview]:
    """A page as flat byte views: a BorrowedPage's, one buffer, or a list/tuple of buffers whose concatenation is
    the page."""
    if isinstance(payload, BorrowedPage):
        return list(payload.views)
    parts = payload if isinstance(payload, (list, tuple)) else (payload,)
    return [memoryview(p).cast("B") for p in parts]


def page_to_store(key: str, payload: PagePayload, page_bytes: int
                  ) -> tuple[Callable[[], bool] | None, list[memoryview]]:
    """What every store's set() writes: the page's byte views, checked to be ``page_bytes`` long, and a
    BorrowedPage's ``valid`` (None for a page the caller owns), to ask once the bytes are written."""
    valid = payload.valid if isinstance(payload, BorrowedPage) else None
    views = byte_views(payload)
    nbytes = sum(v.nbytes for v in views)
    if nbytes != page_bytes:
        raise ValueError(f"payload for {key[:12]}.. has {nbytes} bytes, this storage stores {page_bytes}")
    return valid, views


def check_page_key(key: str) -> None:
    """Every backend's keys come from page_keys(); anything else is a caller's bug."""
    if not is_page_key(key):
        raise ValueError(f"storage keys come from page_keys() (64 lowercase hex), got {key!r}")


class KVStorage(ABC):
    """A namespaced store of KV pages, each page an opaque byte string of a fixed size. Only what the runtime
    calls is listed here (the HiCache manager, its prefetch, state tiers and StorageIO's threads)."""

    # The backend's name as /server_info and the startup log show it ("file", "mooncake", ...).
    name: str = ""
    # Where the pages live, for logs and /server_info: a folder, or a URL such as mooncake://master/namespace.
    location: str = ""
    # How long a request whose pages this server's index does not know waits for the probe of the first one (one
    # stat, or one round trip, when nothing is there); once that page is found it waits for the rest as for known
    # pages (storage_prefetch.py). A networked store's round trip is slower, and slower still on a loaded machine.
    probe_wait_s: float = 0.05
    # Pages a prefetch asks for in one call. A networked store answers many keys per round trip (Mooncake: one
    # metadata RPC and parallel transfers), so reading them one by one would pay the round trip per page.
    read_batch_pages: int = 1
    # Other servers write the same pages (a shared store): a key this server's index does not know is likely there,
    # so a prefetch reserves a host page for it as for a known one and reads it straight into that page.
    shared: bool = False

    @abstractmethod
    def known(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is (believed to be) stored, from what this object already knows, without I/O: the
        scheduler thread asks this, and must never wait on a disk. A True may still miss on get() (evicted
        meanwhile); a False may be stored by another process (probe() finds it)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The payload stored under key, verified; None on a miss or a damaged entry."""

    def probe(self, key: str) -> bytes | None:
        """get() for a key this object does not know of (another process may have stored it): an absent entry
        is an expected answer, not a miss."""
        return self.get(key)

    def get_into(self, key: str, out: Sequence[PageBuffer], *, probe: bool = False) -> bool:
        """Read the page stored under key straight into ``out``: writable buffers (e.g. the rows of a host page)
        that together take the payload in order. True when it was read and verified; False on a miss, and then
        ``out`` may hold anything. ``probe``: as probe() (an absent entry is not a miss). Backends that can read
        into memory (the file backend: one preadv a page) override this copy of get()'s bytes."""
        page = self.probe(key) if probe else self.get(key)
        if page is None:
            return False
        copy_into(page, out)
        return True

    def batch_read(self, keys: Sequence[str], *, probe: bool = False) -> list[bytes | None]:
        """get() (or probe()) for consecutive keys, stopping at the first one not read (it and the rest are
        None). Networked stores answer the batch in one round trip."""
        read = self.probe if probe else self.get
        got: list[bytes] = []
        for key in keys:
            page = read(key)
            if page is None:
                break
            got.append(page)
        return got + [None] * (len(keys) - len(got))

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[Sequence[PageBuffer]], *, probe: bool = False
                       ) -> list[bool]:
        """get_into() for consecutive keys, stopping at the first one not read (it and the rest are False)."""
        got: list[bool] = []
        for key, out in zip(keys, outs):
            if not self.get_into(key, out, probe=probe):
                break
            got.append(True)
        return got + [False] * (len(keys) - len(got))

    def register_host_memory(self, buf: PageBuffer) -> None:
        """Pages will be read into and written from ``buf`` (the host pool's array, alive while this storage is):
        a backend that moves pages through registered memory (Mooncake) registers it; the others need nothing."""

    @abstractmethod
    def set(self, key: str, payload: PagePayload) -> bool:
        """Store payload under key (a no-op returning True when it is already stored). False when not stored.
        ``payload`` may also be a list of buffers whose concatenation is the page (e.g. one per layer of a host
        page), or a BorrowedPage: backends write them without joining them first; a BorrowedPage whose memory
        was reused meanwhile (``valid()`` False after the write) is not stored and set() returns False."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every entry of this namespace; returns how many were removed."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """A snapshot with at least the STAT_FIELDS keys."""

    def health(self) -> HealthState:
        """{"state": "online" | "degraded", "last_error": str | None}; degraded while writes fail."""
        return {"state": "online", "last_error": None}

    @abstractmethod
    def close(self) -> None:
        """Release resources; idempotent. Later calls other than stats() raise RuntimeError."""

    def __enter__(self) -> "KVStorage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def copy_into(page: bytes | memoryview, out: Sequence[PageBuffer]) -> None:
    """The bytes of ``page`` spread over the writable buffers ``out``, in order (their sizes must add up)."""
    src = memoryview(page).cast("B")
    total = sum(memoryview(b).nbytes for b in out)
    if total != src.nbytes:
        raise ValueError(f"get_into got buffers of {total} bytes for a {src.nbytes}-byte page")
    pos = 0
    for b in out:
        view = memoryview(b).cast("B")
        view[:] = src[pos:pos + view.nbytes]
        pos += view.nbytes
