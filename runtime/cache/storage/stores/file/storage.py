"""L3 file storage: one file per KV page under <root>/<namespace id prefix>/, verified on every read.

File format: the 128-byte page header of page_header.py (magic, version, namespace, key, length, XXH3-128),
then the raw payload, never pickle.
Writes go to a unique temp file in the same folder, are fsynced and os.replace()d into place, so a reader (in
any process) sees either no file or a complete one under the final name. A read that finds a bad magic,
version, namespace, key, length or checksum is a miss: logged, counted in ``errors`` and the file removed.
A read is one open, one fstat and one preadv of header + payload straight into the caller's buffers (the host
pool page that will hold it: ``get_into``); nothing is copied on the way.
An in-memory LRU index (rebuilt from the folder on start, ordered by file mtime, which reads refresh) keeps
the folder under ``max_size_bytes``. Several processes may share a folder; each bounds what it knows of.

A bad disk never hangs or breaks the caller: only regular files are opened (non-blocking, so a FIFO in place
of a page cannot block a read), a folder deleted while serving is recreated by the next write (its pages are
forgotten, so files/bytes match the disk), and a failed write (full disk, read-only folder) leaves no temp
file, is counted and turns ``health()`` "degraded" until a write succeeds again.

Opening the folder (namespace.json, the scan that rebuilds the index, the free space) runs on a daemon thread
under the tier's I/O time limit (``io_timeout`` in the extra-config, as for every later read and write): past it
the server starts with this store offline (every call a miss, ``health()`` "degraded" with why) instead of
waiting on a hung filesystem or a FIFO; the open finishes in the background when the folder answers, and a
failed late open is retried every ``STARTUP_RETRY_INTERVAL_S``, never with more than one thread stuck.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from tierlm.runtime.cache.storage import page_header
from tierlm.runtime.cache.storage.base import (HealthState, KVStorage, PageBuffer, PagePayload, byte_views,
                                               check_page_key, page_to_store)
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.cache.storage.page_header import HEADER_SIZE
from tierlm.runtime.cache.storage.stores.file.config import (AUTO_BOUND, DEFAULT_BOUND_FREE_SHARE,
                                                             DEFAULT_BOUND_MAX_BYTES, KNOWN_EXTRA_CONFIG_KEYS,
                                                             STORAGE_DIR_ENV,
                                                             default_max_size_bytes, default_storage_dir,
                                                             io_timeout_from_config, max_size_bytes_from_config)
from tierlm.runtime.cache.storage.stores.file.page_io import read_fully, touch_fd, unlink_quietly
from tierlm.runtime.errors import StartupError

logger = logging.getLogger(__name__)

FILE_FORMAT_VERSION = page_header.FORMAT_VERSION  # 1: SHA-256 payload checksum; 2: XXH3-128
_UTIME_FD = os.utime in os.supports_fd
FILE_SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
NAMESPACE_FILE = "namespace.json"
_KV_NAME_RE = re.compile(r"[0-9a-f]{64}\.kv")
STARTUP_RETRY_INTERVAL_S = 5.0  # a late open that failed is tried again this often
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class FileKVStorage(KVStorage):
    name = "file"

    def __init__(
        self,
        root_dir: str | os.PathLike[str] | None,
        namespace: StorageNamespace,
        page_bytes: int,
        max_size_bytes: int | None | Literal["auto"] = None,
        *,
        fsync: bool = True,
        stale_temp_seconds: float = 600.0,
        startup_timeout_s: float | None = None,
        retry_interval_s: float = STARTUP_RETRY_INTERVAL_S,
    ) -> None:
        """``startup_timeout_s``: open the folder on a thread and wait at most this long (then start offline);
        None opens it on the caller's thread."""
        if not isinstance(page_bytes, int) or page_bytes < 1:
            raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if isinstance(max_size_bytes, int) and max_size_bytes < HEADER_SIZE + page_bytes:
            raise ValueError(
                f"max_size_bytes={max_size_bytes} cannot hold even one page ({HEADER_SIZE + page_bytes} bytes); "
                "raise max_size_gb or leave it unset"
            )
        self.root_dir = Path(root_dir) if root_dir is not None else default_storage_dir()
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.file_bytes = HEADER_SIZE + page_bytes
        self.max_size_bytes: int | None = None if max_size_bytes == AUTO_BOUND else max_size_bytes
        self._auto_bound = max_size_bytes == AUTO_BOUND
        self.dir = self.root_dir / namespace.folder_name
        self.location = str(self.dir)
        self._fsync = fsync
        self._ns_raw = namespace.id_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._total = 0
        self._closed = False
        self._counts = dict(reads=0, writes=0, bytes_read=0, bytes_written=0, misses=0, errors=0, evictions=0)
        self._read_ns = 0  # time inside successful reads (open to verified), for the L3 read rate
        self._checksum_ns = 0  # the part of it spent verifying
        self._degraded: str | None = None  # why writes fail right now; None while online
        self._last_error: str | None = None
        self._stale_temp_seconds = stale_temp_seconds
        self._offline: str | None = None  # why the folder is not open yet (every call a miss meanwhile)
        self._opening: _OpenAttempt | None = None
        self._started_offline = False  # the open outlived the startup time limit
        self._stop = threading.Event()
        self.retry_interval_s = retry_interval_s
        if startup_timeout_s is None:
            self._open_folder()
        else:
            self._open_within(startup_timeout_s)

    @classmethod
    def from_extra_config(
        cls,
        namespace: StorageNamespace,
        page_bytes: int,
        extra_config: Mapping[str, object] | None = None,
        root_dir: str | os.PathLike[str] | None = None,
    ) -> "FileKVStorage":
        """Build from parsed extra-config and the default folder unless root_dir is given. Without max_size_gb the
        bound is default_max_size_bytes() of the folder's free space at startup."""
        cfg = dict(extra_config or {})
        unknown = sorted(set(cfg) - set(KNOWN_EXTRA_CONFIG_KEYS))
        if unknown:
            logger.warning("file storage ignores extra-config keys %s (it knows %s)",
                           unknown, list(KNOWN_EXTRA_CONFIG_KEYS))
        bound = max_size_bytes_from_config(cfg)
        return cls(root_dir, namespace, page_bytes, AUTO_BOUND if bound is None else bound,
                   startup_timeout_s=io_timeout_from_config(cfg))

    # --- KVStorage, plus exists() and delete() of this backend's own (tests and tools) ---
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Like known(), but a key missing from the index is looked for on disk (and adopted when found)."""
        self._check_open()
        out = []
        for key in keys:
            self._check_key(key)
            if self._offline is not None:
                out.append(False)
                continue
            with self._lock:
                known = key in self._index
            out.append(known or self._adopt(key))
        return out

    def known(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            if self._offline is not None:
                return [False] * len(keys)
            return [key in self._index for key in keys]

    def probe(self, key: str) -> bytes | None:
        return self._read_bytes(key, absent_is_miss=False)

    def get(self, key: str) -> bytes | None:
        return self._read_bytes(key, absent_is_miss=True)

    def get_into(self, key: str, out: Sequence[PageBuffer], *, probe: bool = False) -> bool:
        self._check_open()
        self._check_key(key)
        views = byte_views(out)
        total = sum(v.nbytes for v in views)
        if total != self.page_bytes:
            raise ValueError(f"get_into got buffers of {total} bytes, this storage stores {self.page_bytes}")
        return self._read(key, views, absent_is_miss=not probe)

    def _read_bytes(self, key: str, absent_is_miss: bool) -> bytes | None:
        self._check_open()
        self._check_key(key)
        buf = bytearray(self.page_bytes)
        if not self._read(key, [memoryview(buf)], absent_is_miss):
            return None
        return bytes(buf)

    def _read(self, key: str, views: list[memoryview], absent_is_miss: bool) -> bool:
        """Read and verify page ``key`` into ``views`` (page_bytes in all); False on a miss."""
        if self._offline is not None:  # the folder has not opened yet: nothing is read from it
            return False
        path = self._path(key)
        header = bytearray(HEADER_SIZE)
        t0 = time.perf_counter_ns()
        try:
            # Only a regular file is opened, and without blocking: a FIFO or device in its place must not
            # hang the reader. fstat after open closes the window where the name is swapped meanwhile.
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                self._discard(key, path, st, "not a regular file")
                self._count(misses=1)
                return False
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
            try:
                st = os.fstat(fd)
                problem: str | None
                if not stat.S_ISREG(st.st_mode):
                    problem = "not a regular file"
                else:
                    got = read_fully(fd, [memoryview(header), *views])
                    t_read = time.perf_counter_ns()
                    problem = self._verify(key, header, got, st.st_size, views)
                    checksum_ns = time.perf_counter_ns() - t_read
                    if problem is None and _UTIME_FD:
                        touch_fd(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._forget(key)
            self._count(misses=int(absent_is_miss))
            if not self.dir.is_dir():
                self._folder_lost()
            return False
        except OSError as e:
            self._failed(f"read of {path} failed: {e}", e)
            self._count(misses=1)
            return False
        if problem is not None:
            self._discard(key, path, st, problem)
            self._count(misses=1)
            return False
        with self._lock:
            self._record_locked(key, st.st_size)
            self._counts["reads"] += 1
            self._counts["bytes_read"] += self.page_bytes
            self._read_ns += time.perf_counter_ns() - t0
            self._checksum_ns += checksum_ns
        if not _UTIME_FD:
            self._touch(path)
        return True

    def set(self, key: str, payload: PagePayload) -> bool:
        """Store a page: a buffer, a list of buffers written in order without joining them, or a BorrowedPage,
        whose ``valid()`` is checked after the temp file is written and before it is renamed into place (False:
        its memory was reused meanwhile; the write is dropped and set() returns False, not counted as an error)."""
        self._check_open()
        self._check_key(key)
        valid, views = page_to_store(key, payload, self.page_bytes)
        if self._offline is not None:
            return False
        path = self._path(key)
        if self._is_page_file(path):  # written before, here or by another process sharing the folder
            self._note_present(key, self.file_bytes)
            self._touch(path)
            return True
        header = page_header.pack_header(self._ns_raw, key, views)
        tmp = self.dir / f"{TEMP_PREFIX}{key}-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
        try:
            try:
                self._write_file(tmp, path, header, views, valid)
            except FileNotFoundError:
                if self.dir.is_dir():
                    raise
                self._folder_lost()  # deleted while serving: recreate it and write again
                self._write_file(tmp, path, header, views, valid)
        except _Stale:
            unlink_quietly(tmp)
            return False
        except OSError as e:
            unlink_quietly(tmp)
            self._failed(f"write of {path} failed: {e}", e)
            return False
        self._recovered()
        with self._lock:
            self._record_locked(key, self.file_bytes)
            self._counts["writes"] += 1
            self._counts["bytes_written"] += self.file_bytes
            victims = self._pick_victims_locked(keep=key)
        self._remove_victims(victims)
        return True

    def delete(self, key: str) -> bool:
        self._check_open()
        self._check_key(key)
        if self._offline is not None:
            return False
        self._forget(key)
        return unlink_quietly(self._path(key))

    def clear(self) -> int:
        self._check_open()
        if self._offline is not None:
            logger.warning("L3 storage %s is offline (%s): nothing cleared", self.dir, self._offline)
            return 0
        removed = 0
        try:
            with os.scandir(self.dir) as it:
                for entry in it:
                    if _KV_NAME_RE.fullmatch(entry.name) and unlink_quietly(Path(entry.path)):
                        removed += 1
        except FileNotFoundError:
            self._folder_lost()
        with self._lock:
            self._index.clear()
            self._total = 0
        logger.info("cleared L3 storage %s: removed %d page files", self.dir, removed)
        return removed

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"files": len(self._index), "bytes": self._total}
            out.update(self._counts)
            out["read_seconds"] = self._read_ns / 1e9
            out["checksum_seconds"] = self._checksum_ns / 1e9
        out["max_bytes"] = self.max_size_bytes
        return out

    def health(self) -> HealthState:
        with self._lock:
            if self._offline is not None:
                return {"state": "degraded", "last_error": self._offline}
            return {"state": "online" if self._degraded is None else "degraded", "last_error": self._last_error}

    def close(self) -> None:
        self._closed = True
        self._stop.set()  # the retry thread ends; an open stuck in the kernel is a daemon, left behind

    # --- opening the folder under the time limit ---
    def _open_folder(self) -> None:
        self._open_namespace_dir()
        self._rebuild_index(self._stale_temp_seconds)

    def _open_within(self, timeout_s: float) -> None:
        """Open the folder on a daemon thread; StartupError when it fails within ``timeout_s``, offline past it."""
        self._offline = f"opening {self.dir}"
        attempt = self._opening = _OpenAttempt(self)
        if attempt.done.wait(timeout_s):
            if attempt.error is not None:
                raise attempt.error
            return
        why = (f"L3 storage folder {self.dir} did not open within {timeout_s:g} s at startup (the I/O time limit, "
               f"extra-config io_timeout): hung disk or network filesystem, or a FIFO in place of {NAMESPACE_FILE}? "
               "Serving without L3 until it opens")
        with self._lock:
            if self._offline is None:  # it opened just now
                return
            self._offline = self._last_error = why
            self._started_offline = True
        logger.warning("%s (checked every %g s).", why, self.retry_interval_s)
        threading.Thread(target=self._retry_open, name="tierlm-l3-open-retry", daemon=True).start()

    def _retry_open(self) -> None:
        """While offline: a new open once the last one has failed (one stuck in the kernel is waited for)."""
        while not self._stop.wait(self.retry_interval_s) and self._offline is not None:
            if self._opening is not None and self._opening.done.is_set():
                self._opening = _OpenAttempt(self)

    def _opened(self, error: BaseException | None) -> None:
        """An open attempt returned (on its thread)."""
        with self._lock:
            late = self._started_offline
            if error is None:
                self._offline = None
            elif late:
                self._offline = self._last_error = f"L3 storage folder {self.dir} cannot be opened: {error}"
        if late and error is None:
            logger.info("L3 storage %s is online: the folder opened after startup", self.dir)
        elif late:
            logger.warning("L3 storage still offline: %s; retrying every %g s", error, self.retry_interval_s)

    # --- internals ---
    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{FILE_SUFFIX}"

    def _is_page_file(self, path: Path) -> bool:
        """A regular file of the right size under ``path`` (a FIFO, folder or stub there is not a page)."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == self.file_bytes

    def _write_file(self, tmp: Path, path: Path, header: bytes, views: list[memoryview],
                    valid: Callable[[], bool] | None = None) -> None:
        with open(tmp, "xb") as f:
            f.write(header)
            for view in views:  # a write larger than the buffer goes straight to the file, uncopied
                f.write(view)
            f.flush()
            if valid is not None and not valid():
                raise _Stale()
            if self._fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)  # also replaces a FIFO or other non-page file squatting on the name

    def _failed(self, what: str, e: OSError) -> None:
        """Count a failed read or write and mark the tier degraded; warn once per episode, with the fix."""
        if e.errno in _NO_ROOM:
            fix = "free space on that disk or lower max_size_gb in --hicache-storage-backend-extra-config"
        elif e.errno in _NOT_WRITABLE:
            fix = f"make {self.root_dir} writable or point {STORAGE_DIR_ENV} at a writable folder"
        else:
            fix = "check that disk or mount"
        with self._lock:
            self._counts["errors"] += 1
            first = self._degraded is None
            self._degraded = self._last_error = what
        logger.log(logging.WARNING if first else logging.DEBUG,
                   "L3 storage degraded: %s; pages stay uncached in storage (serving is unaffected) until a "
                   "write succeeds again: %s", what, fix)

    def _recovered(self) -> None:
        with self._lock:
            was, self._degraded = self._degraded, None
        if was is not None:
            logger.info("L3 storage %s is back online: a write succeeded again (last error: %s)", self.dir, was)

    def _folder_lost(self) -> None:
        """The namespace folder vanished (deleted while serving): forget its pages and recreate it."""
        with self._lock:
            pages, size = len(self._index), self._total
            self._index.clear()
            self._total = 0
        logger.warning("L3 folder %s disappeared while serving (deleted?): forgot its %d pages (%d bytes) and "
                       "recreated it; pages are stored again as they are used", self.dir, pages, size)
        self._make_namespace_dir()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"FileKVStorage at {self.dir} is closed; open a new one")

    _check_key = staticmethod(check_page_key)

    def _verify(self, key: str, header: bytearray, got: int, size: int, views: list[memoryview]) -> str | None:
        """Why the file is unusable, or None when it is the intact page ``key`` of this namespace. ``got`` bytes
        of the ``size``-byte file were read into ``header`` and then ``views``."""
        return page_header.verify(header, got, size, key=key, ns_raw=self._ns_raw,
                                  ns_label=self.namespace.folder_name, page_bytes=self.page_bytes, views=views)

    def _discard(self, key: str, path: Path, st: os.stat_result, reason: str) -> None:
        logger.warning("L3 file %s is damaged (%s): removed it, serving a miss", path, reason)
        self._forget(key)
        self._count(errors=1)
        try:
            now = os.lstat(path)
            # Only remove the file we read: another process may have just renamed a good one into place.
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("could not remove damaged L3 file %s: %s", path, e)

    def _adopt(self, key: str) -> bool:
        """A key absent from the index may have been written by another process sharing the folder."""
        if not self._is_page_file(self._path(key)):
            return False
        self._note_present(key, self.file_bytes)
        return True

    def _note_present(self, key: str, size: int) -> None:
        with self._lock:
            self._record_locked(key, size)
            victims = self._pick_victims_locked(keep=key)
        self._remove_victims(victims)

    def _record_locked(self, key: str, size: int) -> None:
        """``key`` is on disk with ``size`` bytes and was used just now (the most recent end of the LRU)."""
        if key not in self._index:
            self._total += size
        self._index[key] = size
        self._index.move_to_end(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._total -= size

    def _pick_victims_locked(self, keep: str | None) -> list[str]:
        victims: list[str] = []
        if self.max_size_bytes is None:
            return victims
        while self._total > self.max_size_bytes and self._index:
            oldest = next(iter(self._index))
            if oldest == keep:
                if len(self._index) == 1:
                    break
                self._index.move_to_end(oldest)
                continue
            self._total -= self._index.pop(oldest)
            self._counts["evictions"] += 1
            victims.append(oldest)
        return victims

    def _remove_victims(self, victims: list[str]) -> None:
        for key in victims:
            unlink_quietly(self._path(key))
        if victims:
            logger.debug("L3 storage over its %s-byte bound: evicted %d least recently used pages",
                         self.max_size_bytes, len(victims))

    def _touch(self, path: Path) -> None:
        # The mtime orders the LRU index rebuilt after a restart; failure only costs that order.
        try:
            os.utime(path)
        except OSError:
            pass

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d

    def _make_namespace_dir(self) -> None:
        """Create the folder and its namespace.json (OSError when the disk refuses)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        meta_path = self.dir / NAMESPACE_FILE
        expected = self.namespace.describe()
        try:
            found = json.loads(meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            found = None
        except (ValueError, UnicodeDecodeError):
            logger.warning("%s is unreadable; rewriting it", meta_path)
            found = None
        if isinstance(found, dict) and found.get("id") not in (None, expected["id"]):
            raise StartupError(
                f"L3 storage folder {self.dir} belongs to namespace {found.get('id')}, not {expected['id']} "
                f"(id prefix collision or a hand-edited folder); move it away or use another storage dir"
            )
        if found != expected:
            tmp = self.dir / f"{TEMP_PREFIX}{NAMESPACE_FILE}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                tmp.write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n", encoding="utf-8")
                os.replace(tmp, meta_path)
            except OSError:
                unlink_quietly(tmp)
                raise

    def _open_namespace_dir(self) -> None:
        try:
            self._make_namespace_dir()
        except OSError as e:
            raise StartupError(
                f"cannot use L3 storage folder {self.dir}: {e.strerror or e}; "
                f"set {STORAGE_DIR_ENV} to a writable folder"
            ) from e

    def _rebuild_index(self, stale_temp_seconds: float) -> None:
        found: list[tuple[float, str, int]] = []
        stale_temps = damaged = 0
        now = time.time()
        with os.scandir(self.dir) as it:
            for entry in it:
                name = entry.name
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if name.startswith(TEMP_PREFIX):
                    # A writer that died mid-write leaves its temp file; a young one may still be in progress.
                    if now - st.st_mtime > stale_temp_seconds and unlink_quietly(Path(entry.path)):
                        stale_temps += 1
                elif _KV_NAME_RE.fullmatch(name):
                    if st.st_size != self.file_bytes:
                        logger.warning("L3 file %s has %d bytes, expected %d: removed it", entry.path,
                                       st.st_size, self.file_bytes)
                        unlink_quietly(Path(entry.path))
                        damaged += 1
                        continue
                    found.append((st.st_mtime, name[: -len(FILE_SUFFIX)], st.st_size))
        found.sort()
        free = self._free_bytes() if self._auto_bound else 0
        auto_bound: int | None = None  # the bound the default rule chose
        with self._lock:
            for _, key, size in found:  # oldest first, so the LRU order follows the mtimes
                self._record_locked(key, size)
            self._counts["errors"] += damaged
            if self._auto_bound:
                auto_bound = self.max_size_bytes = default_max_size_bytes(free, self._total, self.file_bytes)
            victims = self._pick_victims_locked(keep=None)
        self._remove_victims(victims)
        if auto_bound is not None:
            logger.info(
                "L3 size bound %.2f GB (default rule: what this namespace stores, %.2f GB, + %d%% of the %.2f GB "
                "free on %s's filesystem at startup, at most %.0f GB); set max_size_gb in "
                "--hicache-storage-backend-extra-config to choose another",
                auto_bound / 1e9, sum(f[2] for f in found) / 1e9, DEFAULT_BOUND_FREE_SHARE * 100,
                free / 1e9, self.root_dir, DEFAULT_BOUND_MAX_BYTES / 1e9,
            )
        bound = "unbounded" if self.max_size_bytes is None else f"bound {self.max_size_bytes} bytes"
        logger.info(
            "L3 file storage %s (namespace %s): found %d pages, %d bytes, %s; evicted %d to fit, "
            "removed %d stale temp files and %d damaged files",
            self.dir, self.namespace.folder_name, len(found), self._total, bound, len(victims), stale_temps, damaged,
        )

    def _free_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.dir).free
        except OSError as e:
            logger.warning("cannot read the free space of %s (%s); the default L3 bound uses its cap", self.dir, e)
            return int(DEFAULT_BOUND_MAX_BYTES / DEFAULT_BOUND_FREE_SHARE)


class _OpenAttempt:
    """One try at opening the folder, on a daemon thread (a read stuck in the kernel must not keep the process
    alive); ``error`` is the StartupError when it failed."""

    def __init__(self, store: FileKVStorage) -> None:
        self.done = threading.Event()
        self.error: StartupError | None = None
        threading.Thread(target=self._run, args=(store,), name="tierlm-l3-open", daemon=True).start()

    def _run(self, store: FileKVStorage) -> None:
        try:
            store._open_folder()
        except StartupError as e:
            self.error = e
        except OSError as e:  # the scan or the free-space read failed
            self.error = StartupError(f"cannot read L3 storage folder {store.dir}: {e.strerror or e}")
        store._opened(self.error)
        self.done.set()


class _Stale(Exception):
    """The memory a page was written from was reused before the write finished: the file must not be published."""


def open_storage(namespace: StorageNamespace, page_bytes: int, extra_config: Mapping[str, object]) -> FileKVStorage:
    """The 'file' store of registry.py: the folder of SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR."""
    return FileKVStorage.from_extra_config(namespace, page_bytes, extra_config)
