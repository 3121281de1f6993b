"""--radix-eviction-policy: the order each policy evicts in (device and host tiers, hand-built trees), hits counted
from every tier, and the host tier under a cyclic workload larger than it (through the real engine)."""
import pytest
from engine_harness import greedy, pool_is_clean, run
from test_hicache import doc, hicache_engine, push_out_of_device
from test_radix_cache import make

from tierlm.runtime.cache.eviction_policy import POLICIES, eviction_priority
from tierlm.runtime.cache.hiradix_cache import HiRadixCache
from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.radix_cache import TreeNode

# Five one-page branches, oldest use first: B never reused, E reused once, D 3 times, A twice, C once just now.
BRANCHES = {"A": [1, 1], "B": [2, 2], "C": [3, 3], "D": [4, 4], "E": [5, 5]}
# slru: B, E, C (hit fewer than twice: probation) before D, A; loop: B (never reused), then reused once newest first
# (C, E), then the rest oldest first (D, A)
EXPECTED = {"lru": "BEDAC", "lfu": "BECAD", "slru": "BECDA", "loop": "BCEDA"}


def _use_branches(tree, alloc) -> None:
    for toks in BRANCHES.values():
        tree.insert(toks, alloc.alloc(1))
    for name, times in (("E", 1), ("D", 3), ("A", 2), ("C", 1)):
        for _ in range(times):
            tree.match_prefix(BRANCHES[name])  # an admission: touches the node and counts one hit


def test_policy_keys_on_nodes() -> None:
    nodes = {"A": TreeNode(hit_count=2, last_access=4), "B": TreeNode(hit_count=0, last_access=1),
             "C": TreeNode(hit_count=1, last_access=5), "D": TreeNode(hit_count=3, last_access=3),
             "E": TreeNode(hit_count=1, last_access=2)}
    for name, order in EXPECTED.items():
        key = eviction_priority(name)
        assert "".join(sorted(nodes, key=lambda n: key(nodes[n]))) == order, name
    with pytest.raises(ValueError):
        eviction_priority("fifo")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_device_eviction_follows_the_policy(policy) -> None:
    alloc, tree = make(8)
    tree.set_eviction_policy(policy)
    _use_branches(tree, alloc)
    assert [tree.peek_prefix(BRANCHES[n])[1].hit_count for n in "ABCDE"] == [2, 0, 1, 3, 1]
    order = ""
    for _ in BRANCHES:
        assert tree.evict(1) == 1
        order += next(n for n, t in BRANCHES.items() if n not in order and tree.peek_prefix(t)[0] == 0)
    assert order == EXPECTED[policy]
    assert alloc.num_free == 8 and tree.device_pages_cached == 0


def _hi_tree(policy: str, device_pages: int = 8, host_pages: int = 8):
    dev, host = PageAllocator(device_pages), PageAllocator(host_pages)

    def backup(node: TreeNode) -> bool:  # write_back: a host copy when the node leaves the device
        if host.num_free < len(node.device_pages):
            return False
        tree.set_host_pages(node, host.alloc(len(node.device_pages)))
        return True

    tree = HiRadixCache(2, dev.free, eviction_policy=policy)
    tree.bind_host_tier(host.free, backup_node=backup, on_new_node=lambda n: None)
    return dev, host, tree


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_host_eviction_follows_the_policy(policy) -> None:
    dev, host, tree = _hi_tree(policy)
    _use_branches(tree, dev)
    tree.evict(5)  # every branch demoted: host-only leaves, hit counts and ages kept
    assert tree.demoted_pages == 5 and tree.host_pages_cached == 5 and dev.num_free == 8
    order = ""
    for _ in BRANCHES:
        assert tree.evict_host(1) == 1
        order += next(n for n, t in BRANCHES.items() if n not in order and tree.peek_prefix(t)[0] == 0)
    assert order == EXPECTED[policy]
    assert host.num_free == 8 and tree.host_pages_cached == 0 and tree.root.children == {}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_host_copies_of_device_nodes_go_in_policy_order(policy) -> None:
    dev, host, tree = _hi_tree(policy)
    _use_branches(tree, dev)
    for name in BRANCHES:  # write_through: host copies while the pages stay on the device
        node = tree.peek_prefix(BRANCHES[name])[1]
        tree.set_host_pages(node, host.alloc(1))
    order = ""
    for _ in BRANCHES:
        assert tree.evict_host(1) == 1
        order += next(n for n, t in BRANCHES.items()
                      if n not in order and tree.peek_prefix(t)[1].host_pages is None)
    assert order == EXPECTED[policy]
    assert tree.device_pages_cached == 5 and host.num_free + tree.host_pages_cached == 8


def test_a_split_keeps_the_hits_on_both_halves() -> None:
    alloc, tree = make(8)
    tree.set_eviction_policy("lfu")
    tree.insert([1, 1, 2, 2, 3, 3], alloc.alloc(3))
    tree.match_prefix([1, 1, 2, 2, 3, 3])
    tree.match_prefix([1, 1, 2, 2, 9, 9])  # splits the edge after two pages; only the upper half is reused
    upper = tree.peek_prefix([1, 1, 2, 2])[1]
    lower = tree.peek_prefix([1, 1, 2, 2, 3, 3])[1]
    assert lower.parent is upper and (upper.hit_count, lower.hit_count) == (2, 1)


