"""The replay's HTTP client (httpx, streamed, as the other benches): one request sent as the client sends it, timed
and read back.

TTFT is the time to the first content delta: Anthropic's first ``content_block_delta`` of any kind (text, thinking,
a tool call's JSON; not ``message_start``, which a server may send before the prefill), the Responses API's first
``*.delta`` event, a chat completions chunk's first delta with content, reasoning or a tool call. A request whose
answer has no delta at all (the model stopped at once) takes its end as its first token.

Prompt and cache counts come from the answer's final usage: Anthropic ``message_delta.usage`` (prompt = input +
cache read + cache creation), Responses ``response.completed`` (or ``.incomplete``) ``usage`` (input_tokens,
input_tokens_details.cached_tokens), chat completions ``usage`` (prompt_tokens_details.cached_tokens); the split
per tier (device, host, storage) where the server reports it (tierlm's ``cache_read_input_tokens_details``,
``cached_tokens_details``).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tierlm.server.commands.bench.agent.plan import PlannedRequest
from tierlm.server.commands.bench.agent.translate import CHAT_PATH, to_chat_completions
from tierlm.server.commands.bench.openai_load import CHECK_HINT, Endpoint, PeerError, Timed, sse_json
from tierlm.server.commands.bench.server_process import REQUEST_TIMEOUT_S

log = logging.getLogger("tierlm.bench")
TIERS = ("device", "host", "storage")
NOT_THERE = (404, 405, 501)  # a server without the route
DROPPED_HEADERS = frozenset({"host", "content-length", "connection", "accept-encoding", "transfer-encoding"})


@dataclass
class Outcome(Timed):
    """What one request showed the client (Timed's times and counts; ``first``: the first content delta)."""

    path: str = ""  # the endpoint it went to (the client's own, or /v1/chat/completions)
    tiers: dict[str, int] | None = None  # cached tokens per tier, where the server reports them
    tier_source: str | None = None  # "usage" or "metrics" (a lone request's /metrics deltas)
    events: int = 0
    usage: dict[str, Any] = field(default_factory=dict)  # Anthropic: message_start's usage, updated by the final one

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ttft_s": self.ttft, "latency_s": self.latency,
                "first_delta": self.first is not None, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "cached_tiers": self.tiers, "tier_source": self.tier_source, "events": self.events}


def _tiers(details: Any) -> dict[str, int] | None:
    if not isinstance(details, dict) or not any(k in details for k in TIERS):
        return None
    return {k: int(details.get(k) or 0) for k in TIERS}


def read_anthropic(out: Outcome, event: dict[str, Any]) -> None:
    """Usage from ``message_start`` and then ``message_delta``: a field the final one leaves out keeps its start
    value (llama-server's final usage has only output_tokens; Anthropic's and tierlm's repeat every count)."""
    kind = event.get("type")
    if kind == "content_block_delta" and out.first is None:
        out.first = time.perf_counter()
    elif kind in ("message_start", "message_delta"):
        u = (event.get("message") or {}).get("usage") if kind == "message_start" else event.get("usage")
        out.usage.update({k: v for k, v in (u or {}).items() if v is not None})
        u = out.usage
        cached = int(u.get("cache_read_input_tokens") or 0)
        if "input_tokens" in u:
            out.prompt_tokens = int(u["input_tokens"]) + cached + int(u.get("cache_creation_input_tokens") or 0)
            out.cached_tokens = cached
        out.completion_tokens = u.get("output_tokens")
        out.tiers = _tiers(u.get("cache_read_input_tokens_details"))
    elif kind == "error":
        raise PeerError(f"error event mid-stream: {event.get('error')}")


def read_responses(out: Outcome, event: dict[str, Any]) -> None:
    kind = str(event.get("type") or "")
    if kind.endswith(".delta") and out.first is None:
        out.first = time.perf_counter()
    elif kind in ("response.completed", "response.incomplete"):
        u = (event.get("response") or {}).get("usage") or {}
        details = u.get("input_tokens_details") or {}
        out.prompt_tokens, out.completion_tokens = u.get("input_tokens"), u.get("output_tokens")
        out.cached_tokens = details.get("cached_tokens")
        out.tiers = _tiers(details.get("cached_tokens_details"))
    elif kind in ("response.failed", "error"):
        raise PeerError(f"{kind} mid-stream: {(event.get('response') or {}).get('error') or event.get('error')}")


