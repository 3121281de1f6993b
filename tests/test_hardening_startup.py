"""Startup that cannot hang (issue #33): every startup read of the L3 folder runs under the tier's I/O time limit.

A FIFO in place of namespace.json blocks whoever opens it for reading until a writer appears: the stand-in for a
hung disk or network filesystem. The store, and a real server over it, must start with L3 offline (saying why),
serve, come online once the folder answers, and exit on SIGTERM with the open still stuck in the kernel.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from e2e_server import start_server
from storage_helpers import get_all, set_all

from tierlm.runtime.cache.storage.stores.file.storage import NAMESPACE_FILE, FileKVStorage
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.cache.storage.page_keys import page_keys

PAGE_BYTES = 256
NS = StorageNamespace.from_fields({
    "model": "fp-startup", "dtype": "float32", "page_size": 4, "layout": "page_first", "num_layers": 2,
    "num_kv_heads": 2, "head_dim": 8, "backend_layout": "torch:layer,kv,token,head,dim"})
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def fifo_namespace_file(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / NAMESPACE_FILE
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


def unblock(fifo: Path, timeout: float = 30.0) -> bool:
    """Open ``fifo`` for writing and close it: a reader stuck opening it gets end of file. False if no reader
    came within ``timeout`` (opening a FIFO for writing without a reader fails with ENXIO)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return True
        except OSError:
            time.sleep(0.05)
    return False


def eventually(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_folder_that_does_not_answer_starts_the_store_offline_then_it_comes_online(tmp_path):
    fifo = fifo_namespace_file(tmp_path / NS.folder_name)
    opened: list[FileKVStorage] = []
    t = threading.Thread(target=lambda: opened.append(FileKVStorage(tmp_path, NS, PAGE_BYTES, startup_timeout_s=0.3,
                                                                    retry_interval_s=0.1)), daemon=True)
    t.start()
    t.join(30)
    try:
        assert opened, "the store's constructor blocked on the folder"
        store = opened[0]
        health = store.health()
        assert health["state"] == "degraded"
        assert "did not open within 0.3 s" in health["last_error"] and NAMESPACE_FILE in health["last_error"]
        keys = page_keys(list(range(8)), 4)
        assert store.known(keys) == [False, False]
        assert store.get(keys[0]) is None and store.exists(keys) == [False, False]
        assert set_all(store, keys, [bytes([i]) * PAGE_BYTES for i in range(2)]) == [False, False]
        assert unblock(fifo)  # the folder answers: the open that was waiting finishes
        assert eventually(lambda: store.health()["state"] == "online")
        assert json.loads((tmp_path / NS.folder_name / NAMESPACE_FILE).read_text())["id"] == NS.id
        assert set_all(store, keys, [bytes([i]) * PAGE_BYTES for i in range(2)]) == [True, True]
        assert get_all(store, keys) == [bytes([i]) * PAGE_BYTES for i in range(2)]
        store.close()
    finally:
        unblock(fifo, timeout=0)


def test_a_write_stuck_in_the_kernel_does_not_keep_the_process_alive(tmp_path):
    """A page write blocked in open() on a FIFO nobody reads: the I/O thread is abandoned and the process exits."""
    fifo = tmp_path / "stuck"
    os.mkfifo(fifo)
    script = f"""
import sys, threading
sys.path.insert(0, {str(Path(__file__).parent)!r})
from memory_storage import MemoryStorage
from tierlm.runtime.cache.hicache_manager import CLOSE_TIMEOUT_S
from tierlm.runtime.cache.storage.storage_io import StorageIO

class Stuck(MemoryStorage):
    def set(self, key, payload):
        open({str(fifo)!r}, "wb").write(bytes(payload))  # blocks in the kernel: no reader, ever
        return True

io = StorageIO(Stuck(), io_timeout_s=30)
io.backup("0" * 64, b"x" * 16)
io.close(flush=True, timeout=CLOSE_TIMEOUT_S)
print("closed", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the process did not exit with a write stuck in the kernel")
    finally:
        unblock(fifo, timeout=0)
    assert proc.returncode == 0, out
    assert "closed" in out and "still inside storage calls at shutdown" in out


@pytest.mark.slow
def test_server_with_a_hung_l3_folder_starts_serves_and_exits(stories_dir: Path, tmp_path: Path) -> None:
    """A real server whose L3 namespace.json is a FIFO: ready with L3 offline (/server_info says why), serves,
    brings L3 online when the folder answers; a second one stops on SIGTERM with its open still stuck."""
    storage = tmp_path / "l3"
    args = ["--model-path", str(stories_dir), "--skip-warmup", "--enable-hierarchical-cache",
            "--hicache-storage-backend", "file", "--page-size", "4", "--max-total-tokens", "256",
            "--hicache-storage-backend-extra-config", json.dumps({"io_timeout": 1})]
    env = {STORAGE_DIR_ENV: str(storage), "TIERLM_NO_PROGRESS": "1"}
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    with start_server(args, env=env, log_dir=tmp_path, timeout=120) as first:  # creates the namespace folder
        cold = httpx.post(f"{first.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    (folder,) = [p for p in storage.iterdir() if p.is_dir()]
    fifo = fifo_namespace_file(folder)
    try:
        with start_server(args, env=env, log_dir=tmp_path, timeout=120) as server:
            st = httpx.get(f"{server.url}/server_info", timeout=10).json()["tiers"]["storage"]
            assert st["state"] == "degraded" and "did not open within 1 s" in st["last_error"], st
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == cold
            assert unblock(fifo)
            assert eventually(lambda: httpx.get(f"{server.url}/server_info", timeout=10).json()
                              ["tiers"]["storage"]["state"] == "online")
            assert "the folder opened after startup" in server.log_text()
        fifo = fifo_namespace_file(folder)
        server = start_server(args, env=env, log_dir=tmp_path, timeout=120)
        try:
            assert httpx.get(f"{server.url}/server_info", timeout=10).json()["tiers"]["storage"]["state"] == "degraded"
            server.proc.send_signal(signal.SIGTERM)
            # uvicorn re-raises SIGTERM once it has shut down: the status is the signal's, or 0
            assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        finally:
            server.stop()
        assert "Traceback" not in server.log_text()
    finally:
        unblock(fifo, timeout=0)
