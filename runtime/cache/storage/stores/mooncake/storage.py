"""L3 on Mooncake Store: KV pages in a distributed in-memory store shared by several tierlm servers; the
``KVStorage`` adapter of the package.

``--hicache-storage-backend mooncake`` (install: ``pip install 'tierlm[mooncake]'``). Objects are named
``tierlm_<namespace id>_<page key>``: the same SHA-256 page keys as the file tier, under the full namespace id
(model fingerprint, KV dtype, page size, layout, format version), so two servers of the same model share pages
and servers of different models never read each other's. Each value is the 128-byte page header of
page_header.py followed by the payload, verified on every read before it reaches the host pool: a short,
foreign or damaged value is a miss, counted in ``errors``, and removed from the store.

The package, one part a module:
  client.py      the client's calls tierlm makes (MooncakeClient, a Protocol): the type at the door
  config.py      the configuration (extra-config, $SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, MOONCAKE_*), SGLang's keys
  connection.py  the client, connected on a background thread (offline at startup is retried, not fatal), TCP to
                 the master or a dummy client on the same host
  health.py      degraded while calls fail (one call per retry_interval_s tries), the health watch that brings
                 the tier back
  memory.py      zero-copy over TCP: the host (L2) pool registered with the client (``register_host_memory``);
                 reads land each value straight in a header slot and the rows of the host page
                 (``batch_get_into_multi_buffers``), backups leave from the host page
                 (``batch_put_from_multi_buffers``); a refused registration keeps the copying path (``get_batch``)
  shm.py         the same-host path: a ``mooncake_client`` on this host (``client_server_address``), pages staged
                 in the dummy client's shared memory
  ledger.py      the keys known as stored (``known()`` answers from memory) and the counters
``read_path`` in stats() (tiers.storage in /server_info) says which path runs ("shm (...)", "zero-copy", "copy
(why)"), ``transport`` whether "shm" or "tcp"; ``zero_copy_reads`` / ``zero_copy_writes`` / ``shm_reads`` /
``shm_writes`` count the pages that took them.
All calls run on storage_io.py's threads, never on the scheduler's: ``known()`` answers from memory.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

from tierlm.runtime.cache.storage import page_header
from tierlm.runtime.cache.storage.base import (HealthState, KVStorage, PageBuffer, PagePayload, check_page_key,
                                               copy_into, page_to_store)
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.cache.storage.page_header import HEADER_SIZE
from tierlm.runtime.cache.storage.stores.mooncake.client import ClientFactory, MooncakeClient
from tierlm.runtime.cache.storage.stores.mooncake.config import (CONFIG_KEYS, DEFAULT_CONNECT_WAIT_S,
                                                                 DEFAULT_RETRY_INTERVAL_S, SGLANG_IGNORED_KEYS,
                                                                 TIERLM_KEYS, MooncakeConfig, parse_seconds)
from tierlm.runtime.cache.storage.stores.mooncake.connection import Connection, import_store_class
from tierlm.runtime.cache.storage.stores.mooncake.health import Health
from tierlm.runtime.cache.storage.stores.mooncake.ledger import MAX_KNOWN_KEYS, Ledger
from tierlm.runtime.errors import StartupError

logger = logging.getLogger(__name__)

RPC_FAIL = -900  # Mooncake's error code of a call whose RPC to the master failed
# A value whose size differs from the buffers (a damaged or foreign value; also a transfer that failed): that key
# is read again as bytes, so the header rules decide, as on the copying path.
SIZE_MISMATCH = (-600, -800)  # BUFFER_OVERFLOW, TRANSFER_FAIL
MAX_READ_BATCH_PAGES = 32
# Reads into registered memory do not pass through the client's transfer buffer, so one round trip may take more
# pages (fewer metadata RPCs: ~20 % faster for 128 pages on loopback TCP here than 4 batches of 32).
MAX_ZERO_COPY_BATCH_PAGES = 128
KEY_PREFIX = "tierlm"


class MooncakeKVStorage(KVStorage):
    """KVStorage on Mooncake Store; see the module docstring. ``store_class``: what makes a client
    (MooncakeDistributedStore; tests pass a subclass)."""

    name = "mooncake"
    probe_wait_s = 0.2  # a metadata round trip to the master and a transfer: tens of ms on a busy 2-core machine
    shared = True  # every server of the model reads and writes the same pages

    def __init__(self, config: MooncakeConfig, namespace: StorageNamespace, page_bytes: int, *,
                 connect_wait_s: float = DEFAULT_CONNECT_WAIT_S, retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
                 store_class: ClientFactory | None = None, max_known: int = MAX_KNOWN_KEYS) -> None:
        if not isinstance(page_bytes, int) or page_bytes < 1:
            raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
        self.config = config
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.value_bytes = HEADER_SIZE + page_bytes
        # Prefetch pages per get_batch (one metadata round trip for all): up to 32, and no more than half the
        # client's transfer buffer holds (a batch larger than the buffer comes back with values missing).
        self.copy_batch_pages = max(1, min(MAX_READ_BATCH_PAGES, config.local_buffer_size // 2 // self.value_bytes))
        self._ns_raw = namespace.id_bytes
        self._prefix = f"{KEY_PREFIX}_{self._ns_raw.hex()}_"
        self.location = f"mooncake://{config.master_server_address or config.client_server_address}/" \
                        f"{namespace.folder_name}"
        self._ledger = Ledger(max_known)
        self._health = Health(float(retry_interval_s), config.master_server_address, self.location,
                              on_recover=self._ledger.forget_all)
        self._conn = Connection(config, self._health, self.value_bytes, MAX_ZERO_COPY_BATCH_PAGES,
                                store_class or import_store_class(), probe_key=self._prefix + "probe")
        self._conn.start(connect_wait_s)

    @property
    def retry_interval_s(self) -> float:
        """After a failed call, one call per this many seconds tries the master (the others are answered at once);
        the health watch probes as often while degraded."""
        return self._health.retry_interval_s

    @retry_interval_s.setter
    def retry_interval_s(self, seconds: float) -> None:
        self._health.retry_interval_s = float(seconds)

    @property
    def online(self) -> bool:
        return self._conn.store is not None

    @property
    def connection(self) -> Connection:
        """The client, how pages move and the memory they move through (tests and tools)."""
        return self._conn

    def register_host_memory(self, buf: PageBuffer) -> None:
        """Pages are read into and written from ``buf`` (the host pool): registered with the client now, or once
        it connects."""
        self._conn.register_host_memory(buf)
        logger.info("L3 Mooncake reads and writes: %s", self.read_path)

    @property
    def read_path(self) -> str:
        """"shm (...)", "zero-copy" or "copy (why)": how pages move between the store and the host pool."""
        return self._conn.read_path

    @property
    def read_batch_pages(self) -> int:  # type: ignore[override]  # a property here: it depends on the path that runs
        if self._conn.shm:
            return self._conn.staging.slot_pages
        return MAX_ZERO_COPY_BATCH_PAGES if self._conn.memory.ready(self._conn.store) else self.copy_batch_pages

    def object_key(self, key: str) -> str:
        return self._prefix + key

    # --- KVStorage, plus exists() and delete() of this backend's own (tests and tools) ---
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored, asked of the master (one round trip); updates what known() answers."""
        self._check_open()
        for key in keys:
            self._check_key(key)
        store = self._conn.client()
        if store is None or not keys:
            return [False] * len(keys)
        res = self._health.call(lambda: store.batch_is_exist([self.object_key(k) for k in keys]), "batch_is_exist")
        if res is None:
            return [False] * len(keys)
        out = [r == 1 for r in res]
        if any(r < 0 for r in res):
            self._health.failed(f"batch_is_exist of {len(keys)} keys returned errors "
                                f"{sorted(set(r for r in res if r < 0))}")
        else:
            self._health.ok()
        self._ledger.found(keys, out)
        return out

    def known(self, keys: Sequence[str]) -> list[bool]:
        return self._ledger.known(keys)

    def get(self, key: str) -> bytes | None:
        return self._read(key, absent_is_miss=True)

    def probe(self, key: str) -> bytes | None:
        return self._read(key, absent_is_miss=False)

    def _batch_client(self, keys: Sequence[str], probe: bool) -> MooncakeClient | None:
        """The client for a batch read of ``keys`` (checked), or None when the store is unreachable (counted)."""
        self._check_open()
        for key in keys:
            self._check_key(key)
        store = self._conn.client()
        if store is None:
            self._ledger.count(misses=0 if probe else min(1, len(keys)))
        return store

    def batch_read(self, keys: Sequence[str], *, probe: bool = False) -> list[bytes | None]:
        store = self._batch_client(keys, probe)
        if store is None:
            return [None] * len(keys)
        got: list[bytes | None] = []
        for page in self._get_batch(store, keys, absent_is_miss=not probe):
            if page is None:
                break
            got.append(bytes(page))
        return got + [None] * (len(keys) - len(got))

    def get_into(self, key: str, out: Sequence[PageBuffer], *, probe: bool = False) -> bool:
        return self.batch_get_into([key], [out], probe=probe)[0]

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[Sequence[PageBuffer]], *, probe: bool = False
                       ) -> list[bool]:
        """batch_read's one round trip, each page landing in its buffers: straight from the store when they are
        registered memory, else copied once from the value the client returned; stops at the first page not read."""
        store = self._batch_client(keys, probe)
        if store is None:
            return [False] * len(keys)
        if self._conn.shm:
            got = self._get_staged(store, keys, outs, absent_is_miss=not probe)
            if got is not None:
                return got
        elif self._conn.memory.ready(store):
            got = self._get_registered(store, keys, outs, absent_is_miss=not probe)
            if got is not None:
                return got
        got = []
        for page, out in zip(self._get_batch(store, keys, absent_is_miss=not probe), outs):
            if page is None:
                break
            self._timed_copy(page, out)
            got.append(True)
        return got + [False] * (len(keys) - len(got))

    def _timed_copy(self, value: memoryview, out: Sequence[PageBuffer]) -> None:
        """copy_into, its time counted as copy time and as read time (the read is not done until it lands)."""
        t0 = time.perf_counter_ns()
        copy_into(value, out)
        self._ledger.copied(time.perf_counter_ns() - t0)

    def _multi_buffer_read(self, store: MooncakeClient, keys: Sequence[str], addresses: list[list[int]],
                           sizes: list[list[int]], absent_is_miss: bool) -> tuple[list[int] | None, int]:
        """One batch_get_into_multi_buffers round trip: (each key's result code, or None when the call raised and
        the batch counts as missed; the round trip's time shared by its pages, in ns)."""
        t0 = time.perf_counter_ns()
        rcs = self._health.call(lambda: store.batch_get_into_multi_buffers(
            [self.object_key(k) for k in keys], addresses, sizes), "batch_get_into_multi_buffers")
        if rcs is None:
            self._ledger.count(misses=len(keys) if absent_is_miss else 0)
        elif any(rc == self.value_bytes for rc in rcs):
            self._health.ok()
        return rcs, (time.perf_counter_ns() - t0) // max(1, len(keys))

    def _get_registered(self, store: MooncakeClient, keys: Sequence[str], outs: Sequence[Sequence[PageBuffer]],
                        absent_is_miss: bool) -> list[bool] | None:
        """batch_get_into on registered memory: one round trip lands each value's header in a header slot and its
        payload in ``outs``, verified there. None (nothing read) when a buffer is not registered memory or no header
        slot is free: the caller copies instead."""
        if len(keys) * HEADER_SIZE > self._conn.memory.slot_bytes:
            return None  # more pages than read_batch_pages, which the header slots are sized for
        views = [[memoryview(b).cast("B") for b in out] for out in outs]
        ptrs: list[list[int]] = []
        for v in views:
            p = self._conn.memory.addresses(v)
            if p is None:
                return None
            ptrs.append(p)
        for v in views:
            if sum(b.nbytes for b in v) != self.page_bytes:
                raise ValueError(f"get_into got buffers of {sum(b.nbytes for b in v)} bytes for a "
                                 f"{self.page_bytes}-byte page")
        with self._conn.memory.header_slot() as slot:
            if slot is None:
                return None
            headers, base = slot
            addresses = [[base + i * HEADER_SIZE, *p] for i, p in enumerate(ptrs)]  # header slot, then the page
            rcs, share = self._multi_buffer_read(store, keys, addresses,
                                                 [[HEADER_SIZE, *(b.nbytes for b in v)] for v in views], absent_is_miss)
            if rcs is None:
                return [False] * len(keys)

            def in_place(i: int, key: str, size: int) -> bool:
                header = headers.data[i * HEADER_SIZE:(i + 1) * HEADER_SIZE]
                return self._verified(key, header, views[i], size, share, path="zero_copy_reads")

            return self._landed(keys, rcs, outs, absent_is_miss, in_place)

    def _get_staged(self, store: MooncakeClient, keys: Sequence[str], outs: Sequence[Sequence[PageBuffer]],
                    absent_is_miss: bool) -> list[bool] | None:
        """The same-host read: one call lands each whole value in a staging area of the dummy client's shared memory
        (copied there by the mooncake_client that holds it), verified there, then copied once into ``outs``. None
        (nothing read) when no staging area is free or the batch is larger than one: the caller copies instead."""
        vb = self.value_bytes
        if len(keys) > self._conn.staging.slot_pages:
            return None
        with self._conn.staging.slot(store) as area:
            if area is None:
                return None
            staged, base = area
            rcs, share = self._multi_buffer_read(store, keys, [[base + i * vb] for i in range(len(keys))],
                                                 [[vb]] * len(keys), absent_is_miss)
            if rcs is None:
                return [False] * len(keys)

            def staged_copy(i: int, key: str, size: int) -> bool:
                value = staged.data[i * vb:(i + 1) * vb]
                if not self._verified(key, value[:HEADER_SIZE], [value[HEADER_SIZE:]], size, share, path="shm_reads"):
                    return False
                self._timed_copy(value[HEADER_SIZE:], outs[i])
                return True

            return self._landed(keys, rcs, outs, absent_is_miss, staged_copy)

    def _landed(self, keys: Sequence[str], rcs: Sequence[int], outs: Sequence[Sequence[PageBuffer]],
                absent_is_miss: bool, accept: Callable[[int, str, int], bool]) -> list[bool]:
        """The pages of a batch read into memory, from each key's result code: a whole value is checked (and copied
        where it must be) by ``accept(i, key, size)``; a value of another size is read again as bytes, so a damaged
        one is removed and counted; anything else is a miss. Stops at the first page not read."""
        got: list[bool] = []
        for i, (key, rc) in enumerate(zip(keys, rcs)):
            if rc == self.value_bytes:
                ok = accept(i, key, rc)
            elif rc in SIZE_MISMATCH:  # read it as bytes: a damaged value is then removed and counted
                page = self._read(key, absent_is_miss)
                ok = page is not None
                if page is not None:
                    copy_into(page, outs[i])
            else:  # absent (-704 OBJECT_NOT_FOUND), or the master unreachable: a miss, as get_batch's b""
                self._accept(key, b"", absent_is_miss, 0)
                ok = False
            if not ok:
                break
            got.append(True)
        return got + [False] * (len(keys) - len(got))

    def _get_batch(self, store: MooncakeClient, keys: Sequence[str], absent_is_miss: bool) -> list[memoryview | None]:
        """The verified payloads of ``keys`` (views of the values the client returned), None where not read; asked
        copy_batch_pages at a time (what the client's transfer buffer holds), until one is missing."""
        out: list[memoryview | None] = []
        step = self.copy_batch_pages
        for start in range(0, len(keys), step):
            part = self._get_values(store, keys[start:start + step], absent_is_miss)
            out += part
            if any(page is None for page in part):
                break
        return out + [None] * (len(keys) - len(out))

    def _get_values(self, store: MooncakeClient, keys: Sequence[str], absent_is_miss: bool
                    ) -> list[memoryview | None]:
        """_get_batch of at most copy_batch_pages keys: one get_batch round trip."""
        t0 = time.perf_counter_ns()
        values = self._health.call(lambda: store.get_batch([self.object_key(k) for k in keys]), "get_batch")
        if values is None:
            self._ledger.count(misses=len(keys) if absent_is_miss else 0)
            return [None] * len(keys)
        if any(values):  # the client answers b"" for a failure too: only a value proves the store works
            self._health.ok()
        share = (time.perf_counter_ns() - t0) // max(1, len(keys))  # one round trip, shared by its pages
        return [self._accept(k, v, absent_is_miss, share) for k, v in zip(keys, values)]

    def _read(self, key: str, absent_is_miss: bool) -> bytes | None:
        self._check_open()
        self._check_key(key)
        store = self._conn.client()
        if store is None:
            self._ledger.count(misses=int(absent_is_miss))
            return None
        t0 = time.perf_counter_ns()
        value = self._health.call(lambda: store.get(self.object_key(key)), "get")
        if value is None:
            self._ledger.count(misses=1)
            return None
        if value:  # the client answers b"" for a failure too: only a value proves the store works
            self._health.ok()
        payload = self._accept(key, value, absent_is_miss, time.perf_counter_ns() - t0)
        return None if payload is None else bytes(payload)

    def _accept(self, key: str, value: bytes, absent_is_miss: bool, read_ns: int) -> memoryview | None:
        """The verified payload of ``value`` read for ``key`` (a view into ``value``); None (a miss) when absent or
        unusable. ``read_ns``: the time its transfer took (the checksum's time is added here)."""
        if not value:  # the client answers b"" for an absent key
            self._ledger.absent(key, absent_is_miss)
            return None
        view = memoryview(value)
        payload = view[HEADER_SIZE:]
        if not self._verified(key, view[:HEADER_SIZE], [payload], len(value), read_ns):
            return None
        return payload

    def _verified(self, key: str, header: memoryview, views: Sequence[memoryview], size: int, read_ns: int,
                  path: str | None = None) -> bool:
        """Whether the ``size``-byte value read for ``key`` (``header``, then ``views``) is its intact page: counted
        as a read (and in the ``path`` counter), else removed from the store and counted as an error and a miss.
        ``read_ns``: its transfer's time (the checksum's is added here)."""
        t0 = time.perf_counter_ns()
        problem = page_header.verify(header, size, size, key=key, ns_raw=self._ns_raw,
                                     ns_label=self.namespace.folder_name, page_bytes=self.page_bytes, views=views)
        checked = time.perf_counter_ns()
        if problem is not None:
            self._discard(key, problem)
            return False
        self._ledger.read(key, self.page_bytes, read_ns, checked - t0, path)
        return True

    def set(self, key: str, payload: PagePayload) -> bool:
        """Store a page (a buffer, a list of buffers, or a BorrowedPage) as header + payload, without joining the
        buffers. A key already stored (by this or another server) is left as it is: True."""
        self._check_open()
        self._check_key(key)
        valid, views = page_to_store(key, payload, self.page_bytes)
        store = self._conn.client()
        if store is None:
            return False
        if self._ledger.used(key):
            return True
        header = page_header.pack_header(self._ns_raw, key, views)
        if valid is not None and not valid():
            return False
        obj = self.object_key(key)
        rc = self._put(store, obj, header, views)
        if rc == RPC_FAIL:  # the first call after a master restart fails on the old connection; the next reconnects
            rc = self._put(store, obj, header, views)
        if rc is None:
            return False
        if rc != 0:
            if self._health.call(lambda: store.is_exist(obj), "is_exist") == 1:  # stored meanwhile by another server
                self._health.ok()
                self._ledger.remember(key)
                return True
            self._health.failed(f"put of {obj[:40]}.. returned {rc}")
            return False
        if valid is not None and not valid():  # the page's memory was reused while it was sent: do not keep it
            self._health.call(lambda: store.remove(obj, True), "remove")
            return False
        self._health.ok()
        self._ledger.wrote(key, self.value_bytes)
        return True

    def _put(self, store: MooncakeClient, obj: str, header: bytes, views: Sequence[memoryview]) -> int | None:
        """Store header + ``views`` as ``obj``: from registered memory when the views are in it (the host pool), from
        a staging area on the same-host path, else through put_parts (which copies them into the client's buffer).
        The client's code, None if it raised."""
        if self._conn.shm:
            with self._conn.staging.slot(store) as area:
                if area is not None:
                    staged = area[0].data
                    staged[:HEADER_SIZE] = memoryview(header)
                    pos = HEADER_SIZE
                    for v in views:
                        staged[pos:pos + v.nbytes] = v.cast("B")
                        pos += v.nbytes
                    rc = self._health.call(lambda: store.put_from(obj, area[1], pos), "put")
                    if rc == 0:
                        self._ledger.count(shm_writes=1)
                    return rc
        ptrs = self._conn.memory.addresses(views) if self._conn.memory.ready(store) else None
        if ptrs is not None:
            with self._conn.memory.header_slot() as slot:
                if slot is not None:
                    slot[0][:HEADER_SIZE] = memoryview(header)
                    rcs = self._health.call(lambda: store.batch_put_from_multi_buffers(
                        [obj], [[slot[1], *ptrs]], [[HEADER_SIZE, *(v.nbytes for v in views)]]), "put")
                    if rcs is not None and rcs[0] == 0:
                        self._ledger.count(zero_copy_writes=1)
                    return None if rcs is None else rcs[0]
        return self._health.call(lambda: store.put_parts(obj, header, *views), "put")

    def delete(self, key: str) -> bool:
        self._check_open()
        self._check_key(key)
        self._ledger.forget(key)
        store = self._conn.store
        if store is None:
            return False
        rc = self._health.call(lambda: store.remove(self.object_key(key), True), "remove")
        return rc == 0

    def clear(self) -> int:
        """Remove every object of this namespace from the whole store (every server sharing it loses them)."""
        self._check_open()
        self._ledger.forget_all()
        store = self._conn.store
        if store is None:
            logger.warning("L3 Mooncake store %s is offline: nothing cleared there", self.location)
            return 0
        rc = self._health.call(lambda: store.remove_by_regex(f"^{self._prefix}[0-9a-f]{{64}}$", True),
                               "remove_by_regex")
        removed = max(0, rc or 0)
        logger.info("cleared L3 Mooncake store %s: removed %d pages", self.location, removed)
        return removed


    def stats(self) -> dict[str, Any]:
        out = self._ledger.snapshot(self.value_bytes, errors=self._health.failures)
        out["max_bytes"] = None  # the store's size is the sum of the segments its clients lend
        out["backend"] = self.name  # tiers.storage in /server_info
        out["read_path"] = self.read_path  # "shm (...)", "zero-copy", or "copy (why)"
        out["transport"] = self._conn.transport  # "shm" (a mooncake_client on this host) or "tcp"
        out["master"] = self.config.master_server_address
        out["connected"] = self.online
        return out

    def health(self) -> HealthState:
        return self._health.state()

    def close(self) -> None:
        self._conn.close()

    # --- internals ---
    def _discard(self, key: str, reason: str) -> None:
        logger.warning("L3 Mooncake object %s is unusable (%s): removed it, serving a miss",
                       self.object_key(key)[:48] + "..", reason)
        self._ledger.unusable(key)
        store = self._conn.store
        if store is not None:
            try:
                store.remove(self.object_key(key), True)
            except Exception as e:  # noqa: BLE001
                logger.debug("could not remove %s: %s", key, e)

    def _check_open(self) -> None:
        if self._conn.closed:
            raise RuntimeError(f"MooncakeKVStorage {self.location} is closed; open a new one")

    _check_key = staticmethod(check_page_key)


