"""L3 storage tier: page keys, namespaces, the verified file store and its background I/O, on real files."""
from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from disk_faults import inject_disk_fault
from memory_storage import MemoryStorage
from storage_helpers import backup_all, exists_prefix, get_all, set_all

from tierlm.runtime.cache.storage.stores.file import storage as fs_mod
from tierlm.runtime.cache.storage.base import STAT_FIELDS
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.cache.storage.page_header import HEADER_SIZE
from tierlm.runtime.cache.storage.page_keys import is_page_key, page_key, page_keys
from tierlm.runtime.cache.storage.registry import parse_extra_config
from tierlm.runtime.cache.storage.storage_io import StorageIO
from tierlm.runtime.cache.storage.stores.file.config import (STORAGE_DIR_ENV, default_storage_dir,
                                                             max_size_bytes_from_config)
from tierlm.runtime.cache.storage.stores.file.storage import NAMESPACE_FILE, TEMP_PREFIX, FileKVStorage
from tierlm.runtime.errors import StartupError

PAGE_BYTES = 512
NS_FIELDS = {
    "model": "fp-aaaa", "dtype": "float32", "page_size": 4, "layout": "page_first", "num_layers": 2,
    "num_kv_heads": 2, "head_dim": 8, "backend_layout": "torch:layer,kv,token,head,dim",
}


def make_ns(**over) -> StorageNamespace:
    return StorageNamespace.from_fields({**NS_FIELDS, **over})


def payload_for(key: str, salt: int = 0, size: int = PAGE_BYTES) -> bytes:
    rng = np.random.default_rng(int(key[:8], 16) + salt)
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def keys_for(n: int, start: int = 0) -> list[str]:
    return page_keys(list(range(start, start + 4 * n)), 4)


@pytest.fixture
def store(tmp_path):
    s = FileKVStorage(tmp_path, make_ns(), PAGE_BYTES)
    yield s
    s.close()


# --- page keys ---
def test_page_keys_chain_full_pages_only():
    tokens = list(range(10))
    keys = page_keys(tokens, 4)
    assert len(keys) == 2 and all(is_page_key(k) for k in keys)  # the partial page 8..9 has no key
    assert page_keys(tokens[:8], 4) == keys
    assert page_keys(np.array(tokens, dtype=np.int32), 4) == keys
    assert page_keys(tokens[4:], 4, prior_key=keys[0]) == keys[1:]  # continuing a chain = keying it whole
    assert keys[0] == page_key(None, tokens[:4]) and keys[1] == page_key(keys[0], tokens[4:8])
    # A page's key depends on everything before it, not only on its own tokens.
    other = page_keys([99, 1, 2, 3] + tokens[4:8], 4)
    assert other[1] != keys[1]
    assert page_keys([], 4) == [] and page_keys([1, 2, 3], 4) == []
    with pytest.raises(ValueError):
        page_keys(tokens, 0)
    with pytest.raises(ValueError):
        page_keys(tokens, 4, prior_key="not-a-key")


