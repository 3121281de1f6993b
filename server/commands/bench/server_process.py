"""A real tierlm server for a benchmark: start it as a subprocess, talk to it, restart it, stop it.

Benchmarks measure what a user gets, so they go through `python -m tierlm.launch_server` and HTTP like any client.
Requests are SGLang-native ``/generate`` calls with token ids (synthetic models have no real tokenizer) and
streaming, so the time of the first token is observed by the client. Every request's cache statistics come back
from the response itself (``meta_info.cached_tokens_details``), never inferred from timings.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx

log = logging.getLogger(__name__)
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
READY_TIMEOUT_S = 600.0  # a 2 GB model on a slow disk plus warm-up on 2 cores
REQUEST_TIMEOUT_S = 1800.0


class BenchServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchServer:
    """One server configuration; ``restart()`` brings it back with the same flags and storage folder."""

    def __init__(self, args: Sequence[str], *, storage_dir: Path | None = None, log_dir: Path | None = None,
                 name: str = "server", env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.storage_dir = storage_dir
        self.name = name
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="tierlm-bench-logs-"))
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = READY_TIMEOUT_S) -> "BenchServer":
        self.port = free_port()
        self.starts += 1
        self.log_path = self.log_dir / f"{self.name}-{self.starts}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIERLM_NO_PROGRESS": "1", **self.env}
        if self.storage_dir is not None:
            env[STORAGE_DIR_ENV] = str(self.storage_dir)
        cmd = [sys.executable, "-m", "tierlm.launch_server", *self.args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        log.info("starting %s: %s (log %s)", self.name, " ".join(cmd), self.log_path)
        with open(self.log_path, "wb") as logf:  # a file, not a pipe: a chatty server must never block
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise BenchServerError(f"the {self.name} exited with status {code} while starting; its log "
                                       f"({self.log_path}) ends with:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.2)
        self.stop()
        raise BenchServerError(f"the {self.name} was not ready within {timeout:.0f} s; see {self.log_path}:\n"
                               f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return "(no log)"

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM (the server flushes pending L3 writes on the way out), SIGKILL after ``grace`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", self.name, grace)
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> "BenchServer":
        """Stop and start again with the same flags and storage folder (the L3 cache survives; L1/L2 do not)."""
        self.wait_storage_idle()
        self.stop()
        return self.start()

    def __enter__(self) -> "BenchServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ state
    def info(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/server_info", timeout=30.0)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        r = httpx.get(f"{self.url}/metrics", timeout=30.0)
        r.raise_for_status()
        return parse_prometheus(r.text)

    def rss_bytes(self) -> int | None:
        try:
            import psutil

            return psutil.Process(self.proc.pid).memory_info().rss
        except Exception:  # noqa: BLE001 - RSS is informative only
            return None

    def wait_storage_idle(self, timeout: float = 120.0) -> bool:
        """Wait until the L3 writer has no pending pages, so a restart finds every page on disk."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            storage = self.info().get("tiers", {}).get("storage")
            if not storage or storage.get("io", {}).get("pending_writes", 0) == 0:
                return True
            time.sleep(0.1)
        log.warning("%s still has pending L3 writes after %.0f s", self.name, timeout)
        return False


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric samples keyed by name plus labels except model_name, e.g. 'tierlm_cache_hit_tokens_total{tier="host"}'."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            key, value = line.rsplit(" ", 1)
            v = float(value)
        except ValueError:
            continue
        if "{" in key:
            name, labels = key.split("{", 1)
            kept = [p for p in labels.rstrip("}").split(",") if p and not p.startswith("model_name=")]
            key = name + ("{" + ",".join(kept) + "}" if kept else "")
        out[key] = out.get(key, 0.0) + v
    return out


# ---------------------------------------------------------------- requests
@dataclass
class RequestResult:
    """What one streamed request showed the client. Times are perf_counter seconds."""

    sent: float
    first_token: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens so far) per event
    output_ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] = field(default_factory=dict)  # the last event's meta_info (final counts, spec_*)

    @property
    def ttft(self) -> float:
        return (self.first_token or self.done or self.sent) - self.sent

    @property
    def latency(self) -> float:
        return (self.done or self.sent) - self.sent

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first (the decode rate, prefill excluded)."""
        if self.first_token is None or self.done is None or self.completion_tokens < 2:
            return None
        last_t = self.token_times[-1][0] if self.token_times else self.done
        span = last_t - self.first_token
        return (self.completion_tokens - 1) / span if span > 0 else None

    @property
    def cached_total(self) -> int:
        return sum(self.cached.values())


async def stream_generate(client: httpx.AsyncClient, url: str, input_ids: list[int], max_new_tokens: int,
                          delay: float = 0.0) -> RequestResult:
    """POST /generate (stream) with token ids, greedy, ignoring EOS so exactly ``max_new_tokens`` come back."""
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"input_ids": list(input_ids), "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    res = RequestResult(sent=time.perf_counter())
    async with client.stream("POST", f"{url}/generate", json=body, timeout=REQUEST_TIMEOUT_S) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise BenchServerError(f"/generate answered {resp.status_code}: {text[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise BenchServerError(f"/generate stream failed: {event['error']}")
            now = time.perf_counter()
            ids = event.get("output_ids") or []
            if ids and res.first_token is None:
                res.first_token = now
            if ids and (not res.token_times or len(ids) > res.token_times[-1][1]):
                res.token_times.append((now, len(ids)))
            res.output_ids = ids
            meta = event.get("meta_info") or {}
            if meta:
                res.meta_info = meta
            res.prompt_tokens = meta.get("prompt_tokens", res.prompt_tokens)
            res.completion_tokens = meta.get("completion_tokens", res.completion_tokens)
            details = meta.get("cached_tokens_details")
            if details:
                res.cached = {k: int(details.get(k, 0)) for k in ("device", "host", "storage")}
    res.done = time.perf_counter()
    return res


def tokenize(url: str, text: str) -> list[int]:
    """The server's token ids of ``text`` (POST /tokenize, special tokens such as BOS added as for a prompt)."""
    r = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60.0)
    if r.status_code != 200:
        raise BenchServerError(f"/tokenize answered {r.status_code}: {r.text[:500]}")
    return [int(t) for t in r.json()["tokens"]]


def run_one(url: str, input_ids: list[int], max_new_tokens: int) -> RequestResult:
    """One streamed request, synchronously."""
    async def go() -> RequestResult:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            return await stream_generate(client, url, input_ids, max_new_tokens)

    return asyncio.run(go())


def run_concurrent(url: str, prompts: Sequence[list[int]], max_new_tokens: int, stagger_s: float = 0.0
                   ) -> tuple[list[RequestResult], float, float]:
    """All prompts at once (request i sent after i x ``stagger_s``). Returns results, first send, last finish."""
    async def go() -> list[RequestResult]:
        limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            return list(await asyncio.gather(*(stream_generate(client, url, p, max_new_tokens, i * stagger_s)
                                               for i, p in enumerate(prompts))))

    results = asyncio.run(go())
    return results, min(r.sent for r in results), max(r.done for r in results)
