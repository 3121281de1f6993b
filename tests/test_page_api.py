"""GET /tiers (the page's one JSON endpoint, also for scripts) and the page's static files at /: against a real
server with all three tiers (occupancy, prompt tokens per tier matching the responses' usage and /metrics, the
history, /flush_cache), and against the fake engine for keys, errors and the files themselves."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from e2e_server import ServerProcess, start_server
from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.api.native.tiers import HISTORY_WINDOW_S, CounterHistory
from tierlm.server.app import create_app

PAGE = Path(__file__).resolve().parents[1] / "server" / "http" / "page"
# 40+ tokens: two full 16-token pages of KV to reuse
PROMPT = ("Once upon a time there was a little dog named Max who liked to run in the park with his friends every "
          "day, and one day he found a red ball.")


# ------------------------------------------------------------------ a real server, three tiers


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    l3 = tmp_path_factory.mktemp("tiers_l3")
    with start_server(["--skip-warmup", "--enable-hierarchical-cache", "--hicache-ratio", "2",
                       "--hicache-storage-backend", "file"],
                      env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(l3), "TIERLM_NO_PROGRESS": "1"},
                      log_dir=tmp_path_factory.mktemp("tiers_logs")) as s:
        yield s


def _tiers(server: ServerProcess) -> dict:
    r = httpx.get(f"{server.url}/tiers", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(server: ServerProcess) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "stories260K", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _hit_metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {s.labels["tier"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "tierlm_cache_hit_tokens_total"}


@pytest.mark.slow
def test_tiers_counts_each_prompt_token_where_its_kv_came_from(server: ServerProcess) -> None:
    before = _tiers(server)
    assert before["model"] == "stories260K"
    time.sleep(1.1)  # the history samples at most once a second: the requests below land in a new interval
    usages = [_complete(server) for _ in range(2)]
    after = _tiers(server)
    assert usages[1]["prompt_tokens_details"]["cached_tokens_details"]["device"] >= 32  # the repeat hit L1
    delta = {k: after["prompt_tokens"][k] - before["prompt_tokens"][k] for k in after["prompt_tokens"]}
    for tier in ("device", "host", "storage"):
        assert delta[tier] == sum(u["prompt_tokens_details"]["cached_tokens_details"][tier] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert delta["prompt"] == sum(u["prompt_tokens"] for u in usages)
    assert delta["computed"] == delta["prompt"] - cached
    assert _hit_metrics(server) == {t: float(after["prompt_tokens"][t]) for t in ("device", "host", "storage")}
    last = after["history"]["intervals"][-1]  # the interval since `before`'s sample holds exactly these requests
    assert {k: last[k] for k in ("device", "host", "storage", "computed")} == {
        k: float(delta[k]) for k in ("device", "host", "storage", "computed")}
    assert after["history"]["window_s"] == HISTORY_WINDOW_S
    assert after["requests"]["finished"] - before["requests"]["finished"] == 2
    assert after["requests"]["running"] == 0 and after["requests"]["waiting"] == 0


@pytest.mark.slow
def test_tiers_occupancy_adds_up_and_flush_empties_the_cache(server: ServerProcess) -> None:
    _complete(server)
    data = _tiers(server)
    for name in ("device", "host"):
        tier = data["tiers"][name]
        assert tier["enabled"]
        assert tier["used_pages"] + tier["cached_pages"] + tier["free_pages"] == tier["total_pages"] > 0
        assert tier["total_bytes"] == tier["total_pages"] * tier["bytes_per_page"] > 0
        assert tier["cached_bytes"] == tier["cached_pages"] * tier["bytes_per_page"]
    assert data["tiers"]["device"]["cached_pages"] >= 2  # the prompt's two full pages stay cached after it ends
    assert data["tiers"]["device"]["bytes_per_page"] == 16 * 1280  # stories260K: 1280 KV bytes per token, float32
    storage = data["tiers"]["storage"]
    assert storage["enabled"] and storage["backend"] == "file" and storage["state"] == "online"
    assert set(data["queues"]) >= {"prefetch_pages", "prefetches_in_flight", "write_back_pending"}
    pins = data["pins"]  # nothing pinned here (no cache_control), but the bound is there per memory tier
    assert pins["prefixes"] == 0 and set(pins["tiers"]) == {"device", "host"}
    assert pins["tiers"]["device"]["limit_pages"] > 0
    machine = data["machine"]
    assert (machine["backend"], machine["dtype"], machine["context_length"]) == ("torch", "float32", 512)
    assert machine["backend_decision"]["reasons"] and machine["chat_template"]
    assert httpx.post(f"{server.url}/flush_cache").status_code == 200
    flushed = _tiers(server)["tiers"]
    assert flushed["device"]["cached_pages"] == 0 and flushed["host"]["cached_pages"] == 0
    assert flushed["device"]["free_pages"] == flushed["device"]["total_pages"]


# ------------------------------------------------------------------ the fake engine: keys, errors, files


def _client(**args) -> TestClient:
    return TestClient(create_app(FakeEngine(ServerArgs(model_path="fake/model", **args))), base_url=LOCAL)


def test_tiers_of_a_bare_engine_reports_the_missing_tiers_as_off() -> None:
    body = _client().get("/tiers").json()
    assert body["tiers"]["host"] == {"enabled": False} and body["tiers"]["storage"] == {"enabled": False}
    assert body["prompt_tokens"] == {"device": 0, "host": 0, "storage": 0, "computed": 0, "prompt": 0}
    assert body["model"] == "fake/model" and body["history"]["intervals"] == []


def test_tiers_answers_503_while_the_model_loads() -> None:
    client = TestClient(create_app(FakeEngine(ready=False)), base_url=LOCAL)
    assert_error(client.get("/tiers"), 503, contains="loading")


def test_the_page_is_open_and_its_data_needs_the_key() -> None:
    client = _client(api_key="sekret")
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.text == (PAGE / "index.html").read_text()
    head = client.head("/")  # Claude Code probes the server this way at every start
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"].startswith("text/html")
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = client.get(f"/page/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert r.text == (PAGE / name).read_text()
    assert_error(client.get("/tiers"), 401, contains="api key")
    assert client.get("/tiers", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_only_the_page_files_are_served() -> None:
    client = _client()
    for name in ("index.html", "..%2F..%2Fpyproject.toml", "missing.js"):
        assert_error(client.get(f"/page/{name}"), 404)


def test_the_page_loads_nothing_from_elsewhere() -> None:
    for name in ("index.html", "app.js", "style.css"):
        text = (PAGE / name).read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text, name
        assert "@import" not in text and "<style" not in text, name


def test_history_keeps_one_sample_a_second_for_the_window() -> None:
    h = CounterHistory()
    zeros = {"device": 0.0, "host": 0.0, "storage": 0.0, "computed": 0.0}
    h.record(100.0, zeros)
    h.record(100.5, {**zeros, "device": 99.0})  # under a second later: not a new sample
    h.record(102.0, {**zeros, "device": 16.0, "computed": 4.0})
    assert h.intervals() == [{"t": 102.0, "seconds": 2.0, "device": 16.0, "host": 0.0, "storage": 0.0,
                              "computed": 4.0}]
    h.record(102.0 + HISTORY_WINDOW_S + 10, {**zeros, "device": 20.0, "computed": 4.0})
    rows = h.intervals()  # the first interval ended before the window: dropped
    assert [r["device"] for r in rows] == [4.0] and rows[0]["seconds"] == HISTORY_WINDOW_S + 10