def test_page_keys_identical_in_another_process():
    tokens = list(range(1000, 1037))
    code = (
        "import json;from tierlm.runtime.cache.storage.page_keys import page_keys;"
        f"print(json.dumps(page_keys({tokens!r}, 8)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == page_keys(tokens, 8)


# --- namespace ---
def test_namespace_id_is_canonical_and_covers_every_field():
    ns = make_ns()
    assert StorageNamespace.from_fields(dict(reversed(list(NS_FIELDS.items())))).id == ns.id
    changed = {"model": "fp-bbbb", "dtype": "bfloat16", "page_size": 8, "layout": "layer_first", "num_layers": 3,
               "num_kv_heads": 1, "head_dim": 16, "backend_layout": "mlx:layer,kv,token,head,dim"}
    ids = {make_ns(**{k: v}).id for k, v in changed.items()}
    assert ns.id not in ids and len(ids) == len(changed)
    with pytest.raises(ValueError, match="missing"):
        StorageNamespace.from_fields({k: v for k, v in NS_FIELDS.items() if k != "dtype"})


def test_namespace_isolation_in_one_folder(tmp_path):
    key = keys_for(1)[0]
    with FileKVStorage(tmp_path, make_ns(), PAGE_BYTES) as a:
        assert a.set(key, payload_for(key))
        meta = json.loads((a.dir / NAMESPACE_FILE).read_text())
        assert meta["id"] == a.namespace.id and meta["fields"]["model"] == "fp-aaaa"
    for other in (make_ns(model="fp-bbbb"), make_ns(dtype="bfloat16")):
        with FileKVStorage(tmp_path, other, PAGE_BYTES) as b:
            assert b.exists([key]) == [False] and b.get(key) is None
            assert b.stats()["files"] == 0


def test_file_from_another_namespace_copied_in_is_a_miss(tmp_path):
    key = keys_for(1)[0]
    a = FileKVStorage(tmp_path, make_ns(), PAGE_BYTES)
    b = FileKVStorage(tmp_path, make_ns(model="fp-bbbb"), PAGE_BYTES)
    a.set(key, payload_for(key))
    (b.dir / f"{key}.kv").write_bytes((a.dir / f"{key}.kv").read_bytes())
    assert b.get(key) is None and b.stats()["errors"] == 1
    assert not (b.dir / f"{key}.kv").exists() and a.get(key) == payload_for(key)


# --- file store ---
def test_round_trip_and_stats(store):
    keys = keys_for(3)
    assert store.exists(keys) == [False] * 3 and store.get(keys[0]) is None
    assert set_all(store, keys[:2], [payload_for(k) for k in keys[:2]]) == [True, True]
    assert store.exists(keys) == [True, True, False] and exists_prefix(store, keys) == 2
    assert get_all(store, keys) == [payload_for(keys[0]), payload_for(keys[1]), None]
    assert store.set(keys[0], payload_for(keys[0], salt=1))  # already stored: kept, not rewritten
    st = store.stats()
    assert set(STAT_FIELDS) <= set(st)
    assert (st["files"], st["bytes"], st["writes"], st["reads"]) == (2, 2 * (HEADER_SIZE + PAGE_BYTES), 2, 2)
    assert st["bytes_read"] == 2 * PAGE_BYTES and st["misses"] == 2 and st["errors"] == 0
    assert store.delete(keys[0]) and not store.delete(keys[0]) and store.exists(keys[:1]) == [False]
    with pytest.raises(ValueError, match="bytes"):
        store.set(keys[2], b"short")
    with pytest.raises(ValueError, match="64 lowercase hex"):
        store.get("../../etc/passwd")
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.get(keys[1])


def test_payload_accepts_numpy_and_memoryview(store):
    k1, k2 = keys_for(2)
    arr = np.frombuffer(payload_for(k1), np.uint8).copy()
    assert store.set(k1, arr) and store.set(k2, memoryview(payload_for(k2)))
    assert store.get(k1) == arr.tobytes() and store.get(k2) == payload_for(k2)


def _damage_check(store: FileKVStorage, key: str) -> None:
    assert store.exists([key]) == [True]
    assert store.get(key) is None
    st = store.stats()
    assert st["errors"] == 1 and st["misses"] == 1 and st["files"] == 0
    assert not (store.dir / f"{key}.kv").exists()
    assert store.set(key, payload_for(key)) and store.get(key) == payload_for(key)  # rewritable afterwards


def test_corrupted_payload_byte_is_a_counted_miss_and_removed(store):
    key = keys_for(1)[0]
    store.set(key, payload_for(key))
    path = store.dir / f"{key}.kv"
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 100] ^= 0x01
    path.write_bytes(bytes(data))
    _damage_check(store, key)


def test_truncated_file_is_a_counted_miss_and_removed(store):
    key = keys_for(1)[0]
    store.set(key, payload_for(key))
    path = store.dir / f"{key}.kv"
    path.write_bytes(path.read_bytes()[: HEADER_SIZE + PAGE_BYTES // 2])
    _damage_check(store, key)


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE - 1])
def test_truncated_header_is_a_counted_miss(store, cut):
    key = keys_for(1)[0]
    store.set(key, payload_for(key))
    path = store.dir / f"{key}.kv"
    path.write_bytes(path.read_bytes()[:cut])
    _damage_check(store, key)


