"""Prometheus metrics of one engine: request and token counters, latency histograms, cache hits per tier."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TIERS = ("device", "host", "storage")


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._m = model_name
        self.requests = Counter("tierlm_requests", "Finished requests", labels + ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("tierlm_prompt_tokens", "Prompt tokens received", labels, registry=r)
        self.generation_tokens = Counter("tierlm_generation_tokens", "Tokens generated", labels, registry=r)
        self.prefill_tokens = Counter("tierlm_prefill_tokens", "Prompt tokens actually prefilled (not reused)",
                                      labels, registry=r)
        self.cache_hit_tokens = Counter("tierlm_cache_hit_tokens", "Prompt tokens reused from a cache tier",
                                        labels + ["tier"], registry=r)
        self.retractions = Counter("tierlm_retracted_requests", "Requests retracted for lack of KV pages",
                                   labels, registry=r)
        self.ttft = Histogram("tierlm_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tierlm_inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tierlm_e2e_request_latency_seconds", "Request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.gauges: dict[str, Gauge] = {}
        for tier in TIERS:
            self.cache_hit_tokens.labels(model_name, tier)

    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge read at scrape time (pool usage, queue sizes)."""
        g = Gauge(name, doc, ["model_name"], registry=self.registry)
        g.labels(self._m).set_function(fn)
        self.gauges[name] = g

    def tier_gauge(self, name: str, doc: str, fns: dict[str, Callable[[], float]]) -> None:
        """A per-tier gauge read at scrape time."""
        g = Gauge(name, doc, ["model_name", "tier"], registry=self.registry)
        for tier, fn in fns.items():
            g.labels(self._m, tier).set_function(fn)
        self.gauges[name] = g

    def text(self) -> bytes:
        return generate_latest(self.registry)
