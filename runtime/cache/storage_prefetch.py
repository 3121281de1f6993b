"""StoragePrefetch: the life of a waiting request's L3 read, from the queue to admission (HiCache).

A request's pages that only storage holds are read while it waits (``start``, called when it is queued). The
read goes straight into the host pages that will hold them: they are reserved when it starts and handed to the
tree at admission (``load``); pages it did not fill go back to the host allocator, the one a cancelled read may
still be writing only once that read has left it (``io_idle``, ``sweep``). The prefetch policy (SGLang's
best_effort, wait_complete, timeout) decides how long admission waits for it (``ready``, ``budget``), always a
bounded time. Hybrid models read the snapshot at the end of the pages too (state_tiers.py).
When nothing else runs, a request whose pages are still being read is admitted once the first one is in, and
``load`` copies each page to the device as soon as it is read: the host -> device copy overlaps the rest of the
read instead of following it (``_stream``), within the same time budget.
"""
from __future__ import annotations

import itertools
import time
from typing import Protocol

import numpy as np

from tierlm.backends.base import HostKVPool, ModelBackend
from tierlm.runtime.cache.cacheable_prefix import cacheable_prefix_len
from tierlm.runtime.cache.hiradix_cache import HiRadixCache
from tierlm.runtime.cache.hit_stages import HitStages
from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.radix_cache import MatchResult, TreeNode
from tierlm.runtime.cache.state_tiers import StateTiers
from tierlm.runtime.cache.storage.base import KVStorage
from tierlm.runtime.cache.storage.page_keys import page_keys
from tierlm.runtime.cache.storage.storage_io import FreeAfterRead, PrefetchHandle, StorageIO
from tierlm.runtime.request import PendingPrefetch, Req

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# The timeout policy's budget: this base plus this per page (--hicache-storage-backend-extra-config
# prefetch_timeout_base / prefetch_timeout_per_page).
PREFETCH_TIMEOUT_BASE_S = 0.5
PREFETCH_TIMEOUT_PER_PAGE_S = 0.002
# wait_complete waits at most one I/O time limit plus 50 ms a page (25x the timeout policy's 2 ms): every stuck
# read is abandoned after the limit, so this only cuts off a disk slower than 20 pages/s.
WAIT_COMPLETE_PER_PAGE_S = 0.05
# The first time a request with a read in flight is offered for admission, the scheduler waits this long at most
# for it: page-cache reads of a prompt's pages land within milliseconds, and admitting it now instead of after the
# next forward of the running requests saves that whole step. Once per request, so a hung disk costs this once.
ADMISSION_WAIT_S = 0.02


class TieredPages(Protocol):
    """What a prefetch needs of the HiCache manager: the tree, both page pools and the copies between them."""

    tree: HiRadixCache
    page_size: int
    allocator: PageAllocator  # device (L1) pages
    in_use_pages: int  # device pages running requests hold (0: nothing runs whose steps a wait would delay)
    host_alloc: PageAllocator  # host (L2) pages
    host: HostKVPool
    backend: ModelBackend
    states: StateTiers | None
    stages: HitStages  # where the time of a hit goes: this adds the copies at admission

    def make_free(self, n: int) -> bool: ...

    def free_host_pages(self, pages: list[int]) -> None: ...

    def host_page_views(self, page: int) -> list[memoryview]: ...


