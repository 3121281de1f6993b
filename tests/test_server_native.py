"""HTTP layer: SGLang-native /generate and the info/admin routes against a fake engine."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error, sse_events
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.app import create_app


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine), base_url=LOCAL)


def test_generate_text(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == "abca"
    assert body["output_ids"] == [ord(c) for c in "abca"]
    meta = body["meta_info"]
    assert meta["id"] == engine.received[0].rid
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert engine.received[0].sampling_params.temperature == 0.0


def test_generate_defaults_follow_sampling_params(client: TestClient, engine: FakeEngine) -> None:
    client.post("/generate", json={"input_ids": [97, 98]})
    assert engine.received[0].sampling_params.max_new_tokens == 128  # SGLang's default
    assert engine.received[0].input_ids == [97, 98]


def test_generate_stop_reports_matched(client: TestClient) -> None:
    r = client.post("/generate", json={"text": "abcd", "sampling_params": {"max_new_tokens": 9, "stop": "c"}})
    assert r.json()["text"] == "ab"
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": "c"}


def test_generate_batch_and_rids(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/generate", json={"text": ["ab", "xyz"], "rid": ["r1", "r2"], "sampling_params": {"max_new_tokens": 2}})
    assert [o["text"] for o in r.json()] == ["ab", "xy"]
    assert [o["meta_info"]["id"] for o in r.json()] == ["r1", "r2"]
    r = client.post("/generate", json={"input_ids": [[97], [98, 99]], "sampling_params": {"max_new_tokens": 1}})
    assert [o["text"] for o in r.json()] == ["a", "b"]


def test_generate_stream_is_cumulative(client: TestClient) -> None:
    r = client.post("/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 3}, "stream": True})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert texts[:3] == ["a", "ab", "abc"]
    assert events[-2]["output_ids"] == [97, 98, 99]
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_generate_request_errors(client: TestClient) -> None:
    r = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_token": 3}})
    assert_error(r, 400, param="sampling_params.max_new_token", contains="unknown field")
    assert_error(client.post("/generate", json={"text": "a", "input_ids": [1]}), 400, contains="exactly one")
    assert_error(client.post("/generate", json={}), 400, contains="exactly one")
    assert_error(client.post("/generate", json={"text": ["a", "b"], "stream": True}), 400, param="stream")
    assert_error(client.post("/generate", json={"text": "a", "sampling_params": {"top_k": -5}}), 400,
                 param="sampling_params.top_k")
    assert_error(client.post("/generate", json={"text": ""}), 400, contains="empty")
    assert_error(client.post("/generate", json={"text": "a", "return_logprob": True, "top_logprobs_num": 21}), 400,
                 param="top_logprobs_num")
    assert_error(client.post("/generate", json={"text": "a", "return_logprob": True, "logprob_start_len": -2}), 400,
                 param="logprob_start_len")


def test_models_list_and_retrieve(client: TestClient) -> None:
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data["data"]] == [("fake/model", "model", 4096)]
    assert client.get("/v1/models/fake/model").json()["id"] == "fake/model"
    assert_error(client.get("/v1/models/other"), 404, param="model")


def test_served_model_name_is_used_everywhere() -> None:
    client = TestClient(create_app(FakeEngine(ServerArgs(model_path="/m", served_model_name="mine"))), base_url=LOCAL)
    assert client.get("/v1/models").json()["data"][0]["id"] == "mine"
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).json()["model"] == "mine"
    assert client.get("/get_model_info").json()["model_path"] == "/m"


def test_server_info_flush_and_metrics(client: TestClient, engine: FakeEngine) -> None:
    assert client.get("/server_info").json()["backend"] == "fake"
    assert client.get("/get_server_info").status_code == 200
    assert client.post("/flush_cache").json()["success"] is True
    assert client.post("/flush_cache?storage=true").status_code == 200
    assert engine.flushed == [False, True]
    engine.flush_result = False
    assert_error(client.post("/flush_cache"), 400, contains="retry")
    m = client.get("/metrics")
    assert m.status_code == 200
    assert m.headers["content-type"].startswith("text/plain")
    assert b"tierlm_requests_total 3.0" in m.content


def test_health_generate(client: TestClient, engine: FakeEngine) -> None:
    assert client.get("/health_generate").status_code == 200
    assert engine.received[-1].sampling_params.max_new_tokens == 1
    engine.ready = False
    assert client.get("/health_generate").status_code == 503


@pytest.mark.parametrize("rid", ["a\nINFO forged line", "tab\there", "", "x" * 257, ["ok", "cr\rlf"]])
def test_a_rid_that_could_forge_log_lines_is_a_400(client: TestClient, engine: FakeEngine, rid) -> None:
    # rids are written into the scheduler's log lines: a newline in one would let a client write lines of its own
    r = client.post("/generate", json={"text": ["ab", "xy"] if isinstance(rid, list) else "ab", "rid": rid,
                                       "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400, r.text
    assert "rid" in r.text
    assert not engine.received
