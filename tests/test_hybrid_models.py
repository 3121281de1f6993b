"""Hybrid models (Qwen3.5 / Qwen3-Next gated DeltaNet, Granite-4.0-H / Nemotron-H Mamba2): greedy output equals
transformers' float32 reference token for token, their recurrent state kept in tierlm's state pool (one live slot
per running request, snapshots on radix-tree nodes for prefix reuse).

Backend level: mixed prefill/decode steps, chunked prefill, page sizes 1/4/16, slots reused across runs (a state
must not leak into the next request that gets its slot). Runtime level: the tree's snapshot rules (match cut to the
deepest snapshot, no stateless leaf after state eviction). Engine level: a shared system prompt + different user
turns and a multi-turn continuation reuse exactly the page-aligned snapshot depth (cached_tokens) with the
reference output, under chunked prefill and page sizes 1/4/16; eviction under tiny pools, retraction and abort
leave both pools clean; HiCache: snapshots go to the host (L2) and storage (L3) tiers with their pages, an L2 or L3
hit gives the cold output (an L3 folder written by torch serves MLX), a missing or damaged snapshot file only makes
the hit shallower; NGRAM speculative decoding, which a hybrid cannot serve yet, is refused at startup with the
reason. Both backends.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from backend_driver import run_greedy
from backends_under_test import backend_params, make_backend
from engine_harness import disconnect_after, greedy, pool_is_clean, run, settles_clean, start_engine
from model_factory import HYBRIDS, build_tiny_hybrid, hybrid_available, reference_greedy

from tierlm.backends.model_source.hybrid_layout import hybrid_layout
from tierlm.backends.verified_architectures import HYBRID_BACKENDS, verified_for
from tierlm.runtime.errors import StartupError

BACKEND_NAMES = list(HYBRID_BACKENDS)  # test_verified_architectures holds the verified list to this
BACKENDS = backend_params(BACKEND_NAMES)
ENGINE_FAMILIES = ["Qwen3_5ForCausalLM", "NemotronHForCausalLM"]  # one gated DeltaNet, one Mamba2
N_NEW = 12


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request, tiny_models_root) -> Path:
    if not hybrid_available(request.param):
        pytest.skip(f"transformers has no {request.param}")
    return build_tiny_hybrid(request.param, tiny_models_root / f"hybrid4_{request.param}")


def _tiny(architecture: str, root: Path) -> Path:
    if not hybrid_available(architecture):
        pytest.skip(f"transformers has no {architecture}")
    return build_tiny_hybrid(architecture, root / f"hybrid4_{architecture}")


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 280, n).tolist() for n in (37, 21, 5, 1)]  # a one-token prompt is a fresh "decode"


class SlotsByFirstPage:
    """The backend, with each ForwardBatch given the state slot of its request (found by the request's first page:
    backend_driver assigns pages per request), as the scheduler does."""

    def __init__(self, backend, slot_of_first_page: dict[int, int]) -> None:
        self.backend, self.slot_of = backend, slot_of_first_page

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, batch):
        batch.state_slots = np.array([self.slot_of[int(p)] for p in batch.page_table[:, 0]], np.int32)
        return self.backend.forward(batch)


# ------------------------------------------------------------------------------------------ backend level


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_greedy_equals_transformers_with_mixed_batches_chunks_and_page_sizes(hybrid, backend_name):
    prompts = _prompts()
    ref = [reference_greedy(hybrid, p, N_NEW) for p in prompts]
    backend = make_backend(backend_name, hybrid, device="cpu", cached=False)
    assert backend.info.state is not None and backend.info.state.slot_bytes > 0
    num_slots = 6
    backend.init_state_pool(num_slots)
    shapes: list[tuple[int, ...]] = []
    for run_no, (page_size, chunk) in enumerate(((1, None), (4, 8), (16, 5))):
        needed = [-(-(len(p) + N_NEW - 1) // page_size) for p in prompts]
        firsts = np.concatenate([[0], np.cumsum(needed)[:-1]]).tolist()
        # each run hands the slots out differently, so every request starts in a slot another one dirtied
        slots = {int(f): (num_slots - 1 - i - run_no) % num_slots for i, f in enumerate(firsts)}
        drivers: list = []
        got = run_greedy(SlotsByFirstPage(backend, slots), prompts, N_NEW, page_size=page_size, chunk_size=chunk,
                         stagger=2, driver_out=drivers)
        assert got == ref, (page_size, chunk)
        shapes += drivers[0].batch_shapes
    assert any(1 in s and max(s) > 1 for s in shapes), "no step mixed decode rows with a prefill chunk"


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_forward_batch_without_state_slots_is_refused(hybrid, backend_name):
    from backend_driver import GreedyDriver

    backend = make_backend(backend_name, hybrid, device="cpu", cached=False)
    backend.init_state_pool(2)
    driver = GreedyDriver(backend, page_size=4, num_pages=8)
    driver.add([5, 6, 7], 2, [0, 1])
    with pytest.raises(ValueError, match="state_slots"):
        driver.step()


def test_layout_from_config_json(hybrid):
    config = json.loads((hybrid / "config.json").read_text())
    layout = hybrid_layout(config)
    spec = HYBRIDS[config["architectures"][0]]
    names = spec.get("layer_types") or spec["layers_block_type"]
    assert layout.linear_layers == tuple(i for i, t in enumerate(names) if t in ("linear_attention", "mamba"))
    assert layout.kv_layers == tuple(i for i, t in enumerate(names) if t in ("full_attention", "attention"))
    assert hybrid_layout({"model_type": "llama", "num_hidden_layers": 3}) is None


def test_nemotron_h_layout_from_its_hub_pattern():
    layout = hybrid_layout({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-E", "mamba_num_heads": 4,
                            "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 2, "conv_kernel": 4})
    assert layout.linear_layers == (0, 2) and layout.kv_layers == (3,)
    assert layout.conv_dim == 4 * 16 + 2 * 2 * 8 and layout.rec_shape == (4, 16, 8)


def test_verified_on_the_backends_that_have_a_state_pool():
    for architecture, spec in HYBRIDS.items():
        for backend in ("torch", "mlx"):
            verified = verified_for(backend).get(architecture) == spec["model_type"]
            assert verified == (backend in BACKEND_NAMES), (architecture, backend)


def test_the_memory_plan_sets_live_and_snapshot_state_slots_aside():
    from test_tier_sizing import CPU_BOX

    from tierlm.platforms import choose_backend, size_kv_tiers
    from tierlm.server.commands.cli_args import parse_args

    decision = choose_backend(CPU_BOX, {"TIERLM_BACKEND": "torch"}, None)
    args = parse_args(["--mem-fraction-static", "0.001", "--max-running-requests", "4", "--page-size", "4"])
    sizes = dict(weight_bytes=10**6, kv_bytes_per_token=1024, context_length=None)
    plain = size_kv_tiers(CPU_BOX, decision, args, **sizes)
    hybrid = size_kv_tiers(CPU_BOX, decision, args, **sizes, state_slot_bytes=2**20)
    # 4 live slots + 2 x 4 snapshot slots (prefix reuse)
    assert (plain.state_slots, hybrid.state_slots, hybrid.state_bytes) == (0, 12, 12 * 2**20)
    assert plain.device_bytes - hybrid.device_bytes == 12 * 2**20  # memory-bound: the slots come out of L1
    assert hybrid.to_dict()["weight_bytes"] == plain.to_dict()["weight_bytes"] == 10**6
    assert hybrid.to_dict()["state_slots"] == 12 and "state_slots" not in plain.to_dict()
    no_radix = parse_args(["--mem-fraction-static", "0.001", "--max-running-requests", "4", "--page-size", "4",
                           "--disable-radix-cache"])
    assert size_kv_tiers(CPU_BOX, decision, no_radix, **sizes, state_slot_bytes=2**20).state_slots == 4  # live only
    assert hybrid.host_state_slots == 0
    hicache = parse_args(["--mem-fraction-static", "0.001", "--max-running-requests", "4", "--page-size", "4",
                          "--enable-hierarchical-cache", "--hicache-ratio", "2"])
    hybrid_l2 = size_kv_tiers(CPU_BOX, decision, hicache, **sizes, state_slot_bytes=2**20)
    # --hicache-ratio 2: twice the device's 8 snapshot slots, next to twice its KV pages
    assert (hybrid_l2.host_state_slots, hybrid_l2.host_state_bytes) == (16, 16 * 2**20)
    assert hybrid_l2.host_pages == 2 * hybrid_l2.device_pages
    assert hybrid_l2.to_dict()["host_state_slots"] == 16
    sized = parse_args(["--mem-fraction-static", "0.001", "--max-running-requests", "4", "--page-size", "4",
                        "--enable-hierarchical-cache", "--hicache-size", "0.05"])
    by_size = size_kv_tiers(CPU_BOX, decision, sized, **sizes, state_slot_bytes=2**20)
    plain_l2 = size_kv_tiers(CPU_BOX, decision, sized, **sizes)
    # --hicache-size: one byte budget; the snapshots (as many per page as on the device) come out of it
    assert by_size.host_state_slots > 0
    assert plain_l2.host_pages - by_size.host_pages == -(-by_size.host_state_slots * 2**20 // (4 * 1024))


# ------------------------------------------------------------------------------------------ runtime level


def test_tree_snapshot_rules_match_cut_split_tombstone_and_state_eviction():
    from tierlm.runtime.cache.radix_cache import RadixCache
    from tierlm.runtime.cache.state_slots import StateSlots

    slots, freed = StateSlots(4), []
    tree = RadixCache(2, freed.extend)
    tree.free_state_slot = slots.free_cached
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9]
    _, node_a = tree.insert(a, [10, 11, 12])
    slot = slots.alloc()
    assert tree.set_state(node_a, slot) and not tree.set_state(node_a, 99)
    slots.to_cache()
    _, node_b = tree.insert(b, [10, 11, 13])  # splits a's edge after 2 pages: the upper node has no state
    upper = node_b.parent
    assert upper.state_slot is None and node_a.state_slot == slot and len(upper.key) == 4
    # b's leaf has no snapshot yet: its match is cut to the root; a's reaches its snapshot
    assert tree.peek_prefix(b + [0]) == (0, tree.root)
    assert tree.peek_prefix(a + [0]) == (3, node_a)
    assert tree.state_ancestor(tree.match_prefix(b).last_node, 3) == (tree.root, 0)
    slot_b = slots.alloc()
    tree.set_state(node_b, slot_b)
    slots.to_cache()
    tree.lock(node_b)
    assert slots.accounting() == {"total_slots": 4, "free_slots": 2, "cached_slots": 2, "in_use_slots": 0}
    # evicting a's snapshot drops its leaf's page too; the stateless upper node stays (b's locked path needs it)
    assert tree.evict_states(1) == (1, 1) and freed == [12] and node_a.state_slot is None
    assert tree.evict_states(1) == (1, 0) and node_b.state_slot is None  # locked: the state goes, the pages stay
    assert slots.accounting()["cached_slots"] == 0 == tree.states_cached
    tree.unlock(node_b)
    assert tree.evict(1) == 3 and sorted(freed) == [10, 11, 12, 13]  # the stateless parent goes with the leaf
    assert not tree.root.children


# ------------------------------------------------------------------------------------------ engine level


SYSTEM = [(7 * j) % 270 + 5 for j in range(24)]  # a shared system prompt of 24 tokens
TURN_A, TURN_B, TURN_C = SYSTEM + list(range(40, 49)), SYSTEM + list(range(90, 96)), SYSTEM + [7, 8, 9, 10, 11]
# (page size, chunk) -> cached tokens of B, C and of A's follow-up turn. B resumes at the deepest snapshot A left at
# or below the system prompt (a chunk end) and takes one where the shared KV ends (24, page-aligned), which C then
# reuses; A's follow-up reuses A's prompt + output up to the last full page A computed (33 + 11 = 44 tokens).
REUSE_DEPTHS = {(4, 16): (16, 24, 44), (1, 5): (20, 24, 44), (16, 512): (0, 16, 32)}


def _tree_nodes(tree) -> list:
    nodes, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        nodes.append(n)
    return nodes


def _check_state_pool(engine) -> None:
    """free + cached + in_use == total, nothing in use, and the cached slots are exactly the tree's snapshots."""
    acc = engine.server_info()["state_pool"]
    assert acc["in_use_slots"] == 0 and acc["free_slots"] + acc["cached_slots"] == acc["total_slots"], acc
    tree = engine.parts.cache.tree
    nodes = _tree_nodes(tree)
    slots = [n.state_slot for n in nodes if n.state_slot is not None]
    assert len(slots) == len(set(slots)) == acc["cached_slots"]
    assert all(n.state_slot is not None for n in nodes if n is not tree.root and not n.children), "stateless leaf"
    assert pool_is_clean(engine)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("architecture", sorted(HYBRIDS))
