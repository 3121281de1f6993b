"""HiCache through the real engine: L1 eviction -> host (L2) hits, restarts -> storage (L3) hits, damaged files,
foreign namespaces, write and prefetch policies. A hit in any tier must give exactly the cold output."""
import json
from pathlib import Path

import pytest
from engine_harness import greedy, pool_is_clean, run, start_engine
from model_factory import reference_greedy

from tierlm.runtime.errors import StartupError

PS = 4
DEVICE_TOKENS = 96  # 24 pages: a 60-token prefix plus a few other prompts overflow it


def hicache_engine(backend, model, storage=True, **kw):
    kw = {"page_size": PS, "max_total_tokens": DEVICE_TOKENS, "enable_hierarchical_cache": True,
          "hicache_ratio": 4.0, **kw}
    if storage:
        kw.setdefault("hicache_storage_backend", "file")
        kw.setdefault("hicache_storage_prefetch_policy", "wait_complete")
    return start_engine(model, backend, **kw)


def doc(seed: int, n: int = 60) -> list[int]:
    return [(seed * 31 + j * 7) % 270 + 5 for j in range(n)]


def push_out_of_device(engine, rounds: int = 3):
    for i in range(rounds):
        run(engine, [doc(100 + i)], greedy(4))


def tier_round_trip(start, prompt: list[int], max_new_tokens: int, on_start=None):
    """The same prompt run cold, again (a device hit), after pushing it out of the device pool (a host hit) and,
    on a second engine from ``start()`` (a restart on the same storage), once more (a storage hit): the four
    results, for the caller's assertions. ``on_start(engine)`` runs first on the first engine."""
    engine = start()
    try:
        if on_start is not None:
            on_start(engine)
        cold, = run(engine, [prompt], greedy(max_new_tokens))
        device, = run(engine, [prompt], greedy(max_new_tokens))
        push_out_of_device(engine)
        host, = run(engine, [prompt], greedy(max_new_tokens))
    finally:
        engine.shutdown()  # flushes queued L3 writes
    engine = start()
    try:
        storage, = run(engine, [prompt], greedy(max_new_tokens))
    finally:
        engine.shutdown()
    return cold, device, host, storage


def test_host_hit_after_device_eviction(tiny_model, store, backend_name):
    engine = hicache_engine(backend_name, tiny_model, storage=False)
    try:
        prompt = doc(1) + [9, 9]
        cold, = run(engine, [prompt], greedy(12))
        push_out_of_device(engine)
        hot, = run(engine, [prompt], greedy(12))
        assert hot.last.cached.host == 60 and hot.last.cached.device == 0
        assert hot.token_ids == cold.token_ids == reference_greedy(tiny_model, prompt, 12)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_storage_hit_after_restart(tiny_model, store, backend_name):
    prompt = doc(2) + [7]
    engine = hicache_engine(backend_name, tiny_model)
    try:
        cold, = run(engine, [prompt], greedy(12))
    finally:
        engine.shutdown()  # flushes queued writes
    engine = hicache_engine(backend_name, tiny_model)
    try:
        hot, = run(engine, [prompt], greedy(12))
        assert hot.last.cached.storage == 60 and hot.last.cached.total == 60
        assert hot.token_ids == cold.token_ids
        assert pool_is_clean(engine)
        metrics = engine.metrics_text().decode()
        assert 'tierlm_cache_hit_tokens_total{model_name="' in metrics and 'tier="storage"} 60.0' in metrics
    finally:
        engine.shutdown()


