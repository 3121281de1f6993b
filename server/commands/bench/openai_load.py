"""The client side of `tierlm bench peers`: any OpenAI-compatible server (tierlm, vLLM, SGLang, llama.cpp's server)
found by URL, streamed /v1/completions timed by the client, and text prompts of an exact token count.

Only what every such server accepts is sent: a text prompt, `model` from its own /v1/models, temperature 0,
`ignore_eos`, and `stream_options.include_usage` so the token counts come from the server's usage, never from
counting chunks (a detokenizer may hold text back, so chunks and tokens need not match).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import httpx

from tierlm.server.commands.bench.server_process import REQUEST_TIMEOUT_S, BenchServerError

CHECK_HINT = "check that the server is running, listening on that host and port, and serving the same model folder"


class PeerError(BenchServerError):
    """A server under test could not be reached, refused a request or answered something that cannot be timed."""


@dataclass
class Endpoint:
    name: str
    url: str  # the server root, without /v1
    model: str = ""  # the first id of its /v1/models, sent as `model`
    models_entry: dict[str, Any] = field(default_factory=dict)


def server_root(url: str) -> str:
    """http://host:port from what a user may paste: a trailing slash or /v1 is dropped."""
    url = url.strip().rstrip("/")
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


def discover(name: str, url: str, timeout: float = 10.0) -> Endpoint:
    """The served model of ``url`` from GET /v1/models; a PeerError naming the URL and what to check otherwise."""
    ep = Endpoint(name, server_root(url))
    where = f"{name} ({ep.url})"
    try:
        r = httpx.get(f"{ep.url}/v1/models", timeout=timeout)
    except httpx.HTTPError as e:
        raise PeerError(f"cannot reach {where}: {type(e).__name__}: {e or 'no answer'}; {CHECK_HINT}") from None
    if r.status_code in (401, 403):
        raise PeerError(f"{where} answered {r.status_code} to GET /v1/models: it wants an API key; start it "
                        "without one for the benchmark")
    if r.status_code != 200:
        raise PeerError(f"{where} answered {r.status_code} to GET /v1/models: {r.text[:200]!r}; is the URL the root "
                        "of an OpenAI-compatible server (e.g. http://127.0.0.1:8000)?")
    try:
        entry = r.json()["data"][0]
        ep.model, ep.models_entry = str(entry["id"]), dict(entry)
    except (ValueError, KeyError, IndexError, TypeError):
        raise PeerError(f"{where}: GET /v1/models did not list a model ({r.text[:200]!r}); is the URL the root of an "
                        "OpenAI-compatible server with a model loaded?") from None
    return ep



def discover_peers(against: Sequence[tuple[str, str]], bench: str) -> list[Endpoint]:
    """Every ``--against NAME=URL`` peer, found before tierlm's server spends minutes starting; a peer that does not
    answer ends ``tierlm bench <bench>`` with the reason."""
    try:
        return [discover(name, url) for name, url in against]
    except PeerError as e:
        raise SystemExit(f"tierlm bench {bench}: {e}") from None

# ---------------------------------------------------------------- one streamed completion
@dataclass
class Timed:
    """When one streamed request was sent, showed its first token and ended (perf_counter seconds); and its token
    counts from the final usage. A stream with no first token takes its end as the first."""

    sent: float
    first: float | None = None  # first event carrying output
    done: float | None = None  # end of the stream
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens read from cache, where the server reports it

    @property
    def ttft(self) -> float:
        return (self.first or self.done or self.sent) - self.sent

    @property
    def latency(self) -> float:
        return (self.done or self.sent) - self.sent