def read_chat(out: Outcome, event: dict[str, Any]) -> None:
    if "error" in event:
        raise PeerError(f"error mid-stream: {event['error']}")
    for choice in event.get("choices") or []:
        d = choice.get("delta") or {}
        if out.first is None and (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")):
            out.first = time.perf_counter()
    u = event.get("usage")
    if u:
        details = u.get("prompt_tokens_details") or {}
        out.prompt_tokens, out.completion_tokens = u.get("prompt_tokens"), u.get("completion_tokens")
        out.cached_tokens = details.get("cached_tokens")
        out.tiers = _tiers(details.get("cached_tokens_details"))


READERS = {"/v1/messages": read_anthropic, "/v1/responses": read_responses, CHAT_PATH: read_chat}


def wire(req: PlannedRequest, ep: Endpoint, path: str, max_tokens: int) -> tuple[str, dict[str, str], dict]:
    """(URL, headers, body) of ``req`` for ``ep``: the client's own endpoint, headers and body with the server's
    model name; or its chat completions translation."""
    if path == CHAT_PATH:
        return f"{ep.url}{CHAT_PATH}", {"content-type": "application/json"}, to_chat_completions(req, ep.model,
                                                                                                   max_tokens)
    url = f"{ep.url}{req.path}" + (f"?{req.query}" if req.query else "")
    headers = {k: v for k, v in req.headers.items() if k.lower() not in DROPPED_HEADERS}
    return url, headers, {**req.body, "model": ep.model}


async def send(http: httpx.AsyncClient, ep: Endpoint, req: PlannedRequest, path: str, max_tokens: int) -> Outcome:
    """One streamed request; a PeerError naming the server and the request for anything that cannot be timed. A
    connection the server closed while it sat idle in the pool (llama-server closes idle keep-alive connections)
    fails before any byte of an answer: that is sent once more, on a new connection, with the clock restarted."""
    where = f"{ep.name} ({ep.url}), {req.label} {req.kind} turn {req.turn}, POST {path}"
    for attempt in (1, 2):
        try:
            return await _send_once(http, ep, req, path, max_tokens, where)
        except _StaleConnection as e:
            if attempt == 2:
                raise PeerError(f"{where} failed: {e.cause}; {CHECK_HINT}") from None
            log.info("agent: %s: the connection was closed before an answer (%s); sending it again", where, e.cause)
    raise AssertionError("unreachable")


class _StaleConnection(Exception):
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


async def _send_once(http: httpx.AsyncClient, ep: Endpoint, req: PlannedRequest, path: str, max_tokens: int,
                     where: str) -> Outcome:
    url, headers, body = wire(req, ep, path, max_tokens)
    read = READERS[path]
    out = Outcome(sent=time.perf_counter(), path=path)
    answered = False
    try:
        async with http.stream("POST", url, json=body, headers=headers, timeout=REQUEST_TIMEOUT_S) as resp:
            answered = True
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise PeerError(f"{where} answered {resp.status_code}: {text[:400]}")
            async for event in sse_json(resp):
                out.events += 1
                read(out, event)
    except httpx.RemoteProtocolError as e:
        if not answered:
            raise _StaleConnection(f"{type(e).__name__}: {e}") from None
        raise PeerError(f"{where} failed: {type(e).__name__}: {e}; {CHECK_HINT}") from None
    except httpx.HTTPError as e:
        raise PeerError(f"{where} failed: {type(e).__name__}: {e}; {CHECK_HINT}") from None
    except json.JSONDecodeError as e:
        raise PeerError(f"{where} streamed an event that is not JSON ({e})") from None
    except PeerError as e:
        if str(e).startswith(where):
            raise
        raise PeerError(f"{where}: {e}") from None
    out.done = time.perf_counter()
    if out.prompt_tokens is None:
        raise PeerError(f"{where} streamed no usage, so its prompt and cached tokens cannot be read")
    return out


PROBES = {"/v1/messages": lambda model: {"model": model, "max_tokens": 1, "stream": True,
                                         "messages": [{"role": "user", "content": "hi"}]},
          "/v1/responses": lambda model: {"model": model, "input": "hi", "max_output_tokens": 16, "stream": True,
                                          "store": False}}


async def probe(http: httpx.AsyncClient, ep: Endpoint, path: str) -> bool:
    """Whether ``ep`` serves ``path`` (a short request, off the clock; it also warms the server up): a 404, 405 or
    501 means no; any other refusal is a PeerError."""
    where = f"{ep.name} ({ep.url})"
    try:
        async with http.stream("POST", f"{ep.url}{path}", json=PROBES[path](ep.model),
                               timeout=REQUEST_TIMEOUT_S) as resp:
            body = await resp.aread()
    except httpx.HTTPError as e:
        raise PeerError(f"cannot reach {where}: {type(e).__name__}: {e}; {CHECK_HINT}") from None
    if resp.status_code in NOT_THERE:
        return False
    if resp.status_code != 200:
        raise PeerError(f"{where} answered {resp.status_code} to a short POST {path}: {body[:300]!r}")
    return True


@dataclass
class Route:
    """Which endpoint each of the client's paths goes to on one server."""

    paths: dict[str, str] = field(default_factory=dict)  # the client's path -> the path used

    def translated(self) -> list[str]:
        return [p for p, used in self.paths.items() if used != p]


async def routes(http: httpx.AsyncClient, ep: Endpoint, paths: list[str]) -> Route:
    """Probe each path the replay uses; chat completions where the server lacks it."""
    r = Route()
    for p in paths:
        r.paths[p] = p if await probe(http, ep, p) else CHAT_PATH
    return r
