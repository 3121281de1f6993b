"""What clients and operators hit (issue #33), through a real server (stories260K, HiCache on) and the openai client:
completion logprobs leave out the stop token the text leaves out, a client-aborted stream is logged as aborted with
its counts and counted, the gauge formerly named tierlm_kv_pages_total and SGLang's missing metrics, logit_bias,
and `tierlm bench prefix` defaults that fit the model's context."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import STORIES_FIRST_40, STORIES_PROMPT
from e2e_server import start_server
from prometheus_client.parser import text_string_to_metric_families

from tierlm.server.commands.bench.prefix import POOL_MARGIN_PAGES, fit_prefix_tokens, max_prefix_tokens, pool_tokens

pytestmark = pytest.mark.slow

SCHEDULER_LABELS = {"engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


@pytest.fixture(scope="module")
def server(stories_dir: Path, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("operator")
    with start_server(["--model-path", str(stories_dir), "--skip-warmup", "--enable-hierarchical-cache",
                       "--page-size", "4", "--max-total-tokens", "512", "--served-model-name", "stories",
                       "--chat-template", "chatml"],
                      env={"TIERLM_NO_PROGRESS": "1"}, log_dir=log_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in fams[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_completion_logprob_tokens_leave_out_the_stop_token(client) -> None:
    stop = STORIES_FIRST_40[2]  # greedy stops on the third token: its text is not output
    kw = dict(model="stories", prompt=STORIES_PROMPT, max_tokens=20, temperature=0, logprobs=1,
              extra_body={"stop_token_ids": [stop]})
    choice = client.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop"
    assert len(choice.logprobs.tokens) == 2 and "".join(choice.logprobs.tokens) == choice.text
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs) == 2
    streamed_text, streamed_tokens = "", []
    for chunk in client.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        streamed_text += c.text
        if c.logprobs is not None:
            streamed_tokens += c.logprobs.tokens
    assert streamed_text == choice.text and streamed_tokens == choice.logprobs.tokens


def test_client_aborted_stream_is_logged_and_counted(server) -> None:
    before = value(families(server), "sglang:num_aborted_requests", "sglang:num_aborted_requests_total")
    body = {"model": "stories", "prompt": STORIES_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events >= 3:
                    break  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        aborted = [line for line in server.log_text().splitlines() if "aborted by the client" in line]
        after = value(families(server), "sglang:num_aborted_requests", "sglang:num_aborted_requests_total")
        if aborted and after > before:
            break
        time.sleep(0.2)
    assert after == before + 1
    (line,) = aborted
    assert "POST /v1/completions 200 aborted by the client" in line and "so far" in line
    completion = int(line.split("completion=")[1].split()[0])
    assert 2 <= completion < 400 and "prompt=" in line


def test_metric_names_operators_look_for(server, client) -> None:
    client.completions.create(model="stories", prompt=STORIES_PROMPT, max_tokens=4, temperature=0)
    client.completions.create(model="stories", prompt=STORIES_PROMPT, max_tokens=4, temperature=0)  # a device hit
    fams = families(server)
    assert "tierlm_kv_pages_total" not in fams  # a gauge named like a counter
    assert fams["tierlm_kv_pages_capacity"].type == "gauge"
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    pool_tokens_now = info["kv_pool"]["total_tokens"]
    for name in ("sglang:num_used_tokens", "sglang:max_total_num_tokens", "sglang:num_retracted_reqs",
                 "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens"):
        assert fams[name].type == "gauge", name
        (sample,) = fams[name].samples
        assert sample.labels == {"model_name": "stories", **SCHEDULER_LABELS}, name
    assert value(fams, "sglang:max_total_num_tokens", "sglang:max_total_num_tokens") == pool_tokens_now
    assert 0 < value(fams, "sglang:num_used_tokens", "sglang:num_used_tokens") <= pool_tokens_now
    host = info["tiers"]["host"]
    assert value(fams, "sglang:hicache_host_total_tokens", "sglang:hicache_host_total_tokens") == host["total_tokens"]
    assert fams["sglang:num_aborted_requests"].type == "counter"
    assert fams["sglang:num_retracted_requests"].type == "counter"
    cached = fams["sglang:cached_tokens"]
    assert {s.labels["cache_source"] for s in cached.samples if s.name == "sglang:cached_tokens_total"} == \
        {"device", "host", "storage"}
    assert value(fams, "sglang:cached_tokens", "sglang:cached_tokens_total", cache_source="device") > 0


def test_logit_bias_through_the_openai_client(client) -> None:
    first = STORIES_FIRST_40[0]
    plain = client.completions.create(model="stories", prompt=STORIES_PROMPT, max_tokens=3, temperature=0,
                                      logprobs=0)
    biased = client.completions.create(model="stories", prompt=STORIES_PROMPT, max_tokens=3, temperature=0,
                                       logprobs=0, logit_bias={str(first): -100})
    assert plain.choices[0].logprobs.tokens[0] != biased.choices[0].logprobs.tokens[0]
    chat = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logit_bias={"300": 100})
    assert chat.choices[0].message.content  # token 300, forced four times
    for bad, why in (({"abc": 1}, "decimal strings"), ({"999999": 1}, "outside the vocabulary"),
                     ({"3": 1000}, "[-100, 100]")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="stories", prompt="x", max_tokens=1, logit_bias=bad)
        assert why in str(e.value) and e.value.body["param"] == "logit_bias"


def test_bench_prefix_defaults_fit_the_models_context() -> None:
    """--synthetic tiny has a 2048-token context: the default prefix, its suffix, the new tokens and the filler
    prompt (the device pool less one page, plus the new tokens) all fit it; an explicit prefix that cannot is
    refused with the largest that can."""
    suffix, new, ps, context = 16, 8, 16, 2048
    prefix = fit_prefix_tokens(None, suffix, new, ps, context)
    pool = pool_tokens(prefix, suffix, new, ps)
    assert 0 < prefix < 2048 and prefix + suffix + new <= context and (pool - new - ps) + new <= context
    assert pool_tokens(prefix + 1, suffix, new, ps) - ps > context  # the largest that fits
    assert fit_prefix_tokens(None, suffix, new, ps, 32768) == 2048
    with pytest.raises(SystemExit, match=f"use --prefix-tokens {max_prefix_tokens(context, suffix, new, ps)}"):
        fit_prefix_tokens(2048, suffix, new, ps, context)
    assert POOL_MARGIN_PAGES >= 1