class StoragePrefetch:
    def __init__(self, cache: TieredPages, storage: KVStorage, io: StorageIO, policy: str = "timeout",
                 timeout: tuple[float, float] = (PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_PAGE_S)) -> None:
        """``cache``: the manager whose tree, host tier and device pool the pages land in."""
        self.cache = cache
        self.storage = storage
        self.io = io
        self.policy = policy
        self.timeout = timeout  # the timeout policy's (base, per page) seconds
        self.states: StateTiers | None = cache.states  # hybrids: snapshots in L2 and L3
        self.loaded_pages = 0
        self.parked_pages = 0  # read from L3 into L2 while L1 had no room
        # Host pages reserved for a prefetch to read into, until its request is admitted or released.
        self._reserved: dict[PrefetchHandle, list[int]] = {}
        # Host pages a cancelled read may still be writing: freed once their prefetch is io_idle.
        self._deferred: FreeAfterRead[list[int]] = FreeAfterRead(cache.free_host_pages)
        # Reads land in (and backups leave from) the host pool: a store that moves pages through registered memory
        # (Mooncake) registers it once, here at startup.
        storage.register_host_memory(cache.host.data)

    @property
    def reserved_pages(self) -> int:
        """Host pages held for reads in flight (reserved, or waiting for a cancelled read to leave them)."""
        return sum(map(len, self._reserved.values())) + sum(map(len, self._deferred))

    # ------------------------------------------------------------ start
    def start(self, req: Req) -> None:
        """Start reading the request's storage-resident pages into memory while it waits in the queue."""
        cache, tree, ps = self.cache, self.cache.tree, self.cache.page_size
        tokens = req.input_ids
        max_pages = cacheable_prefix_len(req) // ps  # respects a prompt-logprob start
        m = tree.match_prefix(tokens, max_pages, count_hit=False)  # not an admission: no hit counted
        have = len(m.device_pages) + len(m.host_pages)
        if have >= max_pages:
            return
        if self.states is not None:
            deepest = m.host_last_node if m.host_pages else m.last_node
            assert deepest is not None  # a host continuation ends at host_last_node
            _, depth = tree.state_ancestor(deepest, have, any_tier=True)
            if depth < have:
                return  # memory holds pages past its deepest snapshot: storage pages could not hang below them
        keys = page_keys(tokens[:max_pages * ps], ps)[have:]
        if self.io.stalled:
            return  # the disk hangs: a miss now beats a request waiting on it
        # Only the storage's in-memory index is consulted on this thread (a hung disk must never stall the
        # scheduler). Pages past what it knows may have been stored by another server sharing the folder: the
        # prefetch thread probes for them and stops at the first absent one.
        known = sum(1 for _ in itertools.takewhile(bool, self.storage.known(keys)))
        if req.prefetch is not None:  # added again with one still pending: its reserved pages go back first
            self.drop(req)
        state_slot = None
        if self.states is not None:
            # a hybrid reads pages only up to the deepest snapshot the store knows, and that snapshot
            known = self.states.deepest_known(keys[:known])
            keys = keys[:known]
            state_slot = self.states.reserve() if known else None
            if state_slot is None:
                return
        # The pages the index knows are read straight into host pages reserved now (LRU host pages are evicted
        # for them). On a shared store probed ones are too (another server may have written them), but only into
        # pages already free: a probe usually misses, and evicting good L2 pages for it would lose them for good.
        # Probed pages of a private store (likely absent) and any the host tier has no room for come back as
        # bytes; reserved pages a probe did not fill go back when the request is admitted or dropped.
        host_pages = self._reserve_host(m, known, len(keys) - known if self.storage.shared else 0)
        into = [cache.host_page_views(hp) for hp in host_pages]
        handle = self.io.prefetch(keys, known=known, into=into)
        if host_pages:
            self._reserved[handle] = host_pages
        if state_slot is not None:
            assert self.states is not None  # a state slot is reserved only from them
            self.states.start_read(handle, keys[-1], state_slot)
        req.prefetch = PendingPrefetch(have, handle, time.perf_counter(), known)

    def _reserve_host(self, m: MatchResult, n: int, extra: int = 0) -> list[int]:
        """Up to ``n`` host pages for a prefetch to read into (LRU host pages are evicted for them, never the ones
        of ``m``'s own match), then up to ``extra`` more from pages already free (no eviction)."""
        self.sweep()
        if n + extra <= 0:
            return []
        tree, host_alloc = self.cache.tree, self.cache.host_alloc
        node = m.host_last_node if m.host_pages else m.last_node
        if n > 0:
            assert node is not None  # evicting for a read: the match to keep ends at a node (the root at least)
            tree.lock(node)
            try:
                self._make_host_free(n)
            finally:
                tree.unlock(node)
        k = min(n + extra, host_alloc.num_free)
        return host_alloc.alloc(k) if k else []

    # ------------------------------------------------------------ admission
    def ready(self, req: Req) -> bool:
        """False while a timeout or wait_complete prefetch is still loading within its time budget."""
        pf = req.prefetch
        if pf is None or self.policy == "best_effort":
            return True
        states = self.states  # a hybrid's snapshot read goes with the pages (state_tiers.py)
        left = pf.started_at + self.budget(pf) - time.perf_counter()
        if not _prefetch_done(pf, states) and left > 0 and not pf.waited:
            pf.waited = True
            if self._may_stream(pf):  # the first page is enough: load() copies the rest as they arrive
                pf.handle.wait_loaded(1, min(left, ADMISSION_WAIT_S))
            else:
                pf.handle.wait(min(left, ADMISSION_WAIT_S))
            left = pf.started_at + self.budget(pf) - time.perf_counter()
        return _prefetch_done(pf, states) or left <= 0 or (self._may_stream(pf) and pf.handle.num_loaded > 0)

    def _may_stream(self, pf: PendingPrefetch) -> bool:
        """Whether admission may overlap the copy to the device with the rest of the read: every page is read into
        a reserved host page (no bytes to place), no snapshot goes with them, and no running request's steps would
        wait while load() does."""
        h = pf.handle
        return (self.policy != "best_effort" and self.states is None and not h.done
                and len(h.into) == len(h.keys) == len(self._reserved.get(h, ())) and self.cache.in_use_pages == 0)

    def budget(self, pf: PendingPrefetch) -> float:
        """Seconds a request waits for its L3 pages; bounded under every policy, so no request waits forever."""
        pages = pf.known_pages
        if pages == 0:
            if pf.handle.num_loaded == 0:
                return self.storage.probe_wait_s  # only a probe for pages another server may have stored
            # The probe found a page another server stored (a shared store, or a folder another process
            # writes): the rest are likely there too, so wait for them as for pages the index knows.
            pages = len(pf.handle.keys)
        if self.policy == "wait_complete":
            return self.io.io_timeout_s + WAIT_COMPLETE_PER_PAGE_S * pages
        base, per_page = self.timeout
        return base + per_page * pages

    def load(self, tokens: list[int], node: TreeNode, pages: list[int], pf: PendingPrefetch,
             count_hit: bool = True) -> tuple[TreeNode, list[int], int]:
        """At admission: the pages the read brought, below ``node`` (the match so far, ``pages`` its device
        pages), put into the tree and onto the device; returns (deepest node, device pages, pages loaded)."""
        cache, tree, ps = self.cache, self.cache.tree, self.cache.page_size
        start, handle = pf.start_page, pf.handle
        if self._may_stream(pf):  # admitted while the read goes on (ready): copy as it reads, else wait for it
            if start == len(pages):
                streamed = self._stream(tokens, node, pages, pf, count_hit)
                if streamed is not None:
                    return streamed
            handle.wait(max(0.0, pf.started_at + self.budget(pf) - time.perf_counter()))
        elif self.policy == "wait_complete":
            handle.wait(max(0.0, pf.started_at + self.budget(pf) - time.perf_counter()))
        entries = handle.cancel()  # all of it when done; else what has arrived within the budget
        reserved = self._reserved.get(handle, [])
        have = len(pages)
        skip = have - start  # pages that meanwhile became available in a faster tier
        used = range(skip, len(entries)) if skip >= 0 else range(0)
        state_slot = None
        if self.states is not None:
            # all pages up to the snapshot, the snapshot itself, and a place in the tree no node covers yet
            wait = 0.0
            if self.policy == "wait_complete":
                wait = max(0.0, pf.started_at + self.budget(pf) - time.perf_counter())
            state_slot = self.states.take(handle, wait)
            whole = len(entries) == len(handle.keys) and state_slot is not None
            if not whole or tree._page_key(tokens, have * ps) in node.children:
                used = range(0)
        n = len(used)
        if n == 0:
            self._give_back(handle, range(0))
            self._free_state_slot(state_slot)
            return node, pages, 0
        n_bytes = sum(1 for i in used if i >= len(reserved))  # entries read as bytes: need host pages now
        tree.lock(node)
        try:
            if not self._make_host_free(n_bytes):
                self._give_back(handle, range(0))
                self._free_state_slot(state_slot)
                return node, pages, 0
            extra = cache.host_alloc.alloc(n_bytes) if n_bytes else []
            dev = cache.allocator.alloc(n) if cache.make_free(n) else None
        finally:
            tree.unlock(node)
        self._give_back(handle, used)  # the reserved pages outside ``used``
        host_pages, extra_it = [], iter(extra)
        t0 = time.perf_counter()
        for i in used:
            if i < len(reserved):
                host_pages.append(reserved[i])  # read straight into it
            else:
                hp = next(extra_it)
                cache.host.page_from_bytes(hp, entries[i])
                host_pages.append(hp)
        t1 = time.perf_counter()
        if n_bytes:  # pages read straight into their host pages took no copy here
            cache.stages.add("host_copy", t1 - t0)
        if dev is None:
            self._park(tokens, node, have, host_pages, state_slot)
            return node, pages, 0
        cache.backend.copy_pages_from_host(cache.host, np.asarray(host_pages), np.asarray(dev))
        cache.stages.add("host_to_device", time.perf_counter() - t1)
        return self._insert(tokens, node, pages, dev, host_pages, state_slot, count_hit)

    def _insert(self, tokens: list[int], node: TreeNode, pages: list[int], dev: list[int], host_pages: list[int],
                state_slot: int | None, count_hit: bool) -> tuple[TreeNode, list[int], int]:
        """Pages read from storage, now in ``host_pages`` and copied to ``dev``, into the tree below ``node``."""
        tree, ps, have, n = self.cache.tree, self.cache.page_size, len(pages), len(dev)
        total = have + n
        tree_pages, last = tree.insert_with_host(tokens[:total * ps], pages + dev, host_pages, have)
        # Pages another path inserted meanwhile cannot exist (same thread), so the tree adopted ours.
        assert tree_pages[have:] == dev
        if state_slot is not None:
            assert self.states is not None  # a state slot is reserved only from them
            self.states.adopt(last, state_slot)
        if count_hit:
            tree.count_hit(last, upto=node)  # the nodes now holding the pages read from storage
        self.loaded_pages += n
        return last, tree_pages, n

    def _stream(self, tokens: list[int], node: TreeNode, pages: list[int], pf: PendingPrefetch, count_hit: bool
                ) -> tuple[TreeNode, list[int], int] | None:
        """load() while the read is still in flight (``_may_stream``): device pages for every page it may bring,
        each copied there as soon as it is read, until the read ends or the budget does; the device pages it did not
        bring go back. None (nothing done) when L1 has no room for them all."""
        cache, tree, handle = self.cache, self.cache.tree, pf.handle
        reserved = self._reserved[handle]
        k = len(reserved)
        tree.lock(node)
        try:
            dev = cache.allocator.alloc(k) if cache.make_free(k) else None
        finally:
            tree.unlock(node)
        if dev is None:
            return None
        deadline = pf.started_at + self.budget(pf)
        copied = 0

        def copy_up_to(n: int) -> int:
            if n > copied:
                t0 = time.perf_counter()
                cache.backend.copy_pages_from_host(cache.host, np.asarray(reserved[copied:n]),
                                                   np.asarray(dev[copied:n]))
                cache.stages.add("host_to_device", time.perf_counter() - t0)
            return max(n, copied)

        while copied < k and not handle.done:
            copied = copy_up_to(min(handle.num_loaded, k))
            left = deadline - time.perf_counter()
            if copied == k or left <= 0:
                break
            handle.wait_loaded(copied + 1, left)
        n = min(len(handle.cancel()), k)  # final: pages that arrived after the last look are copied now
        copied = copy_up_to(n)
        self._give_back(handle, range(n))
        if n < k:
            cache.allocator.free(dev[n:])
        if n == 0:
            return node, pages, 0
        return self._insert(tokens, node, pages, dev[:n], reserved[:n], None, count_hit)

    def _park(self, tokens: list[int], node: TreeNode, have: int, host_pages: list[int], state_slot: int | None
              ) -> None:
        """L1 is full at the moment: keep what was read in L2, where this request's retry finds it."""
        cache, tree, ps, n = self.cache, self.cache.tree, self.cache.page_size, len(host_pages)
        if tree.add_host_only_child(node, tokens[have * ps:(have + n) * ps], host_pages):
            self.parked_pages += n
            if state_slot is not None:
                assert self.states is not None  # a state slot is reserved only from them
                self.states.adopt(node.children[tree._page_key(tokens, have * ps)], state_slot)
        else:
            cache.free_host_pages(host_pages)
            self._free_state_slot(state_slot)

    def _free_state_slot(self, slot: int | None) -> None:
        if slot is not None:
            assert self.states is not None  # a state slot is reserved only from them
            self.states.alloc.free(slot)

    def _make_host_free(self, n: int) -> bool:
        self.sweep()
        short = n - self.cache.host_alloc.num_free
        if short > 0:
            self.cache.tree.evict_host(short)
        return self.cache.host_alloc.num_free >= n

    # ------------------------------------------------------------ end
    def drop(self, req: Req) -> None:
        """A waiting request leaves (abort, error) or restarts its prefetch: stop it, free its host pages."""
        pf, req.prefetch = req.prefetch, None
        assert pf is not None  # called for a request with a prefetch pending
        pf.handle.cancel()
        self._give_back(pf.handle, range(0))

    def _give_back(self, handle: PrefetchHandle, used: range) -> None:
        """Free the reserved host pages of a finished or cancelled prefetch outside ``used`` (indices into its
        keys); the page a cancelled read may still be filling waits until that read is over."""
        if self.states is not None:
            self.states.give_back(handle)  # its snapshot read, unless taken
        reserved = self._reserved.pop(handle, None)
        if not reserved:
            return
        free = [hp for i, hp in enumerate(reserved) if i not in used]
        if not handle.io_idle:
            busy = reserved[handle.num_loaded] if handle.num_loaded < len(reserved) else None
            if busy is not None and busy in free:
                free.remove(busy)
                self._deferred.hold(handle, [busy])
        if free:
            self.cache.free_host_pages(free)

    def sweep(self) -> None:
        """Free the host pages that cancelled reads have left since the last sweep."""
        if self.states is not None:
            self.states.sweep()
        self._deferred.sweep()


def _prefetch_done(pf: PendingPrefetch, states: StateTiers | None) -> bool:
    """The prefetch's pages (and for a hybrid its snapshot) are read."""
    return pf.handle.done and (states is None or states.read_done(pf.handle))
