"""Radix prefix cache at page granularity.

Each edge holds whole pages of tokens and the device pages with their KV. A request locks the path it reads
(``lock``/``unlock``), so locked pages are never evicted; unlocked leaves go in the order of the eviction
policy (runtime/cache/eviction_policy.py, least recently used by default) when the allocator runs dry. With HiCache,
a node may also (or only) hold host pages; ``hiradix_cache.py`` extends eviction to demote instead of drop.

Hybrid models (runtime/cache/state_snapshots.py) also hang a recurrent-state snapshot on some nodes (``state_slot``: the
state after the node's last token). A prefix is only usable up to the deepest node holding one; a node's state
goes with its pages on eviction, and ``evict_states`` frees states on their own (a leaf then loses its pages too:
KV that no snapshot at or below it can resume is dead weight).

Pins (runtime/cache/pins.py): a pinned node (``pin_until`` ahead of the pin table's clock) is evicted only when the
unpinned unlocked nodes did not free enough, so a pin never costs a running request its pages.
"""
from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from tierlm.runtime.cache.eviction_policy import eviction_priority

if TYPE_CHECKING:
    from tierlm.runtime.cache.pins import PinTable

log = logging.getLogger(__name__)

_clock = itertools.count()
_tiebreak = itertools.count()  # heap entries with equal policy keys never compare nodes


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)  # tokens on the edge into this node, len % page_size == 0
    device_pages: list[int] | None = None  # one device page per page of key; None when not in device memory
    host_pages: list[int] | None = None  # one host page per page of key when backed up in host memory (L2)
    parent: "TreeNode | None" = None
    children: dict[tuple[int, ...], "TreeNode"] = field(default_factory=dict)
    lock_ref: int = 0
    hit_count: int = 0
    state_slot: int | None = None  # hybrids: the state snapshot at the end of this node's key (a state-pool slot)
    host_state_slot: int | None = None  # hybrids with HiCache: that snapshot in a host state slot (with host_pages)
    last_access: int = field(default_factory=lambda: next(_clock))
    pin_until: float = 0.0  # pinned while the pin table's clock is below this (runtime/cache/pins.py)

    def touch(self) -> None:
        self.last_access = next(_clock)


@dataclass
class MatchResult:
    device_pages: list[int]  # pages of the matched prefix that are in device memory, in order
    last_node: TreeNode  # deepest node of the device-resident match (lock it while using the pages)
    host_pages: list[int] = field(default_factory=list)  # continuation that lives only in host memory
    host_last_node: TreeNode | None = None  # deepest node of the host-resident continuation


