"""--schedule-policy (runtime/schedule_policy.py): each ordering on a real radix tree, the side-effect-free prefix
query it uses, and the engine admitting a cache hit first under lpm with the same outputs as fcfs."""
from __future__ import annotations

import itertools

import pytest
from engine_harness import greedy, run, start_engine

from tierlm.runtime.cache.kv_cache_manager import KVCacheManager
from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.radix_cache import RadixCache
from tierlm.runtime.request import Req
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.runtime.schedule_policy import LPM_QUEUE_LIMIT, SchedulePolicy

PS = 4
_rids = itertools.count()


def req(tokens, max_new_tokens: int = 8) -> Req:
    return Req(rid=f"r{next(_rids)}", input_ids=list(tokens),
               sampling_params=SamplingParams(max_new_tokens=max_new_tokens))


def cache_with(*prefixes) -> KVCacheManager:
    """A real KVCacheManager whose radix tree holds ``prefixes`` (whole pages, on the device)."""
    alloc = PageAllocator(256)
    cache = KVCacheManager(alloc, PS, RadixCache(PS, alloc.free))
    for p in prefixes:
        assert len(p) % PS == 0
        cache.tree.insert(p, cache.allocator.alloc(len(p) // PS))
    return cache


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def snapshot(tree):
    """Every node's key, pages, lock and LRU stamp: what a query must not change."""
    out, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        out.append((tuple(n.key), n.device_pages, n.host_pages, n.lock_ref, n.last_access, len(n.children)))
        stack.extend(n.children.values())
    return sorted(out, key=repr)


# ------------------------------------------------------------ the query
def test_cached_prefix_changes_nothing_and_agrees_with_match() -> None:
    cache = cache_with(seq(100, 16), seq(500, 8))
    # the second edge's last page lives only on the host: it counts (a copy, not a prefill)
    node = cache.tree.root.children[tuple(seq(500, PS))]
    cache.tree.insert(seq(500, 8) + seq(900, 4), cache.allocator.alloc(3))
    host_node = node.children[tuple(seq(900, PS))]
    cache.allocator.free(host_node.device_pages)
    cache.tree.device_pages_cached -= 1
    host_node.device_pages, host_node.host_pages = None, [7]
    before = snapshot(cache.tree)
    r1 = req(seq(100, 10) + [1, 2, 3])  # ends part-way through a 4-page edge: match_prefix would split it
    r2 = req(seq(500, 8) + seq(900, 4) + [1])
    r3 = req([1, 2, 3, 4, 5])
    assert [cache.cached_prefix(r)[0] for r in (r1, r2, r3)] == [8, 12, 0]
    assert cache.cached_prefix(r2)[1] is host_node and cache.cached_prefix(r3)[1] is cache.tree.root
    assert snapshot(cache.tree) == before
    for r, expect in ((r1, 8), (r2, 12), (r3, 0)):
        m = cache.tree.match_prefix(r.input_ids, (len(r.input_ids) - 1) // PS)
        assert (len(m.device_pages) + len(m.host_pages)) * PS == expect
    assert cache.cached_prefix(req(seq(100, 16)))[0] == 12  # never the last token: one is left to compute


# ------------------------------------------------------------ orderings
def test_lpm_orders_by_longest_cached_prefix_ties_in_arrival_order() -> None:
    cache = cache_with(seq(100, 16))
    cold, short, long_, short2 = (req(seq(900, 20)), req(seq(100, 4) + seq(700, 8)),
                                  req(seq(100, 16) + [5, 6]), req(seq(100, 8) + [1]))
    policy = SchedulePolicy("lpm", cache)
    assert policy.order([cold, short, long_, short2]) == [long_, short2, short, cold]
    assert policy.order([short, short2]) == [short2, short]


def test_lpm_falls_back_to_fcfs_above_the_queue_limit() -> None:
    cache = cache_with(seq(100, 16))
    policy = SchedulePolicy("lpm", cache)
    queue = [req(seq(1000 + 50 * i, 20)) for i in range(LPM_QUEUE_LIMIT - 1)] + [req(seq(100, 16) + [1])]
    assert policy.order(queue)[0] is queue[-1] and policy.fallbacks == 0
    longer = queue + [req(seq(100, 12) + [2])]
    assert policy.order(longer) == longer and policy.fallbacks == 1


def test_lpm_holds_back_requests_sharing_an_uncached_prefix_for_one_step() -> None:
    cache = cache_with(seq(100, 8))
    doc = seq(2000, 40)
    leader, other, follower = req(doc + [1]), req(seq(5000, 40)), req(doc + [2, 3])
    warm = req(seq(100, 8) + doc)  # cached 8 tokens, then the same document: not the same uncached tokens
    policy = SchedulePolicy("lpm", cache)
    assert policy.order([leader, other, follower, warm]) == [warm, leader, other, follower]
    assert policy.deferred == {follower: leader}
    assert policy.waits_for(follower, [leader]) is leader and policy.waits_for(follower, [other]) is None
    assert policy.waits_for(other, [leader]) is None
    # once the leader's pages are in the tree the follower is simply a hit
    cache.tree.insert(doc, cache.allocator.alloc(10))
    assert policy.order([other, follower]) == [follower, other] and policy.deferred == {}
    assert policy.waits_for(follower, [leader]) is None


@pytest.mark.parametrize("name", ["fcfs", "lpm"])
def test_a_request_waits_for_the_prefill_computing_its_next_page(name: str) -> None:
    """Under every policy: while a running request still prefills pages another one would need next, that one
    waits, and once they are in the tree (the prefill moved past them) it goes."""
    cache = cache_with(seq(100, 8))
    tools = seq(2000, 64)  # 16 pages of a shared prefix nobody has cached yet
    running, waiting = req(tools + [1]), req(tools + [2, 3])
    policy = SchedulePolicy(name, cache)
    assert policy.waits_for(waiting, [running]) is running
    running.kv_len = 32  # half computed: its first 8 pages are in the tree now, the next one is not
    cache.tree.insert(tools[:32], cache.allocator.alloc(8))
    assert policy.waits_for(waiting, [running]) is running
    running.kv_len = 64
    cache.tree.insert(tools, cache.allocator.alloc(16))
    assert policy.waits_for(waiting, [running]) is None  # its remaining tokens are its own
    assert policy.waits_for(req(seq(100, 8) + tools), [running]) is None  # other tokens after the cached page


def test_dfs_weight_visits_the_heaviest_subtree_first() -> None:
    # root -> A (100..107) -> A1 (A + 200..203), A2 (A + 400..403) ;  root -> B (300..307)
    a, b = seq(100, 8), seq(300, 8)
    cache = cache_with(a + seq(200, 4), a + seq(400, 4), b)
    on_b = req(b + [1])
    on_a1 = req(a + seq(200, 4) + [2])
    on_a = req(a + [3, 4, 5, 6, 7])
    on_a_too = req(a + seq(600, 4) + [8])  # diverges below A: its match ends at A
    cold = req(seq(900, 9))
    policy = SchedulePolicy("dfs-weight", cache)
    # A's subtree holds 3 waiting requests, B's 1; below A, the child A1 first, then A's own; cold ones last
    assert policy.order([on_b, cold, on_a1, on_a, on_a_too]) == [on_a1, on_a, on_a_too, on_b, cold]
    # weights decide, not arrival: with two on B, B goes first
    on_b2 = req(b + [9])
    assert policy.order([on_a1, on_b, on_b2, cold]) == [on_b, on_b2, on_a1, cold]


def test_random_is_reproducible_with_the_seed() -> None:
    cache = cache_with()
    queue = [req([i] * 5) for i in range(12)]
    a, b, c = (SchedulePolicy("random", cache, seed=7), SchedulePolicy("random", cache, seed=7),
               SchedulePolicy("random", cache, seed=8))
    orders_a = [a.order(queue) for _ in range(3)]
    assert orders_a == [b.order(queue) for _ in range(3)]
    assert orders_a != [c.order(queue) for _ in range(3)]
    assert all(sorted(o, key=queue.index) == queue for o in orders_a)  # a permutation
    assert orders_a[0] != queue


def test_lof_and_fcfs() -> None:
    cache = cache_with(seq(100, 16))
    r = [req([1, 2, 3], 4), req(seq(100, 16) + [1], 64), req([4, 5], 16), req([6, 7], 64)]
    assert SchedulePolicy("lof", cache).order(r) == [r[1], r[3], r[2], r[0]]
    assert SchedulePolicy("fcfs", cache).order(r) == r


def test_cache_aware_policies_need_the_radix_cache() -> None:
    cache = KVCacheManager(PageAllocator(16), PS, None)
    policy = SchedulePolicy("lpm", cache)
    assert policy.policy == "fcfs" and "asked for lpm" in policy.describe()
    with pytest.raises(ValueError):
        SchedulePolicy("priority", cache)


# ------------------------------------------------------------ the engine
def _admission(tiny_llama, policy: str):
    """One running slot; an unrelated request arrives before one whose prefix is cached. Returns the request
    admitted first, the hit it got and both outputs."""
    shared = seq(10, 24)
    engine = start_engine(tiny_llama, page_size=PS, max_total_tokens=1024, max_running_requests=1,
                          schedule_policy=policy)
    try:
        run(engine, [shared + [3]], greedy(2))  # puts the shared prefix in the tree
        engine.stop_scheduler()  # drive the scheduler by hand from here
        sched = engine.parts.scheduler
        unrelated = Req(rid="unrelated", input_ids=seq(60, 20), sampling_params=greedy(6))
        hit = Req(rid="hit", input_ids=shared + [5, 6, 7], sampling_params=greedy(6))
        sched.add(unrelated)
        sched.add(hit)
        sched.step()
        first = sched.running[0].rid
        for _ in range(100):
            if not sched.has_work():
                break
            sched.step()
        assert not sched.has_work()
        return first, hit.cached.device, unrelated.output_ids, hit.output_ids
    finally:
        engine.shutdown()


def test_engine_lpm_admits_the_cache_hit_first_with_the_same_outputs(tiny_llama) -> None:
    lpm = _admission(tiny_llama, "lpm")
    fcfs = _admission(tiny_llama, "fcfs")
    assert lpm[0] == "hit" and fcfs[0] == "unrelated"
    assert lpm[1] == 24  # it started on the cached prefix
    assert lpm[2:] == fcfs[2:] and len(lpm[2]) == len(lpm[3]) == 6


# ------------------------------------------------------------ the bench's policy comparison
def test_multiturn_bench_compares_policies_against_fcfs() -> None:
    from tierlm.server.commands.bench import command as bench_cmd
    from tierlm.server.commands.bench import multiturn

    ns = bench_cmd.build_parser().parse_args(["multiturn", "--synthetic", "tiny", "--clients", "16", "--concurrency",
                                              "16", "--max-running", "2", "--schedule-policies", "fcfs,lpm"])
    assert multiturn.running_slots(ns) == 2
    sizes = multiturn.plan_sizes(ns, 16)
    assert sizes["l1"] >= 2 * sizes["longest"]
    summaries = [{"mode": "radix", "policy": p, "label": f"radix/{p}", "hit_all": hit, "mean_ttft_s": t,
                  "p50_ttft_s": t, "p99_ttft_s": 2 * t, "wall_s": 10 * t} for p, hit, t in
                 (("fcfs", 0.2, 1.0), ("lpm", 0.6, 0.5))]
    rows = {r["label"]: r for r in multiturn.policy_table(summaries).rows}
    assert rows["radix/fcfs"]["ttft_vs_fcfs"] == 1.0
    assert rows["radix/lpm"]["ttft_vs_fcfs"] == 0.5 and rows["radix/lpm"]["hit_vs_fcfs"] == pytest.approx(3.0)
