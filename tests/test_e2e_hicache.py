"""HiCache through real server processes on stories260K, with L3 files in temp folders: a prompt pushed out of
L1 comes back from host memory, a restarted server reads it from storage, two servers can share one folder,
/flush_cache?storage=true deletes the files, and an MLX server reads pages the torch server wrote.

Every hit must give exactly the cold run's text; the tier that served it must be the one the usage names.
"""
from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from conftest import STORIES_PROMPT, STORIES_TEXT
from e2e_server import ServerProcess, ServerStartError, start_server
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
# 68 tokens: 16 pages of 4 can come from a cache tier.
PROMPT_A = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
            "she saw a big, red ball. She wanted to play with it, but it was too high. She asked her mom")
# Distinct openings (no shared pages), each ~20 prompt + 40 new tokens: together far more than the 64-page L1.
FILLERS = [
    "Tom had a dog named Max. Every day they went to the river and",
    "The little bird sat in its nest high up in the tall tree and",
    "Sara wanted a new doll for her birthday, so she asked her dad",
    "A big truck drove down the road. It was full of apples and",
    "Ben liked to draw pictures of the sea with his blue crayons. One",
    "In the garden there was a small frog who could not jump very",
]
# Small pools, so the first few requests already push a prompt down the tiers.
HICACHE_ARGS = ["--skip-warmup", "--enable-hierarchical-cache", "--hicache-ratio", "4",
                "--hicache-storage-backend", "file", "--page-size", "4", "--max-total-tokens", "256"]


# ------------------------------------------------------------------ helpers

def hicache_server(model_dir: Path, storage_dir: Path, log_dir: Path, *extra: str, wait: bool = True,
                   env: dict[str, str] | None = None) -> ServerProcess:
    return start_server(["--model-path", str(model_dir), *HICACHE_ARGS, *extra],
                        env={STORAGE_DIR_ENV: str(storage_dir), "TIERLM_NO_PROGRESS": "1", **(env or {})},
                        log_dir=log_dir, wait=wait)


