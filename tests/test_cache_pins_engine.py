"""Prompt-caching pins through the real engine, on both backends: a pinned prefix survives a flood that evicts
everything unpinned (asserted per tier) and is then hit from that tier, expires after its TTL, moves down a tier
under memory pressure instead of pushing a running request into retraction, is written through to the host and
L3, and stays within --cache-pin-fraction. Requests carry GenerateRequest.pins as the Messages route sets them."""
import asyncio
import itertools
import re
import time
from pathlib import Path

import pytest
from engine_harness import greedy, pool_is_clean, run, start_engine

from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest, PinRequest

PS = 4
DEVICE_TOKENS = 160  # 40 pages: a pinned 60-token prefix (15 pages) and one flood prompt at a time
PINNED = 60
_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def doc(seed: int, n: int = PINNED) -> list[int]:
    return [(seed * 31 + j * 7) % 270 + 5 for j in range(n)]


PROMPT = doc(1) + [9, 9]


def ask(engine, ids, max_new=4, pins=()) -> GenerateOutput:
    """One request with ``pins``; its final output."""
    async def main():
        last = None
        async for out in engine.generate(GenerateRequest(rid=f"pin{next(_ids)}", input_ids=list(ids),
                                                         sampling_params=greedy(max_new), pins=list(pins))):
            last = out
        return last
    return asyncio.run(main())


def flood(engine, n: int) -> None:
    for i in range(n):
        ask(engine, doc(100 + i))


def pinned(engine) -> dict[str, int]:
    return engine.parts.cache.pins.pinned_pages()


def count_retractions(engine) -> list[int]:
    """A list that grows by one for every retraction the scheduler records from now on."""
    seen, metrics = [], engine.parts.metrics
    record = metrics.record_retraction
    metrics.record_retraction = lambda: (seen.append(1), record())[1]
    return seen


def radix_engine(backend, model, **kw):
    return start_engine(model, backend, page_size=PS, max_total_tokens=DEVICE_TOKENS, **kw)


def hicache_engine(backend, model, **kw):
    kw = {"enable_hierarchical_cache": True, "hicache_ratio": 2.0, "hicache_write_policy": "write_back", **kw}
    return radix_engine(backend, model, **kw)


