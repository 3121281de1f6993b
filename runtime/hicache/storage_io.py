"""Background L3 I/O so the scheduler never waits on disk: backup writes and prefetch reads on their own threads.

Backups and prefetches have separate queues and threads, so a long backlog of writes never delays the read a
waiting request needs. A prefetch loads its keys in order and stops at the first miss (a later page is useless
without the earlier ones). The controller builds SGLang's prefetch policies from a ``PrefetchHandle``:
  best_effort:   when the request is scheduled, ``handle.cancel()`` and use the pages it returns;
  wait_complete: ``handle.wait()`` then ``handle.result()``;
  timeout:       ``handle.wait(t)`` then ``handle.cancel()`` (the pages loaded within t).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Sequence

from tierlm.runtime.hicache.storage_base import KVStorage

logger = logging.getLogger(__name__)

BackupCallback = Callable[[str, bool], None]  # (key, stored) on the backup thread
PrefetchCallback = Callable[[list[bytes]], None]  # pages loaded, in key order, on the prefetch thread


class PrefetchHandle:
    """One prefetch: ``keys`` in order; the pages loaded so far are always a prefix of them."""

    def __init__(self, keys: Sequence[str], on_done: PrefetchCallback | None) -> None:
        self.keys = list(keys)
        self._on_done = on_done
        self._pages: list[bytes] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancelled = False

    def cancel(self) -> list[bytes]:
        """Stop loading and return the pages loaded so far; the result is final from here on (no blocking).

        If the prefetch had already finished, this returns its full result, ``cancelled`` stays False and
        on_done was (or is being) called with the same pages.
        """
        with self._lock:
            if not self._done.is_set():
                self._cancelled = True
                self._done.set()
            return list(self._pages)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished (all loaded, a miss, or cancelled); False if ``timeout`` seconds passed first."""
        return self._done.wait(timeout)

    def result(self) -> list[bytes]:
        """The pages loaded so far (final once ``done``)."""
        with self._lock:
            return list(self._pages)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def num_loaded(self) -> int:
        with self._lock:
            return len(self._pages)

    @property
    def complete(self) -> bool:
        """Finished with every key loaded."""
        with self._lock:
            return self._done.is_set() and len(self._pages) == len(self.keys)

    # --- worker side ---
    def _append(self, page: bytes) -> bool:
        with self._lock:
            if self._done.is_set():
                return False  # cancelled while this page was being read: the caller already has its result
            self._pages.append(page)
            return True

    def _finish(self) -> list[bytes] | None:
        """Mark finished; the pages when this call finished it (so on_done runs), None if cancel() did first."""
        with self._lock:
            if self._done.is_set():
                return None
            self._done.set()
            return list(self._pages)