def test_other_keys_file_renamed_into_place_is_a_miss(store):
    k1, k2 = keys_for(2)
    store.set(k1, payload_for(k1))
    os.replace(store.dir / f"{k1}.kv", store.dir / f"{k2}.kv")
    assert store.get(k2) is None and store.stats()["errors"] == 1
    assert not (store.dir / f"{k2}.kv").exists()


def test_restart_sees_previous_pages_and_drops_damaged_ones(tmp_path):
    keys = keys_for(3)
    with FileKVStorage(tmp_path, make_ns(), PAGE_BYTES) as a:
        for k in keys:
            a.set(k, payload_for(k))
    (a.dir / f"{keys[2]}.kv").write_bytes(b"TLMKV-truncated")
    with FileKVStorage(tmp_path, make_ns(), PAGE_BYTES) as b:
        st = b.stats()
        assert st["files"] == 2 and st["errors"] == 1
        assert b.exists(keys) == [True, True, False]
        assert b.get(keys[0]) == payload_for(keys[0]) and b.get(keys[1]) == payload_for(keys[1])


def test_lru_bound_evicts_least_recently_used(tmp_path):
    keys = keys_for(4)
    file_bytes = HEADER_SIZE + PAGE_BYTES
    with FileKVStorage(tmp_path, make_ns(), PAGE_BYTES, max_size_bytes=3 * file_bytes) as s:
        for k in keys[:3]:
            s.set(k, payload_for(k))
        assert s.get(keys[0]) is not None  # keys[1] is now the least recently used
        s.set(keys[3], payload_for(keys[3]))
        assert s.exists(keys) == [True, False, True, True]
        assert not (s.dir / f"{keys[1]}.kv").exists()
        st = s.stats()
        assert st["evictions"] == 1 and st["bytes"] == 3 * file_bytes and st["bytes"] <= st["max_bytes"]


def test_restart_rebuilds_lru_order_from_mtimes_and_enforces_bound(tmp_path):
    keys = keys_for(3)
    file_bytes = HEADER_SIZE + PAGE_BYTES
    with FileKVStorage(tmp_path, make_ns(), PAGE_BYTES) as a:
        for k in keys:
            a.set(k, payload_for(k))
    for age, k in zip((100, 300, 200), keys):  # keys[0] is the oldest on disk
        os.utime(a.dir / f"{k}.kv", (1_000_000 + age, 1_000_000 + age))
    a2 = FileKVStorage(tmp_path, make_ns(), PAGE_BYTES)
    assert a2.get(keys[0]) is not None  # a read refreshes the mtime that orders the next restart
    assert os.stat(a2.dir / f"{keys[0]}.kv").st_mtime > 1_000_000 + 300
    with FileKVStorage(tmp_path, make_ns(), PAGE_BYTES, max_size_bytes=2 * file_bytes) as b:
        assert b.exists(keys) == [True, True, False]  # keys[2] (mtime 200) is now the least recently used
        assert b.stats()["evictions"] == 1


def test_temp_files_are_never_keys_and_stale_ones_are_cleaned(tmp_path):
    key = keys_for(1)[0]
    with FileKVStorage(tmp_path, make_ns(), PAGE_BYTES) as a:
        a.set(key, payload_for(key))
        good = (a.dir / f"{key}.kv").read_bytes()
        a.delete(key)
        old_tmp = a.dir / f"{TEMP_PREFIX}{key}-1-1-deadbeef"
        young_tmp = a.dir / f"{TEMP_PREFIX}{key}-2-2-cafef00d"
        old_tmp.write_bytes(good)
        young_tmp.write_bytes(good)
        os.utime(old_tmp, (1_000_000, 1_000_000))
        assert a.exists([key]) == [False] and a.get(key) is None
    with FileKVStorage(tmp_path, make_ns(), PAGE_BYTES) as b:
        assert b.exists([key]) == [False] and b.stats()["files"] == 0
        assert not old_tmp.exists() and young_tmp.exists()  # a young temp file may be another writer's