@dataclass
class Completion(Timed):
    """What one streamed /v1/completions request showed the client (``first``: the first event carrying a choice,
    text or finish_reason; cached_tokens: usage.prompt_tokens_details.cached_tokens)."""

    last: float | None = None  # last event carrying a choice

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time from the first event to the last (TTFT excluded)."""
        n = self.completion_tokens or 0
        if self.first is None or self.last is None or n < 2 or self.last <= self.first:
            return None
        return (n - 1) / (self.last - self.first)

    @property
    def end_to_end_tokens_per_s(self) -> float | None:
        return (self.completion_tokens or 0) / self.latency if self.latency > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft, "latency_s": self.latency, "decode_tps": self.decode_tokens_per_s,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens}



async def sse_json(resp: httpx.Response) -> AsyncIterator[Any]:
    """The JSON of each ``data:`` line of a server-sent event stream, up to ``[DONE]`` (every client here reads
    streams this way: completions, and `bench agent`'s Anthropic, Responses and chat streams)."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)

async def stream_completion(client: httpx.AsyncClient, ep: Endpoint, prompt: str, max_tokens: int) -> Completion:
    """POST /v1/completions (stream, usage), greedy, EOS ignored: exactly ``max_tokens`` should come back."""
    body = {"model": ep.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    where = f"{ep.name} ({ep.url})"
    res = Completion(sent=time.perf_counter())
    try:
        async with client.stream("POST", f"{ep.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise PeerError(f"{where} answered {resp.status_code} to POST /v1/completions: {text[:300]}")
            async for event in sse_json(resp):
                _apply(res, event, where)
    except httpx.HTTPError as e:
        raise PeerError(f"{where} failed during POST /v1/completions: {type(e).__name__}: {e}; {CHECK_HINT}") from None
    except json.JSONDecodeError as e:
        raise PeerError(f"{where} streamed an event that is not JSON ({e}); is it an OpenAI-compatible server?") \
            from None
    res.done = time.perf_counter()
    if res.completion_tokens is None:
        raise PeerError(f"{where} streamed no usage (stream_options.include_usage), so its tokens cannot be "
                        "counted; use a server version that supports it")
    if res.completion_tokens < max_tokens:
        raise PeerError(f"{where} returned {res.completion_tokens} completion tokens where {max_tokens} were asked "
                        "(ignore_eos: true); the ratios would be meaningless. Check that it accepts ignore_eos and "
                        "that its context length holds the prompt plus the completion")
    return res


def _apply(res: Completion, event: dict[str, Any], where: str) -> None:
    if "error" in event:
        raise PeerError(f"{where} reported an error mid-stream: {event['error']}")
    now = time.perf_counter()
    if event.get("choices"):
        res.first = res.first or now
        res.last = now
    usage = event.get("usage")
    if usage:
        res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
        res.completion_tokens = usage.get("completion_tokens", res.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.cached_tokens = int(details["cached_tokens"])


class Session:
    """One HTTP client (keep-alive) for every request to one server, on one event loop."""

    def __init__(self, ep: Endpoint, max_connections: int) -> None:
        self.ep = ep
        self.limits = httpx.Limits(max_connections=max_connections + 4, max_keepalive_connections=max_connections + 4)
        self.client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> "Session":
        self.client = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=self.limits)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def one(self, prompt: str, max_tokens: int) -> Completion:
        return await stream_completion(self.client, self.ep, prompt, max_tokens)

    async def concurrent(self, prompts: Sequence[str], max_tokens: int) -> tuple[list[Completion], float]:
        """All prompts at once; the results and the wall time from the first send to the last finish."""
        results = list(await asyncio.gather(*(self.one(p, max_tokens) for p in prompts)))
        return results, max(r.done for r in results) - min(r.sent for r in results)


# ---------------------------------------------------------------- text prompts of an exact token count
class PromptBuilder:
    """Random lowercase words that ``encode`` (the model folder's tokenizer, special tokens included as for a
    prompt) turns into exactly the asked number of tokens. Word boundaries are spaces, which BPE and SentencePiece
    pre-tokenizers do not merge across, so appending words only adds tokens; the total is checked every time."""

    MAX_TRIES = 2000

    def __init__(self, encode: Callable[[str], Sequence[int]], rng: Any) -> None:
        self.encode = encode
        self.rng = rng

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def word(self, lo: int = 2, hi: int = 8) -> str:
        n = int(self.rng.integers(lo, hi + 1))
        return "".join(chr(97 + int(c)) for c in self.rng.integers(0, 26, size=n))

    def text(self, n_tokens: int, head: str = "") -> str:
        """``head`` followed by random words, ``n_tokens`` tokens in all."""
        words: list[str] = []
        join = (lambda ws: head + "".join(" " + w for w in ws)) if head else (lambda ws: " ".join(ws))
        base = self.count(head)
        if base > n_tokens:
            raise BenchServerError(f"cannot build a {n_tokens}-token prompt: its fixed part already has {base} tokens")
        per_word, c = 3.0, base
        while n_tokens - c > 16:  # bulk: most of the way, by the measured tokens per word
            words += [self.word() for _ in range(max(1, int((n_tokens - c) * 0.9 / per_word)))]
            c = self.count(join(words))
            per_word = max(1.0, (c - base) / len(words))
        while c > n_tokens and words:
            words.pop()
            c = self.count(join(words))
        text = join(words)
        for _ in range(self.MAX_TRIES):  # the last few tokens: short words, or one letter glued on
            if c == n_tokens:
                return text
            candidates = (" " + self.word(1, 3), self.word(1, 1)) if text else (self.word(1, 3),)
            trial = text + candidates[int(self.rng.integers(0, len(candidates)))]
            t = self.count(trial)
            if c < t <= n_tokens:
                text, c = trial, t
        raise BenchServerError(f"could not build a prompt of exactly {n_tokens} tokens with this tokenizer "
                               f"(closest: {c})")
