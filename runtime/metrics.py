"""Prometheus metrics of one engine: request and token counters, latency histograms, cache hits per tier.

Callers record events through the methods below; the label set (the served model name) stays in here.
"""
from __future__ import annotations

from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TIERS = ("device", "host", "storage")


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        self._requests = Counter("tierlm_requests", "Finished requests", labels + ["finish_reason"], registry=r)
        self._prompt_tokens = Counter("tierlm_prompt_tokens", "Prompt tokens received", labels, registry=r)
        self._generation_tokens = Counter("tierlm_generation_tokens", "Tokens generated", labels, registry=r)
        self._prefill_tokens = Counter("tierlm_prefill_tokens", "Prompt tokens actually prefilled (not reused)",
                                       labels, registry=r)
        self._cache_hit_tokens = Counter("tierlm_cache_hit_tokens", "Prompt tokens reused from a cache tier",
                                         labels + ["tier"], registry=r)
        self._retractions = Counter("tierlm_retracted_requests", "Requests retracted for lack of KV pages",
                                    labels, registry=r)
        self._ttft = Histogram("tierlm_time_to_first_token_seconds", "Time to first token", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("tierlm_inter_token_latency_seconds", "Time between output tokens", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("tierlm_e2e_request_latency_seconds", "Request latency", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        for tier in TIERS:  # every tier shows up in /metrics from the start, at 0
            self._cache_hit_tokens.labels(model_name, tier)

    # ------------------------------------------------------------ events
    def record_prefill(self, tokens: int) -> None:
        self._prefill_tokens.labels(self.model_name).inc(tokens)

    def record_retraction(self) -> None:
        self._retractions.labels(self.model_name).inc()

    def record_first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def record_inter_token(self, seconds: float) -> None:
        self._itl.labels(self.model_name).observe(seconds)

    def record_finished(self, finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
                        cached_by_tier: Mapping[str, int], e2e_seconds: float) -> None:
        m = self.model_name
        self._requests.labels(m, finish_reason).inc()
        self._prompt_tokens.labels(m).inc(prompt_tokens)
        self._generation_tokens.labels(m).inc(completion_tokens)
        for tier, n in cached_by_tier.items():
            if n:
                self._cache_hit_tokens.labels(m, tier).inc(n)
        self._e2e.labels(m).observe(e2e_seconds)

    # ------------------------------------------------------------ gauges read at scrape time
    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge read at scrape time (pool usage, queue sizes)."""
        Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name).set_function(fn)

    def tier_gauge(self, name: str, doc: str, fns: Mapping[str, Callable[[], float]]) -> None:
        """A per-tier gauge read at scrape time."""
        g = Gauge(name, doc, ["model_name", "tier"], registry=self.registry)
        for tier, fn in fns.items():
            g.labels(self.model_name, tier).set_function(fn)

    def text(self) -> bytes:
        return generate_latest(self.registry)
