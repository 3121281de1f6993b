"""A real server on stories260K, driven by the official `openai` client (httpx for /generate, /server_info,
/metrics): greedy text equals the llama2.c reference, streaming equals non-streaming, concurrent streams
equal solo runs, usage reports cache hits per tier, errors keep OpenAI's shape, a dropped stream frees its KV.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import STORIES_FIRST_40, STORIES_PROMPT, STORIES_TEXT
from e2e_server import ServerProcess, start_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

# 63 tokens with the stories tokenizer: three full 16-token pages can come back from the cache.
LONG_PROMPT = ("The sun was shining and the birds were singing. Ben and his sister Mia went to the farm to see the "
               "cows, the pigs and the horses. They fed the")


@pytest.fixture(scope="module")
def server(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("e2e_openai_logs")
    with start_server(["--model-path", str(stories_dir), "--skip-warmup"], env={"TIERLM_NO_PROGRESS": "1"},
                      log_dir=log_dir) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server: ServerProcess, client: Any) -> str:
    return client.models.list().data[0].id


# ------------------------------------------------------------------ helpers

def cached_details(usage: Any) -> dict[str, int]:
    """usage.prompt_tokens_details.cached_tokens_details, checking the fields are all there and add up."""
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None, usage
    tiers = details.cached_tokens_details  # not in OpenAI's schema, so the client keeps it as a dict
    assert set(tiers) == {"device", "host", "storage"}, usage
    assert sum(tiers.values()) == details.cached_tokens, usage
    return tiers


def greedy(client: Any, model: str, prompt: str, max_tokens: int, **kw: Any) -> Any:
    """A temperature-0 completion; a non-streamed one must carry the per-tier cache usage."""
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    if not kw.get("stream"):
        cached_details(resp.usage)
    return resp


def metric(text: str, sample_name: str, **labels: str) -> float:
    """Sum of the samples called ``sample_name`` whose labels include ``labels`` (0 when there are none)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def assert_openai_error(exc: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert exc.status_code == status
    err = exc.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ------------------------------------------------------------------ greedy reference

def test_greedy_completion_is_the_reference_story(client: Any, model: str) -> None:
    comp = greedy(client, model, STORIES_PROMPT, 40)
    choice = comp.choices[0]
    assert choice.text.startswith(",")  # prompt + completion is the full text, no space lost or added
    assert STORIES_PROMPT + choice.text == STORIES_PROMPT + STORIES_TEXT
    assert choice.finish_reason == "length"
    assert comp.usage.completion_tokens == 40
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + 40
    cached_details(comp.usage)


def test_generate_with_input_ids_returns_reference_ids(server: ServerProcess, stories_dir: Path) -> None:
    from tokenizers import Tokenizer

    prompt_ids = Tokenizer.from_file(str(stories_dir / "tokenizer.json")).encode(STORIES_PROMPT).ids
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 25, "temperature": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == STORIES_FIRST_40[:25]
    assert STORIES_TEXT.startswith(body["text"])
    assert body["meta_info"]["prompt_tokens"] == len(prompt_ids)
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 25}
    # Continuing from the middle of the reference with ids gives the rest of the reference.
    r = httpx.post(f"{server.url}/generate", timeout=60, json={
        "input_ids": prompt_ids + STORIES_FIRST_40[:10], "sampling_params": {"max_new_tokens": 20, "temperature": 0}})
    assert r.json()["output_ids"] == STORIES_FIRST_40[10:30]


# ------------------------------------------------------------------ streaming