def test_engine_reuses_a_shared_system_prompt_and_the_previous_turn(architecture, backend_name, tiny_models_root):
    model = _tiny(architecture, tiny_models_root)
    _reuse_depths(model, backend_name, 4, 16)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("page_size, chunk", [(1, 5), (16, 512)])
@pytest.mark.parametrize("architecture", ENGINE_FAMILIES)
def test_engine_reuse_depths_by_page_size_and_chunk(architecture, page_size, chunk, backend_name, tiny_models_root):
    _reuse_depths(_tiny(architecture, tiny_models_root), backend_name, page_size, chunk)


def _reuse_depths(model: Path, backend_name: str, page_size: int, chunk: int) -> None:
    engine = start_engine(model, backend_name, dtype="float32", page_size=page_size, max_total_tokens=512,
                          chunked_prefill_size=chunk)
    try:
        assert engine.server_info()["radix_cache"] is True
        cached = []
        for p in (TURN_A, TURN_B, TURN_C):
            r, = run(engine, [p], greedy(N_NEW))
            assert r.token_ids == reference_greedy(model, p, N_NEW), len(p)
            cached.append(r.last.cached.total)
            if p is TURN_A:
                follow_up = TURN_A + r.token_ids + [100, 101, 102]
        r, = run(engine, [follow_up], greedy(N_NEW))
        assert r.token_ids == reference_greedy(model, follow_up, N_NEW)
        assert tuple(cached) + (r.last.cached.total,) == (0,) + REUSE_DEPTHS[page_size, chunk]
        both = run(engine, [TURN_B, TURN_C], greedy(N_NEW))  # batched, both from snapshots
        assert [r.token_ids for r in both] == [reference_greedy(model, p, N_NEW) for p in (TURN_B, TURN_C)]
        _check_state_pool(engine)
        assert asyncio.run(engine.flush_cache())
        assert engine.server_info()["state_pool"]["cached_slots"] == 0
        r, = run(engine, [TURN_C], greedy(N_NEW))  # after a flush: from zeros again
        assert r.last.cached.total == 0 and r.token_ids == reference_greedy(model, TURN_C, N_NEW)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_engine_eviction_under_tiny_pools_keeps_the_reference_and_the_accounting(backend_name, tiny_models_root):
    model = _tiny("NemotronHForCausalLM", tiny_models_root)
    # 20 pages of 4 tokens and 2 running requests (2 live + 4 snapshot slots): pages and snapshots are evicted
    engine = start_engine(model, backend_name, dtype="float32", page_size=4, max_total_tokens=80,
                          chunked_prefill_size=16, max_running_requests=2)
    try:
        assert engine.server_info()["state_pool"]["total_slots"] == 6
        prompts = [SYSTEM[:16 + 4 * (i % 3)] + [(i * 13 + j) % 270 + 5 for j in range(9)] for i in range(6)]
        for round_ in range(2):
            for p in prompts:
                r, = run(engine, [p], greedy(N_NEW))
                assert r.token_ids == reference_greedy(model, p, N_NEW), (round_, len(p))
            both = run(engine, prompts[:3], greedy(N_NEW))
            assert [r.token_ids for r in both] == [reference_greedy(model, p, N_NEW) for p in prompts[:3]]
            _check_state_pool(engine)
        assert engine.parts.cache.snapshots.evicted_states > 0
        assert engine.parts.cache.eviction_counters()["device"]() > 0
    finally:
        engine.shutdown()