def test_failed_write_leaves_nothing_behind(store, monkeypatch):
    key = keys_for(1)[0]

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs_mod.os, "fsync", broken_fsync)
    assert store.set(key, payload_for(key)) is False
    assert store.stats()["errors"] == 1 and store.exists([key]) == [False]
    assert [p.name for p in store.dir.iterdir()] == [NAMESPACE_FILE]


def test_instances_sharing_a_folder_see_each_others_pages(tmp_path):
    key = keys_for(1)[0]
    a = FileKVStorage(tmp_path, make_ns(), PAGE_BYTES)
    b = FileKVStorage(tmp_path, make_ns(), PAGE_BYTES)
    a.set(key, payload_for(key))
    assert b.exists([key]) == [True] and b.get(key) == payload_for(key) and b.stats()["files"] == 1


def test_clear_empties_only_this_namespace(tmp_path):
    k1, k2 = keys_for(2)
    a = FileKVStorage(tmp_path, make_ns(), PAGE_BYTES)
    other = FileKVStorage(tmp_path, make_ns(dtype="float16"), PAGE_BYTES)
    set_all(a, [k1, k2], [payload_for(k1), payload_for(k2)])
    other.set(k1, payload_for(k1))
    assert a.clear() == 2 and a.stats()["files"] == 0 and a.exists([k1, k2]) == [False, False]
    assert other.get(k1) == payload_for(k1)
    assert a.set(k1, payload_for(k1)) and a.get(k1) == payload_for(k1)


def test_namespace_folder_holding_another_id_is_refused(tmp_path):
    ns = make_ns()
    folder = tmp_path / ns.folder_name
    folder.mkdir()
    (folder / NAMESPACE_FILE).write_text(json.dumps({"id": "f" * 64}))
    with pytest.raises(StartupError, match="another storage dir"):
        FileKVStorage(tmp_path, ns, PAGE_BYTES)


# --- concurrency across processes ---
CONC_PAGE = 64 * 1024


def _writer(root: str, writer_id: int, rounds: int, start: mp.synchronize.Event) -> None:
    s = FileKVStorage(root, make_ns(), CONC_PAGE)
    keys = keys_for(6)
    start.wait()
    for r in range(rounds):
        for i, k in enumerate(keys):
            if (r + i + writer_id) % 2 == 0:
                s.delete(k)  # forces real rewrites (set() skips pages already stored)
            s.set(k, payload_for(k, salt=writer_id, size=CONC_PAGE))


def test_two_processes_writing_same_keys_never_expose_a_partial_file(tmp_path):
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 25, start)) for w in (1, 2)]
    for p in procs:
        p.start()
    reader = FileKVStorage(tmp_path, make_ns(), CONC_PAGE)
    keys = keys_for(6)
    valid = {k: {payload_for(k, salt=w, size=CONC_PAGE) for w in (1, 2)} for k in keys}
    start.set()
    hits = reads = 0
    while any(p.is_alive() for p in procs) or reads < 300:
        for k in keys:
            got = reader.get(k)
            reads += 1
            if got is not None:
                assert got in valid[k]
                hits += 1
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert reader.stats()["errors"] == 0  # a partial file would have failed its checksum and been counted
    assert hits > 0
    names = [p.name for p in reader.dir.iterdir()]
    assert not [n for n in names if n.startswith(TEMP_PREFIX)]
    for k in keys:
        assert reader.get(k) in valid[k]