def test_stream_deltas_join_to_the_non_streamed_text(client: Any, model: str) -> None:
    whole = greedy(client, model, STORIES_PROMPT, 30)
    chunks = list(greedy(client, model, STORIES_PROMPT, 30, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert len(text_chunks) > 2  # really streamed, not one lump
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 30
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    cached_details(usage_chunk.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(client: Any, model: str) -> None:
    chunks = list(greedy(client, model, STORIES_PROMPT, 5, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_template_is_a_clear_400(client: Any, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    err = assert_openai_error(e.value, 400, param="messages")
    assert "chat template" in err["message"] and "/v1/completions" in err["message"]


# ------------------------------------------------------------------ usage and the prefix cache

def test_repeated_long_prompt_reports_device_cache_hit(client: Any, model: str) -> None:
    first = greedy(client, model, LONG_PROMPT, 12)
    assert first.usage.prompt_tokens > 40  # several 16-token pages
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert cached_details(first.usage) == {"device": 0, "host": 0, "storage": 0}
    second = greedy(client, model, LONG_PROMPT, 12)
    tiers = cached_details(second.usage)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert tiers["device"] > 0 and tiers["host"] == tiers["storage"] == 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens  # last token is recomputed
    assert second.choices[0].text == first.choices[0].text


# ------------------------------------------------------------------ concurrency

CONCURRENT = [
    ("Once upon a time, there was a little dog", 12),
    ("Tom and Sue went to the park", 20),
    ("The cat sat on the mat and", 9),
    ("One day, a big bird flew", 30),
    ("Lily had a red ball. She", 16),
    ("The sun was hot, so Ben", 25),
    ("Mom said, \"Let's bake a cake", 14),
    ("In a small house lived a", 22),
]


def test_concurrent_streams_equal_solo_runs(server: ServerProcess, client: Any, model: str) -> None:
    solo = [greedy(client, model, p, n).choices[0].text for p, n in CONCURRENT]

    async def one_stream(aclient: Any, prompt: str, n: int) -> tuple[str, str | None]:
        stream = await aclient.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_streams() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60) as ac:
            return await asyncio.gather(*(one_stream(ac, p, n) for p, n in CONCURRENT))

    together = asyncio.run(all_streams())
    assert [t for t, _ in together] == solo
    assert all(f in ("length", "stop") for _, f in together)


# ------------------------------------------------------------------ stop rules and sampling

def test_stop_string_and_max_tokens_finish_reasons(client: Any, model: str) -> None:
    stopped = greedy(client, model, STORIES_PROMPT, 40, stop=["Lily"])
    assert stopped.choices[0].text == STORIES_TEXT.split("Lily")[0]  # the stop string itself is not returned
    assert stopped.choices[0].finish_reason == "stop"
    short = greedy(client, model, STORIES_PROMPT, 3)
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3
    assert STORIES_TEXT.startswith(short.choices[0].text)


def test_seeded_sampling_is_reproducible(client: Any, model: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt=STORIES_PROMPT, max_tokens=30, temperature=0.8,
                                         seed=seed).choices[0].text

    assert sample(7) == sample(7)
    # Sampling really happens: across a few seeds, not every text is the greedy one.
    greedy_text = greedy(client, model, STORIES_PROMPT, 30).choices[0].text
    assert any(sample(s) != greedy_text for s in (7, 8, 9, 10))


# ------------------------------------------------------------------ bad input

def test_bad_requests_are_400_in_openai_shape_and_server_keeps_serving(client: Any, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=STORIES_PROMPT, max_tokens=5, temperature=-1)
    assert_openai_error(e.value, 400, param="temperature")

    with pytest.raises(openai.BadRequestError) as e:
        greedy(client, model, "the dog ran " * 200, 5)  # far more than the 512-token context
    err = assert_openai_error(e.value, 400, param="prompt")
    assert err["code"] == "context_length_exceeded" and "512" in err["message"]

    with pytest.raises(openai.BadRequestError) as e:
        greedy(client, model, STORIES_PROMPT, 600)
    err = assert_openai_error(e.value, 400, param="max_tokens")
    assert err["code"] == "context_length_exceeded"

    with pytest.raises(openai.BadRequestError) as e:
        greedy(client, model, STORIES_PROMPT, 5, n=0)
    assert_openai_error(e.value, 400)

    assert greedy(client, model, STORIES_PROMPT, 40).choices[0].text == STORIES_TEXT


# ------------------------------------------------------------------ disconnect frees resources

def test_mid_stream_disconnect_aborts_and_frees_kv(server: ServerProcess, client: Any, model: str) -> None:
    aborted_before = metric(httpx.get(f"{server.url}/metrics").text, "tierlm_requests_total", finish_reason="abort")
    stream = client.completions.create(model=model, prompt=STORIES_PROMPT, max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    received = [next(it).choices[0].text for _ in range(2)]
    assert "".join(received) and STORIES_TEXT.startswith("".join(received))
    stream.close()

    deadline = time.monotonic() + 10
    while True:
        info = httpx.get(f"{server.url}/server_info").json()
        pool = info["kv_pool"]
        idle = (pool["in_use_pages"] == 0 and info["running_requests"] == 0 and info["waiting_requests"] == 0
                and pool["free_pages"] + pool["cached_pages"] == pool["total_pages"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, f"the server did not release the dropped stream's KV within 10 s: {info}"
    # The request was aborted, not run to its 400 tokens.
    aborted_after = metric(httpx.get(f"{server.url}/metrics").text, "tierlm_requests_total", finish_reason="abort")
    assert aborted_after == aborted_before + 1
    assert greedy(client, model, STORIES_PROMPT, 40).choices[0].text == STORIES_TEXT


# ------------------------------------------------------------------ metrics

def test_metrics_count_requests_tokens_ttft_and_cache_hits(server: ServerProcess, client: Any, model: str) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    prompt = "Sam found a shiny stone by the lake. He showed it to his friend Anna, and they wondered where it came " \
             "from. Anna said it"
    first = greedy(client, model, prompt, 7)
    second = greedy(client, model, prompt, 7)
    after = httpx.get(f"{server.url}/metrics").text
    assert "tierlm_time_to_first_token_seconds_bucket" in after

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("tierlm_requests_total") == 2
    assert delta("tierlm_requests_total", finish_reason="length") == 2
    assert delta("tierlm_prompt_tokens_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert delta("tierlm_generation_tokens_total") == 14
    assert delta("tierlm_time_to_first_token_seconds_count") == 2
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert hit > 0
    assert delta("tierlm_cache_hit_tokens_total", tier="device") == hit
    assert delta("tierlm_cache_hit_tokens_total", tier="host") == 0
    assert delta("tierlm_prefill_tokens_total") == first.usage.prompt_tokens + second.usage.prompt_tokens - hit


# ------------------------------------------------------------------ --api-key

def test_api_key_required_on_api_routes(stories_dir: Path, tmp_path: Path) -> None:
    with start_server(["--model-path", str(stories_dir), "--skip-warmup", "--api-key", "secret",
                       "--max-total-tokens", "1024"], env={"TIERLM_NO_PROGRESS": "1"}, log_dir=tmp_path) as s:
        no_key = httpx.post(f"{s.url}/v1/completions", json={"prompt": STORIES_PROMPT, "max_tokens": 3})
        assert no_key.status_code == 401
        err = no_key.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "--api-key" in err["message"]

        with pytest.raises(openai.AuthenticationError) as e:
            wrong = openai.OpenAI(base_url=s.base_url, api_key="not-the-key", max_retries=0)
            wrong.completions.create(model="default", prompt=STORIES_PROMPT, max_tokens=3)
        assert_openai_error(e.value, 401)

        good = openai.OpenAI(base_url=s.base_url, api_key="secret", max_retries=0, timeout=60)
        comp = good.completions.create(model="default", prompt=STORIES_PROMPT, max_tokens=40, temperature=0)
        assert comp.choices[0].text == STORIES_TEXT
        assert httpx.get(f"{s.url}/health").status_code == 200  # health checks stay open
