"""HiCacheManager: the KV cache manager with host (L2) and storage (L3) tiers under the radix cache.

Backend-neutral: tensors only move through the backend's page-copy calls; L3 sees raw page bytes.
- Write policies (SGLang): write_through backs a node up to the host when it is inserted; write_through_selective
  once it has been hit twice; write_back only when it is evicted from the device.
- Every page that reaches the host is also written to L3 in the background (when a storage backend is set).
- A request's prefix is served from the fastest tier holding it: device pages are used in place, host pages are
  copied back to the device, and storage pages are read (prefetched while the request waits) into host then
  device. Per-request counts land in ``req.cached`` (device / host / storage).
- An L3 read goes straight into the host pages that will hold it: they are reserved when the prefetch starts
  (``on_request_added``) and handed to the tree at admission; pages it did not fill go back to the host
  allocator, the one a cancelled read may still be writing only once that read has left it (``io_idle``).
- Hybrid models: state snapshots follow their nodes' pages through L2 and L3 (``state_tiers.py``); a match is cut
  to the deepest snapshot it reaches in any tier, which is brought back into a device snapshot slot.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from tierlm.backends.base import HostKVPool, HostStatePool, ModelBackend
from tierlm.runtime.errors import RequestError, StartupError
from tierlm.runtime.cache.storage import registry as storage_registry
from tierlm.runtime.cache.storage.file_storage import FileKVStorage, parse_extra_config
from tierlm.runtime.cache.hiradix_cache import HiRadixCache
from tierlm.runtime.cache.storage.page_keys import page_keys
from tierlm.runtime.cache.state_tiers import StateTiers, state_namespace_fields
from tierlm.runtime.cache.storage.base import BorrowedPage, KVStorage
from tierlm.runtime.cache.storage.storage_io import (DEFAULT_IO_TIMEOUT_S, DEFAULT_MAX_PENDING_WRITE_BYTES, PrefetchHandle,
                                               StorageIO)
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.io_struct import CachedTokens
from tierlm.runtime.cache.kv_cache_manager import KVCacheManager
from tierlm.runtime.logprobs import cacheable_prefix_len
from tierlm.runtime.metrics import EngineMetrics
from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.radix_cache import MatchResult, TreeNode
from tierlm.runtime.request import PendingPrefetch, Req
from tierlm.runtime.server_args import ServerArgs
from tierlm.runtime.cache.state_slots import StateSlots
from tierlm.runtime.cache.state_snapshots import StateSnapshots

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# Keys of --hicache-storage-backend-extra-config read here (the rest goes to the storage backend).
PREFETCH_TIMEOUT_BASE_S = 0.5
PREFETCH_TIMEOUT_PER_PAGE_S = 0.002
# wait_complete waits at most one I/O time limit plus 50 ms a page (25x the timeout policy's 2 ms): every stuck
# read is abandoned after the limit, so this only cuts off a disk slower than 20 pages/s.
WAIT_COMPLETE_PER_PAGE_S = 0.05
# The first time a request with a read in flight is offered for admission, the scheduler waits this long at most
# for it: page-cache reads of a prompt's pages land within milliseconds, and admitting it now instead of after the
# next forward of the running requests saves that whole step. Once per request, so a hung disk costs this once.
ADMISSION_WAIT_S = 0.02
CLOSE_TIMEOUT_S = 3.0  # shutdown: flush queued L3 writes and stop the I/O threads within this, whatever the disk


class HiCacheManager(KVCacheManager):
    def __init__(self, backend: ModelBackend, num_pages: int, page_size: int, host_pages: int, *,
                 write_policy: str, layout: str, storage: FileKVStorage | None = None,
                 storage_io: StorageIO | None = None,
                 prefetch_policy: str = "timeout", prefetch_timeout: tuple[float, float] = (
                     PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_PAGE_S), eviction_policy: str = "lru",
                 state_slots: StateSlots | None = None, host_state_slots: int = 0,
                 state_storage: tuple[KVStorage, StorageIO] | None = None) -> None:
        """``state_slots`` (hybrid models): the device state slots; ``host_state_slots`` host snapshot slots and
        ``state_storage`` the L3 snapshot store beside ``storage`` (state_tiers.py)."""
        super().__init__(num_pages, page_size, enable_radix=False, state_slots=state_slots)
        self.backend = backend
        self.write_policy = write_policy
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout = prefetch_timeout
        page_bytes = backend.kv_bytes_per_token() * page_size
        self.host = HostKVPool(num_pages=host_pages, page_bytes=page_bytes, num_layers=backend.info.num_layers,
                               layout="layer_first" if layout == "layer_first" else "page_first")
        self.host_alloc = PageAllocator(host_pages)
        # Bumped whenever a host page is freed: a queued L3 write of that page (made without a copy) is published
        # only if its page's generation did not move while it was written.
        self._host_gen = np.zeros(host_pages, np.int64)
        self._pending_backups: dict[str, tuple[int, BorrowedPage]] = {}  # queued L3 writes from host pages
        self._pending_lock = threading.Lock()
        self.tree = HiRadixCache(page_size, self.allocator.free, self._free_host_pages,
                                 backup_node=self._backup_node, on_new_node=self._on_new_node,
                                 eviction_policy=eviction_policy)
        self.storage = storage
        self.storage_io = storage_io
        self.states: StateTiers | None = None  # hybrids: snapshots in L2 and L3
        if state_slots is not None:
            self.snapshots = StateSnapshots(state_slots, self.tree, page_size, backend.copy_state_slots)
            st, st_io = state_storage if state_storage is not None else (None, None)
            self.states = StateTiers(backend, self.tree, self.snapshots, max(host_state_slots, 1), page_size, st, st_io)
        self.loaded_host_pages = 0
        self.loaded_storage_pages = 0
        self.parked_storage_pages = 0  # read from L3 into L2 while L1 had no room
        # Host pages reserved for a prefetch to read into, until its request is admitted or released.
        self._prefetch_host: dict[PrefetchHandle, list[int]] = {}
        # Host pages a cancelled read may still be writing: freed once their prefetch is io_idle.
        self._deferred_host: list[tuple[PrefetchHandle, list[int]]] = []

    # ------------------------------------------------------------ construction from flags
    @classmethod
    def create(cls, args: ServerArgs, backend: ModelBackend, num_pages: int, host_pages: int, state_slots: int = 0,
               host_state_slots: int = 0) -> "HiCacheManager":
        """From the flags; ``host_pages`` (and for a hybrid model ``state_slots``, ``host_state_slots``) come from the
        platform's memory plan (runtime/engine_setup.py)."""
        for name, value, allowed in (("--hicache-write-policy", args.hicache_write_policy, WRITE_POLICIES),
                                     ("--hicache-storage-prefetch-policy", args.hicache_storage_prefetch_policy,
                                      PREFETCH_POLICIES),
                                     ("--hicache-mem-layout", args.hicache_mem_layout, LAYOUTS),
                                     ("--hicache-io-backend", args.hicache_io_backend, ("kernel", "direct"))):
            if value not in allowed:
                raise StartupError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        ps = args.page_size
        page_bytes = backend.kv_bytes_per_token() * ps
        storage = storage_io = state_storage = None
        timeout = (PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_PAGE_S)
        hybrid = backend.info.state is not None and state_slots > 0
        if args.hicache_storage_backend:
            storage, storage_io, timeout, state_storage = _open_storage(args, backend, page_bytes, hybrid)
        mgr = cls(backend, num_pages, ps, host_pages, write_policy=args.hicache_write_policy,
                  layout=args.hicache_mem_layout, storage=storage, storage_io=storage_io,
                  prefetch_policy=args.hicache_storage_prefetch_policy, prefetch_timeout=timeout,
                  eviction_policy=args.radix_eviction_policy, state_slots=StateSlots(state_slots) if hybrid else None,
                  host_state_slots=host_state_slots, state_storage=state_storage)
        if mgr.states is not None:
            hs = mgr.states.host
            log.info("HiCache host state pool (L2): %d snapshot slots x %.2f MiB = %.1f MiB%s", hs.num_slots,
                     hs.slot_bytes / 2**20, hs.total_bytes / 2**20,
                     "; snapshots also stored in L3 beside the pages" if state_storage is not None else "")
        log.info("HiCache host pool (L2): %d pages x %d tokens = %d tokens, %.1f MiB, layout %s, write policy %s, "
                 "eviction policy %s (--radix-eviction-policy, device and host tiers)", host_pages, ps, host_pages * ps,
                 mgr.host.total_bytes / 2**20, mgr.host.layout, args.hicache_write_policy, args.radix_eviction_policy)
        if storage is not None:
            st = storage.stats()
            log.info("HiCache storage (L3): %s backend at %s, %d pages already stored (%.1f MiB), "
                     "prefetch policy %s, I/O time limit %g s", args.hicache_storage_backend, storage.dir,
                     st.get("files", 0), st.get("bytes", 0) / 2**20, args.hicache_storage_prefetch_policy,
                     storage_io.io_timeout_s)
        return mgr

    # ------------------------------------------------------------ write policies
    def _on_new_node(self, node: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._backup_node(node)

    def _backup_node(self, node: TreeNode) -> bool:
        """Copy a device node to the host tier (and queue it for storage). False when the host is full."""
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
        n = len(node.host_pages)
        keys = page_keys(self.tree.path_tokens(node), self.page_size)[-n:]
        stored = self.storage.known(keys)  # no file I/O here: the backup thread skips files already present
        gen = self._host_gen
        for key, hp, present in zip(keys, node.host_pages, stored):
            if not present:
                # Written from the host page itself, no copy on this thread (see _free_host_pages).
                page = BorrowedPage(self._host_page_views(hp), lambda hp=hp, g=int(gen[hp]): gen[hp] == g)
                with self._pending_lock:  # _backup_done (backup thread) waits until the entry is in
                    if self.storage_io.backup(key, page, on_done=self._backup_done):
                        self._pending_backups[key] = (hp, page)

    def _backup_done(self, key: str, ok: bool) -> None:  # on the backup thread
        with self._pending_lock:
            self._pending_backups.pop(key, None)

    def _free_host_pages(self, pages: list[int]) -> None:
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

    # ------------------------------------------------------------ admission
    def on_request_added(self, req: Req) -> None:
        """Start reading the request's storage-resident pages into memory while it waits in the queue."""
        if self.storage_io is None:
            return
        tokens = req.input_ids
        max_pages = cacheable_prefix_len(req) // self.page_size  # respects a prompt-logprob start
        m = self.tree.match_prefix(tokens, max_pages, count_hit=False)  # not an admission: no hit counted
        have = len(m.device_pages) + len(m.host_pages)
        if have >= max_pages:
            return
        if self.states is not None:
            _, depth = self.tree.state_ancestor(m.host_last_node if m.host_pages else m.last_node, have, any_tier=True)
            if depth < have:
                return  # memory holds pages past its deepest snapshot: storage pages could not hang below them
        keys = page_keys(tokens[:max_pages * self.page_size], self.page_size)[have:]
        if self.storage_io.stalled:
            return  # the disk hangs: a miss now beats a request waiting on it
        # Only the storage's in-memory index is consulted on this thread (a hung disk must never stall the
        # scheduler). Pages past what it knows may have been stored by another server sharing the folder: the
        # prefetch thread probes for them and stops at the first absent one.
        known = sum(1 for _ in itertools.takewhile(bool, self.storage.known(keys)))
        if req.prefetch is not None:  # added again with one still pending: its reserved pages go back first
            self._drop_prefetch(req)
        state_slot = None
        if self.states is not None:
            # a hybrid reads pages only up to the deepest snapshot the store knows, and that snapshot
            known = self.states.deepest_known(keys[:known])
            keys = keys[:known]
            state_slot = self.states.reserve() if known else None
            if state_slot is None:
                return
        # The pages the index knows are read straight into host pages reserved now; probed ones (likely absent)
        # and any the host tier cannot make room for come back as bytes.
        host_pages = self._reserve_host(m, known)
        into = [self._host_page_views(hp) for hp in host_pages]
        handle = self.storage_io.prefetch(keys, known=known, into=into)
        if host_pages:
            self._prefetch_host[handle] = host_pages
        if state_slot is not None:
            self.states.start_read(handle, keys[-1], state_slot)
        req.prefetch = PendingPrefetch(have, handle, time.perf_counter(), known)

    def _reserve_host(self, m: MatchResult, n: int) -> list[int]:
        """Up to ``n`` free host pages for a prefetch to read into (LRU host pages are evicted for them, never
        the ones of ``m``'s own match)."""
        self._sweep_deferred_host()
        if n <= 0:
            return []
        node = m.host_last_node if m.host_pages else m.last_node
        self.tree.lock(node)
        try:
            self._make_host_free(n)
        finally:
            self.tree.unlock(node)
        k = min(n, self.host_alloc.num_free)
        return self.host_alloc.alloc(k) if k else []

    def _host_page_views(self, page: int) -> list[memoryview]:
        """Writable views of host page ``page`` in page_first byte order (what an L3 file stores)."""
        data = self.host.data
        if self.host.layout == "layer_first":
            return [memoryview(data[layer, page]).cast("B") for layer in range(data.shape[0])]
        return [memoryview(data[page]).cast("B")]

    def _give_back_prefetch_pages(self, handle: PrefetchHandle, used: range) -> None:
        """Free the reserved host pages of a finished or cancelled prefetch outside ``used`` (indices into its
        keys); the page a cancelled read may still be filling waits until that read is over."""
        if self.states is not None:
            self.states.give_back(handle)  # its snapshot read, unless taken
        reserved = self._prefetch_host.pop(handle, None)
        if not reserved:
            return
        free = [hp for i, hp in enumerate(reserved) if i not in used]
        if not handle.io_idle:
            busy = reserved[handle.num_loaded] if handle.num_loaded < len(reserved) else None
            if busy is not None and busy in free:
                free.remove(busy)
                self._deferred_host.append((handle, [busy]))
        if free:
            self._free_host_pages(free)

    def _sweep_deferred_host(self) -> None:
        if self.states is not None:
            self.states.sweep()
        if not self._deferred_host:
            return
        keep = []
        for handle, pages in self._deferred_host:
            if handle.io_idle:
                self._free_host_pages(pages)
            else:
                keep.append((handle, pages))
        self._deferred_host = keep

    def _drop_prefetch(self, req: Req) -> None:
        """A waiting request leaves (abort, error) or restarts its prefetch: stop it, free its host pages."""
        pf, req.prefetch = req.prefetch, None
        pf.handle.cancel()
        self._give_back_prefetch_pages(pf.handle, range(0))

    def release(self, req: Req, cache_kv: bool) -> None:
        if req.prefetch is not None:
            self._drop_prefetch(req)
        super().release(req, cache_kv)
        self._sweep_deferred_host()

    def ready_to_admit(self, req: Req) -> bool:
        """False while a timeout or wait_complete prefetch is still loading within its time budget."""
        pf = req.prefetch
        if pf is None or self.prefetch_policy == "best_effort":
            return True
        states = self.states  # a hybrid's snapshot read goes with the pages (state_tiers.py)
        left = pf.started_at + self._prefetch_budget(pf) - time.perf_counter()
        if not _prefetch_done(pf, states) and left > 0 and not pf.waited:
            pf.waited = True
            pf.handle.wait(min(left, ADMISSION_WAIT_S))
            left = pf.started_at + self._prefetch_budget(pf) - time.perf_counter()
        return _prefetch_done(pf, states) or left <= 0

    def _prefetch_budget(self, pf: PendingPrefetch) -> float:
        """Seconds a request waits for its L3 pages; bounded under every policy, so no request waits forever."""
        pages = pf.known_pages
        if pages == 0:
            if pf.handle.num_loaded == 0:
                return self.storage.probe_wait_s  # only a probe for pages another server may have stored
            # The probe found a page another server stored (a shared store, or a folder another process
            # writes): the rest are likely there too, so wait for them as for pages the index knows.
            pages = len(pf.handle.keys)
        if self.prefetch_policy == "wait_complete":
            return self.storage_io.io_timeout_s + WAIT_COMPLETE_PER_PAGE_S * pages
        base, per_page = self.prefetch_timeout
        return base + per_page * pages

    def _extend_match(self, req: Req, tokens: list[int], m: MatchResult
                      ) -> tuple[TreeNode, list[int], CachedTokens]:
        """Device pages in place, then the host continuation copied back, then pages read from storage. Every
        node reused counts one hit: the device match's in ``match_prefix``, loaded ones where they are loaded."""
        if self.write_policy == "write_through_selective":
            for node in _path(self.tree, m.last_node):
                if node.hit_count >= 2 and node.host_pages is None:
                    self._backup_node(node)
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
            node, pages, n_store = self._load_from_storage(tokens, node, pages, pf, count)
        if self.states is not None:
            self.states.to_device(node)  # the snapshot the request resumes at (KVCacheManager.match cuts there)
        ps = self.page_size
        return node, pages, CachedTokens(device=n_dev * ps, host=n_host * ps, storage=n_store * ps)

    def _cut_host_to_state(self, m: MatchResult) -> MatchResult:
        """A hybrid's host continuation, cut to the deepest snapshot (any tier) on it: pages past it are not
        loaded (the request could not resume there)."""
        n_dev = len(m.device_pages)
        node, pages = self.tree.state_ancestor(m.host_last_node, n_dev + len(m.host_pages), any_tier=True)
        if pages <= n_dev:
            return MatchResult(m.device_pages, m.last_node)
        return MatchResult(m.device_pages, m.last_node, m.host_pages[:pages - n_dev], node)

    def _load_from_host(self, m: MatchResult, count_hit: bool = True) -> tuple[TreeNode, list[int]]:
        """Copy the host-only continuation of a match back to device pages; returns (deepest node, pages)."""
        nodes = _path_between(self.tree, m.last_node, m.host_last_node)
        n = len(m.host_pages)
        self.tree.lock(m.host_last_node)  # neither tier may evict these nodes while we make room
        try:
            if not self._make_free(n):
                return m.last_node, []
            dev = self.allocator.alloc(n)
        finally:
            self.tree.unlock(m.host_last_node)
        self.backend.copy_pages_from_host(self.host, np.asarray(m.host_pages), np.asarray(dev))
        i = 0
        for node in nodes:
            k = len(node.host_pages)
            self.tree.attach_device_pages(node, dev[i:i + k])
            i += k
        if count_hit:
            self.tree.count_hit(m.host_last_node, upto=m.last_node)  # the nodes loaded back from the host
        self.loaded_host_pages += n
        return m.host_last_node, dev

    def _load_from_storage(self, tokens: list[int], node: TreeNode, pages: list[int], pf: PendingPrefetch,
                           count_hit: bool = True) -> tuple[TreeNode, list[int], int]:
        start, handle = pf.start_page, pf.handle
        if self.prefetch_policy == "wait_complete":
            handle.wait(max(0.0, pf.started_at + self._prefetch_budget(pf) - time.perf_counter()))
        entries = handle.cancel()  # all of it when done; else what has arrived within the budget
        reserved = self._prefetch_host.get(handle, [])
        have = len(pages)
        skip = have - start  # pages that meanwhile became available in a faster tier
        used = range(skip, len(entries)) if skip >= 0 else range(0)
        state_slot = None
        if self.states is not None:
            # all pages up to the snapshot, the snapshot itself, and a place in the tree no node covers yet
            wait = 0.0
            if self.prefetch_policy == "wait_complete":
                wait = max(0.0, pf.started_at + self._prefetch_budget(pf) - time.perf_counter())
            state_slot = self.states.take(handle, wait)
            whole = len(entries) == len(handle.keys) and state_slot is not None
            if not whole or self.tree._page_key(tokens, have * self.page_size) in node.children:
                used = range(0)
        n = len(used)
        if n == 0:
            self._give_back_prefetch_pages(handle, range(0))
            if state_slot is not None:
                self.states.alloc.free(state_slot)
            return node, pages, 0
        n_bytes = sum(1 for i in used if i >= len(reserved))  # entries read as bytes: need host pages now
        self.tree.lock(node)
        try:
            if not self._make_host_free(n_bytes):
                self._give_back_prefetch_pages(handle, range(0))
                if state_slot is not None:
                    self.states.alloc.free(state_slot)
                return node, pages, 0
            extra = self.host_alloc.alloc(n_bytes) if n_bytes else []
            dev = self.allocator.alloc(n) if self._make_free(n) else None
        finally:
            self.tree.unlock(node)
        self._give_back_prefetch_pages(handle, used)  # the reserved pages outside ``used``
        host_pages, extra_it = [], iter(extra)
        for i in used:
            if i < len(reserved):
                host_pages.append(reserved[i])  # read straight into it
            else:
                hp = next(extra_it)
                self.host.page_from_bytes(hp, entries[i])
                host_pages.append(hp)
        if dev is None:
            # L1 is full at the moment: keep what was read in L2, where this request's retry finds it.
            ps = self.page_size
            if self.tree.add_host_only_child(node, tokens[have * ps:(have + n) * ps], host_pages):
                self.parked_storage_pages += n
                if state_slot is not None:
                    self.states.adopt(node.children[self.tree._page_key(tokens, have * ps)], state_slot)
            else:
                self._free_host_pages(host_pages)
                if state_slot is not None:
                    self.states.alloc.free(state_slot)
            return node, pages, 0
        self.backend.copy_pages_from_host(self.host, np.asarray(host_pages), np.asarray(dev))
        total = have + n
        tree_pages, last = self.tree.insert_with_host(tokens[:total * self.page_size], pages + dev, host_pages, have)
        # Pages another path inserted meanwhile cannot exist (same thread), so the tree adopted ours.
        assert tree_pages[have:] == dev
        if state_slot is not None:
            self.states.adopt(last, state_slot)
        if count_hit:
            self.tree.count_hit(last, upto=node)  # the nodes now holding the pages read from storage
        self.loaded_storage_pages += n
        return last, tree_pages, n

    def _make_host_free(self, n: int) -> bool:
        self._sweep_deferred_host()
        short = n - self.host_alloc.num_free
        if short > 0:
            self.tree.evict_host(short)
        return self.host_alloc.num_free >= n

    # ------------------------------------------------------------ flush / close / reporting
    def flush(self, storage: bool = False) -> None:
        self.tree.reset()
        if storage and self.storage is not None:
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
            info["storage"] = {"backend": "file", "dir": str(self.storage.dir), **self.storage_health(),
                               **self.storage.stats(), "prefetch_policy": self.prefetch_policy,
                               "io_timeout_s": self.storage_io.io_timeout_s, "io": self.storage_io.stats()}
        if self.states is not None:
            info["host_state"] = self.states.info()
        return info

    def state_accounting(self) -> dict[str, int] | None:
        acc = super().state_accounting()
        if acc is not None and self.states is not None:
            acc.update(self.states.accounting())
        return acc

    def storage_health(self) -> dict[str, Any]:
        """"online", or "degraded" while writes fail or a storage call hangs; the latest error either way."""
        disk, io = self.storage.health(), self.storage_io.health()
        bad = [h for h in (io, disk) if h["state"] != "online"]
        last = (bad[0] if bad else disk if disk["last_error"] else io)["last_error"]
        return {"state": "degraded" if bad else "online", "last_error": last}

    def accounting(self) -> dict[str, int]:
        acc = super().accounting()
        acc.update(host_total_pages=self.host.num_pages, host_free_pages=self.host_alloc.num_free,
                   host_cached_pages=self.tree.host_pages_cached,
                   host_prefetch_pages=sum(map(len, self._prefetch_host.values()))
                   + sum(len(p) for _, p in self._deferred_host))
        return acc

    def register_gauges(self, metrics: EngineMetrics) -> None:
        super().register_gauges(metrics)
        m, ps, t = metrics, self.page_size, self.tree
        m.gauge("tierlm_hicache_host_pages_total", "Host (L2) KV pages", lambda: self.host.num_pages)
        m.gauge("tierlm_hicache_host_pages_used", "Host (L2) KV pages in use",
                lambda: self.host.num_pages - self.host_alloc.num_free)
        # cumulative values are counters (exposed as *_total)
        m.counter("tierlm_hicache_demoted_pages", "Device pages demoted to host on eviction", lambda: t.demoted_pages)
        m.counter("tierlm_hicache_host_evicted_pages", "Host pages evicted", lambda: t.evicted_host_pages)
        m.counter("tierlm_hicache_loaded_host_tokens", "Tokens loaded back from host to device",
                  lambda: self.loaded_host_pages * ps)
        m.counter("tierlm_hicache_loaded_storage_tokens", "Tokens loaded from storage into the device tier",
                  lambda: self.loaded_storage_pages * ps)
        m.counter("tierlm_hicache_parked_storage_tokens", "Tokens read from storage into the host tier while the "
                  "device tier had no room", lambda: self.parked_storage_pages * ps)
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
            for stat in ("files", "bytes"):
                m.gauge(f"tierlm_hicache_storage_{stat}", f"L3 storage {stat}",
                        lambda stat=stat: self.storage.stats()[stat])
            for stat in ("bytes_read", "bytes_written", "misses", "errors", "evictions", "read_seconds"):
                m.counter(f"tierlm_hicache_storage_{stat}", f"L3 storage {stat}",
                          lambda stat=stat: self.storage.stats()[stat])
            m.gauge("tierlm_hicache_storage_online", "1 while L3 storage works, 0 while writes fail or a "
                    "storage call hangs (see tiers.storage.last_error in /server_info)",
                    lambda: float(self.storage_health()["state"] == "online"))
            m.gauge("tierlm_hicache_storage_stuck_threads", "L3 I/O threads stuck in a storage call right now",
                    lambda: self.storage_io.stats()["stuck_threads"])
            for stat, doc in (("io_timeouts", "L3 reads/writes abandoned after the I/O time limit"),
                              ("backups_dropped", "L3 page writes dropped (backlog full, hung disk, shutdown)")):
                m.counter(f"tierlm_hicache_storage_{stat}", doc, lambda stat=stat: self.storage_io.stats()[stat])

    def eviction_counters(self) -> dict[str, Callable[[], float]]:
        counters = {**super().eviction_counters(), "host": lambda: self.tree.evicted_host_pages}
        if self.storage is not None:
            counters["storage"] = lambda: self.storage.stats()["evictions"]
        return counters


def _prefetch_done(pf: PendingPrefetch, states: StateTiers | None) -> bool:
    """The prefetch's pages (and for a hybrid its snapshot) are read."""
    return pf.handle.done and (states is None or states.read_done(pf.handle))


def _path(tree: HiRadixCache, node: TreeNode) -> list[TreeNode]:
    out = []
    while node is not tree.root:
        out.append(node)
        node = node.parent
    return out[::-1]


def _path_between(tree: HiRadixCache, upper: TreeNode, lower: TreeNode) -> list[TreeNode]:
    """Nodes strictly below ``upper`` down to and including ``lower``, top first."""
    out = []
    while lower is not upper:
        out.append(lower)
        lower = lower.parent
    return out[::-1]


def _open_storage(args: ServerArgs, backend: ModelBackend, page_bytes: int, hybrid: bool = False
                  ) -> tuple[KVStorage, StorageIO, tuple[float, float], tuple[KVStorage, StorageIO] | None]:
    try:
        storage_registry.check_name(args.hicache_storage_backend)
    except ValueError as e:
        raise StartupError(str(e)) from e
    try:
        cfg = parse_extra_config(args.hicache_storage_backend_extra_config)
    except ValueError as e:
        raise StartupError(f"--hicache-storage-backend-extra-config: {e}") from e
    timeout = (float(cfg.pop("prefetch_timeout_base", PREFETCH_TIMEOUT_BASE_S)),
               float(cfg.pop("prefetch_timeout_per_page", PREFETCH_TIMEOUT_PER_PAGE_S)))
    io_timeout = cfg.pop("io_timeout", DEFAULT_IO_TIMEOUT_S)
    if isinstance(io_timeout, bool) or not isinstance(io_timeout, (int, float)) or not io_timeout > 0:
        raise StartupError("--hicache-storage-backend-extra-config: io_timeout (time limit of one L3 read or write) "
                           f"must be a positive number of seconds, got {io_timeout!r}")
    # Host pages are always written to files in page-first byte order, whatever the host layout.
    ns = StorageNamespace.from_fields({**backend.kv_namespace(), "page_size": args.page_size, "layout": "page_first"})
    state_cfg = dict(cfg)  # as the page store gets it
    storage = storage_registry.open_storage(args.hicache_storage_backend, args, ns, page_bytes, cfg)
    # The write backlog holds page copies: 256 MiB, or 16 pages where pages are larger than 16 MiB.
    backlog = max(DEFAULT_MAX_PENDING_WRITE_BYTES, 16 * page_bytes)
    io = StorageIO(storage, num_threads=1, max_pending_write_bytes=backlog, io_timeout_s=io_timeout)
    state_storage = None
    if hybrid:  # snapshots: a second store of the same backend, in a namespace of their own (state_tiers.py)
        slot_bytes = HostStatePool(0, backend.info.state).slot_bytes
        state_ns = StorageNamespace.from_fields(state_namespace_fields(backend, args.page_size))
        st = storage_registry.open_storage(args.hicache_storage_backend, args, state_ns, slot_bytes, state_cfg)
        state_storage = (st, StorageIO(st, num_threads=1, max_pending_write_bytes=max(DEFAULT_MAX_PENDING_WRITE_BYTES,
                                                                                      16 * slot_bytes),
                                       io_timeout_s=io_timeout))
    return storage, io, timeout, state_storage