def _metric(engine, name: str) -> float:
    """The value of an engine metric (one sample: its labels are the model name)."""
    line = next(ln for ln in engine.metrics_text().decode().splitlines() if ln.startswith((name + " ", name + "{")))
    return float(line.rsplit(" ", 1)[1])


def _slots_clean(engine) -> bool:
    acc = engine.parts.cache.state_accounting()
    return acc["in_use_slots"] == 0 and acc["free_slots"] + acc["cached_slots"] == acc["total_slots"]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_engine_retraction_and_abort_leave_the_state_slots_clean(backend_name, tiny_models_root):
    model = _tiny("Qwen3_5ForCausalLM", tiny_models_root)
    # 24 pages of 4 tokens: 4 requests of ~40 tokens + 16 new cannot all fit at once, so some are retracted and
    # resume from the snapshot they published (or from zeros when it was evicted meanwhile)
    engine = start_engine(model, backend_name, dtype="float32", page_size=4, max_total_tokens=96,
                          chunked_prefill_size=32,
                          max_running_requests=4)
    try:
        prompts = [[(i * 11 + j) % 280 + 3 for j in range(37 + i)] for i in range(4)]
        results = run(engine, prompts, greedy(16))
        for p, r in zip(prompts, results):
            assert r.token_ids == reference_greedy(model, p, 16)
        assert _metric(engine, "tierlm_retracted_requests_total") > 0
        assert pool_is_clean(engine) and _slots_clean(engine)
        _check_state_pool(engine)
        disconnect_after(engine, list(range(3, 30)), greedy(60))  # aborted mid-generation
        assert settles_clean(engine) and _slots_clean(engine)
        _check_state_pool(engine)
        r, = run(engine, [prompts[0]], greedy(16))  # from what is still cached, or zeros
        assert r.token_ids == reference_greedy(model, prompts[0], 16)
        r, = run(engine, [list(range(3, 30))], greedy(16))  # the aborted one's prefix, if still cached
        assert r.token_ids == reference_greedy(model, list(range(3, 30)), 16)
        _check_state_pool(engine)
    finally:
        engine.shutdown()


