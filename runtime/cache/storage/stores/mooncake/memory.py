"""Host memory registered with a Mooncake client, so pages move between the store and the host (L2) pool with
no intermediate bytes: ``batch_get_into_multi_buffers`` lands each stored value (128-byte header, then payload)
in a header slot of a small registered area and in the rows of the host page reserved for it, and
``batch_put_from_multi_buffers`` writes a page from those rows. The value format is unchanged (page_header.py),
so servers on either path share pages.

A transport that needs registered memory (RDMA) refuses unregistered buffers; over TCP registering is cheap. If
the client refuses a registration, the backend keeps its copying path (get_batch, then one copy into the host
page) and says why in ``read_path`` (tiers.storage in /server_info).
"""
from __future__ import annotations

import bisect
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from tierlm.runtime.cache.storage.base import PageBuffer
from tierlm.runtime.cache.storage.page_header import HEADER_SIZE
from tierlm.runtime.cache.storage.stores.mooncake.client import MooncakeClient

# Header slots: one per storage call in flight (prefetch threads, backup threads and the few a watchdog may
# abandon), each big enough for one batch. A call that finds none free takes the copying path.
HEADER_SLOTS = 24
ZERO_COPY = "zero-copy"
# A header slot: its bytes and their address.
HeaderSlot = tuple[npt.NDArray[np.uint8], int]


def address_of(buf: PageBuffer) -> tuple[int, int]:
    """(address, size) of a C-contiguous buffer (a numpy array, a memoryview of one, a bytearray)."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("registered memory must be one contiguous block")
    return int(arr.ctypes.data), int(arr.nbytes)


class RegisteredMemory:
    """The host memory one Mooncake client may read into and write from: the header area (owned here) and the
    regions the runtime hands over (the host pool), registered with each client once it is connected."""

    def __init__(self, batch_pages: int, slots: int = HEADER_SLOTS) -> None:
        self.slot_bytes = HEADER_SIZE * max(1, batch_pages)
        self._headers = np.zeros(slots * self.slot_bytes, np.uint8)
        self._free_slots = list(range(slots))
        self._regions: list[tuple[int, int, PageBuffer]] = [(*address_of(self._headers), self._headers)]  # sorted
        self._registered: set[int] = set()  # addresses registered with the current client
        self._client: MooncakeClient | None = None
        self._refused: str | None = None
        self._lock = threading.Lock()

    # --- registration (startup, and each (re)connect of the client) ---
    def add(self, buf: PageBuffer) -> None:
        """Register ``buf`` too (kept alive here): pages are read into and written from it."""
        addr, size = address_of(buf)
        with self._lock:
            if any(a == addr for a, _, _ in self._regions):
                return
            # a new sorted list, not an insert: addresses() reads the list it got without the lock
            self._regions = sorted([*self._regions, (addr, size, buf)], key=lambda r: r[0])

    def register(self, client: MooncakeClient) -> None:
        """Register every region not yet registered with ``client`` (a new client starts afresh)."""
        with self._lock:
            if client is not self._client:
                self._client, self._registered, self._refused = client, set(), None
            for addr, size, _ in self._regions:
                if addr in self._registered or self._refused is not None:
                    continue
                try:
                    rc: int | str = client.register_buffer(addr, size)
                except Exception as e:  # noqa: BLE001 - the client raises RuntimeError and friends
                    rc = f"{type(e).__name__}: {e}"
                if rc == 0:
                    self._registered.add(addr)
                else:
                    self._refused = f"register_buffer of {size} bytes returned {rc}"

    def ready(self, client: MooncakeClient | None) -> bool:
        """Whether reads and writes through ``client`` may use registered memory: every region registered."""
        with self._lock:
            return (client is not None and client is self._client and self._refused is None
                    and len(self._registered) == len(self._regions) > 1)

    def path(self, client: MooncakeClient | None) -> str:
        """``read_path`` for /server_info: "zero-copy", or "copy (why)"."""
        if self.ready(client):
            return ZERO_COPY
        with self._lock:
            why = (self._refused if self._client is client and self._refused
                   else "no host pool registered" if len(self._regions) == 1
                   else "the store is not connected")
        return f"copy ({why})"

    # --- per call ---
    def addresses(self, views: Sequence[PageBuffer]) -> list[int] | None:
        """The addresses of ``views`` when each lies inside a registered region, else None (copy instead)."""
        out = []
        with self._lock:
            regions = self._regions
        starts = [r[0] for r in regions]
        for v in views:
            addr, size = address_of(v)
            i = bisect.bisect_right(starts, addr) - 1
            if i < 0 or addr + size > regions[i][0] + regions[i][1]:
                return None
            out.append(addr)
        return out

    @contextmanager
    def header_slot(self) -> Iterator[HeaderSlot | None]:
        """A free header slot (its bytes and address) for one call, or None when all are in use."""
        with self._lock:
            slot = self._free_slots.pop() if self._free_slots else None
        if slot is None:
            yield None
            return
        try:
            start = slot * self.slot_bytes
            yield self._headers[start:start + self.slot_bytes], int(self._headers.ctypes.data) + start
        finally:
            with self._lock:
                self._free_slots.append(slot)
