"""HiCacheManager: the KV cache manager with host (L2) and storage (L3) tiers under the radix cache; its one
job is which tier holds each page.

Backend-neutral: tensors only move through the backend's page-copy calls; L3 sees raw page bytes.
- Write policies (SGLang): write_through backs a node up to the host when it is inserted; write_through_selective
  once it has been hit twice; write_back only when it is evicted from the device.
- Every page that reaches the host is also written to L3 in the background (when a storage backend is set).
- A request's prefix is served from the fastest tier holding it: device pages are used in place, host pages are
  copied back to the device, and storage pages are read (prefetched while the request waits) into host then
  device. The L3 read's life, from the queue to admission, is storage_prefetch.py's. Per-request counts land in
  ``req.cached`` (device / host / storage).
- Hybrid models: state snapshots follow their nodes' pages through L2 and L3 (``state_tiers.py``); a match is cut
  to the deepest snapshot it reaches in any tier, which is brought back into a device snapshot slot.

The composition root (runtime/engine_setup.py) builds the tree, the host pool size and the L3 store from the flags.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from tierlm.backends.base import HostKVPool, ModelBackend
from tierlm.runtime.cache.hiradix_cache import HiRadixCache
from tierlm.runtime.cache.hit_stages import STAGES, HitStages
from tierlm.runtime.cache.kv_cache_manager import KVCacheManager
from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.radix_cache import MatchResult, TreeNode
from tierlm.runtime.cache.state_slots import StateSlots
from tierlm.runtime.cache.state_tiers import StateTiers
from tierlm.runtime.cache.storage.base import BorrowedPage, KVStorage
from tierlm.runtime.cache.storage.page_keys import page_keys
from tierlm.runtime.cache.storage.storage_io import StorageIO
from tierlm.runtime.cache.storage_prefetch import PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_PAGE_S, StoragePrefetch
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import CachedTokens
from tierlm.runtime.metrics import EngineMetrics
from tierlm.runtime.request import Req

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
CLOSE_TIMEOUT_S = 3.0  # shutdown: flush queued L3 writes and stop the I/O threads within this, whatever the disk


class HiCacheManager(KVCacheManager):
    def __init__(self, backend: ModelBackend, allocator: PageAllocator, page_size: int, tree: HiRadixCache,
                 host_pages: int, *, write_policy: str, layout: str, storage: KVStorage | None = None,
                 storage_io: StorageIO | None = None, prefetch_policy: str = "timeout",
                 prefetch_timeout: tuple[float, float] = (PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_PAGE_S),
                 state_slots: StateSlots | None = None, host_state_slots: int = 0,
                 state_storage: tuple[KVStorage, StorageIO] | None = None) -> None:
        """``tree``: a HiRadixCache on ``allocator.free`` (this manager gives it its host tier). ``storage`` and
        ``storage_io``: the L3 store and its I/O threads, None without one. ``state_slots`` (hybrid models): the
        device state slots; ``host_state_slots`` host snapshot slots and ``state_storage`` the L3 snapshot store
        beside ``storage`` (state_tiers.py)."""
        super().__init__(allocator, page_size, tree, state_slots=state_slots,
                         copy_state_slots=backend.copy_state_slots if state_slots is not None else None)
        self.tree: HiRadixCache = tree
        self.backend = backend
        self.write_policy = write_policy
        page_bytes = backend.kv_bytes_per_token() * page_size
        self.host = HostKVPool(num_pages=host_pages, page_bytes=page_bytes, num_layers=backend.info.num_layers,
                               layout="layer_first" if layout == "layer_first" else "page_first")
        self.host_alloc = PageAllocator(host_pages)
        # Bumped whenever a host page is freed: a queued L3 write of that page (made without a copy) is published
        # only if its page's generation did not move while it was written.
        self._host_gen = np.zeros(host_pages, np.int64)
        self._pending_backups: dict[str, tuple[int, BorrowedPage]] = {}  # queued L3 writes from host pages
        self._pending_lock = threading.Lock()
        tree.bind_host_tier(self.free_host_pages, self._backup_node, self._on_new_node)
        self.storage = storage
        self.storage_io = storage_io
        self.states: StateTiers | None = None  # hybrids: snapshots in L2 and L3
        if self.snapshots is not None:
            st, st_io = state_storage if state_storage is not None else (None, None)
            self.states = StateTiers(backend, tree, self.snapshots, max(host_state_slots, 1), page_size, st, st_io)
        self.loaded_host_pages = 0
        self.stages = HitStages()  # where hits' time goes (hit_stages.py), in /server_info and /metrics
        self.prefetch: StoragePrefetch | None = None  # the L3 read of waiting requests (storage_prefetch.py)
        if storage is not None and storage_io is not None:
            self.prefetch = StoragePrefetch(self, storage, storage_io, prefetch_policy, prefetch_timeout)

    # ------------------------------------------------------------ write policies
    def _on_new_node(self, node: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._backup_node(node)

    def _backup_node(self, node: TreeNode) -> bool:
        """Copy a device node to the host tier (and queue it for storage). False when the host is full."""
        assert node.device_pages is not None  # only device nodes are backed up
        n = len(node.device_pages)
        if self.host_alloc.num_free < n:
            self.tree.evict_host(n - self.host_alloc.num_free)
            if self.host_alloc.num_free < n:
                return False
        host_pages = self.host_alloc.alloc(n)
        self.backend.copy_pages_to_host(np.asarray(node.device_pages), self.host, np.asarray(host_pages))
        self.tree.set_host_pages(node, host_pages)
        self._backup_to_storage(node)
        if self.states is not None:
            self.states.backup(node)  # its snapshot, when it has one, goes with the pages
        return True

    def _backup_to_storage(self, node: TreeNode) -> None:
        if self.storage_io is None or self.storage_io.stalled:
            return
        assert self.storage is not None and node.host_pages is not None  # storage comes with its I/O; just backed up
        n = len(node.host_pages)
        keys = page_keys(self.tree.path_tokens(node), self.page_size)[-n:]
        stored = self.storage.known(keys)  # no file I/O here: the backup thread skips files already present
        gen = self._host_gen
        for key, hp, present in zip(keys, node.host_pages, stored):
            if not present:
                # Written from the host page itself, no copy on this thread (see free_host_pages).
                page = BorrowedPage(self.host_page_views(hp), _generation_unchanged(gen, hp, int(gen[hp])))
                with self._pending_lock:  # _backup_done (backup thread) waits until the entry is in
                    if self.storage_io.backup(key, page, on_done=self._backup_done):
                        self._pending_backups[key] = (hp, page)

    def _backup_done(self, key: str, ok: bool) -> None:  # on the backup thread
        with self._pending_lock:
            self._pending_backups.pop(key, None)

    def free_host_pages(self, pages: list[int]) -> None:
        """Every host page is freed here. A page whose L3 write is still queued or running is copied out first
        (the write goes on from the copy; the only copy the write path makes, and only for such pages); the
        generation bump then stops a write from the page's memory from being published."""
        if len(pages):
            with self._pending_lock:
                if self._pending_backups:
                    freed = set(pages)
                    for key in [k for k, (hp, _) in self._pending_backups.items() if hp in freed]:
                        self._pending_backups.pop(key)[1].detach()
                self._host_gen[np.asarray(pages)] += 1
        self.host_alloc.free(pages)

    def host_page_views(self, page: int) -> list[memoryview]:
        """Writable views of host page ``page`` in page_first byte order (what an L3 file stores)."""
        data = self.host.data
        if self.host.layout == "layer_first":
            return [memoryview(data[layer, page]).cast("B") for layer in range(data.shape[0])]
        return [memoryview(data[page]).cast("B")]

    # ------------------------------------------------------------ admission
    def on_request_added(self, req: Req) -> None:
        """Start reading the request's storage-resident pages into memory while it waits in the queue."""
        if self.prefetch is not None:
            self.prefetch.start(req)

    def ready_to_admit(self, req: Req) -> bool:
        """False while a timeout or wait_complete prefetch is still loading within its time budget."""
        return self.prefetch is None or self.prefetch.ready(req)

    def release(self, req: Req, cache_kv: bool) -> None:
        self.stages.released(req, req.first_token_time)
        if req.prefetch is not None:
            assert self.prefetch is not None  # a request's prefetch comes from it
            self.prefetch.drop(req)
        super().release(req, cache_kv)
        if self.prefetch is not None:
            self.prefetch.sweep()

    def _extend_match(self, req: Req, tokens: list[int], m: MatchResult
                      ) -> tuple[TreeNode, list[int], CachedTokens]:
        """Device pages in place, then the host continuation copied back, then pages read from storage. Every
        node reused counts one hit: the device match's in ``match_prefix``, loaded ones where they are loaded."""
        if self.write_policy == "write_through_selective":
            for node in self.tree.path_to(m.last_node):
                if node.hit_count >= 2 and node.host_pages is None:
                    self._backup_node(node)
        copies_before = self.stages.copies()
        node, pages = m.last_node, list(m.device_pages)
        n_dev, n_host, n_store = len(pages), 0, 0
        count = not req.admitted_once  # a retracted request coming back is not a new reuse
        if self.states is not None and m.host_pages:
            m = self._cut_host_to_state(m)
        if m.host_pages:
            node, loaded = self._load_from_host(m, count)
            pages += loaded
            n_host = len(loaded)
        if req.prefetch is not None:
            pf, req.prefetch = req.prefetch, None
            assert self.prefetch is not None  # a request's prefetch comes from it
            node, pages, n_store = self.prefetch.load(tokens, node, pages, pf, count)
        if self.states is not None:
            self.states.to_device(node)  # the snapshot the request resumes at (KVCacheManager.match cuts there)
        if count:
            self.stages.admitted(req, req.arrival, copies_before)
        ps = self.page_size
        return node, pages, CachedTokens(device=n_dev * ps, host=n_host * ps, storage=n_store * ps)

    def _cut_host_to_state(self, m: MatchResult) -> MatchResult:
        """A hybrid's host continuation, cut to the deepest snapshot (any tier) on it: pages past it are not
        loaded (the request could not resume there)."""
        n_dev = len(m.device_pages)
        assert m.host_last_node is not None  # a host continuation ends at a node
        node, pages = self.tree.state_ancestor(m.host_last_node, n_dev + len(m.host_pages), any_tier=True)
        if pages <= n_dev:
            return MatchResult(m.device_pages, m.last_node)
        return MatchResult(m.device_pages, m.last_node, m.host_pages[:pages - n_dev], node)

    def _load_from_host(self, m: MatchResult, count_hit: bool = True) -> tuple[TreeNode, list[int]]:
        """Copy the host-only continuation of a match back to device pages; returns (deepest node, pages)."""
        assert m.host_last_node is not None  # a host continuation ends at a node
        nodes = _path_between(self.tree, m.last_node, m.host_last_node)
        n = len(m.host_pages)
        self.tree.lock(m.host_last_node)  # neither tier may evict these nodes while we make room
        try:
            if not self.make_free(n):
                return m.last_node, []
            dev = self.allocator.alloc(n)
        finally:
            self.tree.unlock(m.host_last_node)
        t0 = time.perf_counter()
        self.backend.copy_pages_from_host(self.host, np.asarray(m.host_pages), np.asarray(dev))
        self.stages.add("host_to_device", time.perf_counter() - t0)
        i = 0
        for node in nodes:
            assert node.host_pages is not None  # the host continuation's nodes
            k = len(node.host_pages)
            self.tree.attach_device_pages(node, dev[i:i + k])
            i += k
        if count_hit:
            self.tree.count_hit(m.host_last_node, upto=m.last_node)  # the nodes loaded back from the host
        self.loaded_host_pages += n
        return m.host_last_node, dev

    # ------------------------------------------------------------ flush / close / reporting
    def flush(self, storage: bool = False) -> None:
        self.tree.reset()
        if storage and self.storage is not None:
            assert self.storage_io is not None  # the storage comes with its I/O threads
            if self.storage_io.stalled:  # clearing the folder from this thread would hang the scheduler
                raise RequestError("the L3 storage is not responding (see tiers.storage.last_error in /server_info): "
                                   "the memory tiers were flushed, the storage files were not; retry once it is "
                                   "back online", 503, code="storage_unavailable", type="service_unavailable_error")
            self.storage_io.flush(timeout=self.storage_io.io_timeout_s)
            removed = self.storage.clear()
            log.info("flushed L3 storage: %d pages removed", removed)
            if self.states is not None and self.states.io is not None:
                log.info("flushed L3 state snapshots: %d removed", self.states.flush_storage())

    def close(self) -> None:
        if self.storage_io is not None:
            self.storage_io.close(flush=True, timeout=CLOSE_TIMEOUT_S)
        if self.storage is not None:
            self.storage.close()
        if self.states is not None:
            self.states.close(CLOSE_TIMEOUT_S)

    def tiers_info(self) -> dict[str, Any]:
        ps = self.page_size
        info: dict[str, Any] = {
            "device": {"total_tokens": self.num_pages * ps, "cached_tokens": self.tree.device_pages_cached * ps,
                       "bytes_per_page": self.host.page_bytes},
            "host": {"total_pages": self.host.num_pages, "total_tokens": self.host.num_pages * ps,
                     "used_pages": self.host.num_pages - self.host_alloc.num_free,
                     "total_bytes": self.host.total_bytes, "layout": self.host.layout,
                     "write_policy": self.write_policy},
        }
        if self.storage is not None:
            assert self.prefetch is not None and self.storage_io is not None  # made with the storage
            info["storage"] = {"backend": self.storage.name, "dir": self.storage.location, **self.storage_health(),
                               **self.storage.stats(), "prefetch_policy": self.prefetch.policy,
                               "io_timeout_s": self.storage_io.io_timeout_s, "io": self.storage_io.stats()}
        if self.states is not None:
            info["host_state"] = self.states.info()
        info["stages"] = self.stage_seconds()
        return info

    def stage_seconds(self) -> dict[str, float]:
        """Seconds spent in each stage of a hit, summed since startup (hit_stages.py)."""
        return self.stages.snapshot(self.storage.stats() if self.storage is not None else None)

    def pin_capacity(self) -> dict[str, int]:
        return {**super().pin_capacity(), "host": self.host.num_pages}  # pins are bounded in the host tier too

    def state_accounting(self) -> dict[str, int] | None:
        acc = super().state_accounting()
        if acc is not None and self.states is not None:
            acc.update(self.states.accounting())
        return acc

    def storage_health(self) -> dict[str, Any]:
        """"online", or "degraded" while writes fail or a storage call hangs; the latest error either way."""
        assert self.storage is not None and self.storage_io is not None  # asked only with L3 storage
        disk, io = self.storage.health(), self.storage_io.health()
        bad = [h for h in (io, disk) if h["state"] != "online"]
        last = (bad[0] if bad else disk if disk["last_error"] else io)["last_error"]
        return {"state": "degraded" if bad else "online", "last_error": last}

    def accounting(self) -> dict[str, int]:
        acc = super().accounting()
        acc.update(host_total_pages=self.host.num_pages, host_free_pages=self.host_alloc.num_free,
                   host_cached_pages=self.tree.host_pages_cached,
                   host_prefetch_pages=self.prefetch.reserved_pages if self.prefetch is not None else 0)
        return acc

    def register_gauges(self, metrics: EngineMetrics) -> None:
        super().register_gauges(metrics)
        m, ps, t = metrics, self.page_size, self.tree
        m.gauge("tierlm_hicache_host_pages_total", "Host (L2) KV pages", lambda: self.host.num_pages)
        m.gauge("tierlm_hicache_host_pages_used", "Host (L2) KV pages in use",
                lambda: self.host.num_pages - self.host_alloc.num_free)
        m.gauge("tierlm_hicache_host_total_tokens", "Tokens the host (L2) KV pool holds",
                lambda: self.host.num_pages * ps)
        m.gauge("tierlm_hicache_host_used_tokens", "Tokens of host (L2) KV pages in use",
                lambda: (self.host.num_pages - self.host_alloc.num_free) * ps)
        # cumulative values are counters (exposed as *_total)
        m.counter("tierlm_hicache_demoted_pages", "Device pages demoted to host on eviction", lambda: t.demoted_pages)
        m.counter("tierlm_hicache_host_evicted_pages", "Host pages evicted", lambda: t.evicted_host_pages)
        m.counter("tierlm_hicache_loaded_host_tokens", "Tokens loaded back from host to device",
                  lambda: self.loaded_host_pages * ps)
        m.counter("tierlm_hicache_loaded_storage_tokens", "Tokens loaded from storage into the device tier",
                  lambda: self.prefetch.loaded_pages * ps if self.prefetch else 0)

        def stage_seconds(stage: str) -> Callable[[], float]:
            return lambda: self.stage_seconds()[stage]

        for stage in STAGES:
            m.counter(f"tierlm_hicache_stage_{stage}_seconds", f"Seconds of cache hits spent in stage {stage} "
                      "(runtime/cache/hit_stages.py)", stage_seconds(stage))
        m.counter("tierlm_hicache_parked_storage_tokens", "Tokens read from storage into the host tier while the "
                  "device tier had no room", lambda: self.prefetch.parked_pages * ps if self.prefetch else 0)
        if self.states is not None:
            st = self.states
            m.gauge("tierlm_state_host_slots_total", "Host (L2) state snapshot slots (hybrid models)",
                    lambda: st.host.num_slots)
            m.gauge("tierlm_state_host_slots_cached", "Host (L2) state snapshots held by the radix cache",
                    lambda: st.alloc.cached)
            m.counter("tierlm_state_host_loaded", "Host state snapshots copied back into device slots",
                      lambda: st.loaded_host_states)
            m.counter("tierlm_state_storage_loaded", "State snapshots read from storage (L3) and used",
                      lambda: st.loaded_storage_states)
        if self.storage is not None:
            storage, io = self.storage, self.storage_io
            assert io is not None  # the storage comes with its I/O threads

            def storage_stat(stat: str) -> Callable[[], float]:
                return lambda: storage.stats()[stat]

            def io_stat(stat: str) -> Callable[[], float]:
                return lambda: io.stats()[stat]

            for stat in ("files", "bytes"):
                m.gauge(f"tierlm_hicache_storage_{stat}", f"L3 storage {stat}", storage_stat(stat))
            for stat in ("bytes_read", "bytes_written", "misses", "errors", "evictions", "read_seconds"):
                m.counter(f"tierlm_hicache_storage_{stat}", f"L3 storage {stat}", storage_stat(stat))
            m.gauge("tierlm_hicache_storage_online", "1 while L3 storage works, 0 while writes fail or a "
                    "storage call hangs (see tiers.storage.last_error in /server_info)",
                    lambda: float(self.storage_health()["state"] == "online"))
            m.gauge("tierlm_hicache_storage_stuck_threads", "L3 I/O threads stuck in a storage call right now",
                    io_stat("stuck_threads"))
            for stat, doc in (("io_timeouts", "L3 reads/writes abandoned after the I/O time limit"),
                              ("backups_dropped", "L3 page writes dropped (backlog full, hung disk, shutdown)")):
                m.counter(f"tierlm_hicache_storage_{stat}", doc, io_stat(stat))

    def eviction_counters(self) -> dict[str, Callable[[], float]]:
        counters = {**super().eviction_counters(), "host": lambda: self.tree.evicted_host_pages}
        if self.storage is not None:
            storage = self.storage
            counters["storage"] = lambda: storage.stats()["evictions"]
        return counters


def _path_between(tree: HiRadixCache, upper: TreeNode, lower: TreeNode) -> list[TreeNode]:
    """Nodes strictly below ``upper`` down to and including ``lower``, top first."""
    out = []
    while lower is not upper:
        out.append(lower)
        assert lower.parent is not None  # ``upper`` is above ``lower``
        lower = lower.parent
    return out[::-1]


def _generation_unchanged(gen: np.ndarray, hp: int, g: int) -> Callable[[], bool]:
    """BorrowedPage's check: host page ``hp`` was not freed (its generation is still ``g``) since the write began."""
    return lambda: gen[hp] == g
