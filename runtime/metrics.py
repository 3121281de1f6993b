"""Prometheus metrics of one engine: request and token counters, latency histograms, cache hits per tier.

Callers record events through the methods below; the label sets stay in here. Next to tierlm's own ``tierlm_*``
metrics the same events feed SGLang's metric names (``sglang:*``, with SGLang's labels and buckets), so a
dashboard built for SGLang works on tierlm unchanged. Values that only grow are counters (``*_total``).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TIERS = ("device", "host", "storage")

# SGLang's buckets (python/sglang/srt/metrics/collector.py, TokenizerMetricsCollector)
_SGLANG_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                        10.0, 15.0, 20.0, 25.0, 30.0)
_SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                       0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
_SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
                       2400)
# SGLang's scheduler metrics carry these labels besides model_name; one unified engine is rank 0 of 1
SGLANG_SCHEDULER_LABELS = {"engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
# tierlm gauge -> the SGLang gauge that means the same (registered together, read from the same function)
SGLANG_GAUGE_ALIASES = {
    "tierlm_num_running_requests": ("sglang:num_running_reqs", "The number of running requests."),
    "tierlm_num_waiting_requests": ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
    "tierlm_kv_pool_usage": ("sglang:token_usage", "The token usage."),
    "tierlm_kv_used_tokens": ("sglang:num_used_tokens", "The number of used tokens."),
    "tierlm_kv_total_tokens": ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    "tierlm_hicache_host_used_tokens": ("sglang:hicache_host_used_tokens", "The number of used tokens in the host "
                                        "(L2) KV pool."),
    "tierlm_hicache_host_total_tokens": ("sglang:hicache_host_total_tokens", "The number of tokens the host (L2) KV "
                                         "pool holds."),
    "tierlm_spec_accept_length": ("sglang:spec_accept_length", "The average acceptance length of speculative decoding."),
    "tierlm_spec_accept_rate": ("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding."),
}
THROUGHPUT_WINDOW_S = 10.0  # sglang:gen_throughput: tokens generated over the last this many seconds
HIT_RATE_WINDOW = 64  # sglang:cache_hit_rate: over the prompts of the last this many finished requests
RETRACTED_WINDOW_S = 10.0  # sglang:num_retracted_reqs: requests retracted over the last this many seconds


class _FunctionCounters(Collector):
    """Counters whose values are read at scrape time from the component that keeps them."""

    def __init__(self) -> None:
        self.families: list[tuple[str, str, list[str], list[tuple[list[str], Callable[[], float]]]]] = []

    def collect(self) -> Iterable[CounterMetricFamily]:
        for name, doc, labelnames, series in self.families:
            family = CounterMetricFamily(name, doc, labels=labelnames)
            for values, fn in series:
                family.add_metric(values, float(fn()))
            yield family


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
        self._function_counters = _FunctionCounters()
        r.register(self._function_counters)
        # SGLang's names (its TokenizerMetricsCollector: label model_name)
        self._sg_prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", labels,
                                         registry=r)
        self._sg_generation_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                                             labels, registry=r)
        # cache_source: the tier that supplied the tokens (device = L1, host = L2, storage = L3)
        self._sg_cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens.",
                                         labels + ["cache_source"], registry=r)
        self._sg_requests = Counter("sglang:num_requests", "Number of requests processed.", labels, registry=r)
        self._sg_aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.", labels, registry=r)
        self._sg_retracted = Counter("sglang:num_retracted_requests", "Total number of retracted requests.", labels,
                                     registry=r)
        self._sg_ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in "
                                  "seconds.", labels, buckets=_SGLANG_TTFT_BUCKETS, registry=r)
        self._sg_itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                 "seconds.", labels, buckets=_SGLANG_ITL_BUCKETS, registry=r)
        self._sg_tpot = Histogram("sglang:time_per_output_token_seconds", "Histogram of time per output token in "
                                  "seconds.", labels, buckets=_SGLANG_ITL_BUCKETS, registry=r)
        self._sg_e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in "
                                 "seconds", labels, buckets=_SGLANG_E2E_BUCKETS, registry=r)
        for metric in (self._sg_prompt_tokens, self._sg_generation_tokens, self._sg_requests, self._sg_aborted,
                       self._sg_retracted):
            metric.labels(model_name)  # present from the start, at 0
        for tier in TIERS:
            self._sg_cached_tokens.labels(model_name, tier)
        # sglang:gen_throughput and sglang:cache_hit_rate: windows kept here, read at scrape time
        self._lock = threading.Lock()
        self._token_times: deque[float] = deque()
        self._started = time.monotonic()
        self._recent_prompts: deque[tuple[int, int]] = deque(maxlen=HIT_RATE_WINDOW)  # (prompt, cached) tokens
        self._retraction_times: deque[float] = deque()
        self._sglang_gauge("sglang:gen_throughput", "The generation throughput (token/s).", self.gen_throughput)
        self._sglang_gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", self.cache_hit_rate)
        self._sglang_gauge("sglang:num_retracted_reqs", f"The number of requests retracted (out of KV pages) in the "
                           f"last {RETRACTED_WINDOW_S:g} s.", self.recent_retractions)

    # ------------------------------------------------------------ events
    def record_prefill(self, tokens: int) -> None:
        self._prefill_tokens.labels(self.model_name).inc(tokens)

    def record_retraction(self) -> None:
        self._retractions.labels(self.model_name).inc()
        self._sg_retracted.labels(self.model_name).inc()
        with self._lock:
            self._retraction_times.append(time.monotonic())

    def record_first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)
        self._sg_ttft.labels(self.model_name).observe(seconds)
        self._count_token()

    def record_inter_token(self, seconds: float) -> None:
        self._itl.labels(self.model_name).observe(seconds)
        self._sg_itl.labels(self.model_name).observe(seconds)
        self._count_token()

    def _count_token(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._token_times.append(now)
            while self._token_times and self._token_times[0] < now - THROUGHPUT_WINDOW_S:
                self._token_times.popleft()

    def record_finished(self, finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
                        cached_by_tier: Mapping[str, int], e2e_seconds: float,
                        ttft_seconds: float | None = None) -> None:
        m = self.model_name
        self._requests.labels(m, finish_reason).inc()
        self._prompt_tokens.labels(m).inc(prompt_tokens)
        self._generation_tokens.labels(m).inc(completion_tokens)
        for tier, n in cached_by_tier.items():
            if n:
                self._cache_hit_tokens.labels(m, tier).inc(n)
        self._e2e.labels(m).observe(e2e_seconds)
        cached = sum(cached_by_tier.values())
        self._sg_requests.labels(m).inc()
        self._sg_prompt_tokens.labels(m).inc(prompt_tokens)
        self._sg_generation_tokens.labels(m).inc(completion_tokens)
        for tier, n in cached_by_tier.items():
            if n:
                self._sg_cached_tokens.labels(m, tier).inc(n)
        if finish_reason == "abort":  # the client went away, or the request failed
            self._sg_aborted.labels(m).inc()
        self._sg_e2e.labels(m).observe(e2e_seconds)
        if completion_tokens > 1 and ttft_seconds is not None:
            self._sg_tpot.labels(m).observe(max(e2e_seconds - ttft_seconds, 0.0) / (completion_tokens - 1))
        with self._lock:
            self._recent_prompts.append((prompt_tokens, min(cached, prompt_tokens)))

    # ------------------------------------------------------------ windows behind SGLang's gauges
    def gen_throughput(self) -> float:
        """Tokens generated per second over the last THROUGHPUT_WINDOW_S seconds (or since start, if shorter)."""
        now = time.monotonic()
        with self._lock:
            while self._token_times and self._token_times[0] < now - THROUGHPUT_WINDOW_S:
                self._token_times.popleft()
            n = len(self._token_times)
        return n / max(min(THROUGHPUT_WINDOW_S, now - self._started), 1e-3)

    def recent_retractions(self) -> float:
        """Requests retracted over the last RETRACTED_WINDOW_S seconds."""
        now = time.monotonic()
        with self._lock:
            while self._retraction_times and self._retraction_times[0] < now - RETRACTED_WINDOW_S:
                self._retraction_times.popleft()
            return float(len(self._retraction_times))

    def cache_hit_rate(self) -> float:
        """Share of prompt tokens reused from a cache tier over the last HIT_RATE_WINDOW finished requests."""
        with self._lock:
            prompt = sum(p for p, _ in self._recent_prompts)
            cached = sum(c for _, c in self._recent_prompts)
        return cached / prompt if prompt else 0.0

    # ------------------------------------------------------------ gauges read at scrape time
    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge read at scrape time (pool usage, queue sizes); SGLang's gauge of the same meaning, if any,
        comes with it."""
        Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name).set_function(fn)
        if name in SGLANG_GAUGE_ALIASES:
            self._sglang_gauge(*SGLANG_GAUGE_ALIASES[name], fn)

    def _sglang_gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        labels = {"model_name": self.model_name, **SGLANG_SCHEDULER_LABELS}
        Gauge(name, doc, list(labels), registry=self.registry).labels(**labels).set_function(fn)

    def counter(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A counter (a value that only grows, kept by a component) read at scrape time; exposed as
        ``name_total``."""
        self._function_counters.families.append((name, doc, ["model_name"], [([self.model_name], fn)]))

    def tier_counter(self, name: str, doc: str, fns: Mapping[str, Callable[[], float]]) -> None:
        """A per-tier counter read at scrape time."""
        series = [([self.model_name, tier], fn) for tier, fn in fns.items()]
        self._function_counters.families.append((name, doc, ["model_name", "tier"], series))

    def tier_gauge(self, name: str, doc: str, fns: Mapping[str, Callable[[], float]]) -> None:
        """A per-tier gauge read at scrape time."""
        g = Gauge(name, doc, ["model_name", "tier"], registry=self.registry)
        for tier, fn in fns.items():
            g.labels(self.model_name, tier).set_function(fn)

    def text(self) -> bytes:
        return generate_latest(self.registry)
