"""The same-host path of the Mooncake L3 backend (stores/mooncake/shm.py): servers as dummy clients of a real
``mooncake_client`` on their host, moving pages through shared memory; and the TCP fallback where that path cannot
run. Needs ``pip install 'tierlm[mooncake]'`` and libibverbs1, like test_mooncake_storage.py (skipped with the hint
where absent)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
from storage_helpers import set_all
from test_mooncake_storage import (CONNECT_WAIT_S, PAGE_BYTES, _counting_store_class, _free_port, _start_client,
                                   _start_master, _stop, another_model_gets_no_hits, cold_run,
                                   damaged_value_is_a_counted_miss, keys, ns, page)

from tierlm.runtime.cache.storage import registry as storage_registry
from tierlm.runtime.cache.storage.stores.mooncake.config import MooncakeConfig
from tierlm.runtime.cache.storage.stores.mooncake.shm import same_host
from tierlm.runtime.cache.storage.stores.mooncake.storage import MooncakeKVStorage
from tierlm.runtime.errors import StartupError


@pytest.fixture(scope="module")
def store_pair():
    """A mooncake_master and a mooncake_client on this host lending it memory: (master, client) addresses."""
    master = _start_master(_free_port())
    client = None
    try:
        client = _start_client(master.address)
        yield master.address, client.address
    finally:
        if client is not None:
            client.stop()
        _stop(master)


def open_shm(pair, namespace=None, store_class=None, pages: int = 8, **cfg):
    """A MooncakeKVStorage given both addresses (the shm path where it can run), with a layer_first host pool of
    ``pages`` pages registered, and a function giving the rows of a host page."""
    master, client = pair
    config = MooncakeConfig.from_mapping({"master_server_address": master, "client_server_address": client,
                                          "local_hostname": "127.0.0.1", "global_segment_size": 0, **cfg}, "test")
    s = MooncakeKVStorage(config, namespace or ns(), PAGE_BYTES, connect_wait_s=CONNECT_WAIT_S,
                          retry_interval_s=cfg.get("retry_interval_s", 5.0), store_class=store_class)
    host = np.zeros((2, pages, PAGE_BYTES // 2), np.uint8)
    s.register_host_memory(host)
    return s, host, lambda p: [memoryview(host[layer, p]) for layer in range(2)]


# ---------------------------------------------------------------- the decision (no mooncake needed)
def test_the_shm_path_is_chosen_only_for_a_mooncake_client_on_this_host() -> None:
    assert same_host("127.0.0.1:50052") is True and same_host("localhost:50052") is True
    assert isinstance(same_host("192.0.2.1:50052"), str)  # TEST-NET-1: never an address of this machine
    assert isinstance(same_host("no-port"), str)

    def wanted(**cfg):
        return MooncakeConfig.from_mapping({"master_server_address": "m:1", **cfg}, "test").shm_wanted()

    assert wanted(client_server_address="127.0.0.1:50052") is True
    assert "no client_server_address" in wanted()
    assert "standalone_storage is false" in wanted(client_server_address="127.0.0.1:1", standalone_storage=False)
    assert "not on this host" in wanted(client_server_address="192.0.2.1:50052")
    # SGLang's environment variables; the master may be left out when a real client holds the connection to it
    c = MooncakeConfig.resolve({}, {"MOONCAKE_CLIENT": "127.0.0.1:7", "MOONCAKE_STANDALONE_STORAGE": "true"})
    assert (c.client_server_address, c.standalone_storage, c.master_server_address) == ("127.0.0.1:7", True, "")
    with pytest.raises(StartupError, match="standalone_storage must be true or false"):
        MooncakeConfig.from_mapping({"client_server_address": "h:1", "standalone_storage": "maybe"}, "test")
    with pytest.raises(StartupError, match="client_server_address"):
        MooncakeConfig.from_mapping({"local_hostname": "x"}, "test")


# ---------------------------------------------------------------- against a real master and mooncake_client
def test_pages_move_through_shared_memory(store_pair) -> None:
    """Both servers are dummy clients of the mooncake_client: a backup is written from a staging area (put_from, no
    put_parts), a batch read is one call into a staging area and one copy into the host pages (no get/get_batch),
    each counted; a server on TCP reads the same values, so either path shares pages."""
    store_class = _counting_store_class()
    a, _, _ = open_shm(store_pair, store_class=store_class)
    b, host, rows = open_shm(store_pair, store_class=store_class)
    tcp = storage_registry.open_storage("mooncake", ns(), PAGE_BYTES, {
        "master_server_address": store_pair[0], "local_hostname": "127.0.0.1", "global_segment_size": 0,
        "connect_wait_s": CONNECT_WAIT_S})
    try:
        st = b.stats()
        assert (st["transport"], tcp.stats()["transport"]) == ("shm", "tcp")
        assert st["read_path"].startswith(f"shm (mooncake_client {store_pair[1]} on this host")
        assert b.read_batch_pages == b.connection.staging.slot_pages >= 8
        ks = keys(5, seed=61)
        assert a.set(ks[0], page(0)) and a.stats()["shm_writes"] == 1
        assert store_class.calls.get("put_parts", 0) == 0 and store_class.calls["put_from"] == 1
        assert tcp.get(ks[0]) == page(0)  # written through shared memory, read over TCP
        assert set_all(tcp, ks[1:3], [page(1), page(2)]) == [True, True]  # written over TCP, read below through shm
        before = dict(store_class.calls)
        assert b.batch_get_into(ks[:4], [rows(p) for p in range(4)], probe=True) == [True, True, True, False]
        assert [host[:, p].tobytes() for p in range(3)] == [page(0), page(1), page(2)]
        assert not any(host[:, 3].ravel())  # the absent page wrote nothing
        calls = {k: v - before.get(k, 0) for k, v in store_class.calls.items()}
        assert calls.get("get", 0) == calls.get("get_batch", 0) == 0 and calls["batch_get_into_multi_buffers"] == 1
        st = b.stats()
        assert (st["shm_reads"], st["reads"], st["misses"], st["zero_copy_reads"]) == (3, 3, 0, 0)
        assert st["copy_seconds"] > 0 and st["checksum_seconds"] > 0  # the one copy, staging area -> host page
    finally:
        for s in (a, b, tcp):
            s.close()


def test_the_tcp_fallback_where_shared_memory_cannot_run(store_pair) -> None:
    """A mooncake_client that does not answer, or one on another host, leaves the TCP client to the master: pages
    still move, and /server_info says which path runs. With no master to fall back to, L3 is offline."""
    master, _ = store_pair
    store_class = _counting_store_class()
    down, host, rows = open_shm((master, f"127.0.0.1:{_free_port()}"), store_class=store_class)
    elsewhere, _, _ = open_shm((master, "192.0.2.1:50052"), store_class=store_class)
    try:
        assert (down.stats()["transport"], elsewhere.stats()["transport"]) == ("tcp", "tcp")
        assert down.stats()["read_path"] == "zero-copy"
        k = keys(1, seed=62)[0]
        assert down.set(k, page(7)) and elsewhere.get(k) == page(7)
        assert down.batch_get_into([k], [rows(0)]) == [True] and host[:, 0].tobytes() == page(7)
        assert down.stats()["zero_copy_reads"] == 1 and down.stats()["shm_reads"] == 0
        assert store_class.calls.get("setup_dummy", 0) == 0  # one never answered, the other is not on this host
    finally:
        down.close()
        elsewhere.close()
    config = MooncakeConfig.from_mapping({"client_server_address": f"127.0.0.1:{_free_port()}"}, "test")
    alone = MooncakeKVStorage(config, ns(), PAGE_BYTES, connect_wait_s=0.2, retry_interval_s=0.2)
    try:
        assert alone.health()["state"] == "degraded" and "unreachable" in alone.health()["last_error"]
        assert alone.get(keys(1, seed=63)[0]) is None
    finally:
        alone.close()


def test_a_refused_staging_area_keeps_the_copying_path(store_pair) -> None:
    """A dummy client that gives no shared memory for staging still moves pages (get_batch, put_parts through the
    mooncake_client), and read_path says why."""
    base = _counting_store_class()

    class NoMemory(base):
        def alloc_from_mem_pool(self, size):
            return 0

    s, host, rows = open_shm(store_pair, store_class=NoMemory)
    try:
        k = keys(1, seed=71)[0]
        assert s.set(k, page(8)) and base.calls.get("put_parts", 0) == 1
        assert s.batch_get_into([k], [rows(2)]) == [True] and host[:, 2].tobytes() == page(8)
        st = s.stats()
        assert st["transport"] == "shm" and st["read_path"].startswith("copy (shm client; a ")
        assert (st["shm_reads"], st["shm_writes"], st["reads"]) == (0, 0, 1) and base.calls["get_batch"] >= 1
    finally:
        s.close()


@pytest.mark.parametrize("damage", ["flip", "short", "garbage", "foreign"])
def test_a_damaged_value_is_a_counted_miss_on_the_shm_path(store_pair, damage: str) -> None:
    """The header and checksum rules in the staging area: a damaged, short or foreign value is a miss, counted,
    removed, and reaches no host page; the page is stored and read again afterwards."""
    s, host, rows = open_shm(store_pair)
    other, _, _ = open_shm(store_pair, ns("model-z"))
    try:
        after = damaged_value_is_a_counted_miss(s, other, host, rows, damage, staged=True,
                                                seed={"flip": 64, "short": 65, "garbage": 66, "foreign": 67}[damage])
        assert s.stats()["shm_reads"] == after["shm_reads"] + 1
    finally:
        s.close()
        other.close()


def test_another_namespace_never_sees_the_pages_on_the_shm_path(store_pair) -> None:
    a, _, _ = open_shm(store_pair, ns("model-a"))
    other, host, rows = open_shm(store_pair, ns("model-b"))
    try:
        k = keys(1, seed=68)[0]
        assert a.set(k, page(3))
        assert other.exists([k]) == [False] and other.batch_get_into([k], [rows(0)], probe=True) == [False]
        assert not any(host[:, 0].ravel())
    finally:
        a.close()
        other.close()


def test_master_killed_then_the_store_restarted_under_the_shm_path() -> None:
    """The master dies while the mooncake_client lives: calls through it fail fast as misses (counted, degraded).
    The store restarted (master and mooncake_client on their ports): the dummy client attaches to the new
    mooncake_client by itself, the background probe brings the tier back, and lost pages are written again. (A
    mooncake_client that outlives its master remounts on the new one by itself too, but only after ~30 s.)"""
    rpc = _free_port()
    master = _start_master(rpc)
    client = None
    s = None
    try:
        client = _start_client(master.address)
        s, host, rows = open_shm((master.address, client.address), retry_interval_s=0.2)
        k = keys(1, seed=69)[0]
        assert s.stats()["transport"] == "shm" and s.set(k, page(1)) and s.known([k]) == [True]
        _stop(master)
        master = None
        assert s.batch_get_into([k], [rows(0)]) == [False] and s.exists([k]) == [False]
        assert s.health()["state"] == "degraded" and s.stats()["errors"] >= 1
        t0 = time.monotonic()
        assert s.get(k) is None and s.set(keys(1, seed=70)[0], page(2)) is False
        assert time.monotonic() - t0 < 0.5  # answered at once, not after the dead master's timeouts
        client.stop()
        master = _start_master(rpc)
        client = _start_client(master.address, client.port)
        deadline = time.monotonic() + 20  # no call from here on: the background probe sees the store back
        while s.health()["state"] != "online" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.health()["state"] == "online", json.dumps(s.health())
        assert s.known([k]) == [False]  # the new store has none of the old pages: the index forgot them
        assert s.stats()["transport"] == "shm" and s.set(k, page(1))
        assert s.batch_get_into([k], [rows(0)]) == [True] and host[:, 0].tobytes() == page(1)
    finally:
        if s is not None:
            s.close()
        if client is not None:
            client.stop()
        if master is not None:
            _stop(master)


# ---------------------------------------------------------------- a server on the shared store
def test_engine_storage_hit_through_shared_memory(store_pair, tiny_llama, store) -> None:
    """A second engine on the same mooncake_client serves the prompt through shared memory with exactly the cold
    output, and /server_info says so."""
    from engine_harness import greedy, run
    from test_hicache import doc, hicache_engine

    extra = json.dumps({"master_server_address": store_pair[0], "client_server_address": store_pair[1],
                        "local_hostname": "127.0.0.1", "global_segment_size": 0, "connect_wait_s": CONNECT_WAIT_S})
    kw = {"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": extra}
    prompt = doc(14) + [6]
    cold, written = cold_run(tiny_llama, kw, prompt)
    assert written["shm_writes"] == written["writes"] >= 15
    engine = hicache_engine("torch", tiny_llama, **kw)
    try:
        hot, = run(engine, [prompt], greedy(12))
        assert hot.last.cached.storage == 60 and hot.token_ids == cold.token_ids
        tier = json.loads(json.dumps(engine.server_info(), default=str))["tiers"]["storage"]
        assert (tier["transport"], tier["shm_reads"], tier["zero_copy_reads"]) == ("shm", 15, 0)
        assert tier["read_path"].startswith("shm (mooncake_client")
    finally:
        engine.shutdown()


def test_engine_of_another_model_gets_no_hits_through_shared_memory(store_pair, tiny_llama, tiny_models_root,
                                                                   store) -> None:
    another_model_gets_no_hits({"master_server_address": store_pair[0], "client_server_address": store_pair[1]},
                               tiny_llama, tiny_models_root)


def test_a_client_that_runs_out_of_staging_memory_keeps_the_areas_it_gave() -> None:
    """The second area is refused: the first stays in use (calls wait for it to be free or copy), no third
    allocation is tried, and read_path does not claim the shm path was refused."""
    import ctypes

    from tierlm.runtime.cache.storage.stores.mooncake.shm import ShmStaging

    class OneArea:
        def __init__(self) -> None:
            self.buf, self.allocs = ctypes.create_string_buffer(4096), 0

        def alloc_from_mem_pool(self, size: int) -> int:
            self.allocs += 1
            return ctypes.addressof(self.buf) if self.allocs == 1 else 0

        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

    client = OneArea()
    staging = ShmStaging(value_bytes=1024, max_pages=4, max_slots=4)
    staging.attach(client)
    with staging.slot(client) as first:
        assert first is not None and first[1] == ctypes.addressof(client.buf)
        with staging.slot(client) as second:
            assert second is None  # refused: this call copies instead
        with staging.slot(client) as third:
            assert third is None and client.allocs == 2  # no allocation is tried again
    with staging.slot(client) as again:
        assert again is not None and again[1] == first[1]  # the area it gave is still handed out
    assert staging.refused is None