# --- extra-config and folders ---
def test_parse_extra_config(tmp_path):
    assert parse_extra_config(None) == {} and parse_extra_config("  ") == {}
    assert parse_extra_config('{"max_size_gb": 2.5}') == {"max_size_gb": 2.5}
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text('{"max_size_gb": 1}')
    assert parse_extra_config(f"@{cfg_file}") == {"max_size_gb": 1}
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_extra_config("{max_size_gb: 1}")
    with pytest.raises(ValueError, match="JSON object"):
        parse_extra_config("[1, 2]")
    with pytest.raises(ValueError, match="cannot read"):
        parse_extra_config(f"@{tmp_path / 'missing.json'}")
    assert max_size_bytes_from_config({"max_size_gb": 2.5}) == 2_500_000_000
    assert max_size_bytes_from_config({}) is None
    with pytest.raises(ValueError, match="positive"):
        max_size_bytes_from_config({"max_size_gb": 0})


def test_from_extra_config_applies_the_bound(tmp_path):
    s = FileKVStorage.from_extra_config(make_ns(), PAGE_BYTES, {"max_size_gb": 0.5}, root_dir=tmp_path)
    assert s.max_size_bytes == 500_000_000 and s.dir.parent == tmp_path


def test_default_storage_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(STORAGE_DIR_ENV, str(tmp_path / "l3"))
    assert default_storage_dir() == tmp_path / "l3"
    monkeypatch.delenv(STORAGE_DIR_ENV)
    import platformdirs

    assert default_storage_dir() == Path(platformdirs.user_cache_dir("tierlm")) / "hicache"


