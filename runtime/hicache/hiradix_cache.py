"""HiRadixCache: the radix tree with a host tier (L2) under the device tier (L1).

A node's pages live on the device, on the host, or both. Evicting a device leaf demotes it to the host when it
has (or can get) a host copy instead of dropping it; the host tier evicts host-only leaves on its own, in the
order of the same eviction policy (--radix-eviction-policy, runtime/eviction_policy.py). The controller
(``controller.py``) decides when pages are backed up (write policy) and loads host pages back.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

from tierlm.runtime.radix_cache import RadixCache, TreeNode


class HiRadixCache(RadixCache):
    def __init__(self, page_size: int, free_device_pages: Callable[[list[int]], None],
                 free_host_pages: Callable[[list[int]], None],
                 backup_node: Callable[[TreeNode], bool],
                 on_new_node: Callable[[TreeNode], None], eviction_policy: str = "lru") -> None:
        super().__init__(page_size, free_device_pages, eviction_policy)
        self._free_host_pages = free_host_pages
        self._backup_node = backup_node  # give a device node a host copy; False when the host tier is full
        self._on_new_node_cb = on_new_node
        self.host_pages_cached = 0
        self.demoted_pages = 0
        self.evicted_host_pages = 0

    # ---------------------------------------------------------------- hooks
    def _on_insert(self, node: TreeNode) -> None:
        if not self._inserting_with_host:
            self._on_new_node_cb(node)

    _inserting_with_host = False

    def set_host_pages(self, node: TreeNode, pages: list[int]) -> None:
        assert node.host_pages is None
        node.host_pages = pages
        self.host_pages_cached += len(pages)

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
        if node.host_pages is None:
            self._backup_node(node)  # write_back, or a write-through copy that did not fit earlier
        pages = node.device_pages
        if node.host_pages is None:
            if node.children:  # host-only descendants would become unreachable: drop them too
                self._drop_subtree_host(node)
            return super()._evict_node(node)
        self._free_device_pages(pages)
        self.device_pages_cached -= len(pages)
        node.device_pages = None
        self.demoted_pages += len(pages)
        return len(pages)

    def _drop_subtree_host(self, node: TreeNode) -> None:
        for child in list(node.children.values()):
            self._drop_subtree_host(child)
            if child.host_pages is not None:
                self._free_host_pages(child.host_pages)
                self.host_pages_cached -= len(child.host_pages)
                self.evicted_host_pages += len(child.host_pages)
            assert child.device_pages is None and child.lock_ref == 0
            del node.children[self._page_key(child.key, 0)]

    # ---------------------------------------------------------------- host eviction
    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` host pages: host-only leaves first, then host copies of device nodes (they
        stay on the device), each in eviction-policy order. Locked nodes are never touched."""
        freed = 0
        heap = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and n.host_pages is not None and n.device_pages is None and not n.children \
                    and n.lock_ref == 0:
                heap.append(self._heap_entry(n))
        heapq.heapify(heap)
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            freed += self._drop_host(node)
            parent = node.parent
            del parent.children[self._page_key(node.key, 0)]
            if parent is not self.root and parent.host_pages is not None and parent.device_pages is None \
                    and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, self._heap_entry(parent))
        if freed < num_pages:
            both = []
            stack = [self.root]
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                if n is not self.root and n.host_pages is not None and n.device_pages is not None:
                    both.append(n)
            for node in sorted(both, key=self.eviction_priority):
                if freed >= num_pages:
                    break
                freed += self._drop_host(node)
        return freed

    def _drop_host(self, node: TreeNode) -> int:
        pages = node.host_pages
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
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def reset(self) -> None:
        assert self.device_pages_locked == 0, "flush with running requests"
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
        self.root.children.clear()
        self.device_pages_cached = self.device_pages_locked = self.host_pages_cached = 0
