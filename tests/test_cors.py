"""CORS for --allowed-origins: preflights answered without a key, Access-Control-Allow-Origin on every answer to an
allowed origin (successes, errors from every layer, SSE streams), and origins not listed refused as before."""
from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.app import create_app

APP = "http://app.example:5173"
KEY = {"authorization": "Bearer k"}


def make_client(**args: Any) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(ServerArgs(model_path="fake/model", **args))
    return TestClient(create_app(engine), base_url=LOCAL), engine


def preflight(client: TestClient, origin: str, headers: str = "authorization, content-type",
              path: str = "/v1/completions", **extra: str) -> Any:
    return client.options(path, headers={"origin": origin, "access-control-request-method": "POST",
                                         "access-control-request-headers": headers, **extra})


def test_preflight_is_answered_without_the_api_key() -> None:
    client, engine = make_client(allowed_origins=[APP], api_key="k")
    r = preflight(client, APP, "authorization, content-type, x-stainless-os, x-stainless-retry-count")
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os", "x-stainless-retry-count"} <= allowed
    assert "origin" in r.headers["vary"].lower()
    assert engine.received == []


@pytest.mark.parametrize("headers", [
    "x-api-key, anthropic-version, anthropic-beta, anthropic-dangerous-direct-browser-access, content-type",
    "authorization, content-type, openai-beta, openai-organization, openai-project, x-stainless-lang",
])
def test_the_sdk_headers_are_allowed(headers: str) -> None:
    client, _ = make_client(allowed_origins=[APP])
    r = preflight(client, APP, headers)
    assert r.status_code == 204, r.text
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {h.strip() for h in headers.split(",")} <= allowed


def test_a_header_of_the_clients_own_is_allowed_for_a_listed_origin_only() -> None:
    # the origin is what the operator trusts; an SDK that adds a header must not break the page
    client, _ = make_client(allowed_origins=[APP])
    r = preflight(client, APP, "content-type, X-My-Tracing")
    assert r.status_code == 204, r.text
    assert "x-my-tracing" in {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    r = preflight(client, "http://evil.example", "content-type, x-my-tracing")
    assert r.status_code == 403
    assert "access-control-allow-origin" not in r.headers


def test_private_network_preflight_is_allowed_for_a_listed_origin() -> None:
    client, _ = make_client(allowed_origins=[APP])
    r = preflight(client, APP, **{"access-control-request-private-network": "true"})
    assert r.headers["access-control-allow-private-network"] == "true"
    assert "access-control-allow-private-network" not in preflight(client, APP).headers


def test_every_answer_to_an_allowed_origin_carries_the_header() -> None:
    client, _ = make_client(allowed_origins=[APP], api_key="k", max_request_bytes=4096)
    origin = {"origin": APP}
    answers = {
        "200": client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers={**origin, **KEY}),
        "401": client.post("/v1/completions", json={"prompt": "ab"}, headers=origin),
        "400": client.post("/v1/completions", json={"prompt": "ab", "max_tokens": -1}, headers={**origin, **KEY}),
        "404": client.get("/v1/nothing", headers={**origin, **KEY}),
        "413": client.post("/v1/completions", json={"prompt": "a" * 5000}, headers={**origin, **KEY}),
    }
    for status, r in answers.items():
        assert str(r.status_code) == status, (status, r.text)
        assert r.headers["access-control-allow-origin"] == APP, status
        assert "origin" in r.headers["vary"].lower(), status


def test_a_stream_carries_the_header() -> None:
    client, _ = make_client(allowed_origins=[APP])
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True},
                    headers={"origin": APP})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["access-control-allow-origin"] == APP
    assert r.text.rstrip().endswith("data: [DONE]")


def test_an_origin_not_listed_is_refused_as_before_and_gets_no_cors_headers() -> None:
    client, engine = make_client(allowed_origins=[APP])
    for r in (preflight(client, "http://evil.example"),
              client.post("/v1/completions", json={"prompt": "a"}, headers={"origin": "http://evil.example"})):
        err = assert_error(r, 403, contains="--allowed-origins")
        assert err["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in r.headers
    assert engine.received == []
    # same-origin and non-browser clients: no CORS headers, nothing changes
    plain = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_no_allowed_origins_means_no_cors() -> None:
    client, _ = make_client()
    assert_error(preflight(client, APP), 403)
    own = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"origin": LOCAL})
    assert own.status_code == 200 and "access-control-allow-origin" not in own.headers


def test_star_allows_any_origin() -> None:
    client, _ = make_client(allowed_origins=["*"])
    r = preflight(client, "http://anything.example:8080")
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "http://anything.example:8080"
    r = client.get("/v1/models", headers={"origin": "http://anything.example:8080"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://anything.example:8080"


def test_options_without_a_preflight_is_not_answered_as_one() -> None:
    client, _ = make_client(allowed_origins=[APP])
    r = client.options("/v1/completions", headers={"origin": APP})
    assert_error(r, 405)
    assert r.headers["access-control-allow-origin"] == APP
    assert "access-control-allow-methods" not in r.headers
