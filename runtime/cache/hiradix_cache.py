"""HiRadixCache: the radix tree with a host tier (L2) under the device tier (L1).

A node's pages live on the device, on the host, or both. Evicting a device leaf demotes it to the host when it
has (or can get) a host copy instead of dropping it; the host tier evicts host-only leaves on its own, in the
order of the same eviction policy (--radix-eviction-policy, runtime/cache/eviction_policy.py). The manager
(``hicache_manager.py``) decides when pages are backed up (write policy) and loads host pages back.

Hybrid models: a node's state snapshot follows its pages through the tiers. It is backed up to a host state slot
(``host_state_slot``, only on a node with host pages) when the node's pages reach the host with a snapshot, when a
snapshot is set on a node already backed up, and before a device snapshot is dropped; host eviction frees it with
its pages. A host-only leaf without a snapshot can never end a match and goes at once (the device tier's rule).

Pins (runtime/cache/pins.py): a pinned node is backed up to the host when pinned (and from there to L3); the host
tier evicts pinned pages only when the unpinned ones did not free enough, so under pressure a pin moves down a tier
(device -> host -> the L3 copy) instead of holding memory a running request needs.
"""
from __future__ import annotations

import heapq
import logging
from typing import Callable, NoReturn, Sequence

from tierlm.runtime.cache.radix_cache import RadixCache, TreeNode

log = logging.getLogger(__name__)