def complete(server: ServerProcess, prompt: str, max_tokens: int = 16) -> tuple[str, dict[str, int]]:
    """Greedy completion -> (text, cached tokens per tier), checking the usage fields add up."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["usage"]["prompt_tokens_details"]
    tiers = details["cached_tokens_details"]
    assert sum(tiers.values()) == details["cached_tokens"], details
    return body["choices"][0]["text"], tiers


def metric(server: ServerProcess, sample_name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def kv_files(storage_dir: Path) -> list[Path]:
    return sorted(storage_dir.rglob("*.kv"))


def temp_files(storage_dir: Path) -> list[Path]:
    return sorted(storage_dir.rglob(".tmp-*"))


def stop_cleanly(server: ServerProcess) -> None:
    server.stop()
    log = server.log_text()
    assert "Traceback" not in log, log


# ------------------------------------------------------------------ first server: host tier, files written

@dataclass
class FirstRun:
    storage_dir: Path
    snapshot_dir: Path  # a copy of the folder as the first server left it, for tests that must not see changes
    cold_a: str
    warm_a: str
    warm_a_tiers: dict[str, int]
    story_text: str
    host_hit_metric: float
    loaded_host_tokens: float


@pytest.fixture(scope="module")
def first_run(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    """One torch server: A cold, fillers push A out of L1, A again; then it stops and its folder is kept."""
    root = tmp_path_factory.mktemp("hicache_first")
    storage_dir = root / "l3"
    with hicache_server(stories_dir, storage_dir, root) as server:
        cold_a, cold_tiers = complete(server, PROMPT_A)
        assert cold_tiers == {"device": 0, "host": 0, "storage": 0}
        for filler in FILLERS:
            complete(server, filler, max_tokens=40)
        warm_a, warm_tiers = complete(server, PROMPT_A)
        story_text, _ = complete(server, STORIES_PROMPT, max_tokens=40)
        host_hits = metric(server, "tierlm_cache_hit_tokens_total", tier="host")
        loaded_host = metric(server, "tierlm_hicache_loaded_host_tokens_total")
        assert metric(server, "tierlm_hicache_storage_errors_total") == 0
    stop_cleanly(server)
    snapshot = root / "snapshot"
    shutil.copytree(storage_dir, snapshot)
    return FirstRun(storage_dir, snapshot, cold_a, warm_a, warm_tiers, story_text, host_hits, loaded_host)


def test_prompt_pushed_out_of_device_comes_back_from_host(first_run: FirstRun) -> None:
    assert first_run.warm_a_tiers["host"] > 0, first_run.warm_a_tiers
    assert first_run.warm_a == first_run.cold_a
    assert first_run.host_hit_metric == first_run.warm_a_tiers["host"]
    assert first_run.loaded_host_tokens >= first_run.warm_a_tiers["host"]
    assert first_run.story_text == STORIES_TEXT


def test_first_server_leaves_page_files_and_no_temp_files(first_run: FirstRun) -> None:
    assert len(kv_files(first_run.storage_dir)) > 0
    assert temp_files(first_run.storage_dir) == []


# ------------------------------------------------------------------ restart: storage tier

@pytest.fixture(scope="module")
def restarted(first_run: FirstRun, stories_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("hicache_restart_logs")
    with hicache_server(stories_dir, first_run.storage_dir, log_dir,
                        "--hicache-storage-prefetch-policy", "wait_complete") as server:
        yield server


def test_restarted_server_reads_prompt_from_storage(first_run: FirstRun, restarted: ServerProcess) -> None:
    text, tiers = complete(restarted, PROMPT_A)
    assert tiers["storage"] > 0, tiers
    assert tiers["device"] == tiers["host"] == 0  # nothing else could have held it after a restart
    assert text == first_run.cold_a
    assert metric(restarted, "tierlm_cache_hit_tokens_total", tier="storage") >= tiers["storage"]
    assert metric(restarted, "tierlm_hicache_storage_bytes_read_total") > 0
    assert metric(restarted, "tierlm_hicache_storage_errors_total") == 0


def test_flush_cache_with_storage_removes_the_files(first_run: FirstRun, restarted: ServerProcess) -> None:
    complete(restarted, PROMPT_A)  # whatever ran before, A's pages are in every tier now
    assert len(kv_files(first_run.storage_dir)) > 0
    r = httpx.post(f"{restarted.url}/flush_cache", params={"storage": "true"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    assert kv_files(first_run.storage_dir) == []
    assert httpx.get(f"{restarted.url}/server_info").json()["tiers"]["storage"]["files"] == 0
    text, tiers = complete(restarted, PROMPT_A)
    assert tiers == {"device": 0, "host": 0, "storage": 0}  # L1 and L2 were flushed too
    assert text == first_run.cold_a


# ------------------------------------------------------------------ two writers on one folder

SHARED_PROMPT = PROMPT_A
OWN_PROMPTS = (
    "The old man walked slowly to the shop. He wanted to buy some bread and milk for his cat, who was very hungry",
    "Anna and her brother built a tall castle of sand on the beach. Then a big wave came and washed it away, so",
)


def test_two_servers_share_one_folder_then_a_third_reads_it(stories_dir: Path, tmp_path: Path) -> None:
    storage_dir = tmp_path / "l3"
    writers = [hicache_server(stories_dir, storage_dir, tmp_path, wait=False) for _ in range(2)]
    try:
        for w in writers:
            w.wait_ready(120)
        results: dict[tuple[int, str], str] = {}
        hits: dict[tuple[int, str], dict[str, int]] = {}
        failures: list[BaseException] = []

        def drive(i: int, prompt: str) -> None:
            try:
                results[(i, prompt)], hits[(i, prompt)] = complete(writers[i], prompt)
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                failures.append(e)

        threads = [threading.Thread(target=drive, args=(i, p))
                   for i in range(2) for p in (SHARED_PROMPT, OWN_PROMPTS[i])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        cold = {"device": 0, "host": 0, "storage": 0}
        # A writer may find the shared prompt's pages the other one just stored; both cannot (one came first).
        assert cold in (hits[(0, SHARED_PROMPT)], hits[(1, SHARED_PROMPT)]), hits
        assert hits[(0, OWN_PROMPTS[0])] == hits[(1, OWN_PROMPTS[1])] == cold, hits
        assert results[(0, SHARED_PROMPT)] == results[(1, SHARED_PROMPT)]
        for w in writers:
            assert metric(w, "tierlm_hicache_storage_errors_total") == 0
            io = httpx.get(f"{w.url}/server_info").json()["tiers"]["storage"]["io"]
            assert io["backups_failed"] == 0 and io["backups_dropped"] == 0, io
    finally:
        for w in writers:
            w.stop()
    for w in writers:
        stop_cleanly(w)
    assert temp_files(storage_dir) == []
    assert len(kv_files(storage_dir)) > 0

    with hicache_server(stories_dir, storage_dir, tmp_path, "--hicache-storage-prefetch-policy",
                        "wait_complete") as reader:
        expected = {SHARED_PROMPT: results[(0, SHARED_PROMPT)], OWN_PROMPTS[0]: results[(0, OWN_PROMPTS[0])],
                    OWN_PROMPTS[1]: results[(1, OWN_PROMPTS[1])]}
        for prompt, cold_text in expected.items():
            text, tiers = complete(reader, prompt)
            assert tiers["storage"] > 0, (prompt, tiers)
            assert text == cold_text, prompt
        assert metric(reader, "tierlm_hicache_storage_errors_total") == 0
        assert metric(reader, "tierlm_hicache_storage_misses_total") == 0
    stop_cleanly(reader)
    assert temp_files(storage_dir) == []


# ------------------------------------------------------------------ MLX backend

@pytest.fixture(scope="module")
def mlx_server(first_run: FirstRun, stories_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    """Only the ``mlx``-marked tests below use it (conftest skips them where mlx does not import)."""
    root = tmp_path_factory.mktemp("hicache_mlx")
    storage_dir = root / "l3"
    shutil.copytree(first_run.snapshot_dir, storage_dir)  # pages the torch server wrote
    try:
        server = hicache_server(stories_dir, storage_dir, root, "--hicache-storage-prefetch-policy",
                                "wait_complete", env={"SGLANG_USE_MLX": "1"})
    except ServerStartError as e:
        pytest.fail(f"the MLX server did not start: {e}")
    with server:
        yield server


@pytest.mark.mlx
def test_mlx_server_gives_the_torch_server_text(first_run: FirstRun, mlx_server: ServerProcess) -> None:
    assert httpx.get(f"{mlx_server.url}/server_info").json()["backend"] == "mlx"
    text, _ = complete(mlx_server, STORIES_PROMPT, max_tokens=40)
    assert text == first_run.story_text == STORIES_TEXT


@pytest.mark.mlx
def test_mlx_server_reads_pages_the_torch_server_stored(first_run: FirstRun, mlx_server: ServerProcess) -> None:
    text, tiers = complete(mlx_server, PROMPT_A)
    assert tiers["storage"] > 0, tiers
    assert text == first_run.cold_a
    assert metric(mlx_server, "tierlm_hicache_storage_errors_total") == 0


# ------------------------------------------------------------------ a misbehaving disk

def test_fifos_in_place_of_page_files_never_hang_the_server(stories_dir: Path, tmp_path: Path) -> None:
    """wait_complete + page files swapped for FIFOs (a read of one blocks forever): the request still completes
    with the cold text, /health_generate answers, and SIGTERM stops the server in seconds."""
    import os
    import signal
    import time

    storage_dir = tmp_path / "l3"
    server = hicache_server(stories_dir, storage_dir, tmp_path, "--hicache-storage-prefetch-policy", "wait_complete")
    fifos: list[Path] = []
    try:
        cold, _ = complete(server, PROMPT_A)
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/server_info").json()["tiers"]["storage"]["io"]["pending_writes"]:
            assert time.monotonic() < deadline, "L3 writes did not finish"
            time.sleep(0.1)
        assert httpx.post(f"{server.url}/flush_cache", timeout=30).json()["success"] is True  # L1 + L2 only
        for f in kv_files(storage_dir):
            f.unlink()
            os.mkfifo(f)
            fifos.append(f)
        assert fifos
        text, tiers = complete(server, PROMPT_A)
        assert text == cold and tiers["storage"] == 0
        assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200
        assert metric(server, "tierlm_hicache_storage_errors_total") >= 1
        assert metric(server, "tierlm_hicache_storage_online") == 1  # damaged files, not a damaged disk
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=30)
        assert time.monotonic() - t0 < 10.0
    finally:
        for f in fifos:  # unblock any reader stuck on a FIFO (only code without the fix opens them)
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        server.stop()
    assert "Traceback" not in server.log_text()
