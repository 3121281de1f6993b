"""GET /tiers: the KV tiers, the queues, the requests and the machine in one JSON object, for the page at / (it
polls every second or two) and for scripts (docs/api.md).

Nothing is computed twice: occupancy, queues and the machine come from the engine's /server_info report, the hit
counters from its /metrics registry (read through the Prometheus text the engine already renders, so /tiers and
/metrics always agree). The one thing kept here is a short history of those counters, sampled when /tiers is
asked for (at most once a second, the last HISTORY_WINDOW_S seconds), so a chart shows hits per tier over recent
minutes even right after the page is opened.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from tierlm.runtime.engine_api import EngineAPI
from tierlm.server.deps import model_name, ready_engine

router = APIRouter()
HISTORY_WINDOW_S = 300.0
MIN_SAMPLE_GAP_S = 1.0
TIERS = ("device", "host", "storage")
COUNTS = TIERS + ("computed",)  # prompt tokens by where their KV came from; computed = prefilled


def prompt_token_counters(metrics_text: bytes) -> dict[str, float]:
    """Cumulative prompt tokens per tier (tierlm_cache_hit_tokens_total) and computed (tierlm_prefill_tokens_total),
    plus finished requests and the TTFT sum/count, from the engine's Prometheus text."""
    out = {k: 0.0 for k in (*COUNTS, "prompt", "requests", "ttft_seconds_sum", "ttft_count")}
    names = {"tierlm_prefill_tokens_total": "computed", "tierlm_prompt_tokens_total": "prompt",
             "tierlm_requests_total": "requests", "tierlm_time_to_first_token_seconds_sum": "ttft_seconds_sum",
             "tierlm_time_to_first_token_seconds_count": "ttft_count"}
    for family in text_string_to_metric_families(metrics_text.decode("utf-8", "replace")):
        for sample in family.samples:
            if sample.name == "tierlm_cache_hit_tokens_total" and sample.labels.get("tier") in TIERS:
                out[sample.labels["tier"]] += sample.value
            elif sample.name in names:
                out[names[sample.name]] += sample.value
    return out


