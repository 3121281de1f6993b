"""The Mooncake Store L3 backend against a real mooncake_master on loopback TCP, and the storage registry.

Needs ``pip install 'tierlm[mooncake]'`` and Debian's libibverbs1 (the master loads it even over TCP); the
tests that need them skip with that hint where they are absent. Objects live in the memory of the clients
that lend a segment: a ``holder`` client lends one here, and the engines lend none, so pages outlive an engine.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from storage_helpers import exists_prefix, get_all, mooncake_client, set_all

from tierlm.runtime.cache.storage import registry as storage_registry
from tierlm.runtime.cache.storage.base import BorrowedPage
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.cache.storage.page_keys import page_keys
from tierlm.runtime.errors import StartupError
from tierlm.server.commands.bench.mooncake_master import INSTALL_HINT as HINT
from tierlm.server.commands.bench.mooncake_master import MooncakeMaster, MooncakeMasterError, MooncakeRealClient

PAGE_BYTES = 4096
SEGMENT = 64 * 2**20
CONNECT_WAIT_S = 30.0  # engines reach a live master; a loaded CI machine must not start them with L3 offline


def ns(model: str = "model-a") -> StorageNamespace:
    return StorageNamespace.from_fields({"model": model, "dtype": "bfloat16", "page_size": 4, "layout": "page_first",
                                         "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                                         "backend_layout": "test"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_master(rpc: int) -> MooncakeMaster:
    """mooncake_master on 127.0.0.1:rpc (and a free metrics port), listening when this returns."""
    why = MooncakeMaster.unavailable()
    if why:
        pytest.skip(why)
    try:
        return MooncakeMaster(rpc).start()
    except MooncakeMasterError as e:
        if "libibverbs" in str(e):
            pytest.skip(str(e))
        pytest.fail(str(e))


def _stop(master: MooncakeMaster) -> None:
    master.stop()


def _stop_all(holder, master: MooncakeMaster | None) -> None:
    """A test's cleanup, whatever it got to: the memory-lending client closed, then its master stopped."""
    if holder is not None:
        _release(holder)
    if master is not None:
        _stop(master)


def _release(holder) -> None:
    """Close a memory-lending client: an in-process one, or a mooncake_client process."""
    if isinstance(holder, MooncakeRealClient):
        holder.stop()
    else:
        holder.close()


def _start_client(master: str, port: int | None = None) -> MooncakeRealClient:
    """A mooncake_client lending ``master`` memory (the shm path's real client), listening when this returns."""
    why = MooncakeRealClient.unavailable()
    if why:
        pytest.skip(why)
    try:
        return MooncakeRealClient(master, SEGMENT, port).start()
    except MooncakeMasterError as e:
        if "libibverbs" in str(e):
            pytest.skip(str(e))
        pytest.fail(str(e))


def _holder(address: str):
    """A client lending the store memory: objects live in the segments of the clients that lend one."""
    from mooncake.store import MooncakeDistributedStore

    holder = MooncakeDistributedStore()
    assert holder.setup("127.0.0.1", "P2PHANDSHAKE", SEGMENT, 16 * 2**20, "tcp", "", address) == 0
    return holder


@pytest.fixture(scope="module")
def master():
    """A mooncake_master on free loopback ports (address "127.0.0.1:port"), and a client lending it memory."""
    rpc = _free_port()
    proc = _start_master(rpc)
    address = f"127.0.0.1:{rpc}"
    holder = _holder(address)
    yield address
    holder.close()
    _stop(proc)


def open_mooncake(master: str, namespace: StorageNamespace | None = None, **cfg):
    extra = {"master_server_address": master, "local_hostname": "127.0.0.1", "global_segment_size": 0, **cfg}
    return storage_registry.open_storage("mooncake", namespace or ns(), PAGE_BYTES, extra)


def page(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(PAGE_BYTES))


def keys(n: int, seed: int) -> list[str]:
    return page_keys([seed * 1000 + t for t in range(4 * n)], 4)


