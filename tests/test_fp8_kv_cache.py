"""--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | bf16: KV pages stored in fewer bytes than the model computes in.

What must hold: the same memory holds twice the tokens of bf16 pages; greedy output stays close to bf16 KV on a
trained model (stories260K); a cache hit in any tier (device, host, storage) and chunked prefill give exactly the
cold, unchunked output; fp8 pages never hit bf16 pages in L3; torch and MLX write the same e4m3 bits; MLX refuses
e5m2 with the fix.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from backend_driver import GreedyDriver, run_greedy
from backends_under_test import make_backend
from engine_harness import greedy, pool_is_clean, run, start_engine
from test_hicache import PS
from test_hicache import hicache_engine as hicache_engine_with_grammar

from tierlm.backends.base import ForwardBatch, HostKVPool, ModelBackend, SamplingBatch
from tierlm.runtime.errors import StartupError


def doc(seed: int, n: int = 60) -> list[int]:
    return [(seed * 31 + j * 7) % 270 + 5 for j in range(n)]


def hicache_engine(backend, model, storage=True, **kw):
    return hicache_engine_with_grammar(backend, model, storage, grammar_backend="none", **kw)


# ------------------------------------------------------------------------------------------------ sizing
def test_same_memory_holds_twice_the_tokens(tiny_llama, monkeypatch, caplog):
    """Through the real startup: the memory plan sizes L1 from the backend's KV bytes per token, so with the
    same (pinned) free memory fp8 pages give twice the tokens of bf16 pages, four times float32's."""
    import tierlm.runtime.engine_setup as engine_setup

    real_detect = engine_setup.detect
    # 2 GiB of RAM (1 GiB kept free), 1.5 GiB available: --mem-fraction-static 0.02 gives weights + L1 ~32 MiB.
    monkeypatch.setattr(engine_setup, "detect", lambda: dataclasses.replace(
        real_detect(), ram_total_bytes=2 * 2**30, ram_available_bytes=3 * 2**29))
    pools = {}
    for kv in ("auto", "bf16", "fp8_e4m3", "fp8_e5m2"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tierlm.runtime.engine_setup"):
            # max_running_requests: lifts the context-length cap so the memory plan alone decides.
            engine = start_engine(tiny_llama, "torch", kv_cache_dtype=kv, page_size=PS, max_running_requests=4096,
                                  mem_fraction_static=0.02, grammar_backend="none")
        try:
            info = engine.server_info()
            pools[kv] = info["kv_pool"]
            assert info["server_args"]["kv_cache_dtype"] == kv
            line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("device KV pool (L1)"))
            assert f"KV {pools[kv]['kv_dtype']} " in line
        finally:
            engine.shutdown()
    assert [pools[k]["kv_dtype"] for k in pools] == ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
    per_token = {k: p["bytes_per_token"] for k, p in pools.items()}
    assert per_token["auto"] == 2 * per_token["bf16"] == 4 * per_token["fp8_e4m3"] == 4 * per_token["fp8_e5m2"]
    tokens = {k: p["total_tokens"] for k, p in pools.items()}
    assert tokens["fp8_e4m3"] == tokens["fp8_e5m2"]
    assert abs(tokens["fp8_e4m3"] - 2 * tokens["bf16"]) <= 2 * PS  # whole pages
    assert abs(tokens["bf16"] - 2 * tokens["auto"]) <= 2 * PS
    assert tokens["auto"] > 1000  # the plan decided, not a floor


def test_startup_log_names_the_kv_dtype(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="tierlm.runtime.engine_setup"):
        engine = start_engine(tiny_llama, "torch", kv_cache_dtype="fp8_e4m3", page_size=PS,
                              max_total_tokens=64, grammar_backend="none")
    engine.shutdown()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("device KV pool (L1)"))
    assert "fp8_e4m3 (half the bytes of bfloat16; the model computes in float32)" in line


# ------------------------------------------------------------------------------------------------ accuracy
STORY_STARTS = [
    "Once upon a time", "Lily went to the park", "Tom had a big red ball", "One day, a little bird",
    "The sun was shining and", "Sam and his mom went", "There was a cat named", "A boy found a shiny",
    "The little dog wanted to", "Mia liked to draw", "In a small house lived", "The kids played in the",
    "Ben saw a big truck", "Anna was sad because", "The old man had a", "It was a rainy day and",
    "Max wanted to fly", "A girl named Sue", "The frog jumped into", "Tim and Lily were friends",
]
NEW = 64


