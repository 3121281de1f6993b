"""Background L3 I/O so the scheduler never waits on disk: backup writes and prefetch reads on their own threads.

Backups and prefetches have separate queues and threads, so a long backlog of writes never delays the read a
waiting request needs. A prefetch loads its keys in order and stops at the first miss (a later page is useless
without the earlier ones). With ``into`` (one list of writable buffers per leading key: the host pool pages
reserved for them) pages are read straight into memory they will stay in, and the handle's entries for those
keys are their indices instead of bytes. After a cancel, ``handle.io_idle`` says when no read can still write
into those buffers (a read in flight finishes first), so the caller knows when it may reuse them.
The prefetch (storage_prefetch.py) builds SGLang's prefetch policies from a ``PrefetchHandle``:
  best_effort:   when the request is scheduled, ``handle.cancel()`` and use the pages it returns;
  wait_complete: ``handle.wait()`` then ``handle.result()``;
  timeout:       ``handle.wait(t)`` then ``handle.cancel()`` (the pages loaded within t).

Every storage call has a time limit (``io_timeout_s``). A watchdog thread abandons a call stuck past it (a hung
network filesystem, a device that never answers): the prefetch finishes with the pages loaded before it (the
stuck page is a miss), the backup counts as failed, and a fresh thread takes over the queue, so later I/O
still runs. The stuck thread is a daemon: it exits when its call returns (or rejoins the pool if one is
missing) and never keeps the process alive. At most ``MAX_STUCK_THREADS`` are left behind; past that L3 is
bypassed (prefetches miss, backups are dropped) until one returns.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

from tierlm.runtime.cache.storage.base import BorrowedPage, HealthState, KVStorage

logger = logging.getLogger(__name__)

BackupCallback = Callable[[str, bool], None]  # (key, stored) on the backup thread
PrefetchCallback = Callable[[list[Any]], None]  # entries loaded, in key order, on the prefetch thread

# A page is KBs to a few MB: a healthy local or network disk reads or writes it in milliseconds. 10 s leaves
# room for a slow network filesystem while still freeing a request stuck behind a hung one.
DEFAULT_IO_TIMEOUT_S = 10.0
# Queued backups hold copies of pages; a hung disk must not let them grow without limit.
DEFAULT_MAX_PENDING_WRITE_BYTES = 256 * 2**20
MAX_STUCK_THREADS = 8  # abandoned threads still inside a storage call; past this L3 is bypassed


class _Worker:
    """One I/O thread and the storage call it is inside (guarded by StorageIO._cond)."""

    def __init__(self, kind: str, run: Callable[[_Worker], None], name: str) -> None:
        self.kind = kind  # "backup" | "prefetch"
        self.thread = threading.Thread(target=run, args=(self,), name=name, daemon=True)
        self.job: Any = None  # the queue item being worked on
        self.busy_since: float | None = None  # monotonic start of the storage call in progress
        self.what = ""  # the call, for logs
        self.abandoned = False


class _Abandoned(Exception):
    """The watchdog gave up on this thread's call and already settled its job."""


Held = TypeVar("Held")


class FreeAfterRead(Generic[Held]):
    """Memory a cancelled read may still be writing into (host pages, a state slot): held until its prefetch is
    ``io_idle``, then handed to ``free`` by ``sweep``."""

    def __init__(self, free: Callable[[Held], None]) -> None:
        self._free = free
        self._held: list[tuple[PrefetchHandle, Held]] = []

    def hold(self, handle: "PrefetchHandle", item: Held) -> None:
        self._held.append((handle, item))

    def release(self, handle: "PrefetchHandle", item: Held) -> None:
        """Free ``item`` now if no read of ``handle`` is in flight, else once there is none."""
        if handle.io_idle:
            self._free(item)
        else:
            self.hold(handle, item)

    def sweep(self) -> None:
        if not self._held:
            return
        keep = []
        for handle, item in self._held:
            if handle.io_idle:
                self._free(item)
            else:
                keep.append((handle, item))
        self._held = keep

    def __iter__(self) -> Iterator[Held]:
        return (item for _, item in self._held)