class StorageIO:
    """Runs ``storage`` writes and prefetch reads on ``num_threads`` backup and ``num_threads`` prefetch threads."""

    def __init__(self, storage: KVStorage, num_threads: int = 1, max_pending_write_bytes: int | None = None) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.storage = storage
        self.max_pending_write_bytes = max_pending_write_bytes
        self._write_q: queue.Queue = queue.Queue()
        self._prefetch_q: queue.Queue = queue.Queue()
        self._cond = threading.Condition()  # guards everything below and signals flush()
        self._pending_writes = 0
        self._pending_write_bytes = 0
        self._closed = False
        self._active: set[PrefetchHandle] = set()  # queued or loading, so close() can cancel them
        self._counts = dict(
            backups_queued=0, backups_done=0, backups_failed=0, backups_dropped=0,
            prefetches=0, prefetches_complete=0, prefetches_partial=0, prefetches_cancelled=0,
            prefetch_pages_loaded=0, prefetch_errors=0,
        )
        self._threads = [
            threading.Thread(target=loop, name=f"tierlm-l3-{kind}-{i}", daemon=True)
            for i in range(num_threads)
            for kind, loop in (("backup", self._backup_loop), ("prefetch", self._prefetch_loop))
        ]
        for t in self._threads:
            t.start()

    # --- producer side (scheduler thread) ---
    def backup(self, key: str, payload: bytes, on_done: BackupCallback | None = None) -> bool:
        """Queue a write of one page; False when dropped because the queue is over max_pending_write_bytes.

        A payload that is not ``bytes`` is copied now, so the caller may reuse its buffer at once.
        """
        if not isinstance(payload, bytes):
            payload = bytes(memoryview(payload).cast("B"))
        with self._cond:
            self._check_open()
            limit = self.max_pending_write_bytes
            if limit is not None and self._pending_writes and self._pending_write_bytes + len(payload) > limit:
                self._counts["backups_dropped"] += 1
                logger.debug("L3 backup of %s.. dropped: %d bytes already queued (limit %d)",
                             key[:12], self._pending_write_bytes, limit)
                return False
            self._pending_writes += 1
            self._pending_write_bytes += len(payload)
            self._counts["backups_queued"] += 1
        self._write_q.put((key, payload, on_done))
        return True

    def backup_many(self, keys: Sequence[str], payloads: Sequence[bytes], on_done: BackupCallback | None = None) -> int:
        """Queue several page writes in order; returns how many were queued (stops at the first dropped one)."""
        if len(keys) != len(payloads):
            raise ValueError(f"backup_many got {len(keys)} keys but {len(payloads)} payloads")
        for n, (key, payload) in enumerate(zip(keys, payloads)):
            if not self.backup(key, payload, on_done):
                return n
        return len(keys)

    def prefetch(self, keys: Sequence[str], on_done: PrefetchCallback | None = None) -> PrefetchHandle:
        """Queue a load of ``keys`` in order, stopping at the first miss; on_done(pages) runs when it finishes
        without being cancelled."""
        handle = PrefetchHandle(keys, on_done)
        with self._cond:
            self._check_open()
            self._counts["prefetches"] += 1
            self._active.add(handle)
        self._prefetch_q.put(handle)
        return handle

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued backup is written (or failed); False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_writes == 0, timeout)

    def stats(self) -> dict[str, int]:
        with self._cond:
            out = dict(self._counts)
            out["pending_writes"] = self._pending_writes
            out["pending_write_bytes"] = self._pending_write_bytes
        return out

    def close(self, flush: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the threads: finish queued backups first when ``flush`` (else drop them); cancel every prefetch."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if flush and not self.flush(timeout):
            logger.warning("L3 backups still pending after %ss at shutdown; dropping them", timeout)
        self._drain_writes()
        while True:
            try:
                handle = self._prefetch_q.get_nowait()
            except queue.Empty:
                break
            if handle is not None:
                handle.cancel()
                with self._cond:
                    self._active.discard(handle)
                    self._counts["prefetches_cancelled"] += 1
        with self._cond:
            loading = list(self._active)
        for handle in loading:  # the thread loading it stops at its next page and counts it
            handle.cancel()
        for t in self._threads:
            (self._write_q if "backup" in t.name else self._prefetch_q).put(None)
        for t in self._threads:
            t.join(timeout)

    # --- worker side ---
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("StorageIO is closed; create a new one")

    def _drain_writes(self) -> None:
        while True:
            try:
                item = self._write_q.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._write_finished(item[0], item[1], None, ok=None)

    def _backup_loop(self) -> None:
        while True:
            item = self._write_q.get()
            if item is None:
                return
            key, payload, on_done = item
            try:
                ok = bool(self.storage.set(key, payload))
            except Exception:
                logger.exception("L3 backup of %s.. raised; the page stays uncached in storage", key[:12])
                ok = False
            self._write_finished(key, payload, on_done, ok)

    def _write_finished(self, key: str, payload: bytes, on_done: BackupCallback | None, ok: bool | None) -> None:
        if on_done is not None and ok is not None:
            try:
                on_done(key, ok)
            except Exception:
                logger.exception("L3 backup callback for %s.. raised", key[:12])
        with self._cond:
            self._pending_writes -= 1
            self._pending_write_bytes -= len(payload)
            name = "backups_dropped" if ok is None else "backups_done" if ok else "backups_failed"
            self._counts[name] += 1
            self._cond.notify_all()

    def _prefetch_loop(self) -> None:
        while True:
            handle = self._prefetch_q.get()
            if handle is None:
                return
            loaded = errors = 0
            for key in handle.keys:
                if handle.done:
                    break
                try:
                    page = self.storage.get(key)
                except Exception:
                    logger.exception("L3 prefetch of %s.. raised; stopping this prefetch there", key[:12])
                    page, errors = None, errors + 1
                if page is None or not handle._append(page):
                    break
                loaded += 1
            pages = handle._finish()
            with self._cond:
                self._active.discard(handle)
                self._counts["prefetch_pages_loaded"] += loaded
                self._counts["prefetch_errors"] += errors
                if handle.cancelled:
                    self._counts["prefetches_cancelled"] += 1
                elif loaded == len(handle.keys):
                    self._counts["prefetches_complete"] += 1
                else:
                    self._counts["prefetches_partial"] += 1
            if pages is not None and handle._on_done is not None:
                try:
                    handle._on_done(pages)
                except Exception:
                    logger.exception("L3 prefetch callback raised")
