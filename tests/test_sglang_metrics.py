"""/metrics speaks SGLang's metric names too (so SGLang's Grafana dashboard works unchanged), and cumulative
values are counters."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.engine_harness import greedy, run, start_engine

SGLANG_TYPES = {
    "sglang:prompt_tokens": "counter",
    "sglang:generation_tokens": "counter",
    "sglang:cached_tokens": "counter",
    "sglang:num_requests": "counter",
    "sglang:time_to_first_token_seconds": "histogram",
    "sglang:inter_token_latency_seconds": "histogram",
    "sglang:time_per_output_token_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram",
    "sglang:num_running_reqs": "gauge",
    "sglang:num_queue_reqs": "gauge",
    "sglang:token_usage": "gauge",
    "sglang:cache_hit_rate": "gauge",
    "sglang:gen_throughput": "gauge",
}
SCHEDULER_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                    "sglang:cache_hit_rate", "sglang:gen_throughput")


def _families(engine) -> dict:
    return {f.name: f for f in text_string_to_metric_families(engine.metrics_text().decode())}


def _value(families: dict, family: str, sample: str) -> float:
    return sum(s.value for s in families[family].samples if s.name == sample)


def test_sglang_metric_names_types_labels_and_counters_grow(tiny_llama) -> None:
    engine = start_engine(tiny_llama, served_model_name="tiny")
    try:
        before = _families(engine)
        for name, kind in SGLANG_TYPES.items():
            assert name in before and before[name].type == kind, name
        for name in SCHEDULER_GAUGES:
            (sample,) = before[name].samples
            assert sample.labels == {"model_name": "tiny", "engine_type": "unified", "tp_rank": "0",
                                     "pp_rank": "0"}, name
        text = engine.metrics_text().decode()
        assert 'sglang:prompt_tokens_total{model_name="tiny"} 0.0' in text
        assert "sglang:generation_tokens_total" in text

        prompt = list(range(5, 40))
        run(engine, [prompt], greedy(6))
        run(engine, [prompt], greedy(6))  # the second reuses the first's prompt pages
        after = _families(engine)
        delta = lambda fam, sample: _value(after, fam, sample) - _value(before, fam, sample)  # noqa: E731
        assert delta("sglang:prompt_tokens", "sglang:prompt_tokens_total") == 2 * len(prompt)
        assert delta("sglang:generation_tokens", "sglang:generation_tokens_total") == 12
        assert delta("sglang:num_requests", "sglang:num_requests_total") == 2
        assert delta("sglang:cached_tokens", "sglang:cached_tokens_total") > 0
        assert delta("sglang:time_to_first_token_seconds", "sglang:time_to_first_token_seconds_count") == 2
        assert delta("sglang:inter_token_latency_seconds", "sglang:inter_token_latency_seconds_count") == 10
        assert delta("sglang:time_per_output_token_seconds", "sglang:time_per_output_token_seconds_count") == 2
        assert delta("sglang:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds_count") == 2
        assert 0 < _value(after, "sglang:cache_hit_rate", "sglang:cache_hit_rate") < 1
        assert _value(after, "sglang:gen_throughput", "sglang:gen_throughput") > 0
        assert _value(after, "sglang:num_running_reqs", "sglang:num_running_reqs") == 0
        # tierlm's own metrics stay; cumulative ones are counters
        assert after["tierlm_prompt_tokens"].type == "counter"
        assert after["tierlm_cache_evicted_pages"].type == "counter"
        assert {s.labels["tier"] for s in after["tierlm_cache_evicted_pages"].samples} == {"device"}
        assert after["tierlm_kv_pool_usage"].type == "gauge"
    finally:
        engine.shutdown()
