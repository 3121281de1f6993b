"""/tokenize, /detokenize (vLLM/SGLang shapes), /get_load, /version: with FakeEngine and one real engine."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fake_engine import VOCAB_SIZE, FakeEngine
from http_helpers import LOCAL, assert_error
from tierlm.server.app import create_app


@pytest.fixture
def client() -> TestClient:
    return TestClient(create_app(FakeEngine()), base_url=LOCAL)


def test_tokenize_text_and_messages(client: TestClient) -> None:
    r = client.post("/tokenize", json={"model": "default", "prompt": "hi!"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [ord("h"), ord("i"), ord("!")] and body["count"] == 3
    assert isinstance(body["max_model_len"], int) and body["max_model_len"] > 0
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "yo"}]})
    assert r.status_code == 200, r.text
    assert "".join(chr(t) for t in r.json()["tokens"]) == "<user>yo<assistant>"


def test_tokenize_errors(client: TestClient) -> None:
    assert_error(client.post("/tokenize", json={}), 400, param="prompt")
    assert_error(client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
                 400, param="prompt")
    assert_error(client.post("/tokenize", json={"model": "nope", "prompt": "a"}), 404, param="model")
    lone_surrogate = b'{"prompt": "a\\ud800"}'
    assert_error(client.post("/tokenize", content=lone_surrogate, headers={"content-type": "application/json"}),
                 400, param="prompt")


def test_tokenize_sglang_paths_and_lists(client: TestClient) -> None:
    """SGLang's shapes: /v1/tokenize, a list of texts -> a list of id lists and of counts."""
    r = client.post("/v1/tokenize", json={"prompt": ["hi", "abc"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [[ord("h"), ord("i")], [ord("a"), ord("b"), ord("c")]] and body["count"] == [2, 3]
    assert client.post("/v1/tokenize", json={"prompt": "hi"}).json()["count"] == 2
    r = client.post("/v1/detokenize", json={"tokens": [[ord("o"), ord("k")], [ord("!")]]})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": ["ok", "!"], "prompt": ["ok", "!"]}
    assert_error(client.post("/v1/detokenize", json={"tokens": [[65], [VOCAB_SIZE]]}), 400, param="tokens[1]")
    assert client.post("/detokenize", json={"tokens": []}).json() == {"text": "", "prompt": ""}


def test_detokenize_round_trip_and_vocabulary(client: TestClient) -> None:
    r = client.post("/detokenize", json={"tokens": [ord(c) for c in "héllo"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "héllo", "prompt": "héllo"}  # SGLang's key and vLLM's
    assert_error(client.post("/detokenize", json={"tokens": [65, VOCAB_SIZE]}), 400, param="tokens",
                 contains="outside the vocabulary")
    assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens")
    assert_error(client.post("/detokenize", json={"tokens": "abc"}), 400)


def test_get_load_and_version(client: TestClient) -> None:
    r = client.get("/get_load")
    assert r.status_code == 200
    (load,) = r.json()
    assert isinstance(load.pop("ts_tic"), float)  # SGLang's time.perf_counter() stamp
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "num_pending_tokens": 0}
    r = client.get("/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str)


def test_endpoints_with_a_real_engine(tiny_llama) -> None:
    from engine_harness import start_engine

    engine = start_engine(tiny_llama)
    try:
        c = TestClient(create_app(engine), base_url=LOCAL)
        with c:
            ids = c.post("/tokenize", json={"prompt": "Once upon a time"}).json()
            assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == engine.context_length
            assert ids["tokens"] == list(engine.tokenizer.encode("Once upon a time"))
            text = c.post("/detokenize", json={"tokens": ids["tokens"]}).json()["text"]
            assert text == engine.tokenizer.decode(ids["tokens"], skip_special_tokens=True)
            raw = c.post("/detokenize", json={"tokens": ids["tokens"], "skip_special_tokens": False}).json()
            assert raw["text"] == raw["prompt"] == engine.tokenizer.decode(ids["tokens"])
            vocab = engine.parts.model_info.vocab_size
            assert_error(c.post("/detokenize", json={"tokens": [vocab]}), 400, param="tokens")
            (load,) = c.get("/get_load").json()
            assert load.pop("ts_tic") > 0
            assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0,
                            "num_pending_tokens": 0}
    finally:
        engine.shutdown()
