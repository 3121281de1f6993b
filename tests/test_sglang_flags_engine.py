"""SGLang flags with engine behaviour: --stream-interval, --max-prefill-tokens, --max-queued-requests,
--watchdog-timeout (docs/sglang-compat.md)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from engine_harness import greedy, run, start_engine

from tierlm.runtime.engine import Wake
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import GenerateRequest


def test_stream_interval_batches_increments(tiny_llama) -> None:
    prompt = list(range(3, 20))
    every = start_engine(tiny_llama, page_size=4, max_total_tokens=1024)
    sparse = start_engine(tiny_llama, page_size=4, max_total_tokens=1024, stream_interval=4)
    try:
        a = run(every, [prompt], greedy(12), stream=True)[0]
        b = run(sparse, [prompt], greedy(12), stream=True)[0]
    finally:
        every.shutdown()
        sparse.shutdown()
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.increments == 12
    assert b.increments == 4  # token 1, tokens 2-4, 5-8, then the final increment with 9-12


def test_max_prefill_tokens_caps_the_step_budget(tiny_llama) -> None:
    prompt = list(range(3, 60))
    ref = start_engine(tiny_llama, page_size=4, max_total_tokens=1024, chunked_prefill_size=64)
    capped = start_engine(tiny_llama, page_size=4, max_total_tokens=1024, chunked_prefill_size=64,
                          max_prefill_tokens=16)
    try:
        assert (ref.parts.scheduler.prefill_budget, capped.parts.scheduler.prefill_budget) == (64, 16)
        a = run(ref, [prompt], greedy(8))[0]
        steps_before = capped.parts.scheduler.steps
        b = run(capped, [prompt], greedy(8))[0]
        assert capped.parts.scheduler.steps - steps_before >= 4 + 7  # 57 prompt tokens in chunks of <= 16
    finally:
        ref.shutdown()
        capped.shutdown()
    assert a.token_ids == b.token_ids


def test_max_queued_requests_refuses_with_503(tiny_llama) -> None:
    engine = start_engine(tiny_llama, page_size=4, max_total_tokens=1024, max_queued_requests=2)
    try:
        engine.check_queue()
        engine._sinks.update({"w1": None, "w2": None})  # two requests waiting, none running
        with pytest.raises(RequestError) as e:
            engine.check_queue()
        assert e.value.status == 503 and "--max-queued-requests 2" in e.value.message
        engine._sinks.clear()
    finally:
        engine.shutdown()


def test_watchdog_marks_a_stuck_step_unhealthy(tiny_llama, caplog: pytest.LogCaptureFixture) -> None:
    engine = start_engine(tiny_llama, page_size=4, max_total_tokens=1024, watchdog_timeout=0.2)
    release = threading.Event()
    try:
        assert run(engine, [[3, 4, 5]], greedy(2))[0].token_ids  # healthy: serves
        real_step = engine.parts.scheduler.step

        def hung_step() -> bool:  # a forward that never returns (until the test lets it)
            release.wait(30)
            return real_step()

        engine.parts.scheduler.step = hung_step
        engine._inbox.put(Wake())  # the scheduler loop runs one (hung) step
        deadline = time.monotonic() + 5
        while engine.unhealthy is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.unhealthy is not None and "--watchdog-timeout" in engine.unhealthy
        assert "watchdog" in caplog.text

        async def one():
            async for _ in engine.generate(GenerateRequest(rid="x", input_ids=[3, 4], sampling_params=greedy(1))):
                pass

        with pytest.raises(RequestError) as e:
            asyncio.run(one())
        assert e.value.status == 503
    finally:
        release.set()
        engine.shutdown()
