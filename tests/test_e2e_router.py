"""Two real tierlm servers on stories260K behind sglang-router (--policy cache_aware), as docs/scale-out.md runs
them: the router discovers both workers (/server_info, /model_info), lists the name tierlm serves, the official
openai client and /generate get the reference greedy text through it, and prompts sharing a prefix go to the
worker that already holds it, so every one after the first reports cached tokens.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from conftest import STORIES_PROMPT, STORIES_TEXT
from e2e_server import ServerProcess, free_port, start_server

openai = pytest.importorskip("openai")
pytest.importorskip("sglang_router", reason="sglang-router is not installed: python -m pip install sglang-router")

pytestmark = pytest.mark.slow

# 47 tokens with the stories tokenizer: two full 16-token pages are shared by every prompt below.
SHARED_PREFIX = ("Once upon a time, there was a little dog named Max who liked to run in the big green park with his "
                 "friends every single day. One morning")
ENDINGS = [" he found a ball.", " it started to rain.", " his friend Sam came to play.", " the sun was hot."]


class RouterProcess:
    def __init__(self, worker_urls: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False, dir=log_dir)
        self.log_path = Path(self._log.name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--policy", "cache_aware", "--worker-urls", *worker_urls, "--log-level", "info"],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})

    def wait_workers(self, n: int, timeout: float = 30.0) -> list[dict]:
        """Until the router lists ``n`` healthy workers (GET /workers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                workers = httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
                if len(workers) == n and all(w["is_healthy"] for w in workers):
                    return workers
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"sglang-router did not register {n} workers in {timeout:.0f} s:\n"
                           f"{self.log_path.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def cluster(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess,
                                                                                         list[ServerProcess]]]:
    log_dir = tmp_path_factory.mktemp("e2e_router_logs")
    args = ["--model-path", str(stories_dir), "--skip-warmup", "--log-requests"]
    env = {"TIERLM_NO_PROGRESS": "1"}
    workers: list[ServerProcess] = []
    router = None
    try:
        workers = [start_server(args, env=env, wait=False, log_dir=log_dir) for _ in range(2)]
        for w in workers:  # both load in parallel
            w.wait_ready()
        router = RouterProcess([w.url for w in workers], log_dir)
        router.wait_workers(2)
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


def test_router_discovers_the_workers_under_the_served_name(cluster, stories_dir: Path) -> None:
    router, workers = cluster
    listed = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(w.url for w in workers)
    for w in listed:  # from /server_info's top-level fields and /model_info
        assert w["model_id"] == str(stories_dir)
        assert w["metadata"]["served_model_name"] == str(stories_dir)
        assert w["metadata"]["tp_size"] == "1" and w["metadata"]["dp_size"] == "1"
        assert w["metadata"]["architectures"] == '["LlamaForCausalLM"]'
    for w in workers:  # the router's requests passed the origin guard
        assert "origin_not_allowed" not in w.log_text() and "refused" not in w.log_text()


def test_openai_client_through_the_router(cluster) -> None:
    router, _ = cluster
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt=STORIES_PROMPT, max_tokens=40, temperature=0)
    assert resp.choices[0].text == STORIES_TEXT
    stream = client.completions.create(model=model, prompt=STORIES_PROMPT, max_tokens=40, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == STORIES_TEXT


def test_generate_through_the_router(cluster) -> None:
    router, _ = cluster
    r = httpx.post(f"{router.url}/generate", timeout=60, json={
        "text": STORIES_PROMPT, "sampling_params": {"max_new_tokens": 40, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == STORIES_TEXT


def test_cache_aware_sends_a_shared_prefix_to_the_same_worker(cluster) -> None:
    router, workers = cluster
    cached = []
    for ending in ENDINGS:
        r = httpx.post(f"{router.url}/generate", timeout=60, json={
            "text": SHARED_PREFIX + ending, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        cached.append(r.json()["meta_info"]["cached_tokens"])
    # The first computes the prefix on one worker; every later one lands on that worker and reuses its 2+ pages
    # (round-robin or random routing would send some to the other worker, whose cache lacks the prefix).
    assert all(c >= 32 for c in cached[1:]), cached
    # a worker logs a request's line as its response goes out: read the logs once every line is in (or 10 s passed)
    deadline = time.monotonic() + 10
    while True:
        served = [sum(SHARED_PREFIX[:40] in line for line in w.log_text().splitlines()) for w in workers]
        if sum(served) >= len(ENDINGS) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(served) == [0, len(ENDINGS)], served