def _teacher_forced_argmax(backend: ModelBackend, seq: list[int], ps: int = 16) -> np.ndarray:
    """The greedy next token at every position of ``seq`` in one prefill (each position sees the stored K/V)."""
    T, P = len(seq), -(-len(seq) // ps)
    backend.init_kv_pool(P, ps)
    batch = ForwardBatch(input_ids=np.array(seq, np.int64), positions=np.arange(T, dtype=np.int64),
                         q_lens=np.array([T], np.int32), kv_lens=np.array([T], np.int32),
                         page_table=np.arange(P, dtype=np.int32)[None], sample_indices=np.arange(T, dtype=np.int64),
                         sampling=SamplingBatch.greedy(T), page_size=ps)
    return backend.forward(batch).next_token_ids


def test_greedy_agreement_with_bf16_kv_on_stories260k(stories_dir):
    """20 prompts x 64 greedy tokens, fp8 KV vs bf16 KV (float32 model, torch). Two measures:
    free-running: the fraction of the 1280 tokens equal at their position (one different token changes the
    story after it, so this counts every later token as a miss); teacher-forced: the fraction of the 1280
    steps whose greedy token agrees when both read the bf16 run's tokens (the per-step error of the KV dtype).
    Measured on x86-64 CPU (torch 2.13): e4m3 46.9% free-running (4/20 stories identical), 96.1% teacher-forced;
    e5m2 20.4% and 90.0%. (bf16 KV vs float32 KV: 99.8% free-running.) A 260K-parameter model with head_dim 8 is
    far more sensitive to KV rounding than a served LLM; the thresholds keep a margin below these numbers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    prompts = [tok(s)["input_ids"] for s in STORY_STARTS]
    runs, backends = {}, {}
    for kv in ("bf16", "fp8_e4m3", "fp8_e5m2"):
        backends[kv] = make_backend("torch", stories_dir, kv_cache_dtype=kv, device="cpu", cached=False)
        runs[kv] = run_greedy(backends[kv], prompts, NEW, page_size=16, num_pages=20 * 6, stagger=0)

    def free_running(kv: str) -> float:
        return sum(a == b for x, y in zip(runs[kv], runs["bf16"]) for a, b in zip(x, y)) / (20 * NEW)

    seqs = [p + o for p, o in zip(prompts, runs["bf16"])]

    def teacher_forced(kv: str) -> float:
        same = 0
        for p, s, out in zip(prompts, seqs, runs["bf16"]):
            same += int((_teacher_forced_argmax(backends[kv], s)[len(p) - 1:-1] == np.array(out)).sum())
        return same / (20 * NEW)

    agreement = {kv: (free_running(kv), teacher_forced(kv)) for kv in ("fp8_e4m3", "fp8_e5m2")}
    print("greedy agreement with bf16 KV (free-running, teacher-forced):", agreement)
    assert agreement["fp8_e4m3"][1] >= 0.93 and agreement["fp8_e4m3"][0] >= 0.35
    assert agreement["fp8_e5m2"][1] >= 0.85 and agreement["fp8_e5m2"][0] >= 0.12
    assert agreement["fp8_e4m3"][1] > agreement["fp8_e5m2"][1]  # 3 mantissa bits beat 2


# ------------------------------------------------------------------------------------------------ the invariant
def test_hits_in_every_tier_and_chunking_give_the_cold_output(tiny_llama, store, backend_name):
    """fp8_e4m3 pages: the same prompt cold, after a device hit, a host hit (after eviction), a storage hit
    (after a restart) and with chunked prefill gives the same greedy tokens; each hit really happened."""
    prompt = doc(1) + [9, 9]
    engine = hicache_engine(backend_name, tiny_llama, kv_cache_dtype="fp8_e4m3")
    try:
        cold, = run(engine, [prompt], greedy(12))
        assert cold.last.cached.total == 0
        device, = run(engine, [prompt], greedy(12))
        assert device.last.cached.device == 60
        for i in range(3):  # push the prefix out of the device pool
            run(engine, [doc(100 + i)], greedy(4))
        host, = run(engine, [prompt], greedy(12))
        assert host.last.cached.host == 60 and host.last.cached.device == 0
        assert device.token_ids == host.token_ids == cold.token_ids
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()  # flushes queued L3 writes
    engine = hicache_engine(backend_name, tiny_llama, kv_cache_dtype="fp8_e4m3")
    try:
        storage, = run(engine, [prompt], greedy(12))
        assert storage.last.cached.storage == 60 and storage.last.cached.total == 60
        assert storage.token_ids == cold.token_ids
    finally:
        engine.shutdown()
    engine = start_engine(tiny_llama, backend_name, kv_cache_dtype="fp8_e4m3", page_size=PS,
                          chunked_prefill_size=8, grammar_backend="none")
    try:
        chunked, = run(engine, [prompt], greedy(12))
        assert chunked.token_ids == cold.token_ids
    finally:
        engine.shutdown()
    # fp8 really changed the numbers on this model (so the checks above are not vacuous).
    engine = start_engine(tiny_llama, backend_name, page_size=PS, grammar_backend="none")
    try:
        exact, = run(engine, [prompt], greedy(12))
        assert exact.token_ids != cold.token_ids
    finally:
        engine.shutdown()


def test_chunked_and_batched_prefill_agree_with_unchunked_under_both_formats(tiny_llama, backend_name):
    kvs = ("fp8_e4m3", "bf16") if backend_name == "mlx" else ("fp8_e4m3", "fp8_e5m2", "bf16")
    prompts = [doc(s, 21 + s) for s in range(3)]
    for kv in kvs:
        backend = make_backend(backend_name, tiny_llama, kv_cache_dtype=kv, device="cpu", cached=False)
        whole = run_greedy(backend, prompts, 10, page_size=PS, num_pages=64)
        assert run_greedy(backend, prompts, 10, page_size=PS, num_pages=64, chunk_size=5, stagger=2) == whole, kv
        assert [run_greedy(backend, [p], 10, page_size=PS, num_pages=64)[0] for p in prompts] == whole, kv


def test_l3_written_with_bf16_kv_is_not_used_by_an_fp8_server(tiny_llama, store):
    prompt = doc(4) + [5]
    engine = hicache_engine("torch", tiny_llama, kv_cache_dtype="bf16")
    try:
        run(engine, [prompt], greedy(4))
    finally:
        engine.shutdown()
    for kv in ("fp8_e4m3", "auto"):  # auto: float32 pages are other bytes than bf16 pages too
        engine = hicache_engine("torch", tiny_llama, kv_cache_dtype=kv)
        try:
            res, = run(engine, [prompt], greedy(4))
            assert res.last.cached.total == 0
        finally:
            engine.shutdown()
    engine = hicache_engine("torch", tiny_llama, kv_cache_dtype="fp8_e4m3")  # its own pages do hit
    try:
        res, = run(engine, [prompt], greedy(4))
        assert res.last.cached.storage == 60
    finally:
        engine.shutdown()
    assert len([p for p in store.iterdir() if p.is_dir()]) == 3  # one namespace folder per KV dtype


# ------------------------------------------------------------------------------------------------ page bytes
def _host(backend: ModelBackend, num_pages: int, layout: str = "page_first") -> HostKVPool:
    return HostKVPool(num_pages=num_pages, page_bytes=backend.kv_bytes_per_token() * PS,
                      num_layers=backend.info.num_layers, layout=layout)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_travel_byte_exact_through_the_host_tier(tiny_llama, backend_name, kv):
    if backend_name == "mlx" and kv == "fp8_e5m2":
        pytest.skip("MLX stores fp8_e4m3 only")
    backend = make_backend(backend_name, tiny_llama, kv_cache_dtype=kv, device="cpu", cached=False)
    info = backend.info
    assert info.kv_dtype == kv and backend.kv_bytes_per_token() == info.num_layers * 2 * info.num_kv_heads * \
        info.head_dim
    driver = GreedyDriver(backend, page_size=PS, num_pages=12)
    driver.add(doc(7, 11), 2, pages=[0, 1, 2])
    driver.run()
    first = _host(backend, 6)
    backend.copy_pages_to_host(np.array([0, 1, 2]), first, np.array([0, 1, 2]))
    assert np.count_nonzero(first.data[:3]) > 0
    backend.copy_pages_from_host(first, np.array([0, 1, 2]), np.array([9, 10, 11]))
    second = _host(backend, 6, "layer_first")
    backend.copy_pages_to_host(np.array([9, 10, 11]), second, np.array([3, 4, 5]))
    for i in range(3):
        assert second.page_to_bytes(3 + i) == first.page_to_bytes(i)


@pytest.mark.mlx
def test_torch_and_mlx_write_the_same_e4m3_bits():
    """The shared page layout holds across backends: mx.to_fp8 and torch's saturated float8_e4m3fn cast give the
    same byte for every finite input (rounding, subnormals, saturation), and both decode all 256 bytes alike."""
    import mlx.core as mx
    import torch

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * s for s in (0.003, 0.3, 30, 3000)]).astype(np.float32)
    x = np.concatenate([x, [0.0, -0.0, 448.0, -448.0, 464.0, 1e6, -1e6, 2.0**-9, 2.0**-10, np.inf, -np.inf]])
    x = x.astype(np.float32)
    for tdt, mdt in ((torch.float32, mx.float32), (torch.bfloat16, mx.bfloat16), (torch.float16, mx.float16)):
        t = torch.from_numpy(x).to(tdt).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        m = np.array(mx.to_fp8(mx.array(x).astype(mdt)))
        np.testing.assert_array_equal(t, m, err_msg=str(tdt))
    every = np.arange(256, dtype=np.uint8)
    t = torch.from_numpy(every).view(torch.float8_e4m3fn).float().numpy()
    m = np.array(mx.from_fp8(mx.array(every), dtype=mx.float32))
    np.testing.assert_array_equal(t, m)  # NaN positions equal too (assert_array_equal treats NaN == NaN)


@pytest.mark.mlx
@pytest.mark.parametrize("writer_name,reader_name", [("torch", "mlx"), ("mlx", "torch")])
def test_fp8_pages_written_by_one_backend_continue_on_the_other(tiny_llama, writer_name, reader_name):
    writer = make_backend(writer_name, tiny_llama, kv_cache_dtype="fp8_e4m3", device="cpu", cached=False)
    reader = make_backend(reader_name, tiny_llama, kv_cache_dtype="fp8_e4m3", device="cpu", cached=False)
    assert writer.kv_namespace() == reader.kv_namespace()  # one L3 namespace for both
    prompt = doc(5, 10)
    expected = run_greedy(writer, [prompt], 24, page_size=PS, num_pages=24)[0]
    first = GreedyDriver(writer, PS, num_pages=24)
    req = first.add(prompt, 24, pages=list(range(first.pages_needed(len(prompt), 24))))
    while len(req.output) < 6:
        first.step()
    used = -(-req.kv_len // PS)
    host = _host(writer, 8)
    writer.copy_pages_to_host(np.arange(used), host, np.arange(used))
    second = GreedyDriver(reader, PS, num_pages=24)
    reader.copy_pages_from_host(host, np.arange(used), np.arange(used))
    second.requests.append(req)
    second.run()
    assert req.output == expected


# ------------------------------------------------------------------------------------------------ MLX
@pytest.mark.mlx
def test_mlx_fp8_e4m3_serves_and_e5m2_is_a_clear_startup_error(tiny_llama):
    engine = start_engine(tiny_llama, "mlx", kv_cache_dtype="fp8_e4m3", page_size=PS, grammar_backend="none")
    try:
        assert engine.server_info()["kv_pool"]["kv_dtype"] == "fp8_e4m3"
        res, = run(engine, [doc(2, 12)], greedy(6))
        assert len(res.token_ids) == 6
    finally:
        engine.shutdown()
    with pytest.raises(StartupError, match="fp8_e5m2 is not available on the mlx backend.*fp8_e4m3.*auto"):
        start_engine(tiny_llama, "mlx", kv_cache_dtype="fp8_e5m2", page_size=PS, grammar_backend="none")


# ------------------------------------------------------------------------------------------------ bench
@pytest.mark.slow
def test_bench_decode_kv_dtypes_side_by_side(tiny_llama, capsys):
    """`tierlm bench decode --kv-cache-dtypes`: one server per dtype, same KV memory, read back from each."""
    import json

    from tierlm.server.commands.bench import command as bench_cmd

    assert bench_cmd.main(["decode", "--model-path", str(tiny_llama), "--kv-cache-dtypes", "bf16,fp8_e4m3",
                           "--prompt-tokens", "8", "--new-tokens", "4", "--streams", "2", "--agreement-prompts", "2",
                           "--kv-budget-mib", "1", "--page-size", "4", "--json", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    rows = {r["kv_cache_dtype"]: r for r in rep["tables"][0]["rows"]}
    assert rows["bf16"]["kv_dtype"] == "bfloat16" and rows["fp8_e4m3"]["kv_dtype"] == "fp8_e4m3"
    for r in rows.values():  # the budget, in whole pages
        assert 2**20 - PS * r["bytes_per_token"] < r["pool_bytes"] <= 2**20
    assert abs(rows["fp8_e4m3"]["pool_tokens"] - 2 * rows["bf16"]["pool_tokens"]) <= 2 * PS
    assert rows["bf16"]["agreement"] == 1.0 and rows["bf16"]["step_agreement"] == 1.0
    assert 0.0 <= rows["fp8_e4m3"]["agreement"] <= 1.0 and rows["fp8_e4m3"]["decode_tps"]