def _hits(engine, prompt) -> int:
    return engine.parts.cache.tree.peek_prefix(prompt, (len(prompt) - 1) // 4)[1].hit_count


def test_host_and_storage_reuse_count_a_hit(tiny_llama, store) -> None:
    prompt = doc(7) + [3]
    engine = hicache_engine("torch", tiny_llama, radix_eviction_policy="lfu")
    try:
        run(engine, [prompt], greedy(4))
        assert _hits(engine, prompt) == 0  # computed, not reused
        push_out_of_device(engine)
        hot, = run(engine, [prompt], greedy(4))
        assert hot.last.cached.host == 60 and _hits(engine, prompt) == 1
        hot, = run(engine, [prompt], greedy(4))
        assert hot.last.cached.device == 60 and _hits(engine, prompt) == 2
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()
    engine = hicache_engine("torch", tiny_llama, radix_eviction_policy="lfu")
    try:
        hot, = run(engine, [prompt], greedy(4))
        assert hot.last.cached.storage == 60 and _hits(engine, prompt) == 1
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def _memory_hits(tiny_llama, policy: str, prompts: list[list[int]], l3, skip: int = 0) -> dict[str, int]:
    """Tokens served per tier, one request at a time, past the first ``skip``: L1 24 pages, L2 48, an empty L3
    (``l3``: the test's monkeypatch and tmp_path) below."""
    monkeypatch, tmp_path = l3
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / f"l3-{policy}-{skip}"))
    engine = hicache_engine("torch", tiny_llama, hicache_ratio=2.0, radix_eviction_policy=policy)
    try:
        hits = {"device": 0, "host": 0, "storage": 0}
        for i, prompt in enumerate(prompts):
            out, = run(engine, [prompt], greedy(1))
            # every L3 write done before the next request: which tier serves it must not depend on the machine's load
            assert engine.parts.cache.storage_io.flush(timeout=30)
            for tier in hits:
                hits[tier] += getattr(out.last.cached, tier) if i >= skip else 0
        assert pool_is_clean(engine)
        return hits
    finally:
        engine.shutdown()


def test_a_cycle_larger_than_the_host_tier_gets_host_hits_under_loop_not_lru(tiny_llama, monkeypatch, tmp_path) -> None:
    cycle = [doc(40 + i, 40) + [1] for _ in range(3) for i in range(6)]  # 6 x 10 pages in turn, 3 times
    lru = _memory_hits(tiny_llama, "lru", cycle, (monkeypatch, tmp_path))
    assert lru["device"] == lru["host"] == 0  # each document is evicted just before it comes back
    assert _memory_hits(tiny_llama, "loop", cycle, (monkeypatch, tmp_path))["host"] > 0


def test_loop_lets_new_documents_in_after_a_burst_of_one_shot_prompts(tiny_llama, monkeypatch, tmp_path) -> None:
    junk = [doc(200 + j, 40) + [2] for j in range(14)]  # fills both memory tiers, never reused
    docs = [doc(60 + i, 40) + [1] for _ in range(5) for i in range(3)]
    for policy in ("lru", "loop"):
        hits = _memory_hits(tiny_llama, policy, junk + docs, (monkeypatch, tmp_path), skip=len(junk))
        assert hits["storage"] == 0 and hits["device"] + hits["host"] == 12 * 40, policy


def test_a_retracted_request_coming_back_is_not_a_new_reuse() -> None:
    """hit_count counts admissions that reuse a node; a request retracted for lack of pages and admitted again
    already counted its hits the first time."""
    from tierlm.runtime.cache.kv_cache_manager import KVCacheManager
    from tierlm.runtime.cache.page_allocator import PageAllocator
    from tierlm.runtime.cache.radix_cache import RadixCache
    from tierlm.runtime.request import Req
    from tierlm.runtime.sampling_params import SamplingParams

    alloc = PageAllocator(64)
    cache = KVCacheManager(alloc, 4, RadixCache(4, alloc.free))
    prompt = list(range(10, 31))  # 5 whole pages reusable (a request always computes its last token)

    def admit(admitted_once: bool) -> Req:
        req = Req(rid="r", input_ids=list(prompt), sampling_params=SamplingParams(max_new_tokens=1))
        req.admitted_once = admitted_once
        cache.match(req)
        assert cache.reserve(req, len(prompt))
        req.kv_len = len(prompt)
        return req

    cache.release(admit(False), cache_kv=True)  # cold: its pages enter the tree, nothing reused
    node = cache.tree.match_prefix(prompt[:20], count_hit=False).last_node
    assert node.hit_count == 0
    cache.release(admit(False), cache_kv=True)  # a new request reusing them: one hit
    assert node.hit_count == 1
    cache.release(admit(True), cache_kv=True)  # the same request back after a retraction: no new hit
    assert node.hit_count == 1