def _page_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*") if p.is_file() and p.name != "namespace.json"
                  and not p.name.startswith(".tmp-"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_files_are_misses_and_output_is_unchanged(tiny_llama, store, damage, backend_name):
    prompt = doc(3) + [5]
    engine = hicache_engine(backend_name, tiny_llama)
    try:
        cold, = run(engine, [prompt], greedy(12))
    finally:
        engine.shutdown()
    files = _page_files(store)
    assert len(files) >= 15
    for f in files[::2]:
        raw = bytearray(f.read_bytes())
        if damage == "flip":
            raw[-5] ^= 0xFF
            f.write_bytes(bytes(raw))
        else:
            f.write_bytes(bytes(raw[: len(raw) // 2]))
    engine = hicache_engine(backend_name, tiny_llama)
    try:
        hot, = run(engine, [prompt], greedy(12))
        assert hot.token_ids == cold.token_ids
        assert hot.last.cached.storage < 60  # the chain stops at the first damaged page
        st = engine.parts.cache.storage.stats()
        assert st["errors"] + st["misses"] >= 1
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_other_model_or_dtype_never_hits(tiny_models_root, tiny_llama, store, backend_name):
    from model_factory import build_tiny_model

    prompt = doc(4) + [5]
    engine = hicache_engine(backend_name, tiny_llama)
    try:
        run(engine, [prompt], greedy(4))
    finally:
        engine.shutdown()
    other = build_tiny_model("llama", tiny_models_root / "llama-seed9", seed=9)  # same shapes, other weights
    for model, kw in ((other, {}), (tiny_llama, {"dtype": "bfloat16"})):
        engine = hicache_engine(backend_name, model, **kw)
        try:
            res, = run(engine, [prompt], greedy(4))
            assert res.last.cached.total == 0
        finally:
            engine.shutdown()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policies(tiny_llama, store, policy, backend_name):
    engine = hicache_engine(backend_name, tiny_llama, storage=False, hicache_write_policy=policy)
    try:
        tree = engine.parts.cache.tree
        prompt = doc(5) + [1]
        run(engine, [prompt], greedy(4))
        after_first = tree.host_pages_cached
        run(engine, [prompt], greedy(4))
        run(engine, [prompt], greedy(4))
        after_hits = tree.host_pages_cached
        if policy == "write_through":
            assert after_first >= 15
        else:
            assert after_first == 0
        if policy == "write_through_selective":
            assert after_hits >= 15
        if policy == "write_back":
            assert after_hits == 0
            push_out_of_device(engine)
            assert tree.host_pages_cached >= 15  # backed up only when evicted
            hot, = run(engine, [prompt], greedy(4))
            assert hot.last.cached.host > 0
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_never_change_output(tiny_llama, store, policy, backend_name):
    prompt = doc(6) + [2]
    engine = hicache_engine(backend_name, tiny_llama)
    try:
        cold, = run(engine, [prompt], greedy(8))
    finally:
        engine.shutdown()
    engine = hicache_engine(backend_name, tiny_llama, hicache_storage_prefetch_policy=policy,
                            hicache_storage_backend_extra_config=json.dumps({"prefetch_timeout_base": 5.0}))
    try:
        hot, = run(engine, [prompt], greedy(8))
        assert hot.token_ids == cold.token_ids
        if policy in ("wait_complete", "timeout"):  # both wait long enough here for all 15 pages
            assert hot.last.cached.storage == 60
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_flush_cache_empties_memory_tiers_and_storage_on_request(tiny_llama, store, backend_name):
    import asyncio

    engine = hicache_engine(backend_name, tiny_llama)
    try:
        prompt = doc(7) + [3]
        run(engine, [prompt], greedy(4))
        assert asyncio.run(engine.flush_cache())
        acc = engine.parts.cache.accounting()
        assert acc["cached_pages"] == 0 and acc["host_cached_pages"] == 0
        assert acc["host_free_pages"] == acc["host_total_pages"]
        assert engine.parts.cache.storage_io.flush(timeout=30)  # background L3 writes are done
        again, = run(engine, [prompt], greedy(4))
        assert again.last.cached.storage == 60  # L3 survived a plain flush
        assert asyncio.run(engine.flush_cache(storage=True))
        assert _page_files(store) == []
    finally:
        engine.shutdown()


def test_startup_errors_are_actionable(tiny_llama, store, backend_name):
    with pytest.raises(StartupError, match="disable-radix-cache"):  # settings built in code: checked at startup
        hicache_engine(backend_name, tiny_llama, disable_radix_cache=True)
    with pytest.raises(StartupError, match="hicache-size"):
        hicache_engine(backend_name, tiny_llama, storage=False, hicache_size=10_000.0)  # 10 TB of host pool


def test_storage_pages_park_in_host_when_device_is_full(tiny_llama, store, backend_name):
    """Pages read from L3 while L1 has no room stay in L2, so the request's retry is a host hit."""
    from tierlm.runtime.request import Req

    prompt = doc(8) + [4]
    engine = hicache_engine(backend_name, tiny_llama)
    try:
        cold, = run(engine, [prompt], greedy(6))
    finally:
        engine.shutdown()
    engine = hicache_engine(backend_name, tiny_llama)
    try:
        engine.stop_scheduler()  # drive the cache manager by hand
        cache = engine.parts.cache
        req = Req(rid="a", input_ids=list(prompt), sampling_params=greedy(6))
        cache.on_request_added(req)
        assert req.prefetch is not None
        hog = cache.allocator.alloc(cache.allocator.num_free)  # running requests hold all of L1
        cache.match(req)
        assert req.cached.storage == 0 and cache.tree.host_pages_cached == 15
        cache.release(req, cache_kv=False)
        cache.allocator.free(hog)
        retry = Req(rid="b", input_ids=list(prompt), sampling_params=greedy(6))
        cache.match(retry)
        assert retry.cached.host == 60 and retry.kv_len == 60
        cache.release(retry, cache_kv=True)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


# ------------------------------------------------------------ a misbehaving L3 disk never hangs or changes output
def _run_within(engine, prompt, n: int, timeout: float = 120.0, on_hang=lambda: None):
    """run() on a daemon thread; fails (after ``on_hang`` unblocks what it can) if it does not finish in time."""
    import threading

    out: list = []
    t = threading.Thread(target=lambda: out.append(run(engine, [prompt], greedy(n))[0]), daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        on_hang()
        pytest.fail(f"the request did not finish within {timeout:.0f} s")
    return out[0]


def _unblock_fifo(path: Path) -> None:
    import os

    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _drop_memory_tiers(engine) -> None:
    import asyncio

    assert engine.parts.cache.storage_io.flush(timeout=30)  # every page is in L3 first
    assert asyncio.run(engine.flush_cache())


def test_wait_complete_with_a_fifo_in_place_of_a_page_file_serves_the_cold_output(tiny_llama, store, backend_name):
    import os

    from tierlm.runtime.cache.storage.page_keys import page_keys

    prompt = doc(9) + [6]
    engine = hicache_engine(backend_name, tiny_llama)  # wait_complete
    fifo = None
    try:
        cold, = run(engine, [prompt], greedy(8))
        _drop_memory_tiers(engine)
        fifo = engine.parts.cache.storage._path(page_keys(prompt[:60], PS)[4])
        fifo.unlink()
        os.mkfifo(fifo)  # a reader that opens it blocks until a writer appears: never, here
        hot = _run_within(engine, prompt, 8, on_hang=lambda: _unblock_fifo(fifo))
        assert hot.token_ids == cold.token_ids
        assert hot.last.cached.storage == 4 * PS  # the pages before the FIFO; the rest was prefilled
        st = engine.parts.cache.tiers_info()["storage"]
        assert st["errors"] >= 1 and st["state"] == "online"  # a bad file, not a bad disk
        assert pool_is_clean(engine)
    finally:
        if fifo is not None:
            _unblock_fifo(fifo)
        engine.shutdown()


def test_wait_complete_with_a_hung_read_serves_the_cold_output(tiny_llama, store, backend_name):
    import threading

    from tierlm.runtime.cache.storage.page_keys import page_keys

    prompt = doc(10) + [6]
    engine = hicache_engine(backend_name, tiny_llama,
                            hicache_storage_backend_extra_config=json.dumps({"io_timeout": 0.5}))
    release = threading.Event()
    try:
        cold, = run(engine, [prompt], greedy(8))
        _drop_memory_tiers(engine)
        storage = engine.parts.cache.storage
        stuck_key, real_get, real_get_into = page_keys(prompt[:60], PS)[6], storage.get, storage.get_into

        def hung_get(key):  # a network filesystem that stops answering for this page
            if key == stuck_key:
                release.wait()
            return real_get(key)

        def hung_get_into(key, out, **kw):  # the same, for a read straight into host pages
            if key == stuck_key:
                release.wait()
            return real_get_into(key, out, **kw)

        storage.get, storage.get_into = hung_get, hung_get_into
        hot = _run_within(engine, prompt, 8, on_hang=release.set)
        assert hot.token_ids == cold.token_ids and hot.last.cached.storage == 6 * PS
        info = engine.parts.cache.tiers_info()["storage"]
        assert info["io"]["io_timeouts"] == 1 and info["state"] == "degraded"
        assert "did not finish within 0.5 s" in info["last_error"]
        assert _gauge(engine, "tierlm_hicache_storage_online") == 0
        assert _gauge(engine, "tierlm_hicache_storage_io_timeouts_total") == 1
        again = _run_within(engine, doc(11) + [1], 4, on_hang=release.set)  # the scheduler keeps serving
        assert again.token_ids == reference_greedy(tiny_llama, doc(11) + [1], 4)
    finally:
        release.set()
        engine.shutdown()


def test_shutdown_is_quick_while_l3_writes_hang(tiny_llama, store, backend_name):
    import threading
    import time

    engine = hicache_engine(backend_name, tiny_llama)
    release = threading.Event()
    try:
        cache = engine.parts.cache
        assert cache.storage_io.max_pending_write_bytes is not None  # a hung disk cannot grow the backlog forever

        def hung_set(key, payload):
            release.wait()
            return False

        cache.storage.set = hung_set
        run(engine, [doc(12) + [2]], greedy(4))
        assert cache.storage_io.stats()["pending_writes"] > 0
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 8.0  # CLOSE_TIMEOUT_S (3 s) plus a generous margin
    finally:
        release.set()
        engine.shutdown()


def _gauge(engine, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(engine.metrics_text().decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no metric {name}")


def _kv_on_disk(storage) -> tuple[int, int]:
    files = list(storage.dir.glob("*.kv"))
    return len(files), sum(f.stat().st_size for f in files)


def test_storage_folder_deleted_while_serving_is_recreated(tiny_llama, store, backend_name):
    import shutil

    engine = hicache_engine(backend_name, tiny_llama)
    try:
        cache = engine.parts.cache
        run(engine, [doc(13) + [1]], greedy(4))
        assert cache.storage_io.flush(timeout=30) and cache.storage.stats()["files"] >= 15
        shutil.rmtree(cache.storage.dir)
        prompt = doc(14) + [1]
        res, = run(engine, [prompt], greedy(4))
        assert res.token_ids == reference_greedy(tiny_llama, prompt, 4)
        assert cache.storage_io.flush(timeout=30)
        info = cache.tiers_info()["storage"]
        assert (info["files"], info["bytes"]) == _kv_on_disk(cache.storage) and info["files"] >= 15
        assert info["state"] == "online" and cache.storage_io.stats()["backups_failed"] == 0
        assert (cache.storage.dir / "namespace.json").is_file()
        assert _gauge(engine, "tierlm_hicache_storage_files") == info["files"]
        assert _gauge(engine, "tierlm_hicache_storage_online") == 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("err", ["ENOSPC", "EROFS"])
def test_full_or_read_only_disk_keeps_serving_and_recovers(tiny_llama, store, backend_name, monkeypatch, err):
    import errno

    from disk_faults import inject_disk_fault

    engine = hicache_engine(backend_name, tiny_llama)
    try:
        cache = engine.parts.cache
        inject_disk_fault(monkeypatch, getattr(errno, err))
        prompt = doc(15) + [3]
        res, = run(engine, [prompt], greedy(6))
        assert res.token_ids == reference_greedy(tiny_llama, prompt, 6)
        assert cache.storage_io.flush(timeout=30)
        info = cache.tiers_info()["storage"]
        assert info["state"] == "degraded" and info["errors"] >= 15 and info["files"] == 0
        assert _kv_on_disk(cache.storage) == (0, 0) and list(store.rglob(".tmp-*")) == []
        assert _gauge(engine, "tierlm_hicache_storage_online") == 0
        again, = run(engine, [prompt], greedy(6))  # L1 still serves it
        assert again.token_ids == res.token_ids and again.last.cached.device == 60
        monkeypatch.undo()  # room again / writable again
        other = doc(16) + [3]
        run(engine, [other], greedy(4))
        assert cache.storage_io.flush(timeout=30)
        info = cache.tiers_info()["storage"]
        assert info["state"] == "online" and info["files"] >= 15
        assert (info["files"], info["bytes"]) == _kv_on_disk(cache.storage)
    finally:
        engine.shutdown()


def test_the_scheduler_never_touches_the_disk_and_still_finds_pages_another_server_stored(tiny_llama, store,
                                                                                          backend_name):
    """File lookups happen on the I/O threads only (a hung mount must not stall the scheduler); pages that
    another server sharing the folder stored after this one started are still found, by the prefetch probe."""
    import threading

    from tierlm.runtime.cache.storage.stores.file.storage import FileKVStorage

    prompt = doc(12) + [3]
    writer = hicache_engine(backend_name, tiny_llama)
    reader = hicache_engine(backend_name, tiny_llama)  # started first: its index does not know the pages
    try:
        cold, = run(writer, [prompt], greedy(8))
        assert writer.parts.cache.storage_io.flush(timeout=30)
        storage = reader.parts.cache.storage
        scheduler_thread = reader._thread
        for name in ("exists", "_adopt", "_is_page_file"):
            real = getattr(storage, name)

            def on_io_threads_only(*args, _real=real, _name=name):
                assert threading.current_thread() is not scheduler_thread, f"{_name} ran on the scheduler thread"
                return _real(*args)

            setattr(storage, name, on_io_threads_only)
        hot = _run_within(reader, prompt, 8)
        assert hot.token_ids == cold.token_ids
        assert hot.last.cached.storage == 60  # every page, found by the probe past what the index knew
        assert storage.stats()["misses"] == 0  # probing stopped at the prompt's end, not at a missing file
        miss = _run_within(reader, doc(13) + [3], 4)  # a cold prompt: the probe finds nothing, quickly
        assert miss.last.cached.total == 0 and storage.stats()["misses"] == 0
        assert isinstance(storage, FileKVStorage) and pool_is_clean(reader)
    finally:
        writer.shutdown()
        reader.shutdown()