class PrefetchHandle:
    """One prefetch: ``keys`` in order; the pages loaded so far are always a prefix of them."""

    def __init__(self, keys: Sequence[str], on_done: PrefetchCallback | None, known: int | None = None,
                 into: Sequence[Sequence[Any]] | None = None) -> None:
        self.keys = list(keys)
        # Keys past ``known`` are ones the storage had no record of: they are probed (another process may have
        # stored them), and an absent one ends the prefetch without counting as a miss.
        self.known = len(self.keys) if known is None else known
        # Key i < len(into) is read into the buffers into[i] and its entry is i; later keys' entries are bytes.
        self.into = list(into or ())
        if len(self.into) > len(self.keys):
            raise ValueError(f"prefetch got {len(self.into)} destinations for {len(self.keys)} keys")
        self._on_done = on_done
        self._pages: list[Any] = []
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)  # notified when a page is loaded or the prefetch ends
        self._done = threading.Event()
        self._idle = threading.Event()  # clear while a read into ``into`` is in flight
        self._idle.set()
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
                self._more.notify_all()
            return list(self._pages)

    @property
    def io_idle(self) -> bool:
        """No read is writing into the ``into`` buffers now; once ``done`` too, none ever will again."""
        return self._idle.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished (all loaded, a miss, or cancelled); False if ``timeout`` seconds passed first."""
        return self._done.wait(timeout)

    def wait_loaded(self, n: int, timeout: float | None = None) -> bool:
        """Block until at least ``n`` pages are loaded or the prefetch has finished; False if ``timeout`` seconds
        passed first. Lets the caller use pages while later ones are still being read."""
        with self._more:
            return self._more.wait_for(lambda: len(self._pages) >= n or self._done.is_set(), timeout)

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
    def _start_read(self) -> bool:
        """Before a read into ``into``: False when finished or cancelled meanwhile (then no read starts)."""
        with self._lock:
            if self._done.is_set():
                return False
            self._idle.clear()
            return True

    def _end_read(self) -> None:
        self._idle.set()

    def _append(self, page: Any) -> bool:
        with self._lock:
            if self._done.is_set():
                return False  # cancelled while this page was being read: the caller already has its result
            self._pages.append(page)
            self._more.notify_all()
            return True

    def _finish(self) -> list[bytes] | None:
        """Mark finished; the pages when this call finished it (so on_done runs), None if cancel() did first."""
        with self._lock:
            if self._done.is_set():
                return None
            self._done.set()
            self._more.notify_all()
            return list(self._pages)


class StorageIO:
    """Runs ``storage`` writes and prefetch reads on ``num_threads`` backup and ``num_threads`` prefetch threads.

    ``max_pending_write_bytes`` bounds the queued backups (None: unbounded); ``io_timeout_s`` is the time limit of
    one storage call.
    """

    def __init__(self, storage: KVStorage, num_threads: int = 1,
                 max_pending_write_bytes: int | None = DEFAULT_MAX_PENDING_WRITE_BYTES,
                 io_timeout_s: float = DEFAULT_IO_TIMEOUT_S) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if not io_timeout_s > 0:
            raise ValueError(f"io_timeout_s must be > 0, got {io_timeout_s!r}")
        self.storage = storage
        self.max_pending_write_bytes = max_pending_write_bytes
        self.io_timeout_s = float(io_timeout_s)
        self._num_threads = num_threads
        self._write_q: queue.Queue[tuple[str, Any, BackupCallback | None] | None] = queue.Queue()
        self._prefetch_q: queue.Queue[PrefetchHandle | None] = queue.Queue()
        self._cond = threading.Condition()  # guards everything below and signals flush()
        self._pending_writes = 0
        self._pending_write_bytes = 0
        self._closed = False
        self._active: set[PrefetchHandle] = set()  # queued or loading, so close() can cancel them
        self._counts = dict(
            backups_queued=0, backups_done=0, backups_failed=0, backups_dropped=0,
            prefetches=0, prefetches_complete=0, prefetches_partial=0, prefetches_cancelled=0,
            prefetch_pages_loaded=0, prefetch_errors=0, prefetches_bypassed=0, io_timeouts=0, backups_stale=0,
        )
        self._workers: list[_Worker] = []  # serving the queues
        self._stuck: list[_Worker] = []  # abandoned by the watchdog, still inside a storage call
        self._thread_seq = 0
        self._hung = False  # a call timed out and none has completed since
        self._last_error: str | None = None
        self._stop = threading.Event()
        with self._cond:
            for _ in range(num_threads):
                self._spawn_locked("backup")
                self._spawn_locked("prefetch")
        self._watchdog = threading.Thread(target=self._watch, name="tierlm-l3-watchdog", daemon=True)
        self._watchdog.start()

    # --- producer side (scheduler thread) ---
    def backup(self, key: str, payload: Any, on_done: BackupCallback | None = None,
               valid: Callable[[], bool] | None = None) -> bool:
        """Queue a write of one page; False when dropped because the queue is over max_pending_write_bytes.

        Without ``valid``, a payload that is not ``bytes`` is copied now, so the caller may reuse its buffer at
        once. A BorrowedPage, or ``payload`` (a buffer or a list of buffers, e.g. the rows of a host page) with
        ``valid``, is NOT copied: the backup thread writes it from the caller's memory and publishes the file only
        if ``valid()`` is still true once it is written (the caller bumps what ``valid`` checks before it reuses
        the memory, after BorrowedPage.detach() if it wants the write kept); otherwise the write is dropped
        (``backups_stale``). The scheduler thread copies nothing.
        """
        if isinstance(payload, BorrowedPage):
            pass
        elif valid is not None:
            payload = BorrowedPage(payload if isinstance(payload, (list, tuple)) else [payload], valid)
        elif not isinstance(payload, bytes):
            payload = bytes(memoryview(payload).cast("B"))
        with self._cond:
            self._check_open()
            limit = self.max_pending_write_bytes
            over = limit is not None and self._pending_writes and self._pending_write_bytes + len(payload) > limit
            if over or not self._has_worker_locked("backup"):
                self._counts["backups_dropped"] += 1
                dropped = self._counts["backups_dropped"]
                why = (f"{self._pending_write_bytes} bytes already queued (limit {limit})" if over
                       else "every backup thread is stuck in a storage call")
                # The first drop and every 1000th are worth a warning; the rest would flood the log.
                logger.log(logging.WARNING if dropped % 1000 == 1 else logging.DEBUG,
                           "L3 backup of %s.. dropped (%d so far): %s; the disk is slower than the traffic "
                           "or hung, see tiers.storage in /server_info", key[:12], dropped, why)
                return False
            self._pending_writes += 1
            self._pending_write_bytes += len(payload)
            self._counts["backups_queued"] += 1
        self._write_q.put((key, payload, on_done))
        return True

    def prefetch(self, keys: Sequence[str], on_done: PrefetchCallback | None = None, known: int | None = None,
                 into: Sequence[Sequence[Any]] | None = None) -> PrefetchHandle:
        """Queue a load of ``keys`` in order, stopping at the first miss; on_done(pages) runs when it finishes
        without being cancelled. Keys from index ``known`` on are probed rather than expected (KVStorage.probe).
        ``into[i]``: writable buffers key i is read into (KVStorage.get_into); its entry is then ``i``."""
        handle = PrefetchHandle(keys, on_done, known, into)
        with self._cond:
            self._check_open()
            self._counts["prefetches"] += 1
            bypass = not self._has_worker_locked("prefetch")
            if bypass:
                self._counts["prefetches_bypassed"] += 1
            else:
                self._active.add(handle)
        if bypass:  # every prefetch thread is stuck: a miss now beats a request waiting on a hung disk
            pages = handle._finish()
            if on_done is not None and pages is not None:
                on_done(pages)
            return handle
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
            out["stuck_threads"] = len(self._stuck)
        return out

    @property
    def stalled(self) -> bool:
        """A storage call is stuck past the time limit right now (the disk or network filesystem hangs)."""
        with self._cond:
            return bool(self._stuck)

    def health(self) -> HealthState:
        """"degraded" from a timed-out call until a later call completes; the last timeout's message."""
        with self._cond:
            hung = self._hung or bool(self._stuck)
            return {"state": "degraded" if hung else "online", "last_error": self._last_error}

    def close(self, flush: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the threads: finish queued backups first when ``flush`` (else drop them); cancel every prefetch.

        ``timeout`` bounds the whole call (flush and joins). Threads stuck in a storage call are left behind:
        they are daemons, so the process can still exit.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
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
        self._stop.set()
        with self._cond:
            workers = list(self._workers)
        for w in workers:
            (self._write_q if w.kind == "backup" else self._prefetch_q).put(None)
        for w in workers:
            w.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._cond:
            busy = sum(w.thread.is_alive() for w in workers) + len(self._stuck)
        if busy:
            logger.warning("%d L3 I/O threads are still inside storage calls at shutdown (hung disk or network "
                           "filesystem?); leaving them behind, they do not keep the process alive", busy)

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

    def _has_worker_locked(self, kind: str) -> bool:
        return any(w.kind == kind for w in self._workers)

    def _spawn_locked(self, kind: str) -> None:
        self._thread_seq += 1
        w = _Worker(kind, self._run_worker, f"tierlm-l3-{kind}-{self._thread_seq}")
        self._workers.append(w)
        w.thread.start()

    def _run_worker(self, w: _Worker) -> None:
        loop = self._backup_loop if w.kind == "backup" else self._prefetch_loop
        while True:
            try:
                loop(w)
                return
            except _Abandoned:
                if w.abandoned:
                    return  # replaced meanwhile: this thread is surplus
                # else it rejoined the pool (a replacement was missing): serve the queue again

    def _call(self, w: _Worker, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` under the watchdog; raises _Abandoned when the watchdog settled the job meanwhile."""
        with self._cond:
            w.busy_since, w.what = time.monotonic(), what
        try:
            return fn(*args)
        finally:
            with self._cond:
                w.busy_since = None
                abandoned = w.abandoned
                if not abandoned:
                    self._hung = False
                else:
                    self._stuck.remove(w)
                    missing = sum(x.kind == w.kind for x in self._workers) < self._num_threads
                    if missing and not self._closed:
                        w.abandoned = False
                        self._workers.append(w)
            if abandoned:
                logger.info("an abandoned L3 %s returned after all; its result was discarded", what)
                raise _Abandoned()  # the watchdog settled the job already: drop fn's outcome

    def _watch(self) -> None:
        period = min(0.5, self.io_timeout_s / 4)
        while not self._stop.wait(period):
            self._abandon_stuck()

    def _abandon_stuck(self) -> None:
        now = time.monotonic()
        settle: list[tuple[_Worker, Any, str]] = []
        with self._cond:
            for w in list(self._workers):
                if w.busy_since is None or now - w.busy_since <= self.io_timeout_s:
                    continue
                w.abandoned = True
                self._workers.remove(w)
                self._stuck.append(w)
                self._counts["io_timeouts"] += 1
                self._hung = True
                self._last_error = (f"L3 {w.what} did not finish within {self.io_timeout_s:g} s "
                                    f"(hung disk or network filesystem?); abandoned it")
                if len(self._stuck) <= MAX_STUCK_THREADS and not self._closed:
                    self._spawn_locked(w.kind)
                    then = "a fresh thread serves the queue"
                else:
                    then = f"{len(self._stuck)} threads are stuck, so L3 {w.kind}s are bypassed until one returns"
                settle.append((w, w.job, f"{self._last_error}; {then}"))
        for w, job, message in settle:
            logger.warning("%s. Check the storage folder's disk or mount.", message)
            if w.kind == "backup":
                key, payload, on_done = job
                self._write_finished(key, payload, on_done, ok=False)
            else:
                self._prefetch_finished(job, job.num_loaded, errors=0)

    def _backup_loop(self, w: _Worker) -> None:
        while True:
            item = self._write_q.get()
            if item is None:
                return
            key, payload, on_done = item
            w.job = item
            stale = False
            try:
                ok = bool(self._call(w, f"write of {key[:12]}..", self._store, key, payload))
                stale = not ok and isinstance(payload, BorrowedPage) and not payload.valid()
            except _Abandoned:
                raise
            except Exception:
                logger.exception("L3 backup of %s.. raised; the page stays uncached in storage", key[:12])
                ok = False
            self._write_finished(key, payload, on_done, ok, stale)

    def _store(self, key: str, payload: Any) -> bool:
        if not isinstance(payload, BorrowedPage):
            return self.storage.set(key, payload)
        for _ in range(2):
            detached = payload.detached
            ok = bool(self.storage.set(key, payload)) if payload.valid() else False
            if ok or detached or not payload.detached:
                return ok
            # the owner copied the page out and reused its memory during this write: write the copy
        return ok

    def _write_finished(self, key: str, payload: Any, on_done: BackupCallback | None, ok: bool | None,
                        stale: bool = False) -> None:
        if on_done is not None and ok is not None:
            try:
                on_done(key, ok)
            except Exception:
                logger.exception("L3 backup callback for %s.. raised", key[:12])
        with self._cond:
            self._pending_writes -= 1
            self._pending_write_bytes -= len(payload)
            name = ("backups_dropped" if ok is None else "backups_done" if ok else
                    "backups_stale" if stale else "backups_failed")
            self._counts[name] += 1
            self._cond.notify_all()

    def _prefetch_loop(self, w: _Worker) -> None:
        while True:
            handle = self._prefetch_q.get()
            if handle is None:
                return
            w.job = handle
            loaded = errors = 0
            i, n, batch = 0, len(handle.keys), max(1, self.storage.read_batch_pages)
            while i < n and not handle.done:
                probe, into = i >= handle.known, i < len(handle.into)
                # One batch never mixes known and probed keys (a probed absence is no miss), nor buffers and bytes.
                # The first probed key goes alone: whether another server stored the pages is known at once.
                size = 1 if probe and i == handle.known else batch
                end = min(i + size, n if probe else handle.known, len(handle.into) if into else n)
                what = f"read of {end - i} pages from {handle.keys[i][:12]}.."
                try:
                    if into:
                        if not handle._start_read():
                            break
                        try:  # the buffers are the caller's memory: io_idle tells when this read has left them
                            oks = self._call(w, what, self._read_into, handle.keys[i:end], handle.into[i:end], probe)
                        finally:
                            handle._end_read()
                        pages: list[Any] = list(range(i, i + sum(1 for _ in itertools.takewhile(bool, oks))))
                    else:
                        got = self._call(w, what, self._read_bytes, handle.keys[i:end], probe)
                        pages = list(itertools.takewhile(lambda page: page is not None, got))
                except _Abandoned:
                    raise
                except Exception:
                    logger.exception("L3 prefetch %s raised; stopping this prefetch there", what)
                    pages, errors = [], errors + 1
                appended = sum(1 for _ in itertools.takewhile(handle._append, pages))
                loaded += appended
                if appended < end - i:  # a page missing, or the prefetch cancelled meanwhile
                    break
                i = end
            self._prefetch_finished(handle, loaded, errors)

    def _read_bytes(self, keys: Sequence[str], probe: bool) -> list[bytes | None]:
        if len(keys) == 1:
            return [self.storage.probe(keys[0]) if probe else self.storage.get(keys[0])]
        return self.storage.batch_read(keys, probe=probe)

    def _read_into(self, keys: Sequence[str], outs: Sequence[Sequence[Any]], probe: bool) -> list[bool]:
        if len(keys) == 1:
            return [self.storage.get_into(keys[0], outs[0], probe=probe)]
        return self.storage.batch_get_into(keys, outs, probe=probe)

    def _prefetch_finished(self, handle: PrefetchHandle, loaded: int, errors: int) -> None:
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