class HiRadixCache(RadixCache):
    def __init__(self, page_size: int, free_device_pages: Callable[[list[int]], None],
                 eviction_policy: str = "lru") -> None:
        """The host tier's hooks come from its owner (``bind_host_tier``) before the tree is used."""
        super().__init__(page_size, free_device_pages, eviction_policy)
        self._free_host_pages: Callable[[list[int]], None] = _unbound
        self._backup_node: Callable[[TreeNode], bool] = _unbound
        self._on_new_node_cb: Callable[[TreeNode], None] = _unbound
        self.host_pages_cached = 0
        self.demoted_pages = 0
        self.evicted_host_pages = 0
        # hybrids (set by state_tiers.py): back a node's device snapshot up to a host slot (False: no room), free a
        # host state slot; host_states_cached counts the nodes holding one
        self.backup_state: Callable[[TreeNode], bool] | None = None
        self.free_host_state_slot: Callable[[int], None] | None = None
        self.host_states_cached = 0
        self.evicted_host_states = 0

    def bind_host_tier(self, free_host_pages: Callable[[list[int]], None], backup_node: Callable[[TreeNode], bool],
                       on_new_node: Callable[[TreeNode], None]) -> None:
        """The host tier's owner (hicache_manager.py): how host pages are freed, how a device node gets a host copy
        (False when the host tier is full), and what a new node triggers (the write policy)."""
        self._free_host_pages = free_host_pages
        self._backup_node = backup_node
        self._on_new_node_cb = on_new_node

    # ---------------------------------------------------------------- hooks
    def _on_insert(self, node: TreeNode) -> None:
        if not self._inserting_with_host:
            self._on_new_node_cb(node)

    _inserting_with_host = False

    def set_host_pages(self, node: TreeNode, pages: list[int]) -> None:
        assert node.host_pages is None
        node.host_pages = pages
        self.host_pages_cached += len(pages)

    # ---------------------------------------------------------------- hybrids: host snapshots
    def set_host_state(self, node: TreeNode, slot: int) -> bool:
        """Give ``node`` (which has host pages) the host snapshot in ``slot``; False when it already has one."""
        assert node.host_pages is not None, "a host snapshot needs its node's host pages"
        if node.host_state_slot is not None:
            return False
        node.host_state_slot = slot
        self.host_states_cached += 1
        return True

    def _drop_host_state(self, node: TreeNode) -> None:
        if node.host_state_slot is not None:
            assert self.free_host_state_slot is not None  # set with the host state slots (state_tiers.py)
            self.free_host_state_slot(node.host_state_slot)
            node.host_state_slot = None
            self.host_states_cached -= 1

    def _on_set_state(self, node: TreeNode) -> None:
        if node.host_pages is not None and self.backup_state is not None:
            self.backup_state(node)  # write_through: the pages went to the host before the node had its snapshot

    def _drop_state(self, node: TreeNode) -> None:
        """A device snapshot goes (its pages are evicted, or the state pool is short): keep it on the host first."""
        if node.state_slot is not None and node.host_state_slot is None and self.backup_state is not None \
                and node.device_pages is not None:
            if node.host_pages is None:
                self._backup_node(node)  # pages and snapshot
            else:
                self.backup_state(node)
        super()._drop_state(node)

    def evict_host_states(self, num: int) -> int:
        """Free at least ``num`` host snapshots of unlocked nodes in eviction-policy order; a host-only leaf goes
        with its pages (then so does each ancestor left a snapshot-less host-only leaf). Returns snapshots freed."""
        nodes, stack = [], [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.host_state_slot is not None and n.lock_ref == 0:
                nodes.append(n)
        # host copies of snapshots still on the device first: dropping them loses nothing yet
        nodes.sort(key=lambda n: (n.state_slot is None, self.eviction_priority(n)))
        for node in nodes[:num]:
            self._drop_host_state(node)
            self.evicted_host_states += 1
            self._prune_leaf(node)
        return min(num, len(nodes))

    def _prune_leaf(self, node: TreeNode) -> None:
        """Drop ``node`` and then its ancestors while each is an unlocked leaf without a snapshot in any tier: its
        pages (device and host) can never end a match."""
        while node is not self.root and node.state_slot is None and node.host_state_slot is None and \
                not node.children and node.lock_ref == 0:
            parent = node.parent
            assert parent is not None  # only the root has none
            if node.host_pages is not None:
                self._drop_host(node)
            if node.device_pages is not None:
                RadixCache._evict_node(self, node)  # frees the pages and unlinks the node
            else:
                del parent.children[self._page_key(node.key, 0)]
            node = parent

    def attach_device_pages(self, node: TreeNode, pages: list[int]) -> None:
        """Give a host-only node its device pages back (after a load from L2)."""
        assert node.device_pages is None and len(pages) * self.page_size == len(node.key)
        node.device_pages = pages
        self.device_pages_cached += len(pages)
        if node.lock_ref > 0:
            self.device_pages_locked += len(pages)

    def insert_with_host(self, tokens: Sequence[int], pages: Sequence[int], host_pages: Sequence[int],
                         start_page: int) -> tuple[list[int], TreeNode]:
        """Insert like ``insert``; pages from ``start_page`` on also carry their host copies."""
        self._inserting_with_host = True  # the new nodes already have host copies: no write-through
        try:
            out, node = self.insert(tokens, pages)
        finally:
            self._inserting_with_host = False
        # walk back from the last node and attach host pages to nodes that cover pages >= start_page
        end = len(pages)
        n = node
        while n is not self.root and end > start_page:
            k = len(n.key) // self.page_size
            begin = end - k
            if begin >= start_page:
                assert n.host_pages is None, "storage pages landed on a node that already has host pages"
                self.set_host_pages(n, list(host_pages[begin - start_page:end - start_page]))
            end = begin
            assert n.parent is not None  # only the root has none
            n = n.parent
        return out, node

    def add_host_only_child(self, parent: TreeNode, tokens: Sequence[int], host_pages: list[int]) -> bool:
        """Hang pages that are only in host memory under ``parent``; False if that branch exists already."""
        key = self._page_key(tokens, 0)
        if key in parent.children:
            return False
        node = TreeNode(key=list(tokens), parent=parent)
        parent.children[key] = node
        self.set_host_pages(node, list(host_pages))
        return True

    # ---------------------------------------------------------------- device eviction: demote
    def _evict_node(self, node: TreeNode) -> int:
        if node.device_pages is None:  # a hybrid's stateless leaf pruned meanwhile (_prune_leaf)
            return 0
        if node.host_pages is None:
            self._backup_node(node)  # write_back, or a write-through copy that did not fit earlier
        pages = node.device_pages
        if node.host_pages is None:
            if node.children:  # host-only descendants would become unreachable: drop them too
                self._drop_subtree_host(node)
            return super()._evict_node(node)
        if self.free_state_slot is not None:
            self._drop_state(node)  # kept on the host first when there is room
        self._free_device_pages(pages)
        self.device_pages_cached -= len(pages)
        node.device_pages = None
        self.demoted_pages += len(pages)
        if self.free_state_slot is not None:
            self._prune_leaf(node)  # demoted without a snapshot (no host state slot): useless on its own
        return len(pages)

    def _drop_subtree_host(self, node: TreeNode) -> None:
        for child in list(node.children.values()):
            self._drop_subtree_host(child)
            if child.host_pages is not None:
                self._drop_host(child)
            assert child.device_pages is None and child.lock_ref == 0
            del node.children[self._page_key(child.key, 0)]

    # ---------------------------------------------------------------- pins
    keeps_host_copies = True
    _sparing_pins = False  # while a pin is written through: making host room never evicts another pin

    def write_through_pin(self, node: TreeNode) -> None:
        """A newly pinned device node gets its host copy now (and so its L3 copy, when storage is on)."""
        if node.device_pages is None or node.host_pages is not None:
            return
        self._sparing_pins = True
        try:
            if not self._backup_node(node):
                log.warning("a pinned prefix has no host copy: the host tier is full of locked or pinned pages")
        finally:
            self._sparing_pins = False

    # ---------------------------------------------------------------- host eviction
    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` host pages, unpinned pages first (pinned ones only when that was not enough,
        and never to make room for another pin's copy). Locked nodes are never touched."""
        pinned = self.pins.pinned_now() if self.pins is not None else None
        freed = self._evict_host_pass(num_pages, pinned)
        if freed < num_pages and pinned is not None and not self._sparing_pins:
            more = self._evict_host_pass(num_pages - freed, None)
            if more:
                self.evicted_pinned_pages += more
                log.warning("memory pressure: %d pinned host pages evicted (nothing unpinned was left); their L3 "
                            "copy stays where storage is on", more)
            freed += more
        return freed

    def _evict_host_pass(self, num_pages: int, pinned: Callable[[TreeNode], bool] | None) -> int:
        """Host-only leaves first, then host copies of device nodes (they stay on the device), each in
        eviction-policy order, passing over nodes ``pinned`` says are."""
        skip = pinned or (lambda _: False)
        freed = 0
        heap = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and n.host_pages is not None and n.device_pages is None and not n.children \
                    and n.lock_ref == 0 and not skip(n):
                heap.append(self._heap_entry(n))
        heapq.heapify(heap)
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            if node.host_pages is None:  # pruned meanwhile
                continue
            freed += self._drop_host(node)
            parent = node.parent
            assert parent is not None  # the root holds no host pages
            del parent.children[self._page_key(node.key, 0)]
            if self.free_state_slot is not None and parent.lock_ref == 0:  # hybrids: no snapshot-less host leaf
                before = self.host_pages_cached
                self._prune_leaf(parent)
                freed += before - self.host_pages_cached
            if parent is not self.root and parent.host_pages is not None and parent.device_pages is None \
                    and not parent.children and parent.lock_ref == 0 and not skip(parent):
                heapq.heappush(heap, self._heap_entry(parent))
        if freed < num_pages:
            both = []
            stack = [self.root]
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                if n is not self.root and n.host_pages is not None and n.device_pages is not None and not skip(n):
                    both.append(n)
            for node in sorted(both, key=self.eviction_priority):
                if freed >= num_pages:
                    break
                if node.host_pages is None:  # pruned with a leaf below it
                    continue
                if node.lock_ref > 0 and node.state_slot is None and node.host_state_slot is not None:
                    continue  # a hybrid's only snapshot of a path in use
                freed += self._drop_host(node)
                if self.free_state_slot is not None:
                    self._prune_leaf(node)  # its only snapshot was the host copy
        return freed

    def _drop_host(self, node: TreeNode) -> int:
        pages = node.host_pages
        assert pages is not None  # only a node with host pages is dropped from the host
        if node.host_state_slot is not None:
            self._drop_host_state(node)
            self.evicted_host_states += 1
        self._free_host_pages(pages)
        self.host_pages_cached -= len(pages)
        self.evicted_host_pages += len(pages)
        node.host_pages = None
        return len(pages)

    # ---------------------------------------------------------------- paths and reset
    def path_tokens(self, node: TreeNode) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.key)
            assert node.parent is not None  # only the root has none
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def reset(self) -> None:
        assert self.device_pages_locked == 0, "flush with running requests"
        if self.pins is not None:
            self.pins.clear()
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is self.root:
                continue
            if n.device_pages is not None:
                self._free_device_pages(n.device_pages)
            if n.host_pages is not None:
                self._free_host_pages(n.host_pages)
            if n.state_slot is not None:
                assert self.free_state_slot is not None  # a tree holding states frees them
                self.free_state_slot(n.state_slot)
                n.state_slot = None
            if n.host_state_slot is not None:
                assert self.free_host_state_slot is not None  # a tree holding host states frees them
                self.free_host_state_slot(n.host_state_slot)
                n.host_state_slot = None
        self.root.children.clear()
        self.device_pages_cached = self.device_pages_locked = self.host_pages_cached = 0
        self.states_cached = self.host_states_cached = 0


def _unbound(*_: object) -> NoReturn:
    raise RuntimeError("HiRadixCache used before bind_host_tier() gave it its host tier")
