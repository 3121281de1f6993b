"""--schedule-policy: the order in which the scheduler offers waiting requests for admission, once per step.

    fcfs        arrival order (a retracted request goes back to the front): the queue as it is
    lpm         longest cached prefix first (device + host tiers, as the radix tree would match it now); above
                LPM_QUEUE_LIMIT waiting requests the matching costs too much per step and that step is fcfs
    dfs-weight  depth-first over the radix tree, heavier subtrees (more waiting requests under them) first, so
                requests sharing a prefix run one after another
    random      a shuffle, from a generator seeded with --random-seed (reproducible)
    lof         longest output (max_new_tokens) first

The policy only orders: it never changes what a request computes, only when it starts. The matching it does is
``KVCacheManager.cached_prefix``, which neither locks nor touches (LRU) nor loads anything. Ties keep arrival
order. What SGLang does (python/sglang/srt/managers/schedule_policy.py), written for tierlm's page-granular tree.

In-batch prefix deprioritization (lpm, after SGLang): a waiting request with at most IN_BATCH_CHECK_TOKENS cached
that shares with an earlier waiting request (its "leader") the next IN_BATCH_DEPRIORITIZE_TOKENS tokens (at least
a page) beyond what is cached goes to the back, and is not admitted in the step its leader is admitted in: one
step later the leader has published those pages to the tree and the follower hits them instead of computing them
again. SGLang compares the first 32 tokens, cached ones included; tierlm compares uncached tokens only, so a
shared, already cached system prompt of 32-47 tokens does not hold back every request that starts with it.

Under every policy a waiting request whose next uncached page another running request is still prefilling waits
for it (``waits_for``): it then hits those pages instead of computing the same KV beside it.
"""
from __future__ import annotations

import logging
import random
from typing import Iterable, Sequence

from tierlm.runtime.cache.kv_cache_manager import KVCacheManager
from tierlm.runtime.cache.radix_cache import TreeNode
from tierlm.runtime.request import Req

log = logging.getLogger(__name__)

POLICIES = ("fcfs", "lpm", "dfs-weight", "random", "lof")
CACHE_AWARE = ("lpm", "dfs-weight")
# SGLang's thresholds: prefix matching is O(prompt) per waiting request, so a longer queue is served fcfs that
# step (SGLang does so for lpm only; tierlm also for dfs-weight, which matches every request the same way).
LPM_QUEUE_LIMIT = 128
IN_BATCH_CHECK_TOKENS = 32  # SGLang's IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD
IN_BATCH_DEPRIORITIZE_TOKENS = 32  # SGLang's IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD


class SchedulePolicy:
    def __init__(self, policy: str, cache: KVCacheManager, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.requested = policy
        if policy in CACHE_AWARE and cache.tree is None:
            log.warning("--schedule-policy %s needs the radix cache, which is disabled: using fcfs", policy)
            policy = "fcfs"
        self.policy = policy
        self.cache = cache
        self._rng = random.Random(seed)
        self.fallbacks = 0  # steps a cache-aware policy ran fcfs because the queue was too long
        # follower -> leader of the last ordering (lpm's in-batch deprioritization)
        self.deferred: dict[Req, Req] = {}

    def describe(self) -> str:
        extra = {
            "fcfs": "arrival order",
            "lpm": f"longest cached prefix first (fcfs above {LPM_QUEUE_LIMIT} waiting)",
            "dfs-weight": f"depth-first over the radix tree, heaviest subtree first (fcfs above {LPM_QUEUE_LIMIT} "
                          "waiting)",
            "random": "shuffled (seeded by --random-seed)",
            "lof": "longest max_new_tokens first",
        }[self.policy]
        note = f" (asked for {self.requested})" if self.requested != self.policy else ""
        return f"{self.policy}: {extra}{note}"

    def order(self, waiting: Iterable[Req]) -> list[Req]:
        """The waiting requests in the order to offer them for admission this step (a new list; the queue
        itself keeps arrival order, so fcfs, and the fallback to it, stay exact)."""
        queue = list(waiting)
        self.deferred = {}
        if len(queue) < 2 or self.policy == "fcfs":
            return queue
        if self.policy == "lof":
            return sorted(queue, key=lambda r: -r.sampling_params.max_new_tokens)
        if self.policy == "random":
            self._rng.shuffle(queue)
            return queue
        if len(queue) > LPM_QUEUE_LIMIT:
            self.fallbacks += 1
            return queue
        matches = [self.cache.cached_prefix(r) for r in queue]
        if self.policy == "lpm":
            return self._longest_prefix(queue, [n for n, _ in matches])
        assert self.cache.tree is not None  # cache-aware policies fall back to fcfs without a radix tree
        return dfs_weight_order(queue, [node for _, node in matches], self.cache.tree.root)

    def _longest_prefix(self, queue: list[Req], cached: list[int]) -> list[Req]:
        leaders: dict[tuple[int, ...], Req] = {}
        shared = max(IN_BATCH_DEPRIORITIZE_TOKENS, self.cache.page_size)  # at least one page the leader caches
        for req, n in zip(queue, cached):
            if n > IN_BATCH_CHECK_TOKENS or len(req.input_ids) < n + shared:
                continue
            head = tuple(req.input_ids[:n + shared])  # the same tokens beyond what is cached
            leader = leaders.setdefault(head, req)
            if leader is not req:
                self.deferred[req] = leader
        rank = {id(r): (r in self.deferred, -n) for r, n in zip(queue, cached)}
        return sorted(queue, key=lambda r: rank[id(r)])  # stable: ties keep arrival order

    def waits_for(self, req: Req, prefilling: Sequence[Req], cached: int | None = None) -> Req | None:
        """The running request whose prefill is still to compute the next page of ``req``'s prompt beyond what the
        tree holds (None: none is), under every policy. ``req`` then waits: a few chunks later those pages are in
        the tree and it hits them, where admitted now it would compute the same KV a second time, side by side.
        Four agent sessions sending the same 12k-token tools and instructions at once otherwise compute them four
        times; a request admitted in the same step counts too (lpm's in-batch deprioritization, after SGLang).
        ``cached``: the tokens of ``req`` the tree holds, where the caller has matched them already."""
        if self.cache.tree is None or not prefilling:
            return None
        ps = self.cache.page_size
        first = req.input_ids[:ps]
        sharing = [p for p in prefilling if p is not req and p.input_ids[:ps] == first]
        if not sharing:  # the common case costs one page of comparison per prefill in progress
            return None
        if cached is None:
            cached, _ = self.cache.cached_prefix(req)
        nxt = req.input_ids[cached:cached + ps]
        if len(nxt) < ps:
            return None  # less than a page left beyond the tree: nothing another prefill would publish
        return next((p for p in sharing if p.kv_len < cached + ps and p.input_ids[cached:cached + ps] == nxt), None)


def dfs_weight_order(queue: list[Req], nodes: list[TreeNode | None], root: TreeNode) -> list[Req]:
    """SGLang's dfs-weight: the weight of a tree node is the number of waiting requests whose match ends at or
    below it; depth-first from the root, heavier children first (ties: arrival order of their first request),
    a node's own requests after its subtree. Only the paths of the queue's matches are visited, so the cost is
    the queue's match depths, not the size of the tree."""
    at: dict[int, list[Req]] = {}
    weight: dict[int, int] = {id(root): 0}
    kids: dict[int, list[TreeNode]] = {}
    for req, matched in zip(queue, nodes):
        node = matched or root
        at.setdefault(id(node), []).append(req)
        while True:
            seen = id(node) in weight
            weight[id(node)] = weight.get(id(node), 0) + 1
            if node is root:
                break
            assert node.parent is not None  # only the root has none
            if not seen:
                kids.setdefault(id(node.parent), []).append(node)
            node = node.parent
    out: list[Req] = []
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        n, expanded = stack.pop()
        if expanded:
            out.extend(at.get(id(n), ()))
            continue
        stack.append((n, True))
        children = sorted(kids.get(id(n), ()), key=lambda c: -weight[id(c)])  # stable
        stack.extend((c, False) for c in reversed(children))  # the heaviest is popped first
    return out
