"""Prefix reuse for hybrid models: recurrent-state snapshots on radix-tree nodes (docs/models.md, "Prefix reuse").

A linear-attention / Mamba layer's state after token i cannot be rebuilt from KV pages, so a cached prefix is only
usable up to a tree node that holds a *snapshot* (the state after the node's last token, in a state-pool slot;
the root's is zeros). Snapshots are page-aligned, one per node at its end. Where they are taken (one point per
request per step, copied by the backend inside the forward through ``ForwardBatch.snapshot_at/snapshot_dst``):

1. **fork point**: when a request's KV match goes deeper than the deepest snapshot on its path, it resumes at the
   snapshot and takes one where the cached KV ends (SGLang's ``mamba_branching_seqlen``, floored to the page
   instead of 64 tokens): the next request with that prefix reuses all of it;
2. **prefill chunk end**: the last page boundary a prefill step reaches (a non-final chunk ends on one);
3. **decode**: after the token that completes a page, overwriting the request's previous unpublished snapshot, so
   at finish (or retraction) its prefix is cached up to the last full page it computed.

A request publishes pages only up to its snapshot (``publish_len``), so every node it adds ends with a state;
inner nodes may lose theirs (a split, ``evict_states``) and then serve deeper snapshots' KV only. The KV
bookkeeping stays in KVCacheManager; this class owns the slots and the points.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tierlm.runtime.cache.radix_cache import RadixCache, TreeNode
from tierlm.runtime.cache.state_slots import StateSlots
from tierlm.runtime.request import Req


class StateSnapshots:
    def __init__(self, slots: StateSlots, tree: RadixCache, page_size: int,
                 copy_state_slots: Callable[[np.ndarray, np.ndarray], None]) -> None:
        self.slots = slots
        self.tree = tree
        self.page_size = page_size
        self.copy = copy_state_slots  # the backend's slot-to-slot copy (snapshot -> live slot at admission)
        self.evicted_pages = 0  # pages that went with a leaf whose snapshot was evicted
        self.evicted_states = 0
        tree.free_state_slot = slots.free_cached

    def alloc(self) -> int | None:
        """A slot for a request, evicting the least valuable snapshot when none is free (None: every slot is
        held by requests)."""
        slot = self.slots.alloc()
        if slot is None:
            states, pages = self.tree.evict_states(1)
            self.evicted_states += states
            self.evicted_pages += pages
            slot = self.slots.alloc()
        return slot

    # ------------------------------------------------------------ admission
    def resume_point(self, req: Req, last_node: TreeNode, kv_pages: int) -> tuple[TreeNode, int]:
        """Cut a KV match (``kv_pages`` pages in device memory, ending at ``last_node``) to the deepest device
        snapshot on its path and copy that snapshot into ``req``'s live slot (allocated beforehand). Returns (that
        node, its depth in pages); records the fork point. HiCache brings host and storage snapshots to the device
        before (runtime/cache/state_tiers.py)."""
        node, pages = self.tree.state_ancestor(last_node, kv_pages)
        if req.state_slot is None:  # no slot to resume in: start from zeros
            node, pages = self.tree.root, 0
        req.fork_len = kv_pages * self.page_size if kv_pages > pages else 0
        if node is not self.tree.root:
            self.copy(np.asarray([node.state_slot], np.int32), np.asarray([req.state_slot], np.int32))
        return node, pages

    # ------------------------------------------------------------ one step
    def plan(self, items: list[tuple[Req, int]]) -> None:
        """Choose each request's snapshot point in this step (``req.snap_at``, 0: none) and its slot."""
        ps = self.page_size
        for req, n in items:
            req.snap_at = 0
            start, end = req.kv_len, req.kv_len + n
            if start < req.fork_len <= end:
                at = req.fork_len  # the fork point beats the chunk end: it is what other requests share
            else:
                at = end // ps * ps
            if at <= start or at <= req.tree_pages * ps:
                continue
            if req.snap_slot is None:  # else the older unpublished snapshot is overwritten by this deeper one
                req.snap_slot = self.alloc()
                if req.snap_slot is None:
                    continue  # every slot is some request's: this point goes unsnapshotted (reuse is shallower)
            req.snap_at = at

    def taken(self, req: Req) -> None:
        """The step ran: ``req.snap_slot`` now holds the state at ``req.snap_at``."""
        req.snap_len, req.snap_at = req.snap_at, 0
        if req.fork_len and req.snap_len >= req.fork_len:
            req.fork_len = 0

    # ------------------------------------------------------------ publish / release
    def publish_len(self, req: Req) -> int:
        """How many tokens of ``req`` may go into the tree now: up to its unpublished snapshot (0: nothing new)."""
        if req.snap_slot is None or req.snap_len <= req.tree_pages * self.page_size:
            return 0
        return req.snap_len

    def attach(self, req: Req, node: TreeNode) -> None:
        """``node`` ends at ``req.snap_len``: it takes the snapshot, or keeps the one another request put there."""
        assert req.snap_slot is not None  # publish_len was > 0
        if self.tree.set_state(node, req.snap_slot):
            self.slots.to_cache()
        else:
            self.slots.free(req.snap_slot)
        req.snap_slot = None

    def release(self, req: Req) -> None:
        """Give back the slots ``req`` still holds (its live slot, an unpublished snapshot)."""
        for slot in (req.state_slot, req.snap_slot):
            if slot is not None:
                self.slots.free(slot)
        req.state_slot = req.snap_slot = None
        req.snap_len = req.fork_len = req.snap_at = 0

    def accounting(self) -> dict[str, int]:
        acc = self.slots.accounting()
        assert acc["cached_slots"] == self.tree.states_cached, "state slots and tree snapshots disagree"
        return acc
