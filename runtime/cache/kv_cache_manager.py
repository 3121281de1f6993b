"""KVCacheManager: which device pages a request uses, where they come from (radix cache or allocator), and
where they go when it finishes. The one place that keeps the pool invariant

    free + cached + in_use == total        (cached: pages in the radix tree; in_use: pages only requests hold)

Hybrid models (linear-attention / Mamba layers) also need one recurrent-state slot per running request
(runtime/cache/state_slots.py): taken at admission, given back on finish, abort or retraction. With a radix tree their
prefixes are reused only up to a state snapshot (runtime/cache/state_snapshots.py): a match is cut to the deepest node
holding one, which is copied into the request's live slot, and a request publishes pages only up to its own
latest snapshot. Without a radix tree every prompt is prefilled from a zero state.

Pins (runtime/cache/pins.py): when a request with ``pins`` finishes, its prompt prefixes are pinned in the tree for
their TTL; ``pins`` is None without a radix tree.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from tierlm.runtime.cache.cacheable_prefix import cacheable_prefix_len
from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.pins import PinTable
from tierlm.runtime.cache.radix_cache import MatchResult, RadixCache, TreeNode
from tierlm.runtime.cache.state_slots import StateSlots
from tierlm.runtime.cache.state_snapshots import StateSnapshots
from tierlm.runtime.io_struct import CachedTokens
from tierlm.runtime.metrics import EngineMetrics
from tierlm.runtime.request import Req

log = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, page_size: int, tree: RadixCache | None,
                 state_slots: StateSlots | None = None,
                 copy_state_slots: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        """``allocator``: the device pages; ``tree``: the radix cache over them (built on ``allocator.free`` by
        whoever builds this manager; a HiRadixCache for HiCache), None for no prefix reuse. ``state_slots``
        (hybrid models): the state pool's slots; with a radix tree, ``copy_state_slots`` (the backend's) copies
        snapshots, and the slots beyond one per running request hold them."""
        self.num_pages = allocator.num_pages
        self.state_slots = state_slots  # hybrids: live slots of running requests (+ snapshots with a tree)
        self.page_size = page_size
        self.allocator = allocator
        self.tree = tree
        self.snapshots: StateSnapshots | None = None
        if state_slots is not None and self.tree is not None:
            if copy_state_slots is None:
                raise ValueError("a hybrid model's radix cache needs the backend's copy_state_slots")
            self.snapshots = StateSnapshots(state_slots, self.tree, page_size, copy_state_slots)
        self.in_use_pages = 0
        self.evicted_device_pages = 0
        self.pins = PinTable(tree, self.pin_capacity) if tree is not None else None

    def pin_capacity(self) -> dict[str, int]:
        """Pages per memory tier, the base of each tier's pin bound (HiCache adds the host tier)."""
        return {"device": self.num_pages}

    def set_pin_fraction(self, fraction: float) -> None:
        """--cache-pin-fraction: the share of each tier's pages pins may hold."""
        if self.pins is not None:
            self.pins.fraction = fraction

    # ------------------------------------------------------------ admission
    def on_request_added(self, req: Req) -> None:
        """A request entered the waiting queue (HiCache starts reading its storage pages here)."""

    def ready_to_admit(self, req: Req) -> bool:
        return True

    def match(self, req: Req) -> None:
        """Start ``req`` on the longest cached prefix (at least one token is left to compute)."""
        if req.pages or self.tree is None:
            return
        if self.snapshots is not None and req.state_slot is None:
            req.state_slot = self.snapshots.alloc()  # before the match: a snapshot eviction cannot hit the match
        tokens = req.tokens(0, req.seq_len)
        # all but the last token, and no prompt position whose logprob row is still to be scored
        # a retracted request coming back is not a new reuse: its hits counted at its first admission
        m = self.tree.match_prefix(tokens, cacheable_prefix_len(req) // self.page_size, count_hit=not req.admitted_once)
        node, pages, cached = self._extend_match(req, tokens, m)
        if self.snapshots is not None:  # a hybrid resumes at the deepest snapshot of the match
            node, n = self.snapshots.resume_point(req, node, len(pages))
            pages, cached = pages[:n], _cut(cached, n * self.page_size)
        self.tree.lock(node)
        req.last_node = node
        req.pages = pages
        req.tree_pages = len(pages)
        req.kv_len = len(pages) * self.page_size
        if not req.admitted_once:  # a retracted request's first admission already counted its hits
            req.cached = cached

    def cached_prefix(self, req: Req) -> tuple[int, TreeNode | None]:
        """(tokens of ``req``'s prefix held in memory, deepest tree node of that match) as ``match`` would start
        it, without touching the tree: no lock, no LRU update, no load from the host or storage tier. The host
        tier counts (a load is a copy, not a prefill); storage pages still being read do not. (0, None) without
        a radix cache."""
        if self.tree is None:
            return 0, None
        tokens = req.input_ids if not req.output_ids else req.tokens(0, req.seq_len)  # no copy of a plain prompt
        pages, node = self.tree.peek_prefix(tokens, cacheable_prefix_len(req) // self.page_size)
        return pages * self.page_size, node

    def _extend_match(self, req: Req, tokens: list[int], m: MatchResult
                      ) -> tuple[TreeNode, list[int], CachedTokens]:
        """The prefix ``req`` starts on: (deepest node, device pages, tokens per tier). HiCache extends the
        device match with pages loaded from the host and storage tiers."""
        return m.last_node, list(m.device_pages), CachedTokens(device=len(m.device_pages) * self.page_size)

    def reserve(self, req: Req, upto_len: int) -> bool:
        """Make sure ``req`` has pages for positions < ``upto_len`` (and, for a hybrid model, a state slot); evict
        cached pages if needed."""
        need = -(-upto_len // self.page_size) - len(req.pages)
        if self.state_slots is not None and req.state_slot is None:
            req.state_slot = self.snapshots.alloc() if self.snapshots is not None else self.state_slots.alloc()
            if req.state_slot is None:
                return False
        if need > 0:
            if not self.make_free(need):
                return False
            req.pages.extend(self.allocator.alloc(need))
            self.in_use_pages += need
            req.admitted_once = True
        return True

    def trim(self, req: Req, upto_len: int) -> None:
        """Give back ``req``'s own pages past those holding positions < ``upto_len`` (speculative decoding: pages
        that held only rejected drafts' KV). Tree pages are never trimmed."""
        keep = max(-(-upto_len // self.page_size), req.tree_pages)
        extra = req.pages[keep:]
        if extra:
            del req.pages[keep:]
            self.allocator.free(extra)
            self.in_use_pages -= len(extra)

    def make_free(self, need: int) -> bool:
        """At least ``need`` free device pages, evicting cached ones if needed; False when that is not enough."""
        short = need - self.allocator.num_free
        if short > 0 and self.tree is not None:
            freed = self.tree.evict(short)
            self.evicted_device_pages += freed
        return self.allocator.num_free >= need

    def cache_unfinished(self, req: Req) -> None:
        """Publish the full pages ``req`` has computed so far to the radix tree while it keeps running.

        A request that arrives meanwhile with the same prefix then reuses them. Where another request published
        the same tokens first, ``req`` switches to the tree's pages and frees its duplicates.
        """
        if self.tree is None:
            return
        # a hybrid publishes only up to its latest snapshot: every node it adds ends with a state
        upto = req.kv_len if self.snapshots is None else self.snapshots.publish_len(req)
        full = upto // self.page_size
        if full <= req.tree_pages:
            return
        tree_pages, node = self.tree.insert(req.tokens(0, full * self.page_size), req.pages[:full])
        if self.snapshots is not None:
            self.snapshots.attach(req, node)
        dup = [mine for mine, theirs in zip(req.pages[req.tree_pages:full], tree_pages[req.tree_pages:])
               if mine != theirs]
        self.allocator.free(dup)
        self.in_use_pages -= full - req.tree_pages
        req.pages[:full] = tree_pages
        self.tree.lock(node)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.last_node = node
        req.tree_pages = full

    # ------------------------------------------------------------ release
    def release(self, req: Req, cache_kv: bool) -> None:
        """Hand ``req``'s pages back: full pages of computed KV go into the radix tree, the rest are freed."""
        if cache_kv:
            self.cache_unfinished(req)  # the full pages now belong to the tree
            # pins take hold when a request ends, not when it is retracted (it comes back) or aborted
            if req.pins and req.finished and req.finish_reason != "abort" and self.pins is not None:
                req.pinned_tokens = self.pins.pin_request(req.pins, req.last_node, req.tree_pages,
                                                          min(len(req.input_ids), req.kv_len))
        own = req.pages[req.tree_pages:]
        self.allocator.free(own)
        self.in_use_pages -= len(own)
        if self.tree is not None and req.last_node is not None:
            self.tree.unlock(req.last_node)
        req.last_node = None
        req.pages = []
        req.tree_pages = 0
        req.kv_len = 0
        if self.snapshots is not None:
            self.snapshots.release(req)  # what it published stays; a request that comes back resumes there
        elif req.state_slot is not None:  # no radix tree: a hybrid request that comes back starts over
            assert self.state_slots is not None  # a request has a state slot only from them
            self.state_slots.free(req.state_slot)
            req.state_slot = None

    # ------------------------------------------------------------ hybrids: state snapshots
    def plan_snapshots(self, items: list[tuple[Req, int]]) -> None:
        """Before a step: where each hybrid request's forward copies its state (req.snap_at, req.snap_slot)."""
        if self.snapshots is not None:
            self.snapshots.plan(items)

    def snapshot_taken(self, req: Req) -> None:
        """After a step that took ``req``'s planned snapshot."""
        assert self.snapshots is not None  # only plan_snapshots with snapshots plans one
        self.snapshots.taken(req)

    def sweep_pins(self) -> None:
        """Drop expired pins from the table (the scheduler calls this every step; expiry itself is lazy)."""
        if self.pins is not None:
            self.pins.sweep()

    def pins_info(self) -> dict[str, Any] | None:
        """/server_info's ``pins``: pinned pages and the bound per tier; None without a radix cache."""
        return self.pins.info() if self.pins is not None else None

    def flush(self, storage: bool = False) -> None:
        if self.tree is not None:
            self.tree.reset()  # pins go too

    def register_gauges(self, metrics: EngineMetrics) -> None:
        """Pool gauges read at scrape time; HiCache adds its host and storage tiers."""
        # a gauge, so no _total suffix (that is a counter's): tierlm_kv_pages_total before issue 33
        metrics.gauge("tierlm_kv_pages_capacity", "Device KV pages (the pool's size)", lambda: self.num_pages)
        metrics.gauge("tierlm_kv_total_tokens", "Tokens the device KV pool holds",
                      lambda: self.num_pages * self.page_size)
        metrics.gauge("tierlm_kv_used_tokens", "Tokens of device KV pages not free (running requests and cache)",
                      lambda: (self.num_pages - self.allocator.num_free) * self.page_size)
        metrics.gauge("tierlm_kv_pages_free", "Free device KV pages", lambda: self.allocator.num_free)
        metrics.gauge("tierlm_kv_pages_cached", "Device KV pages held by the radix cache",
                      lambda: self.tree.device_pages_cached if self.tree else 0)
        metrics.gauge("tierlm_kv_pages_in_use", "Device KV pages held only by running requests",
                      lambda: self.in_use_pages)
        metrics.gauge("tierlm_kv_pool_usage", "Share of device KV pages not free",
                      lambda: 1.0 - self.allocator.num_free / max(self.num_pages, 1))
        if self.state_slots is not None:
            slots = self.state_slots
            metrics.gauge("tierlm_state_slots_total", "Recurrent-state slots (hybrid models)", lambda: slots.total)
            metrics.gauge("tierlm_state_slots_free", "Free recurrent-state slots", lambda: slots.num_free)
            metrics.gauge("tierlm_state_slots_in_use", "Recurrent-state slots held by running requests",
                          lambda: slots.in_use)
            metrics.gauge("tierlm_state_slots_cached", "Recurrent-state snapshots held by the radix cache",
                          lambda: slots.cached)
        if self.pins is not None:
            pins = self.pins

            def pinned_pages(tier: str) -> Callable[[], float]:
                return lambda: pins.pinned_pages()[tier]

            metrics.tier_gauge("tierlm_cache_pinned_pages", "Pages of each memory tier held by prompt-caching pins",
                               {tier: pinned_pages(tier) for tier in self.pin_capacity()})
        metrics.tier_counter("tierlm_cache_evicted_pages", "Pages evicted from each cache tier since start (device "
                             "pages demoted to host count here too)", self.eviction_counters())

    def eviction_counters(self) -> dict[str, Callable[[], float]]:
        """Pages evicted since start, per tier, read at scrape time."""
        snaps = self.snapshots
        return {"device": lambda: self.evicted_device_pages + (snaps.evicted_pages if snaps is not None else 0)}

    def tiers_info(self) -> dict[str, Any]:
        """Capacity and use per cache tier beyond the device pool (HiCache reports host and storage)."""
        return {}

    def close(self) -> None:
        """Stop background work (HiCache's storage threads)."""

    # ------------------------------------------------------------ accounting
    def state_accounting(self) -> dict[str, int] | None:
        """Hybrid models: the state slots (free + cached + in_use == total); None for attention-only models."""
        if self.snapshots is not None:
            return self.snapshots.accounting()
        return self.state_slots.accounting() if self.state_slots is not None else None

    def accounting(self) -> dict[str, int]:
        cached = self.tree.device_pages_cached if self.tree is not None else 0
        return {
            "total_pages": self.num_pages,
            "free_pages": self.allocator.num_free,
            "cached_pages": cached,
            "in_use_pages": self.in_use_pages,
            "evictable_pages": self.tree.evictable_pages if self.tree is not None else 0,
            "page_size": self.page_size,
        }


def _cut(cached: CachedTokens, tokens: int) -> CachedTokens:
    """``cached`` cut to its first ``tokens`` (the device part comes first, then host, then storage)."""
    device = min(cached.device, tokens)
    host = min(cached.host, tokens - device)
    return CachedTokens(device=device, host=host, storage=min(cached.storage, tokens - device - host))