class CounterHistory:
    """Samples of the cumulative counters, at least MIN_SAMPLE_GAP_S apart, kept for HISTORY_WINDOW_S; read as
    the tokens of each interval between two samples."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def record(self, now: float, counters: dict[str, float]) -> None:
        with self._lock:
            if self._samples and now - self._samples[-1][0] < MIN_SAMPLE_GAP_S:
                return
            self._samples.append((now, counters))
            while len(self._samples) > 2 and now - self._samples[1][0] > HISTORY_WINDOW_S:
                self._samples.popleft()  # the oldest sample left is the start of the oldest interval

    def intervals(self) -> list[dict[str, float]]:
        with self._lock:
            samples = list(self._samples)
        rows = []
        for (t0, a), (t1, b) in zip(samples, samples[1:]):
            row = {"t": round(t1, 3), "seconds": round(t1 - t0, 3)}
            # a counter never shrinks; max() keeps a row sane should a registry ever be replaced
            row.update({k: max(b[k] - a[k], 0.0) for k in COUNTS})
            rows.append(row)
        return rows


def _history(request: Request) -> CounterHistory:
    state = request.app.state
    if getattr(state, "tiers_history", None) is None:
        state.tiers_history = CounterHistory()
    return state.tiers_history


def _pages(total: int, free: int, cached: int, bytes_per_page: int) -> dict[str, int]:
    """used = held by requests (or loads in flight), cached = reusable prefixes nobody holds, free = empty."""
    used = max(total - free - cached, 0)
    counts = {"total_pages": total, "used_pages": used, "cached_pages": cached, "free_pages": free}
    return {**counts, "bytes_per_page": bytes_per_page,
            **{k.replace("_pages", "_bytes"): v * bytes_per_page for k, v in counts.items()}}


def tier_occupancy(info: dict[str, Any]) -> dict[str, Any]:
    """L1 (device), L2 (host), L3 (storage) from /server_info's kv_pool and tiers; a tier not configured is
    {"enabled": false}."""
    pool, tiers = info.get("kv_pool", {}), info.get("tiers", {})
    page_size = int(pool.get("page_size", 1))
    page_bytes = int(pool.get("bytes_per_token", 0)) * page_size
    out: dict[str, Any] = {"device": {"enabled": True, **_pages(pool.get("total_pages", 0), pool.get("free_pages", 0),
                                                                pool.get("cached_pages", 0), page_bytes)}}
    if "host_total_pages" in pool:
        host_total = int(pool["host_total_pages"])
        host_page_bytes = int(tiers.get("host", {}).get("total_bytes", 0)) // max(host_total, 1)
        out["host"] = {"enabled": True, **_pages(host_total, pool.get("host_free_pages", 0),
                                                 pool.get("host_cached_pages", 0), host_page_bytes),
                       "write_policy": tiers.get("host", {}).get("write_policy")}
    else:
        out["host"] = {"enabled": False}
    storage = tiers.get("storage")
    if storage is None:
        out["storage"] = {"enabled": False}
    else:
        max_bytes = storage.get("max_bytes")
        out["storage"] = {"enabled": True, "backend": storage.get("backend"), "state": storage.get("state"),
                          "last_error": storage.get("last_error"), "files": storage.get("files"),
                          "used_bytes": storage.get("bytes"), "max_bytes": max_bytes,
                          "free_bytes": max(max_bytes - storage.get("bytes", 0), 0) if max_bytes else None}
    return out


def queues(info: dict[str, Any]) -> dict[str, Any]:
    """Prefetch (storage -> host) and write-back (host -> storage) work not yet done."""
    io = info.get("tiers", {}).get("storage", {}).get("io", {})
    finished = sum(io.get(k, 0) for k in ("prefetches_complete", "prefetches_partial", "prefetches_cancelled",
                                          "prefetches_bypassed"))
    return {"prefetch_pages": info.get("kv_pool", {}).get("host_prefetch_pages", 0),
            "prefetches_in_flight": max(io.get("prefetches", 0) - finished, 0),
            "write_back_pending": io.get("pending_writes", 0),
            "write_back_pending_bytes": io.get("pending_write_bytes", 0),
            "write_backs_done": io.get("backups_done", 0), "write_backs_failed": io.get("backups_failed", 0)}


MACHINE_KEYS = ("version", "backend", "device", "dtype", "dtype_chosen_by", "backend_decision", "attention_backend",
                "kernels", "cpu", "decode_graphs", "torch_compile", "architecture", "architecture_verified", "context_length",
                "model_path", "chat_template", "warnings")


def machine(info: dict[str, Any]) -> dict[str, Any]:
    """What `tierlm doctor` reports about this launch, as the running server decided it (no second detection)."""
    out = {k: info[k] for k in MACHINE_KEYS if k in info}
    out["kv_dtype"] = info.get("kv_pool", {}).get("kv_dtype")
    return out


@router.get("/tiers")
async def tiers(request: Request, engine: EngineAPI = Depends(ready_engine)) -> JSONResponse:
    info = engine.server_info()
    counters = prompt_token_counters(engine.metrics_text())
    now = time.time()
    history = _history(request)
    history.record(now, counters)
    ttft_n = counters["ttft_count"]
    return JSONResponse({
        "time": round(now, 3),
        "model": model_name(engine),
        "uptime_s": info.get("uptime_s"),
        "page_size": info.get("kv_pool", {}).get("page_size"),
        "tiers": tier_occupancy(info),
        "prompt_tokens": {k: int(counters[k]) for k in (*COUNTS, "prompt")},
        "requests": {"running": info.get("running_requests", 0), "waiting": info.get("waiting_requests", 0),
                     "finished": int(counters["requests"]), "max_running": info.get("max_running_requests"),
                     "mean_ttft_s": counters["ttft_seconds_sum"] / ttft_n if ttft_n else None},
        "queues": queues(info),
        "pins": info.get("pins"),  # cache_control pins (docs/hicache.md): prefixes, pinned pages per tier; null: none
        "history": {"window_s": HISTORY_WINDOW_S, "intervals": history.intervals()},
        "machine": machine(info),
    })
