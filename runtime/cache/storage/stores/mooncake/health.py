"""The Mooncake store's health: whether calls reach the store, and the watch that brings the tier back.

A failed call (master gone while serving) is counted, marks the tier degraded and returns a miss / an unstored
page; a call to a dead master takes seconds to fail, so after a failure only one call per ``retry_interval_s``
tries the store (``may_try``), the others are answered at once. The first call that succeeds again, or the health
watch (one probe per ``retry_interval_s`` while degraded), brings the tier back and forgets which pages it had
stored (``on_recover``: a restarted master has lost them all, backups write them again).

A dummy client (the same-host path, shm.py) never re-attaches to a mooncake_client that restarted, so after
``REATTACH_AFTER_PROBES`` failed probes the watch asks for a fresh one (``Watched.reattach``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol, TypeVar

from tierlm.runtime.cache.storage.base import HealthState
from tierlm.runtime.cache.storage.stores.mooncake.client import MooncakeClient

logger = logging.getLogger(__name__)

REATTACH_AFTER_PROBES = 3  # failed health probes of a dummy client before a fresh one is tried

T = TypeVar("T")


class Health:
    """The degraded state of one Mooncake store, its retry slot and its count of failed calls."""

    def __init__(self, retry_interval_s: float, master: str, location: str, on_recover: Callable[[], None]) -> None:
        self.retry_interval_s = float(retry_interval_s)
        self.master = master  # for the logs
        self.location = location
        self._on_recover = on_recover
        self._lock = threading.Lock()
        self.degraded: str | None = "connecting to the Mooncake master"  # why the tier is degraded; None: online
        self.last_error: str | None = None
        self.retry_at: float | None = None  # after a failed call: when the next call may try the store
        self.failures = 0  # failed calls, counted in stats()'s errors

    def state(self) -> HealthState:
        with self._lock:
            return {"state": "online" if self.degraded is None else "degraded",
                    "last_error": self.last_error or self.degraded}

    def may_try(self) -> bool:
        """Whether a call may try the store now: always while calls succeed; after a failed call (the master is
        gone: a call then takes seconds to fail) only one call per retry_interval_s, the others are answered at once
        as misses / unstored pages."""
        if self.retry_at is None:
            return True
        now = time.monotonic()
        with self._lock:
            if self.retry_at is not None and now < self.retry_at:
                return False
            if self.retry_at is not None:
                self.retry_at = now + self.retry_interval_s  # this caller tries; the rest wait for it
        return True

    def call(self, fn: Callable[[], T], what: str) -> T | None:
        """fn() or None when the client raised (counted as a failure)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            self.failed(f"{what} raised {type(e).__name__}: {e}")
            return None

    def failed(self, what: str) -> None:
        with self._lock:
            self.failures += 1
            first = self.degraded is None
            self.degraded = self.last_error = what
            self.retry_at = time.monotonic() + self.retry_interval_s
        logger.log(logging.WARNING if first else logging.DEBUG,
                   "L3 Mooncake store degraded: %s; serving from the memory tiers until a call succeeds again "
                   "(master %s)", what, self.master)

    def ok(self) -> None:
        """A call succeeded: back online when degraded."""
        if self.degraded is None:
            return
        with self._lock:
            was, self.degraded = self.degraded, None
            self.retry_at = None
        if was is not None:
            # The master may have restarted meanwhile and lost every page: forget what was stored, so backups
            # write pages again and reads probe instead of trusting a stale index.
            self._on_recover()
            logger.info("L3 Mooncake store %s is back online (last error: %s)", self.location, was)

    def connected(self) -> None:
        with self._lock:
            self.degraded = None

    def offline(self, why: str, attempt: int) -> None:
        """A connection attempt failed: say why (a warning the first time)."""
        with self._lock:
            self.degraded = self.last_error = why
        logger.log(logging.WARNING if attempt == 1 else logging.DEBUG,
                   "L3 Mooncake store offline: %s; retrying every %g s", why, self.retry_interval_s)


class Watched(Protocol):
    """What the health watch needs of the connection it watches (connection.Connection)."""

    @property
    def shm(self) -> bool:
        """The client is a dummy client (the same-host path)."""
        ...

    def client(self) -> MooncakeClient | None:
        """The client when a call may try it now (Health.may_try), else None."""
        ...

    def reattach(self, old: MooncakeClient, probe_key: str) -> MooncakeClient:
        """A fresh dummy client when one attaches and passes its probe, else ``old``."""
        ...


def probe(health: Health, store: MooncakeClient, key: str, shm: bool) -> int | None:
    """The health probe's code (>= 0: the store answers), None if the client raised. Over TCP an is_exist; a dummy
    client stores and removes a probe object, as its is_exist answers 0 when the mooncake_client behind it
    restarted (or the master is down) and nothing can be read or written."""
    if not shm:
        return health.call(lambda: store.is_exist(key), "is_exist (health probe)")
    rc = health.call(lambda: store.upsert(key, b"1"), "upsert (health probe)")
    if rc == 0:
        health.call(lambda: store.remove(key, True), "remove (health probe)")
    return rc


def watch(conn: Watched, health: Health, store: MooncakeClient, probe_key: str, stop: threading.Event) -> None:
    """While degraded, probe the store once per retry_interval_s (on the connection's thread, until ``stop``), so
    the tier comes back when the master does even if no request happens to touch L3 (a server whose traffic all
    hits L1/L2)."""
    failed_probes = 0
    while not stop.wait(health.retry_interval_s):
        if health.retry_at is None:
            failed_probes = 0
            continue  # healthy
        # Over TCP a data call that wins the retry slot probes as well as this thread; on the shm path this
        # thread probes every interval whatever the traffic does, so failures add up to a re-attach even
        # while failing backups keep taking the slot (and shm reads that fail count as misses, not failures).
        if not conn.shm and conn.client() is None:
            continue
        rc = probe(health, store, probe_key, conn.shm)
        if rc is not None and rc >= 0:
            health.ok()
            failed_probes = 0
            continue
        if rc is not None:
            health.failed(f"the health probe returned {rc}")
        failed_probes += 1
        if conn.shm and failed_probes >= REATTACH_AFTER_PROBES:
            store = conn.reattach(store, probe_key)
