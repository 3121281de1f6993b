"""Helpers for HTTP-layer tests: parse SSE bodies, check OpenAI-shaped errors."""
from __future__ import annotations

import json
from typing import Any

# TestClient's default Host ("testserver") is not a name of this machine: the origin guard would refuse it.
LOCAL = "http://localhost"


def sse_events(resp: Any) -> list[Any]:
    """Parse an SSE body into JSON payloads, with the '[DONE]' terminator kept as the string."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp: Any, status: int, *, param: str | None = None, contains: str = "") -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert contains.lower() in err["message"].lower()
    if param is not None:
        assert err["param"] == param
    return err