# --- background I/O ---
class GatedStorage(MemoryStorage):
    """In-memory storage whose get/set wait for a gate, so tests control when I/O finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.get_gate = threading.Semaphore(1000)
        self.set_gate = threading.Event()
        self.set_gate.set()

    def get(self, key):
        self.get_gate.acquire()
        return super().get(key)

    def set(self, key, payload):
        self.set_gate.wait()
        return super().set(key, payload)


def test_storage_io_backup_then_prefetch_on_files(store):
    io = StorageIO(store)
    keys = keys_for(4)
    done: list[tuple[str, bool]] = []
    assert backup_all(io, keys[:3], [payload_for(k) for k in keys[:3]], on_done=lambda k, ok: done.append((k, ok))) == 3
    assert io.flush(timeout=30)
    assert sorted(done) == sorted((k, True) for k in keys[:3]) and store.exists(keys[:3]) == [True] * 3
    got: list[list[bytes]] = []
    h = io.prefetch(keys, on_done=got.append)  # keys[3] was never stored: stops there
    assert h.wait(timeout=30)
    assert h.result() == [payload_for(k) for k in keys[:3]] and not h.complete and not h.cancelled
    full = io.prefetch(keys[:2])
    assert full.wait(timeout=30) and full.complete
    io.close()
    assert got == [h.result()]
    st = io.stats()
    assert (st["backups_done"], st["prefetches_partial"], st["prefetches_complete"]) == (3, 1, 1)
    assert st["prefetch_pages_loaded"] == 5 and st["pending_writes"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        io.backup(keys[3], payload_for(keys[3]))


def test_storage_io_cancel_freezes_the_loaded_prefix():
    storage = GatedStorage()
    keys = keys_for(3)
    for k in keys:
        storage.data[k] = payload_for(k)
    storage.get_gate = threading.Semaphore(1)  # the first page loads, the second read blocks
    io = StorageIO(storage)
    called = []
    h = io.prefetch(keys, on_done=called.append)
    for _ in range(30_000):
        if h.num_loaded:
            break
        threading.Event().wait(0.001)
    assert h.num_loaded == 1
    assert not h.wait(timeout=0.05)  # still blocked on the second page: the timeout policy gives up here
    assert h.cancel() == [payload_for(keys[0])] and h.done and h.cancelled
    storage.get_gate.release()  # the blocked read finishes; its page must not be added
    storage.get_gate.release()
    io.close()
    assert h.result() == [payload_for(keys[0])] and called == []
    assert io.stats()["prefetches_cancelled"] == 1


def test_storage_io_flush_timeout_and_write_backlog_limit():
    storage = GatedStorage()
    storage.set_gate.clear()
    keys = keys_for(4)
    io = StorageIO(storage, max_pending_write_bytes=2 * PAGE_BYTES)
    assert io.backup(keys[0], payload_for(keys[0])) and io.backup(keys[1], bytearray(payload_for(keys[1])))
    assert io.backup(keys[2], payload_for(keys[2])) is False  # over the backlog limit: dropped, counted
    assert not io.flush(timeout=0.05)
    assert io.stats()["pending_writes"] == 2
    storage.set_gate.set()
    assert io.flush(timeout=30)
    assert set(storage.data) == set(keys[:2]) and storage.data[keys[1]] == payload_for(keys[1])
    st = io.stats()
    assert (st["backups_done"], st["backups_dropped"], st["pending_write_bytes"]) == (2, 1, 0)
    io.close()


def test_storage_io_close_without_flush_drops_queued_writes_and_cancels_prefetches():
    storage = GatedStorage()
    storage.set_gate.clear()
    storage.get_gate = threading.Semaphore(0)
    keys = keys_for(3)
    io = StorageIO(storage)
    for k in keys:
        io.backup(k, payload_for(k))
    first = io.prefetch(keys)  # taken by the prefetch thread, blocked in get
    queued = io.prefetch(keys)
    closer = threading.Thread(target=io.close, kwargs={"flush": False, "timeout": 5})
    closer.start()
    assert queued.wait(timeout=30) and queued.cancelled
    storage.set_gate.set()
    storage.get_gate.release(10)
    closer.join(30)
    assert not closer.is_alive() and first.done
    st = io.stats()
    assert st["pending_writes"] == 0 and st["backups_dropped"] >= 1 and st["backups_done"] <= 1


# --- a misbehaving disk: special files, hung calls, deleted folder, full or read-only disk ---
def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _unblock_fifo(path: Path) -> None:
    """Let a reader stuck opening ``path`` (code without the fix) return, so a failing test cannot hang."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _in_thread(fn, timeout: float = 10.0):
    """fn() on a daemon thread; (finished within timeout, result)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), (out[0] if out else None)


def test_fifo_in_place_of_a_page_file_is_a_miss_not_a_hang(store):
    keys = keys_for(3)
    for k in keys:
        assert store.set(k, payload_for(k))
    fifo = store._path(keys[1])
    _replace_with_fifo(fifo)
    io = StorageIO(store)
    try:
        finished, page = _in_thread(lambda: store.get(keys[1]))
        assert finished and page is None
        h = io.prefetch(keys)
        assert h.wait(timeout=10) and h.result() == [payload_for(keys[0])]
        assert store.stats()["errors"] >= 1 and store.health()["state"] == "online"  # a bad file, not a bad disk
        assert store.exists([keys[1]]) == [False]
        assert store.set(keys[1], payload_for(keys[1]))  # the page is written again over whatever was there
        assert store.get(keys[1]) == payload_for(keys[1])
    finally:
        for k in keys:
            _unblock_fifo(store._path(k))
        io.close(timeout=5)


def test_a_fifo_is_never_adopted_or_taken_for_a_stored_page(store):
    key = keys_for(1)[0]
    os.mkfifo(store._path(key))
    try:
        assert store.exists([key]) == [False] and store.stats()["files"] == 0
        assert store.set(key, payload_for(key))  # replaces the FIFO with the page file
        assert store.get(key) == payload_for(key)
    finally:
        _unblock_fifo(store._path(key))


class HangingStorage(GatedStorage):
    """In-memory storage whose get/set of the keys in ``hang`` block until ``release`` is set: a hung disk."""

    def __init__(self) -> None:
        super().__init__()
        self.hang: set[str] = set()
        self.release = threading.Event()

    def get(self, key):
        if key in self.hang:
            self.release.wait()
        return self.data.get(key)

    def set(self, key, payload):
        if key in self.hang:
            self.release.wait()
        self.data[key] = bytes(payload)
        return True


def _eventually(cond, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        threading.Event().wait(0.01)
    return cond()


def test_a_hung_read_or_write_is_abandoned_and_later_io_still_runs():
    storage = HangingStorage()
    keys = keys_for(4)
    for k in keys[:3]:
        storage.data[k] = payload_for(k)
    storage.hang = {keys[1], keys[3]}
    io = StorageIO(storage, io_timeout_s=0.3)
    try:
        h = io.prefetch(keys[:3])
        assert h.wait(timeout=10) and h.result() == [payload_for(keys[0])]  # the stuck page counts as a miss
        again = io.prefetch([keys[0], keys[2]])  # served by the replacement thread
        assert again.wait(timeout=10) and again.complete
        assert io.backup(keys[3], payload_for(keys[3]))  # this write hangs ...
        assert io.backup(keys[2], payload_for(keys[2]))  # ... and this one is still written after it
        assert io.flush(timeout=10)
        st = io.stats()
        assert st["io_timeouts"] == 2 and st["stuck_threads"] == 2 and st["backups_failed"] == 1
        assert st["backups_done"] == 1 and st["prefetches_partial"] == 1
        health = io.health()
        assert health["state"] == "degraded" and "did not finish within 0.3 s" in health["last_error"]
        assert io.stalled
        storage.release.set()  # the disk answers again: the stuck threads return and their results are dropped
        assert _eventually(lambda: io.stats()["stuck_threads"] == 0)
        assert io.prefetch([keys[0]]).wait(timeout=10)
        assert io.health()["state"] == "online" and not io.stalled
        assert h.result() == [payload_for(keys[0])]  # the late page was not added to the finished prefetch
    finally:
        storage.release.set()
        io.close(timeout=5)


def test_when_every_thread_is_stuck_l3_is_bypassed(monkeypatch):
    from tierlm.runtime.cache.storage import storage_io as sio_mod

    monkeypatch.setattr(sio_mod, "MAX_STUCK_THREADS", 1)
    storage = HangingStorage()
    keys = keys_for(3)
    storage.hang = set(keys)
    io = StorageIO(storage, io_timeout_s=0.2)
    try:
        for k in keys[:2]:  # the first stuck thread is replaced, the second is not
            assert io.prefetch([k]).wait(timeout=10)
        bypassed = io.prefetch([keys[2]])
        assert bypassed.done and bypassed.result() == []  # a miss at once instead of a queue nobody serves
        assert io.backup(keys[2], payload_for(keys[2])) is True  # the backup thread is fine
        st = io.stats()
        assert st["prefetches_bypassed"] == 1 and st["stuck_threads"] == 2
        storage.release.set()
        assert _eventually(lambda: io.stats()["stuck_threads"] == 0)
        assert io.prefetch([keys[0]]).wait(timeout=10)  # a returning thread rejoined the pool
    finally:
        storage.release.set()
        io.close(timeout=5)


def test_close_returns_within_seconds_while_workers_are_stuck():
    from tierlm.runtime.cache.hicache_manager import CLOSE_TIMEOUT_S

    storage = HangingStorage()
    keys = keys_for(3)
    storage.data[keys[0]] = payload_for(keys[0])
    storage.hang = set(keys)
    io = StorageIO(storage)  # the default time limit (10 s) is far away: the threads are simply busy
    try:
        io.backup(keys[1], payload_for(keys[1]))
        io.backup(keys[2], payload_for(keys[2]))
        h = io.prefetch(keys)
        assert _eventually(lambda: io.stats()["pending_writes"] == 2)
        finished, _ = _in_thread(lambda: io.close(flush=True, timeout=CLOSE_TIMEOUT_S), timeout=CLOSE_TIMEOUT_S + 2)
        assert finished and CLOSE_TIMEOUT_S <= 5
        assert h.done
    finally:
        storage.release.set()


def test_storage_io_bounds_the_write_backlog_by_default():
    from tierlm.runtime.cache.storage.storage_io import DEFAULT_MAX_PENDING_WRITE_BYTES

    io = StorageIO(GatedStorage())
    assert io.max_pending_write_bytes == DEFAULT_MAX_PENDING_WRITE_BYTES
    io.close()


def _disk_totals(s: FileKVStorage) -> tuple[int, int]:
    files = [p for p in s.dir.iterdir() if p.name.endswith(".kv")]
    return len(files), sum(p.stat().st_size for p in files)


def test_folder_deleted_while_serving_is_recreated_and_counters_match_the_disk(store):
    import shutil

    keys = keys_for(5)
    for k in keys[:3]:
        assert store.set(k, payload_for(k))
    shutil.rmtree(store.dir)
    assert store.get(keys[0]) is None  # a read finds the folder gone: forgets what it held
    assert store.exists(keys[:3]) == [False] * 3
    assert (store.stats()["files"], store.stats()["bytes"]) == (0, 0)
    shutil.rmtree(store.dir)  # and a write that finds it gone recreates it
    assert store.set(keys[3], payload_for(keys[3])) and store.set(keys[4], payload_for(keys[4]))
    assert json.loads((store.dir / NAMESPACE_FILE).read_text())["id"] == store.namespace.id
    st = store.stats()
    assert (st["files"], st["bytes"]) == _disk_totals(store) == (2, 2 * store.file_bytes)
    assert store.get(keys[4]) == payload_for(keys[4]) and store.health()["state"] == "online"
    shutil.rmtree(store.dir)
    assert store.clear() == 0 and store.dir.is_dir() and store.stats()["files"] == 0


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_leaves_nothing_behind_and_recovers(store, monkeypatch, err):
    keys = keys_for(3)
    assert store.set(keys[0], payload_for(keys[0]))
    inject_disk_fault(monkeypatch, err)
    assert store.set(keys[1], payload_for(keys[1])) is False
    assert store.set(keys[2], payload_for(keys[2])) is False
    assert sorted(p.name for p in store.dir.iterdir()) == sorted([NAMESPACE_FILE, f"{keys[0]}.kv"])  # no temp file
    st, health = store.stats(), store.health()
    assert st["errors"] == 2 and st["files"] == 1 and store.exists(keys[1:]) == [False, False]
    assert health["state"] == "degraded" and os.strerror(err) in health["last_error"]
    assert store.get(keys[0]) == payload_for(keys[0])  # what is stored is still served
    monkeypatch.undo()  # the disk has room / is writable again
    assert store.set(keys[1], payload_for(keys[1])) and store.get(keys[1]) == payload_for(keys[1])
    assert store.health() == {"state": "online", "last_error": health["last_error"]}


# --- the default size bound ---
def _free_space(monkeypatch, free: int) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * free + 1, 9 * free, free))


def test_default_bound_is_a_share_of_free_space_plus_what_is_stored(tmp_path, monkeypatch, caplog):
    _free_space(monkeypatch, 40 * 10**9)
    with caplog.at_level("INFO", logger=fs_mod.__name__):
        s = FileKVStorage.from_extra_config(make_ns(), PAGE_BYTES, {}, root_dir=tmp_path)
    assert s.max_size_bytes == 10 * 10**9  # a quarter of 40 GB
    assert "default rule" in caplog.text and "max_size_gb" in caplog.text
    keys = keys_for(3)
    for k in keys:
        s.set(k, payload_for(k))
    s.close()
    stored = 3 * s.file_bytes
    _free_space(monkeypatch, 0)  # a full disk evicts nothing that is already stored
    again = FileKVStorage.from_extra_config(make_ns(), PAGE_BYTES, {}, root_dir=tmp_path)
    assert again.max_size_bytes == stored and again.exists(keys) == [True] * 3
    _free_space(monkeypatch, 10**15)  # a huge shared filesystem: capped
    assert FileKVStorage.from_extra_config(make_ns(), PAGE_BYTES, {}, root_dir=tmp_path).max_size_bytes == 100 * 10**9
    explicit = FileKVStorage.from_extra_config(make_ns(), PAGE_BYTES, {"max_size_gb": 0.001}, root_dir=tmp_path)
    assert explicit.max_size_bytes == 1_000_000  # max_size_gb still overrides the rule
    _free_space(monkeypatch, 0)
    empty = FileKVStorage.from_extra_config(make_ns(model="other"), PAGE_BYTES, {}, root_dir=tmp_path)
    assert empty.max_size_bytes == empty.file_bytes  # never below one page
