"""The same-host path to Mooncake Store: a ``mooncake_client`` on this host (Mooncake's standalone "real client",
which owns the segment and talks to the master) serves this server as a "dummy client". The dummy hands the real
client shared memory (memfd, over a Unix socket), so a page stored in that real client's segment reaches this
process with memory copies inside the host instead of loopback TCP (here 16 MiB reach the host pages in ~4 ms,
against ~25 ms over loopback TCP).

A dummy can only register memory it allocated from its own shared pool, not the host (L2) pool, so pages pass
through staging areas allocated there: a batch read lands the values (header + payload) in a staging area, they
are verified there and copied once into the host pages; a backup copies header + page into one and stores it from
there. Staging areas are allocated on first use, at most ``max_slots`` of them; a call that finds none free takes
the copying path (get_batch / put_parts, also through the real client).

``same_host`` decides whether the shm path can work at all: the dummy finds the real client by an abstract Unix
socket named after its port, which only exists on the real client's host.
"""
from __future__ import annotations

import ctypes
import ipaddress
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import numpy.typing as npt

from tierlm.runtime.cache.storage.stores.mooncake.client import MooncakeClient

SHM_SLOTS = 4  # staging areas: the prefetch thread, the backup thread, and a call or two the watchdog abandoned
SHM_SLOT_BYTES = 32 * 2**20  # one area holds a read batch of up to this many bytes of values
SHM = "shm"
# A staging area: its bytes and their address.
StagingArea = tuple[npt.NDArray[np.uint8], int]


def same_host(address: str) -> bool | str:
    """True when ``address`` ("host:port") names this machine (a loopback address, or one this machine's sockets
    can bind to), else why not."""
    host = address.rpartition(":")[0].strip("[]")
    if not host:
        return f"{address!r} is not host:port"
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as e:
        return f"cannot resolve {host!r} ({e})"
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))  # only an address of one of this machine's interfaces binds
            return True
        except OSError:
            continue
    return f"{host} is not an address of this machine"


class ShmStaging:
    """Staging areas in one dummy client's shared memory, each ``slot_pages`` values of ``value_bytes``."""

    def __init__(self, value_bytes: int, max_pages: int, max_slots: int = SHM_SLOTS,
                 slot_bytes: int = SHM_SLOT_BYTES) -> None:
        self.value_bytes = value_bytes
        self.slot_pages = max(1, min(max_pages, slot_bytes // value_bytes))
        self.max_slots = max_slots
        self._client: MooncakeClient | None = None
        self._free: list[StagingArea] = []
        self._made = 0
        self._limit = max_slots  # areas this client may have: lowered to what it gave when it refuses one
        self._busy: dict[int, int] = {}  # areas in use, by id() of the client they belong to
        self._refused: str | None = None
        self._cond = threading.Condition()

    def attach(self, client: MooncakeClient) -> None:
        """Stage through ``client`` (a dummy whose setup succeeded) from now on; its areas are allocated on use. The
        areas of the client before are dropped as they are handed back."""
        with self._cond:
            self._client, self._free, self._made, self._refused = client, [], 0, None
            self._limit = self.max_slots

    @property
    def refused(self) -> str | None:
        """Why the client gave no staging area (then calls copy), or None."""
        return self._refused

    @contextmanager
    def slot(self, client: MooncakeClient) -> Iterator[StagingArea | None]:
        """A free staging area of ``client`` (its bytes and address), or None: none free, none allocatable."""
        area = self._take(client)
        try:
            yield area
        finally:
            if area is not None:
                with self._cond:
                    self._release_locked(client)
                    if client is self._client:
                        self._free.append(area)

    def wait_idle(self, timeout: float, client: MooncakeClient | None = None) -> bool:
        """Whether every area (of ``client``, else of any) was handed back within ``timeout`` s: the client may
        then free their memory."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy.get(id(client), 0) if client is not None else any(self._busy.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _take(self, client: MooncakeClient) -> StagingArea | None:
        with self._cond:
            if client is None or client is not self._client or self._refused is not None:
                return None
            if not self._free and self._made >= self._limit:
                return None
            self._busy[id(client)] = self._busy.get(id(client), 0) + 1
            if self._free:
                return self._free.pop()
            self._made += 1  # reserved before allocating outside the lock
        area = self._allocate(client)
        if area is None:
            with self._cond:
                self._release_locked(client)
        return area

    def _release_locked(self, client: MooncakeClient) -> None:
        left = self._busy.pop(id(client)) - 1
        if left:
            self._busy[id(client)] = left
        self._cond.notify_all()

    def _allocate(self, client: MooncakeClient) -> StagingArea | None:
        size = self.slot_pages * self.value_bytes
        try:
            ptr = int(client.alloc_from_mem_pool(size))
            rc = client.register_buffer(ptr, size) if ptr else "no memory"
        except Exception as e:  # noqa: BLE001 - the client raises RuntimeError and friends
            ptr, rc = 0, f"{type(e).__name__}: {e}"
        if not ptr or rc != 0:
            with self._cond:  # the areas it gave stay in use; with none, every call takes the copying path
                if client is not self._client:  # attached to another client meanwhile: its counts are not ours
                    return None
                self._made -= 1
                self._limit = self._made
                if self._made == 0:
                    self._refused = f"a {size}-byte staging area in shared memory was refused ({rc})"
            return None
        # The memory belongs to the client (freed when it closes): the storage waits for wait_idle() first.
        return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr)), ptr