def open_storage(namespace: StorageNamespace, page_bytes: int, extra_config: Mapping[str, object]
                 ) -> MooncakeKVStorage:
    """The 'mooncake' store of registry.py."""
    cfg = dict(extra_config or {})
    store_class = import_store_class()  # the install hint before any config question
    unknown = sorted(set(cfg) - set(CONFIG_KEYS) - set(TIERLM_KEYS) - set(SGLANG_IGNORED_KEYS))
    if unknown:
        logger.warning("mooncake storage ignores extra-config keys %s (it knows %s)", unknown,
                       list(CONFIG_KEYS + TIERLM_KEYS))
    try:
        connect_wait = parse_seconds(cfg.get("connect_wait_s", DEFAULT_CONNECT_WAIT_S))
        retry = parse_seconds(cfg.get("retry_interval_s", DEFAULT_RETRY_INTERVAL_S))
    except (TypeError, ValueError) as e:
        raise StartupError(f"mooncake connect_wait_s / retry_interval_s must be numbers of seconds: {e}") from e
    config = MooncakeConfig.resolve(cfg)
    logger.info("L3 Mooncake store config from %s: %s", config.source, config.describe())
    return MooncakeKVStorage(config, namespace, page_bytes, connect_wait_s=connect_wait,
                             retry_interval_s=max(0.1, retry), store_class=store_class)
