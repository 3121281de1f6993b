"""--radix-eviction-policy: the order unlocked cached nodes leave a tier (device eviction in RadixCache.evict,
host eviction in HiRadixCache.evict_host). A policy maps a TreeNode to a sort key; the smallest key goes first.

SGLang's names and keys: lru = last access; lfu = (hits, last access); slru = (hit at least twice, last access),
i.e. a probation segment (nodes reused at most once) that always goes before the protected one. tierlm adds loop
(loop-resistant; measured in docs/performance.md, "Host tier eviction policy"). ``hit_count``
counts request admissions that reused the node from any tier (radix_cache.py, hiradix_cache.py).
"""
from __future__ import annotations

from typing import Callable, Protocol


class TreeNode(Protocol):
    """What a policy reads of a radix tree node (radix_cache.TreeNode); a Protocol, so this module needs no
    import of the tree that imports it."""

    last_access: int  # a logical clock
    hit_count: int


Priority = Callable[[TreeNode], tuple[int, ...]]


def lru(node: TreeNode) -> tuple[int, ...]:
    return (node.last_access,)


def lfu(node: TreeNode) -> tuple[int, ...]:
    return (node.hit_count, node.last_access)


def slru(node: TreeNode) -> tuple[int, ...]:
    return (1 if node.hit_count >= 2 else 0, node.last_access)


def loop(node: TreeNode) -> tuple[int, ...]:
    """tierlm's own, loop-resistant: never-reused nodes go first (oldest first), then nodes reused once, newest
    first, then the rest (oldest first). Reuse that comes back in a cycle larger than the tier (chat clients
    taking turns, documents asked about in turn) then keeps the part of the cycle that got in first, where lru,
    lfu and slru evict every node just before it returns; one-shot nodes still leave in lru order, so a tier
    full of stale one-shot pages never locks out new ones (pure LRU insertion, LIP, does)."""
    h = node.hit_count
    return (0, node.last_access) if h == 0 else (1, -node.last_access) if h == 1 else (2, node.last_access)


POLICIES: dict[str, Priority] = {"lru": lru, "lfu": lfu, "slru": slru, "loop": loop}


def eviction_priority(name: str) -> Priority:
    """The sort key of policy ``name`` (ServerArgs has checked the name; a wrong one here is a bug)."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown radix eviction policy {name!r}; use one of {', '.join(POLICIES)}") from None