# ---------------------------------------------------------------- registry (no mooncake needed)
def test_registry_names_and_refusal() -> None:
    assert {"file", "mooncake"} <= set(storage_registry.names())
    with pytest.raises(ValueError, match="file, mooncake"):
        storage_registry.check_name("hf3fs")
    from tierlm.runtime.cache.storage.stores.file.storage import open_storage as file_open

    assert storage_registry.factory("file") is file_open


def test_config_follows_sglang_order(tmp_path: Path) -> None:
    from tierlm.runtime.cache.storage.stores.mooncake.config import DEFAULT_GLOBAL_SEGMENT_SIZE, MooncakeConfig

    env = {"MOONCAKE_MASTER": "envhost:1", "MOONCAKE_PROTOCOL": "rdma", "MOONCAKE_DEVICE": "mlx5_0",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb", "LOCAL_HOSTNAME": "me"}
    c = MooncakeConfig.resolve({}, env)
    assert (c.master_server_address, c.protocol, c.device_name, c.global_segment_size, c.local_hostname) == (
        "envhost:1", "rdma", "mlx5_0", 2 * 2**30, "me")
    f = tmp_path / "mc.json"
    f.write_text(json.dumps({"master_server_address": "filehost:2", "metadata_server": "http://m:8080/metadata"}))
    c = MooncakeConfig.resolve({}, {**env, "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(f)})
    assert (c.master_server_address, c.metadata_server, c.global_segment_size) == (
        "filehost:2", "http://m:8080/metadata", DEFAULT_GLOBAL_SEGMENT_SIZE)
    c = MooncakeConfig.resolve({"master_server_address": "x:3"}, env)
    assert (c.master_server_address, c.protocol, c.metadata_server) == ("x:3", "tcp", "P2PHANDSHAKE")
    with pytest.raises(StartupError, match="MOONCAKE_MASTER"):
        MooncakeConfig.resolve({}, {})


# ---------------------------------------------------------------- against a real master
def test_contract_round_trip(master) -> None:
    s = open_mooncake(master)
    try:
        assert s.health()["state"] == "online"
        ks = keys(3, seed=1)
        assert s.exists(ks) == [False] * 3 and s.known(ks) == [False] * 3
        assert s.get(ks[0]) is None
        assert s.set(ks[0], page(0)) and s.set(ks[0], page(0))  # the second is a no-op
        assert s.set(ks[1], [memoryview(page(1))[:100], memoryview(page(1))[100:]])  # buffers, not joined
        assert s.get(ks[0]) == page(0) and s.get(ks[1]) == page(1)
        assert s.known(ks) == [True, True, False] and exists_prefix(s, ks) == 2
        out = [bytearray(1000), bytearray(PAGE_BYTES - 1000)]
        assert s.get_into(ks[1], out) and bytes(out[0] + out[1]) == page(1)
        assert s.probe(ks[2]) is None
        st = s.stats()
        assert (st["writes"], st["reads"], st["misses"], st["errors"]) == (2, 3, 1, 0)
        assert s.delete(ks[0]) and s.get(ks[0]) is None
    finally:
        s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.get(ks[1])


def test_batches_and_sharing_between_instances(master) -> None:
    a, b = open_mooncake(master), open_mooncake(master)
    try:
        ks = keys(5, seed=2)
        assert set_all(a, ks[:4], [page(i) for i in range(4)]) == [True] * 4
        assert b.known(ks) == [False] * 5  # b has no record yet: the prefetch thread probes
        assert b.exists(ks) == [True] * 4 + [False]
        assert get_all(b, ks) == [page(i) for i in range(4)] + [None]
        assert b.known(ks) == [True] * 4 + [False]
    finally:
        a.close()
        b.close()


def test_batch_get_into_fills_the_buffers_and_times_its_checksum_and_copy(master) -> None:
    """The prefetch's batched read lands each page in its buffers, stops at the first absent one, and reports the
    checksum and copy parts of its read time (hit_stages.py prints them)."""
    s = open_mooncake(master)
    try:
        ks = keys(4, seed=9)
        assert set_all(s, ks[:3], [page(i) for i in range(3)]) == [True] * 3
        outs = [[bytearray(PAGE_BYTES)] for _ in range(4)]
        assert s.batch_get_into([ks[0], ks[1], ks[3], ks[2]], outs) == [True, True, False, False]
        assert bytes(outs[0][0]) == page(0) and bytes(outs[1][0]) == page(1) and not any(outs[3][0])
        st = s.stats()
        assert st["checksum_seconds"] > 0 and st["copy_seconds"] > 0
        assert st["checksum_seconds"] + st["copy_seconds"] <= st["read_seconds"]
    finally:
        s.close()


def _counting_store_class(refuse_registration: bool = False) -> type:
    """A MooncakeDistributedStore that counts the calls a MooncakeKVStorage makes (and can refuse registration)."""
    from mooncake.store import MooncakeDistributedStore

    class Counting(MooncakeDistributedStore):
        calls: dict[str, int] = {}

        def _count(self, name: str) -> None:
            Counting.calls[name] = Counting.calls.get(name, 0) + 1

        def register_buffer(self, ptr, size):
            self._count("register_buffer")
            return -1 if refuse_registration else super().register_buffer(ptr, size)

    for name in ("get", "get_batch", "put_parts", "put_from", "setup_dummy", "batch_get_into_multi_buffers",
                 "batch_put_from_multi_buffers"):
        def counted(self, *a, _name=name, **kw):
            self._count(_name)
            return getattr(super(Counting, self), _name)(*a, **kw)
        setattr(Counting, name, counted)
    return Counting


def open_registered(master: str, store_class: type, pages: int = 8):
    """A MooncakeKVStorage with a layer_first host pool of ``pages`` pages registered (2 rows a page, as the
    runtime's pool of a 2-layer model), and a function giving the rows of a host page."""
    from tierlm.runtime.cache.storage.stores.mooncake.config import MooncakeConfig
    from tierlm.runtime.cache.storage.stores.mooncake.storage import MooncakeKVStorage

    config = MooncakeConfig.from_mapping({"master_server_address": master, "local_hostname": "127.0.0.1",
                                          "global_segment_size": 0}, "test")
    s = MooncakeKVStorage(config, ns(), PAGE_BYTES, connect_wait_s=CONNECT_WAIT_S, store_class=store_class)
    host = np.zeros((2, pages, PAGE_BYTES // 2), np.uint8)
    s.register_host_memory(host)
    return s, host, lambda p: [memoryview(host[layer, p]) for layer in range(2)]


def test_reads_land_in_registered_host_pages_and_writes_leave_from_them(master) -> None:
    """Zero-copy: with the host pool registered, a batch read lands each page straight in its host page (no
    get/get_batch, no copy: counted), and a backup is written from the host page; the values are the same format
    as the copying path's, so servers on either path share pages."""
    store_class = _counting_store_class()
    s, host, rows = open_registered(master, store_class)
    other = open_mooncake(master)  # no host pool registered: the copying path
    try:
        st = s.stats()
        assert st["read_path"] == "zero-copy" and other.stats()["read_path"].startswith("copy (no host pool")
        ks = keys(4, seed=21)
        host[:, 7] = np.frombuffer(page(0), np.uint8).reshape(2, -1)
        assert s.set(ks[0], BorrowedPage(rows(7), lambda: True))
        assert s.stats()["zero_copy_writes"] == 1 and store_class.calls.get("put_parts", 0) == 0
        assert other.get(ks[0]) == page(0)  # written from the host page, read by a server that copies
        assert set_all(other, ks[1:3], [page(1), page(2)]) == [True, True]
        before = dict(store_class.calls)
        assert s.batch_get_into(ks, [rows(p) for p in range(4)], probe=True) == [True, True, True, False]
        assert [host[:, p].tobytes() for p in range(3)] == [page(0), page(1), page(2)]
        assert not any(host[:, 3].ravel())  # the absent page wrote nothing
        st = s.stats()
        assert (st["zero_copy_reads"], st["reads"], st["copy_seconds"], st["misses"]) == (3, 3, 0.0, 0)
        assert st["checksum_seconds"] > 0
        calls = {k: v - before.get(k, 0) for k, v in store_class.calls.items()}
        assert calls.get("get", 0) == calls.get("get_batch", 0) == 0
        assert calls["batch_get_into_multi_buffers"] == 1  # one round trip for the batch
        host[:, 4] = 0
        assert s.get_into(ks[1], rows(4)) and host[:, 4].tobytes() == page(1)  # the first probe reads alone
        assert s.stats()["zero_copy_reads"] == 4
        out = [bytearray(PAGE_BYTES)]  # not registered memory: read through the copying path
        assert s.batch_get_into(ks[2:3], [out]) == [True] and bytes(out[0]) == page(2)
        assert s.stats()["zero_copy_reads"] == 4 and s.stats()["copy_seconds"] > 0
    finally:
        s.close()
        other.close()


def test_a_refused_registration_keeps_the_copying_path(master) -> None:
    store_class = _counting_store_class(refuse_registration=True)
    s, host, rows = open_registered(master, store_class)
    try:
        path = s.stats()["read_path"]
        assert path.startswith("copy (register_buffer of ") and path.endswith(" bytes returned -1)")
        k = keys(1, seed=22)[0]
        assert s.set(k, page(6)) and store_class.calls.get("batch_put_from_multi_buffers", 0) == 0
        assert s.batch_get_into([k], [rows(0)]) == [True] and host[:, 0].tobytes() == page(6)
        st = s.stats()
        assert st["zero_copy_reads"] == 0 and st["reads"] == 1 and store_class.calls["get_batch"] >= 1
    finally:
        s.close()


def test_batch_sizes_follow_the_path(master) -> None:
    """Zero-copy reads take up to 128 pages a round trip (no transfer buffer in between); the copying path asks
    what the client's transfer buffer holds at a time, however many pages the caller passed."""
    from tierlm.runtime.cache.storage.stores.mooncake.storage import MAX_ZERO_COPY_BATCH_PAGES

    store_class = _counting_store_class()
    s, host, rows = open_registered(master, store_class, pages=40)
    copier = open_mooncake(master, local_buffer_size=4 * (PAGE_BYTES + 128))  # room for 2 pages a batch
    try:
        assert s.read_batch_pages == MAX_ZERO_COPY_BATCH_PAGES and copier.read_batch_pages == 2
        ks = keys(40, seed=27)
        assert set_all(copier, ks, [page(i) for i in range(40)]) == [True] * 40
        before = store_class.calls.get("batch_get_into_multi_buffers", 0)
        assert s.batch_get_into(ks, [rows(p) for p in range(40)]) == [True] * 40
        assert store_class.calls["batch_get_into_multi_buffers"] == before + 1
        assert all(host[:, p].tobytes() == page(p) for p in range(40))
        assert copier.batch_read(ks[:5]) == [page(i) for i in range(5)]
        outs = [[bytearray(PAGE_BYTES)] for _ in range(5)]
        assert copier.batch_get_into(ks[:5], outs) == [True] * 5 and bytes(outs[4][0]) == page(4)
    finally:
        s.close()
        copier.close()


def damaged(value: bytes, damage: str) -> bytes:
    """A stored value spoiled one way: its last byte flipped, cut 10 bytes short, or replaced by garbage."""
    if damage == "flip":
        return value[:-1] + bytes([value[-1] ^ 0xFF])
    if damage == "short":
        return value[: len(value) - 10]
    assert damage == "garbage", damage
    return b"not a page" * 10


@pytest.mark.parametrize("damage", ["flip", "short", "garbage", "foreign"])
def test_a_damaged_value_is_a_counted_miss_on_the_zero_copy_path(master, damage: str) -> None:
    """The header and checksum rules in place: a damaged, short or foreign value read into a registered host page
    is a miss, counted, removed from the store, and the page is stored and read again afterwards."""
    s, host, rows = open_registered(master, _counting_store_class())
    other = open_mooncake(master, ns("model-z"))
    try:
        damaged_value_is_a_counted_miss(s, other, host, rows, damage, seed={"flip": 23, "short": 24, "garbage": 25,
                                                                             "foreign": 26}[damage])
    finally:
        s.close()
        other.close()


def damaged_value_is_a_counted_miss(s, other, host, rows, damage: str, seed: int, staged: bool = False) -> dict:
    """Store a page, damage its value in the store (or put another namespace's value under its name), read it:
    a counted miss, removed from the store; stored again, it is read. ``staged``: read through a staging area,
    so the damaged bytes never reach the host page (zero-copy reads land in it and are checked there). Returns the
    stats after the miss."""
    k = keys(1, seed=seed)[0]
    assert s.set(k, page(5))
    raw, obj = mooncake_client(s), s.object_key(k)
    if damage == "foreign":  # a value another model's server wrote, under this namespace's name
        assert other.set(k, page(5))
        value = raw.get(other.object_key(k))
    else:
        value = damaged(raw.get(obj), damage)
    assert raw.upsert(obj, value) == 0
    before = s.stats()
    assert s.batch_get_into([k], [rows(1)]) == [False]
    assert not staged or not any(host[:, 1].ravel())
    after = s.stats()
    assert (after["errors"], after["misses"], after["reads"]) == (
        before["errors"] + 1, before["misses"] + 1, before["reads"])
    assert raw.is_exist(obj) != 1  # removed, so the next backup stores it again
    assert s.set(k, page(5)) and s.batch_get_into([k], [rows(1)]) == [True] and host[:, 1].tobytes() == page(5)
    return after


def test_another_namespace_never_sees_the_pages(master) -> None:
    a, other = open_mooncake(master, ns("model-a")), open_mooncake(master, ns("model-b"))
    try:
        ks = keys(2, seed=3)
        assert a.set(ks[0], page(3))
        assert other.exists(ks) == [False, False] and other.get(ks[0]) is None
        # a value written under another namespace's header (here: copied under a's name) is refused
        raw = mooncake_client(a)
        assert other.set(ks[1], page(4))
        raw.upsert(a.object_key(ks[1]), raw.get(other.object_key(ks[1])))
        errors = a.stats()["errors"]
        assert a.get(ks[1]) is None and a.stats()["errors"] == errors + 1
    finally:
        a.close()
        other.close()


@pytest.mark.parametrize("damage", ["flip", "short", "garbage"])
def test_a_damaged_value_is_a_counted_miss(master, damage: str) -> None:
    s = open_mooncake(master)
    try:
        k = keys(1, seed={"flip": 4, "short": 5, "garbage": 6}[damage])[0]
        assert s.set(k, page(5))
        raw, obj = mooncake_client(s), s.object_key(k)
        assert raw.upsert(obj, damaged(raw.get(obj), damage)) == 0
        before = s.stats()
        assert s.get(k) is None
        after = s.stats()
        assert (after["errors"], after["misses"]) == (before["errors"] + 1, before["misses"] + 1)
        assert raw.is_exist(obj) != 1  # removed, so the next backup stores it again
        assert s.set(k, page(5)) and s.get(k) == page(5)
    finally:
        s.close()


def test_master_down_at_startup_then_up_and_killed_while_serving() -> None:
    """Offline at startup (no wait on the scheduler), online once the master answers, and a master killed while
    serving makes calls fail fast as misses (counted, degraded) instead of hanging."""
    pytest.importorskip("mooncake.store", reason=HINT)
    rpc = _free_port()
    t0 = time.monotonic()
    s = open_mooncake(f"127.0.0.1:{rpc}", connect_wait_s=0.3, retry_interval_s=0.2)
    proc = holder = None
    try:
        assert time.monotonic() - t0 < 2
        k = keys(1, seed=7)[0]
        assert s.health()["state"] == "degraded" and not s.stats()["connected"]
        assert "unreachable" in s.health()["last_error"]
        assert s.exists([k]) == [False] and s.get(k) is None and s.set(k, page(1)) is False
        proc = _start_master(rpc)
        holder = _holder(f"127.0.0.1:{rpc}")
        deadline = time.monotonic() + 10
        while not s.stats()["connected"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.health()["state"] == "online"
        assert s.set(k, page(1)) and s.get(k) == page(1)
        s.retry_interval_s = 30.0  # after the failure below, no call tries the dead master again in this test
        holder.close()
        holder = None
        _stop(proc)
        proc = None
        # get() answers b"" (absent) on any failure; the exists RPC reports it (and may take seconds to fail)
        assert s.get(k) is None and s.exists([k]) == [False]
        assert s.health()["state"] == "degraded" and s.stats()["errors"] >= 1
        t1 = time.monotonic()
        assert s.get(k) is None and s.exists([k]) == [False] and s.set(keys(1, seed=8)[0], page(2)) is False
        assert time.monotonic() - t1 < 0.5  # the next ones do not wait on the dead master
    finally:
        t2 = time.monotonic()
        s.close()
        assert time.monotonic() - t2 < 3  # shutdown does not wait out the dead master
        _stop_all(holder, proc)


def test_a_restarted_master_is_noticed_without_traffic_and_its_lost_pages_are_written_again() -> None:
    rpc = _free_port()
    address = f"127.0.0.1:{rpc}"
    proc, holder = _start_master(rpc), _holder(address)
    s = open_mooncake(address, retry_interval_s=0.2)
    try:
        k = keys(1, seed=11)[0]
        assert s.set(k, page(3)) and s.known([k]) == [True]
        holder.close()
        _stop(proc)
        proc = holder = None
        assert s.exists([k]) == [False] and s.health()["state"] == "degraded"  # exists reports the failure
        proc, holder = _start_master(rpc), _holder(address)
        deadline = time.monotonic() + 15  # no call from here on: the background probe sees the master back
        while s.health()["state"] != "online" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.health()["state"] == "online"
        assert s.known([k]) == [False]  # the new master has none of the old pages: the index forgot them
        assert s.set(k, page(3)) and mooncake_client(s).is_exist(s.object_key(k)) == 1 and s.get(k) == page(3)
    finally:
        s.close()
        _stop_all(holder, proc)


def test_the_first_write_after_a_master_restart_is_stored() -> None:
    """The first call on the connection to a master that restarted fails (RPC_FAIL); a write is retried once, so
    the backup that happens to come first after the restart is stored, not dropped."""
    rpc = _free_port()
    address = f"127.0.0.1:{rpc}"
    proc, holder = _start_master(rpc), _holder(address)
    s = open_mooncake(address, retry_interval_s=600)  # no health probe in between: the write is the first call
    try:
        first, second = keys(2, seed=12)
        assert s.set(first, page(4))
        holder.close()
        _stop(proc)
        proc = holder = None
        proc, holder = _start_master(rpc), _holder(address)
        assert s.set(second, page(5)) and s.health()["state"] == "online"
        assert mooncake_client(s).is_exist(s.object_key(second)) == 1 and s.get(second) == page(5)
    finally:
        s.close()
        _stop_all(holder, proc)


def test_missing_package_names_the_install_command(monkeypatch) -> None:
    import builtins

    from tierlm.runtime.cache.storage.stores.mooncake import connection

    real = builtins.__import__

    def no_mooncake(name, *a, **kw):
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    with pytest.raises(StartupError, match=r"pip install 'tierlm\[mooncake\]'"):
        connection.import_store_class()


# ---------------------------------------------------------------- a server on the shared store
def cold_run(model_dir, kw: dict, prompt: list[int]):
    """One engine on the store serves ``prompt`` cold (12 greedy tokens) and shuts down, which flushes its backups:
    (its output, its storage stats)."""
    from engine_harness import greedy, run
    from test_hicache import hicache_engine

    engine = hicache_engine("torch", model_dir, **kw)
    try:
        cold, = run(engine, [prompt], greedy(12))
    finally:
        engine.shutdown()
    return cold, engine.parts.cache.storage.stats()


def test_engine_storage_hit_after_restart(master, tiny_llama, store) -> None:
    """A second engine on the same master serves the prompt from Mooncake with exactly the cold output."""
    from engine_harness import greedy, run
    from test_hicache import doc, hicache_engine

    extra = json.dumps({"master_server_address": master, "local_hostname": "127.0.0.1", "global_segment_size": 0,
                        "connect_wait_s": CONNECT_WAIT_S})
    kw = {"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": extra}
    prompt = doc(11) + [3]
    cold, written = cold_run(tiny_llama, kw, prompt)
    assert written["zero_copy_writes"] == written["writes"] >= 15  # every page written from its registered host page
    engine = hicache_engine("torch", tiny_llama, **kw)
    try:
        hot, = run(engine, [prompt], greedy(12))
        assert hot.last.cached.storage == 60 and hot.token_ids == cold.token_ids
        tier = json.loads(json.dumps(engine.server_info(), default=str))["tiers"]["storage"]
        # read straight into the registered host pool: every page of the hit, no copy on the way
        assert (tier["read_path"], tier["zero_copy_reads"], tier["copy_seconds"]) == ("zero-copy", 15, 0.0)
    finally:
        engine.shutdown()


def test_engine_starts_with_l3_offline_when_the_master_is_down(tiny_llama, store) -> None:
    """No master: the server starts anyway, serves correctly from L1/L2, and /server_info says L3 is offline."""
    pytest.importorskip("mooncake.store", reason=HINT)
    from engine_harness import greedy, run
    from model_factory import reference_greedy
    from test_hicache import doc, hicache_engine

    extra = json.dumps({"master_server_address": f"127.0.0.1:{_free_port()}", "connect_wait_s": 0.2})
    engine = hicache_engine("torch", tiny_llama, hicache_storage_backend="mooncake",
                            hicache_storage_backend_extra_config=extra)
    try:
        prompt = doc(12) + [4]
        out, = run(engine, [prompt], greedy(6))
        assert out.token_ids == reference_greedy(tiny_llama, prompt, 6)
        tiers = json.loads(json.dumps(engine.server_info(), default=str))["tiers"]["storage"]
        assert (tiers["backend"], tiers["state"], tiers["connected"]) == ("mooncake", "degraded", False)
        assert "unreachable" in tiers["last_error"]
    finally:
        engine.shutdown()


def test_clear_removes_this_namespace_only(master) -> None:
    a, other = open_mooncake(master, ns("model-c")), open_mooncake(master, ns("model-d"))
    try:
        ks = keys(3, seed=9)
        assert set_all(a, ks, [page(i) for i in range(3)]) == [True] * 3
        assert other.set(ks[0], page(9))
        assert a.clear() == 3
        assert a.exists(ks) == [False] * 3 and other.get(ks[0]) == page(9)
    finally:
        a.close()
        other.close()


def test_engine_of_another_model_gets_no_hits(master, tiny_llama, tiny_models_root, store) -> None:
    """Two models on one master: the second one's identical token ids never load the first one's pages."""
    another_model_gets_no_hits({"master_server_address": master}, tiny_llama, tiny_models_root)


def another_model_gets_no_hits(addresses: dict, tiny_llama, tiny_models_root) -> None:
    """The check of the test above, on the store named by ``addresses`` (also run on the shm path)."""
    from engine_harness import greedy, run
    from model_factory import build_tiny_model, reference_greedy
    from test_hicache import doc, hicache_engine

    extra = json.dumps({**addresses, "local_hostname": "127.0.0.1", "global_segment_size": 0,
                        "connect_wait_s": CONNECT_WAIT_S})
    kw = {"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": extra}
    prompt = doc(13) + [5]
    engine = hicache_engine("torch", tiny_llama, **kw)
    try:
        run(engine, [prompt], greedy(4))
    finally:
        engine.shutdown()  # flushes the queued L3 writes
    other_model = build_tiny_model("qwen2", tiny_models_root / "qwen2")
    engine = hicache_engine("torch", other_model, **kw)
    try:
        out, = run(engine, [prompt], greedy(6))
        assert out.last.cached.storage == 0 and out.token_ids == reference_greedy(other_model, prompt, 6)
    finally:
        engine.shutdown()
    engine = hicache_engine("torch", tiny_llama, **kw)
    try:  # the pages are still there for their own model: the miss above was the namespace, not a lost write
        out, = run(engine, [prompt], greedy(4))
        assert out.last.cached.storage == 60
    finally:
        engine.shutdown()


def _stream_all(engine, prompts: list[list[int]], params, on_first_token) -> list[list[int]]:
    """Stream every prompt at once; ``on_first_token()`` runs (off the event loop) when the first token arrives."""
    import asyncio

    from tierlm.runtime.io_struct import GenerateRequest

    fired = asyncio.Event()

    async def one(i: int, ids: list[int]) -> list[int]:
        toks: list[int] = []
        async for out in engine.generate(GenerateRequest(rid=f"kill{i}", input_ids=list(ids), sampling_params=params,
                                                         stream=True)):
            assert out.error is None, out.error
            toks += out.token_ids
            if toks and not fired.is_set():
                fired.set()
                await asyncio.to_thread(on_first_token)
        return toks

    async def main():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    return asyncio.run(main())


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_engine_keeps_serving_when_the_master_dies_and_uses_it_again_when_it_returns(tiny_llama, store,
                                                                                     transport) -> None:
    """The master (and what lends it memory) killed while requests stream: every request finishes with the
    reference output, later ones are served from L1/L2, /server_info shows L3 degraded; the store restarted: L3
    comes back and takes pages again (another engine then loads them). "shm": the engines are dummy clients of a
    mooncake_client on this host, which lends the memory (test_mooncake_shm.py)."""
    from engine_harness import greedy, pool_is_clean, run, settles_clean
    from model_factory import reference_greedy
    from test_hicache import doc, hicache_engine

    rpc, client_port = _free_port(), _free_port()
    address = f"127.0.0.1:{rpc}"
    proc = _start_master(rpc)

    def lender():
        return _holder(address) if transport == "tcp" else _start_client(address, client_port)

    holder = lender()
    addresses = {"master_server_address": address}
    if transport == "shm":
        addresses["client_server_address"] = f"127.0.0.1:{client_port}"
    extra = json.dumps({**addresses, "local_hostname": "127.0.0.1", "global_segment_size": 0,
                        "connect_wait_s": CONNECT_WAIT_S, "retry_interval_s": 0.3})
    kw = {"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": extra,
          "hicache_storage_prefetch_policy": "timeout"}

    def storage_tier(engine) -> dict:
        return json.loads(json.dumps(engine.server_info(), default=str))["tiers"]["storage"]

    def kill_master() -> None:
        nonlocal holder, proc
        _release(holder)
        holder = None
        _stop(proc)
        proc = None

    try:
        engine = hicache_engine("torch", tiny_llama, **kw)
        try:
            prompts = [doc(30 + i) + [i + 1] for i in range(3)]
            outs = _stream_all(engine, prompts, greedy(16), kill_master)
            assert proc is None  # the master really died mid-stream
            for prompt, toks in zip(prompts, outs):
                assert toks == reference_greedy(tiny_llama, prompt, 16)
            again = run(engine, prompts + [doc(33) + [7]], greedy(4))  # L1/L2 hits, one new prompt; master dead
            for prompt, out in zip(prompts + [doc(33) + [7]], again):
                assert out.last.error is None and out.token_ids == reference_greedy(tiny_llama, prompt, 4)
            assert again[0].last.cached.total > 0
            deadline = time.monotonic() + 20  # the failed writes and exists calls surface as degraded
            while storage_tier(engine)["state"] != "degraded" and time.monotonic() < deadline:
                run(engine, [doc(40) + [int(time.monotonic() * 10) % 200]], greedy(1))
                time.sleep(0.2)
            assert storage_tier(engine)["state"] == "degraded"
            # A read the kill left in flight past its prefetch's timeout (a dummy client's call to a dead
            # mooncake_client takes ~4 s to fail) parks its host page until a later prefetch sweeps it.
            for i in range(5):
                if settles_clean(engine, 2.0):
                    break
                run(engine, [doc(41) + [10 + i]], greedy(1))
            assert settles_clean(engine)

            proc = _start_master(rpc)
            holder = lender()
            fresh = doc(50) + [8]
            deadline = time.monotonic() + 20  # no request touches L3 meanwhile: the health probe notices it
            while storage_tier(engine)["state"] != "online" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert storage_tier(engine)["state"] == "online", json.dumps(storage_tier(engine))
            cold, = run(engine, [fresh], greedy(8))
        finally:
            engine.shutdown()  # flushes the backup of ``fresh`` to the master that came back
        assert pool_is_clean(engine)
        engine = hicache_engine("torch", tiny_llama, **kw)
        try:
            hot, = run(engine, [fresh], greedy(8))
            assert hot.last.cached.storage == 60 and hot.token_ids == cold.token_ids
        finally:
            engine.shutdown()
    finally:  # whatever failed, no master outlives the test
        _stop_all(holder, proc)