class RadixCache:
    def __init__(self, page_size: int, free_device_pages: Callable[[list[int]], None],
                 eviction_policy: str = "lru") -> None:
        self.page_size = page_size
        self._free_device_pages = free_device_pages
        self.set_eviction_policy(eviction_policy)
        self.root = TreeNode(device_pages=[])
        self.root.lock_ref = 1  # the root is never evicted
        self.device_pages_cached = 0  # pages referenced by the tree (evictable + locked)
        self.device_pages_locked = 0
        # hybrids: frees a state slot a node drops (None: the tree holds no states); states_cached counts them
        self.free_state_slot: Callable[[int], None] | None = None
        self.states_cached = 0
        self.pins: PinTable | None = None  # set by the PinTable built over this tree
        self.evicted_pinned_pages = 0  # pinned pages evicted (or demoted) because nothing unpinned was left

    def set_eviction_policy(self, name: str) -> None:
        """--radix-eviction-policy: the order unlocked nodes are evicted in (both tiers with HiCache)."""
        self.eviction_policy = name
        self.eviction_priority = eviction_priority(name)

    # ---------------------------------------------------------------- lookup
    def _page_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def match_prefix(self, tokens: Sequence[int], max_pages: int | None = None, *,
                     count_hit: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens`` in whole pages (at most ``max_pages``); touches the nodes it passes.

        This is the admission lookup: with ``count_hit`` every node of the device-resident match gets one more
        ``hit_count`` (the eviction policies rank by it). Host and storage continuations are counted by HiCache
        when they are loaded; a lookup that admits nothing (a prefetch probe) passes ``count_hit=False``."""
        ps = self.page_size
        n_pages = len(tokens) // ps if max_pages is None else min(len(tokens) // ps, max_pages)
        node = self.root
        device_pages: list[int] = []
        host_pages: list[int] = []
        device_node, host_node = node, None
        pos = 0  # in pages
        while pos < n_pages:
            child = node.children.get(self._page_key(tokens, pos * ps))
            if child is None:
                break
            child, k = self._follow_edge(child, tokens, pos, n_pages)
            if child.device_pages is not None and not host_pages:
                device_pages.extend(child.device_pages)
                device_node = child
            elif child.host_pages is not None:
                host_pages.extend(child.host_pages)
                host_node = child
            else:
                break
            node = child
            pos += k
        if count_hit:
            self.count_hit(device_node)
        return MatchResult(device_pages, device_node, host_pages, host_node)

    def count_hit(self, node: TreeNode, upto: TreeNode | None = None) -> None:
        """One more reuse of every node from ``node`` up to (not including) ``upto`` (default: the root)."""
        upto = upto or self.root
        while node is not upto and node is not self.root:
            node.hit_count += 1
            assert node.parent is not None  # only the root has none
            node = node.parent

    def path_to(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from the root (excluded) down to ``node``, top first."""
        out = []
        while node is not self.root:
            out.append(node)
            assert node.parent is not None  # only the root has none
            node = node.parent
        return out[::-1]

    def peek_prefix(self, tokens: Sequence[int], max_pages: int | None = None) -> tuple[int, TreeNode]:
        """How many whole pages of ``tokens`` (at most ``max_pages``) ``match_prefix`` would find in memory
        (device pages, then their host continuation), and the deepest node reached (the one whose edge the
        match ends in, possibly part-way). Unlike ``match_prefix`` it changes nothing: no edge split, no LRU
        touch, no lock, no load (the scheduling policies call it on every waiting request)."""
        ps = self.page_size
        n_pages = len(tokens) // ps if max_pages is None else min(len(tokens) // ps, max_pages)
        node, pos, on_host = self.root, 0, False
        while pos < n_pages:
            child = node.children.get(self._page_key(tokens, pos * ps))
            if child is None:
                break
            if child.device_pages is not None and not on_host:
                pass
            elif child.host_pages is not None:
                on_host = True
            else:
                break
            key, k, edge_pages = child.key, 1, len(child.key) // ps
            while k < edge_pages and pos + k < n_pages and \
                    key[k * ps:(k + 1) * ps] == list(tokens[(pos + k) * ps:(pos + k + 1) * ps]):
                k += 1
            node, pos = child, pos + k
            if k < edge_pages:
                if self.free_state_slot is not None:  # the match ends inside this edge: not at its state
                    assert node.parent is not None  # a child's
                    node, pos = node.parent, pos - k
                break
        if self.free_state_slot is not None:
            node, pos = self.state_ancestor(node, pos, any_tier=True)
        return pos, node

    def state_ancestor(self, node: TreeNode, pages: int, any_tier: bool = False) -> tuple[TreeNode, int]:
        """The deepest node at or above ``node`` (which ends ``pages`` pages deep) holding a state snapshot (on the
        device; with ``any_tier`` on the host too), and its depth in pages: how far a hybrid model's match can be
        used. The root (zero state, depth 0) at worst."""
        while node is not self.root and node.state_slot is None and \
                (not any_tier or node.host_state_slot is None):
            pages -= len(node.key) // self.page_size
            assert node.parent is not None  # only the root has none
            node = node.parent
        return node, pages

    def set_state(self, node: TreeNode, slot: int) -> bool:
        """Give ``node`` the snapshot in ``slot``; False (the caller keeps ``slot``) when it already has one."""
        if node.state_slot is not None or node is self.root:
            return False
        node.state_slot = slot
        self.states_cached += 1
        self._on_set_state(node)
        return True

    def _on_set_state(self, node: TreeNode) -> None:
        """Hook for subclasses (HiCache backs a snapshot up next to its node's host pages)."""

    def _drop_state(self, node: TreeNode) -> None:
        if node.state_slot is not None:
            assert self.free_state_slot is not None  # a tree holding states has the hook that frees them
            self.free_state_slot(node.state_slot)
            node.state_slot = None
            self.states_cached -= 1

    def evict_states(self, num: int) -> tuple[int, int]:
        """Free at least ``num`` state snapshots, unlocked nodes first, each group in eviction-policy order. An
        inner node keeps its pages (deeper snapshots still need them); an unlocked leaf goes with its pages and
        then so does every ancestor left a stateless unlocked leaf. Returns (states freed, pages freed)."""
        nodes, stack = [], [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.state_slot is not None:
                nodes.append(n)
        nodes.sort(key=lambda n: (n.lock_ref > 0, self.eviction_priority(n)))
        states = pages = 0
        for node in nodes[:num]:
            self._drop_state(node)
            states += 1
            while node is not self.root and node.state_slot is None and node.lock_ref == 0 and \
                    node.device_pages is not None and not node.children:
                parent = node.parent
                assert parent is not None  # only the root has none
                pages += self._evict_node(node)
                node = parent
        return states, pages

    def _follow_edge(self, child: TreeNode, tokens: Sequence[int], pos: int, n_pages: int) -> tuple[TreeNode, int]:
        """How many pages of ``child``'s edge match ``tokens`` from page ``pos`` (the first always does);
        splits the edge where the match ends. Returns the (possibly new upper) node and that page count."""
        ps = self.page_size
        edge_pages = len(child.key) // ps
        k = 1
        while k < edge_pages and pos + k < n_pages and \
                child.key[k * ps:(k + 1) * ps] == list(tokens[(pos + k) * ps:(pos + k + 1) * ps]):
            k += 1
        if k < edge_pages:
            child = self._split(child, k)
        child.touch()
        return child, k

    def split(self, node: TreeNode, k: int) -> TreeNode:
        """Split ``node``'s edge after ``k`` of its pages (a pin that ends inside it); the new upper node."""
        return self._split(node, k)

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Split ``node``'s edge after ``k`` pages; return the new upper node (which keeps locks)."""
        ps = self.page_size
        assert node.parent is not None  # the root is never split
        upper = TreeNode(key=node.key[:k * ps], parent=node.parent, lock_ref=node.lock_ref,
                         hit_count=node.hit_count, last_access=node.last_access, pin_until=node.pin_until)
        upper.device_pages = node.device_pages[:k] if node.device_pages is not None else None
        upper.host_pages = node.host_pages[:k] if node.host_pages is not None else None
        node.parent.children[self._page_key(upper.key, 0)] = upper
        node.key = node.key[k * ps:]
        node.device_pages = node.device_pages[k:] if node.device_pages is not None else None
        node.host_pages = node.host_pages[k:] if node.host_pages is not None else None
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        if self.pins is not None:
            self.pins.on_split(upper, node)
        self._on_split(upper, node)
        return upper

    def _on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """Hook for subclasses that keep per-node data (HiCache page keys)."""

    # ---------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[list[int], TreeNode]:
        """Insert whole pages ``tokens`` -> ``pages``. Returns (the tree's pages for these tokens, last node).

        Where the tree already holds a page for the same tokens, the tree's page wins and the caller frees its
        own copy (its index differs from the returned one).
        """
        ps = self.page_size
        n_pages = len(pages)
        assert len(tokens) >= n_pages * ps
        node = self.root
        out: list[int] = []
        pos = 0
        while pos < n_pages:
            child = node.children.get(self._page_key(tokens, pos * ps))
            if child is None:
                new_pages = list(pages[pos:])
                new = TreeNode(key=list(tokens[pos * ps:n_pages * ps]), device_pages=new_pages, parent=node)
                node.children[self._page_key(new.key, 0)] = new
                self.device_pages_cached += len(new_pages)
                self._on_insert(new)
                out.extend(new_pages)
                return out, new
            child, k = self._follow_edge(child, tokens, pos, n_pages)
            if child.device_pages is None:
                # Evicted from the device (maybe still in host memory): adopt the caller's fresh pages.
                child.device_pages = list(pages[pos:pos + k])
                self.device_pages_cached += k
                if child.lock_ref > 0:
                    self.device_pages_locked += k
            out.extend(child.device_pages)
            node = child
            pos += k
        return out, node

    def _on_insert(self, node: TreeNode) -> None:
        """Hook for subclasses (HiCache write-through)."""

    # ---------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0 and node.device_pages is not None:
                self.device_pages_locked += len(node.device_pages)
            node.lock_ref += 1
            assert node.parent is not None  # only the root has none
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix lock underflow"
            if node.lock_ref == 0 and node.device_pages is not None:
                self.device_pages_locked -= len(node.device_pages)
            assert node.parent is not None  # only the root has none
            node = node.parent

    # ---------------------------------------------------------------- eviction
    @property
    def evictable_pages(self) -> int:
        return self.device_pages_cached - self.device_pages_locked

    def _device_leaves(self) -> list[TreeNode]:
        """Nodes holding device pages none of whose children hold device pages."""
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            has_dev_child = False
            for c in n.children.values():
                stack.append(c)
                if c.device_pages is not None:
                    has_dev_child = True
            if n is not self.root and n.device_pages is not None and not has_dev_child:
                out.append(n)
        return out

    def _heap_entry(self, node: TreeNode) -> tuple[tuple[int, ...], int, TreeNode]:
        return (self.eviction_priority(node), next(_tiebreak), node)

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` device pages from unlocked leaves in eviction-policy order, unpinned ones
        first; pinned ones only when that was not enough. Returns pages freed."""
        pinned = self.pins.pinned_now() if self.pins is not None else None
        freed = self._evict_pass(num_pages, pinned)
        if freed < num_pages and pinned is not None:
            more = self._evict_pass(num_pages - freed, None)
            if more:
                self.evicted_pinned_pages += more
                log.warning("memory pressure: %d pinned device pages evicted (nothing unpinned was left)%s", more,
                            "; they move to the host tier" if self.keeps_host_copies else "")
            freed += more
        return freed

    def _evict_pass(self, num_pages: int, pinned: Callable[[TreeNode], bool] | None) -> int:
        """One eviction pass over unlocked leaves in policy order, passing over nodes ``pinned`` says are."""
        skip = pinned or _never
        heap = [self._heap_entry(n) for n in self._device_leaves() if n.lock_ref == 0 and not skip(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            freed += self._evict_node(node)
            parent = node.parent
            assert parent is not None  # the root is never evicted
            while self.free_state_slot is not None and parent is not self.root and parent.state_slot is None and \
                    parent.lock_ref == 0 and parent.device_pages is not None and not parent.children:
                assert parent.parent is not None  # not the root
                node, parent = parent, parent.parent  # a hybrid's stateless leaf can never end a match: goes too
                freed += self._evict_node(node)
            if parent is not self.root and parent.lock_ref == 0 and parent.device_pages is not None and \
                    not skip(parent) and not any(c.device_pages is not None for c in parent.children.values()):
                heapq.heappush(heap, self._heap_entry(parent))
        return freed

    # ---------------------------------------------------------------- pins (runtime/cache/pins.py)
    keeps_host_copies = False  # HiRadixCache: a pinned node is backed up to the host tier when pinned

    def write_through_pin(self, node: TreeNode) -> None:
        """Back a newly pinned node up to the lower tiers (HiCache); nothing below the device here."""

    def _evict_node(self, node: TreeNode) -> int:
        """Drop ``node``'s device pages (the HiCache subclass demotes to host instead). Returns pages freed."""
        pages = node.device_pages
        assert pages is not None and node.parent is not None  # an evicted node holds device pages; never the root
        if self.free_state_slot is not None:
            self._drop_state(node)  # a snapshot lives exactly as long as the pages it ends
        self._free_device_pages(pages)
        self.device_pages_cached -= len(pages)
        node.device_pages = None
        if node.host_pages is None and not node.children:
            del node.parent.children[self._page_key(node.key, 0)]
        return len(pages)

    def reset(self) -> None:
        """Forget every unlocked node and every pin (flush_cache). Only valid when nothing is locked."""
        assert self.device_pages_locked == 0, "flush with running requests"
        if self.pins is not None:
            self.pins.clear()
        self.evict(self.device_pages_cached)
        self.root.children.clear()


def _never(_: TreeNode) -> bool:
    return False