def test_engine_refuses_what_a_hybrid_cannot_serve_yet(tiny_models_root, monkeypatch):
    from tierlm.runtime import engine_setup

    model = _tiny("Qwen3_5ForCausalLM", tiny_models_root)
    monkeypatch.setattr(engine_setup, "load_backend", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(StartupError, match="roll its recurrent state back"):
        start_engine(model, "torch", dtype="float32", speculative_algorithm="NGRAM")


# ------------------------------------------------------------------------------------------ HiCache


def test_states_round_trip_through_the_host_state_pool(tiny_models_root):
    """copy_states_to_host / copy_states_from_host keep every byte a later step reads (the conv's last K-1 columns,
    the recurrent state) in SHARED_STATE_LAYOUT; the conv's oldest column comes back as zeros."""
    import torch

    from tierlm.backends.base import HostStatePool

    backend = make_backend("torch", _tiny("Qwen3_5ForCausalLM", tiny_models_root), device="cpu", cached=False)
    backend.init_state_pool(4)
    pool = backend.linear_state.pool
    torch.manual_seed(0)
    pool.conv.copy_(torch.randn_like(pool.conv))
    pool.rec.copy_(torch.randn_like(pool.rec))
    host = HostStatePool(3, backend.info.state)
    backend.copy_states_to_host(np.array([2, 0], np.int32), host, np.array([1, 2], np.int32))
    g = backend.info.state
    conv0 = host.layer_views(1, 0)[0].view(np.float32).reshape(g.conv_kernel - 1, g.conv_dim)
    assert np.array_equal(conv0, pool.conv[0, 2, :, 1:].T.numpy())  # channels-last, last K-1 inputs
    before_conv, before_rec = pool.conv.clone(), pool.rec.clone()
    backend.copy_states_from_host(host, np.array([1, 2], np.int32), np.array([3, 1], np.int32))
    assert torch.equal(pool.rec[:, 3], before_rec[:, 2]) and torch.equal(pool.rec[:, 1], before_rec[:, 0])
    assert torch.equal(pool.conv[:, 3, :, 1:], before_conv[:, 2, :, 1:]) and not pool.conv[:, 3, :, 0].any()
    assert torch.equal(pool.conv[:, 0], before_conv[:, 0]) and torch.equal(pool.rec[:, 2], before_rec[:, 2])


def _hicache(model: Path, backend_name: str, storage: bool, **kw):
    kw = {**dict(dtype="float32", page_size=4, max_total_tokens=96, chunked_prefill_size=16, max_running_requests=2,
                 enable_hierarchical_cache=True, hicache_ratio=32.0), **kw}
    if storage:
        kw.update(hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete")
    return start_engine(model, backend_name, **kw)


def _doc(seed: int, n: int = 42) -> list[int]:
    return [(seed * 31 + j * 7) % 270 + 5 for j in range(n)]


def _check_host_states(engine, host_snapshots: bool = True) -> None:
    """Both state pools clean: the device one as _check_state_pool, the host one's cached slots exactly the tree's
    host snapshots, each on a node with host pages, and no leaf without a snapshot in some tier."""
    acc = engine.server_info()["state_pool"]
    assert acc["in_use_slots"] == 0 and acc["free_slots"] + acc["cached_slots"] == acc["total_slots"], acc
    assert pool_is_clean(engine)
    assert acc["host_in_use_slots"] == 0, acc
    assert acc["host_free_slots"] + acc["host_cached_slots"] == acc["host_total_slots"], acc
    tree = engine.parts.cache.tree
    nodes = _tree_nodes(tree)
    device = [n.state_slot for n in nodes if n.state_slot is not None]
    assert len(device) == len(set(device)) == acc["cached_slots"]
    host = [n.host_state_slot for n in nodes if n.host_state_slot is not None]
    assert len(host) == len(set(host)) == acc["host_cached_slots"]
    assert acc["host_cached_slots"] > 0 or not host_snapshots
    assert all(n.host_pages is not None for n in nodes if n.host_state_slot is not None)
    assert all(n.state_slot is None or n.device_pages is not None for n in nodes)
    assert all(n.host_state_slot is not None or n.state_slot is not None for n in nodes
               if n is not tree.root and not n.children), "leaf without a snapshot in any tier"


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("architecture", ENGINE_FAMILIES)
def test_hicache_host_hit_resumes_from_a_host_snapshot(architecture, backend_name, tiny_models_root):
    model = _tiny(architecture, tiny_models_root)
    engine = _hicache(model, backend_name, storage=False)
    try:
        prompt = _doc(1) + [9, 9]
        cold, = run(engine, [prompt], greedy(N_NEW))
        assert cold.token_ids == reference_greedy(model, prompt, N_NEW)
        for i in range(3):  # push it out of the device tier: pages and snapshots demoted to the host
            run(engine, [_doc(100 + i)], greedy(4))
        hot, = run(engine, [prompt], greedy(N_NEW))
        assert hot.last.cached.host > 0 and hot.last.cached.device == 0, hot.last.cached
        assert hot.token_ids == cold.token_ids
        assert engine.parts.cache.states.loaded_host_states > 0
        _check_host_states(engine)
        assert asyncio.run(engine.flush_cache())
        acc = engine.server_info()["state_pool"]
        assert acc["cached_slots"] == acc["host_cached_slots"] == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_hicache_eviction_in_both_tiers_keeps_the_reference_and_the_accounting(backend_name, tiny_models_root):
    """A host tier too small for the traffic: pages and snapshots are demoted, evicted from the host and loaded back
    under every write policy; every output stays the reference and both state pools stay consistent."""
    model = _tiny("NemotronHForCausalLM", tiny_models_root)
    prompts = [SYSTEM[:16 + 4 * (i % 3)] + [(i * 13 + j) % 270 + 5 for j in range(9 + i)] for i in range(6)]
    refs = [reference_greedy(model, p, 8) for p in prompts]
    for policy in ("write_through", "write_back"):
        engine = _hicache(model, backend_name, storage=False, hicache_write_policy=policy, hicache_ratio=1.5)
        try:
            for _ in range(2):
                for p, ref in zip(prompts, refs):
                    r, = run(engine, [p], greedy(8))
                    assert r.token_ids == ref, (policy, len(p))
                both = run(engine, prompts[:3], greedy(8))
                assert [r.token_ids for r in both] == refs[:3]
                _check_host_states(engine, host_snapshots=False)
            states = engine.parts.cache.states
            assert states.loaded_host_states > 0 and engine.parts.cache.tree.evicted_host_states > 0, policy
        finally:
            engine.shutdown()


def _state_files(store: Path) -> list[Path]:
    """The snapshot files of the L3 folder (the namespace whose namespace.json says entry "state")."""
    out = []
    for ns in store.rglob("namespace.json"):
        if json.loads(ns.read_text())["fields"].get("entry") == "state":
            out += [p for p in ns.parent.rglob("*") if p.is_file() and p.name != "namespace.json"
                    and not p.name.startswith(".tmp-")]
    return out


@pytest.mark.parametrize("writer, reader, damage", [
    ("torch", "torch", None), ("torch", "torch", "flip"), ("torch", "torch", "missing"),
    pytest.param("mlx", "mlx", None, marks=pytest.mark.mlx),
    pytest.param("torch", "mlx", None, marks=pytest.mark.mlx),  # SHARED_STATE_LAYOUT: a torch snapshot serves MLX
])
def test_hicache_storage_hit_after_restart_loads_pages_and_their_snapshot(writer, reader, damage, tiny_models_root,
                                                                          tmp_path, monkeypatch):
    store = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(store))
    model = _tiny("Qwen3_5ForCausalLM", tiny_models_root)
    prompt = _doc(2) + [7]
    engine = _hicache(model, writer, storage=True)
    try:
        cold, = run(engine, [prompt], greedy(N_NEW))
        assert cold.token_ids == reference_greedy(model, prompt, N_NEW)
    finally:
        engine.shutdown()  # flushes queued writes of both stores
    files = _state_files(store)
    assert files, "no snapshot reached L3"
    if damage == "missing":  # the snapshot at the prompt's last full page (40 tokens) is gone: the one at 32 serves
        from tierlm.runtime.cache.state_tiers import state_key
        from tierlm.runtime.cache.storage.page_keys import page_keys

        deepest = state_key(page_keys(prompt[:40], 4)[-1])
        (f,) = [f for f in files if f.name.startswith(deepest)]
        f.unlink()
    if damage == "flip":
        for f in files:
            raw = bytearray(f.read_bytes())
            raw[-5] ^= 0xFF
            f.write_bytes(bytes(raw))
    engine = _hicache(model, reader, storage=True)
    try:
        hot, = run(engine, [prompt], greedy(N_NEW))
        assert hot.token_ids == cold.token_ids
        states = engine.parts.cache.states
        if damage == "missing":
            assert hot.last.cached.storage == 32 and hot.last.cached.total == 32, hot.last.cached
        elif damage:
            assert hot.last.cached.total == 0  # the snapshot is the only way in: a counted miss, then a prefill
            st = states.storage.stats()
            assert st["errors"] + st["misses"] >= 1
        else:
            assert hot.last.cached.storage == 40 and hot.last.cached.total == 40, hot.last.cached
            assert states.loaded_storage_states == 1
        assert pool_is_clean(engine)
        _check_host_states(engine)
        assert asyncio.run(engine.flush_cache(storage=True))  # clears the snapshot store too
        assert not _state_files(store) and engine.server_info()["state_pool"]["host_cached_slots"] == 0
    finally:
        engine.shutdown()


def test_doctor_reports_the_pools_and_state_slots_serve_allocates(tiny_models_root, monkeypatch):
    """`tierlm doctor` sets the same recurrent-state slots aside as serve, so its KV pages are serve's."""
    from test_tier_sizing import doctor_json, serve_pools

    folder = _tiny(sorted(HYBRIDS)[0], tiny_models_root)
    flags = ["--model-path", str(folder), "--dtype", "float32", "--mem-fraction-static", "0.001",
             "--max-running-requests", "3", "--page-size", "4"]
    memory = doctor_json(flags)["memory"]
    served = serve_pools(flags, monkeypatch)
    assert memory["state_slots"] == 3 * 3 and memory["state_bytes"] > 0  # 3 live + 6 snapshot slots
    assert (memory["device_pages"], memory["kv_bytes_per_token"]) == (served["device_pages"],
                                                                      served["kv_bytes_per_token"])