@pytest.mark.parametrize("pin", [True, False])
def test_pinned_prefix_survives_a_flood_in_the_device_tier(tiny_llama, backend_name, pin):
    engine = radix_engine(backend_name, tiny_llama)
    try:
        first = ask(engine, PROMPT, 8, pins=[PinRequest(PINNED, 300.0)] if pin else [])
        assert first.pinned_tokens == (PINNED if pin else 0)
        flood(engine, 4)
        assert ask(engine, doc(100)).cached.total == 0  # the flood evicted every unpinned page it could
        assert pinned(engine) == {"device": PINNED // PS if pin else 0}
        hot = ask(engine, PROMPT, 8)
        assert hot.cached.device == (PINNED if pin else 0)
        assert hot.token_ids == first.token_ids
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_a_pin_expires_after_its_ttl(tiny_llama, backend_name):
    engine = radix_engine(backend_name, tiny_llama)
    clock = engine.parts.cache.pins.clock = Clock()
    try:
        assert ask(engine, PROMPT, pins=[PinRequest(PINNED, 60.0)]).pinned_tokens == PINNED
        clock.now += 61
        assert pinned(engine) == {"device": 0}
        flood(engine, 4)
        assert ask(engine, PROMPT).cached.total == 0  # evicted like any other prefix
        info = engine.server_info()["pins"]
        assert info["prefixes"] == 0 and info["tiers"]["device"]["pinned_pages"] == 0
    finally:
        engine.shutdown()


def test_pins_never_push_a_running_request_into_retraction(tiny_llama, backend_name):
    engine = radix_engine(backend_name, tiny_llama)
    try:
        assert ask(engine, PROMPT, pins=[PinRequest(PINNED, 300.0)]).pinned_tokens == PINNED
        retracted = count_retractions(engine)
        # two requests that together need every page of the pool (2 x 20 pages): only the pinned pages make room
        outs = run(engine, [doc(200, 40), doc(201, 40)], greedy(40))
        assert [len(o.token_ids) for o in outs] == [40, 40]
        assert retracted == []
        assert engine.parts.cache.tree.evicted_pinned_pages > 0
        assert pinned(engine)["device"] < PINNED // PS
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_the_bound_truncates_a_pin_and_reports_it(tiny_llama, backend_name):
    # 10 of 40 pages; lru, so the flood reaches the unpinned rest of the prompt (loop would keep it: it was reused)
    engine = radix_engine(backend_name, tiny_llama, cache_pin_fraction=0.25, radix_eviction_policy="lru")
    try:
        out = ask(engine, PROMPT, pins=[PinRequest(PINNED, 300.0)])
        assert out.pinned_tokens == 40
        assert ask(engine, doc(2) + [1], pins=[PinRequest(PINNED, 300.0)]).pinned_tokens == 0  # bound spent
        assert ask(engine, PROMPT, pins=[PinRequest(PINNED, 300.0)]).pinned_tokens == 40  # a refresh
        info = engine.server_info()["pins"]
        assert info["tiers"]["device"] == {"pinned_pages": 10, "limit_pages": 10}
        assert info["fraction"] == 0.25 and info["truncated_pins"] >= 2
        flood(engine, 4)
        assert ask(engine, PROMPT).cached.device == 40  # the pinned part survived, the rest of the prompt not
    finally:
        engine.shutdown()


def test_pinned_prefix_is_written_through_to_the_host_and_moves_down_under_pressure(tiny_llama, backend_name):
    engine = hicache_engine(backend_name, tiny_llama)
    try:
        first = ask(engine, PROMPT, 8, pins=[PinRequest(PINNED, 300.0)])
        assert first.pinned_tokens == PINNED
        # write_back backs nothing up before an eviction: the host copy is the pin's own
        assert pinned(engine) == {"device": 15, "host": 15}
        assert engine.parts.cache.tree.host_pages_cached == 15
        flood(engine, 8)  # 8 x 15 pages: more than the 80 host pages hold
        assert ask(engine, doc(100)).cached.total == 0  # gone from both tiers
        assert pinned(engine) == {"device": 15, "host": 15}
        hot = ask(engine, PROMPT, 8)
        assert hot.cached.device == PINNED and hot.token_ids == first.token_ids
        # pressure: the pinned device pages move to the host tier, no request is retracted
        retracted = count_retractions(engine)
        run(engine, [doc(200, 40), doc(201, 40)], greedy(40))
        assert retracted == []
        assert pinned(engine)["device"] < 15 and pinned(engine)["host"] == 15
        warm = ask(engine, PROMPT, 8)
        assert warm.cached.host > 0 and warm.cached.total == PINNED and warm.token_ids == first.token_ids
        metrics = engine.metrics_text().decode()
        assert re.search(r'^tierlm_cache_pinned_pages\{[^}]*tier="host"\} 15\.0$', metrics, re.M)
        assert engine.server_info()["pins"]["tiers"]["host"] == {"pinned_pages": 15, "limit_pages": 40}
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def _page_files(store: Path) -> list[Path]:
    return [p for p in store.rglob("*") if p.is_file() and p.name != "namespace.json"
            and not p.name.startswith(".tmp-")]


def test_pinned_prefix_reaches_l3_and_flush_drops_pins(tiny_llama, store, backend_name):
    kw = {"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "wait_complete"}
    engine = hicache_engine(backend_name, tiny_llama, **kw)
    try:
        first = ask(engine, PROMPT, 8, pins=[PinRequest(PINNED, 300.0)])
        deadline = time.monotonic() + 20
        while len(_page_files(store)) < 15 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_page_files(store)) == 15  # write_back: only the pinned pages were written
        assert asyncio.run(engine.flush_cache())
        assert pinned(engine) == {"device": 0, "host": 0} and engine.server_info()["pins"]["prefixes"] == 0
    finally:
        engine.shutdown()
    engine = hicache_engine(backend_name, tiny_llama, **kw)
    try:
        hot = ask(engine, PROMPT, 8)
        assert hot.cached.storage == PINNED and hot.token_ids == first.token_ids
    finally:
        engine.shutdown()


@pytest.mark.parametrize("pin, message", [(PinRequest(0, 60.0), "covers 0 tokens"),
                                          (PinRequest(999, 60.0), "covers 999 tokens"),
                                          (PinRequest(8, 0.0), "ttl"), (PinRequest(8, float("inf")), "ttl")])
def test_bad_pins_are_a_400(tiny_llama, pin, message):
    from tierlm.runtime.errors import RequestError

    engine = radix_engine("torch", tiny_llama)
    try:
        with pytest.raises(RequestError, match=message) as e:
            ask(engine, PROMPT, pins=[pin])
        assert e.value.status == 400 and e.value.param == "pins"
    finally:
        engine.shutdown()


def test_server_shows_pins_per_tier_and_the_flag_is_checked(tiny_llama, capsys):
    """A real server process: /server_info's ``pins`` and the per-tier gauge in /metrics follow the flag."""
    import httpx
    from e2e_server import start_server

    from tierlm.server.commands.cli_args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--cache-pin-fraction", "1.5"])
    assert "--cache-pin-fraction must be between 0 and 1" in capsys.readouterr().err
    args = ["--model-path", str(tiny_llama), "--page-size", str(PS), "--max-total-tokens", str(DEVICE_TOKENS),
            "--enable-hierarchical-cache", "--hicache-ratio", "2", "--cache-pin-fraction", "0.3"]
    with start_server(args) as server:
        info = httpx.get(f"{server.url}/server_info").json()["pins"]
        assert info["fraction"] == 0.3 and info["prefixes"] == 0
        assert info["tiers"] == {"device": {"pinned_pages": 0, "limit_pages": 12},
                                 "host": {"pinned_pages": 0, "limit_pages": 24}}
        metrics = httpx.get(f"{server.url}/metrics").text
        for tier in ("device", "host"):
            assert re.search(rf'^tierlm_cache_pinned_pages\{{[^}}]*tier="{tier}"\}} 0\.0$', metrics, re.M)
