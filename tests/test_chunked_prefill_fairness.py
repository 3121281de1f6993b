"""Chunked prefill mixing (runtime/scheduler.py): a request that arrives while a long prompt prefills is admitted at
the next chunk boundary, not after the whole prompt (an agent's side request next to its long main turn), and the
long prompt keeps half of every step's budget however many new requests arrive. The scheduler is driven by hand,
step by step, on a real engine; outputs stay transformers' greedy tokens."""
from __future__ import annotations

import pytest
from engine_harness import greedy, pool_is_clean, start_engine
from model_factory import reference_greedy

from tierlm.runtime.request import Req

PS = 4
CHUNK = 32


def prompt(start: int, n: int) -> list[int]:
    return [(start + i * 7) % 250 + 3 for i in range(n)]


@pytest.fixture
def scheduler(tiny_llama, backend_name):
    engine = start_engine(tiny_llama, backend_name, page_size=PS, max_total_tokens=4096,
                          chunked_prefill_size=CHUNK)
    engine.stop_scheduler()  # drive the scheduler by hand from here
    try:
        yield engine.parts.scheduler
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_a_short_request_is_admitted_at_the_next_chunk_boundary(scheduler, tiny_llama) -> None:
    long = Req(rid="long", input_ids=prompt(10, 300), sampling_params=greedy(4))
    scheduler.add(long)
    scheduler.step()
    assert long.kv_len == CHUNK  # alone, the long prompt takes the whole budget
    short = Req(rid="short", input_ids=prompt(90, 12), sampling_params=greedy(4))
    scheduler.add(short)
    scheduler.step()
    # the next step prefills all of the short prompt and samples its first token, and the long one goes on
    assert short.kv_len == len(short.input_ids) and len(short.output_ids) == 1
    assert long.kv_len >= CHUNK + CHUNK // 2 and not long.output_ids
    while scheduler.has_work():
        scheduler.step()
    for req in (long, short):
        assert req.output_ids == reference_greedy(tiny_llama, req.input_ids, 4), req.rid


def test_new_requests_cannot_starve_the_prefill_in_progress(scheduler) -> None:
    long = Req(rid="long", input_ids=prompt(10, 200), sampling_params=greedy(1))
    scheduler.add(long)
    scheduler.step()
    for i in range(4):  # a new request as long as the whole budget arrives at every step
        before = long.kv_len
        scheduler.add(Req(rid=f"new{i}", input_ids=prompt(40 + 31 * i, CHUNK), sampling_params=greedy(1)))
        scheduler.step()
        assert long.kv_len - before >= CHUNK // 2  # its half of the budget
    while scheduler.has_work():
        scheduler.step()
    assert len(long.output_ids) == 1


def test_requests_sharing_a_long_prefix_compute_it_once(scheduler, tiny_llama) -> None:
    """Agent sessions started together send the same long tools and instructions: the first computes them, the
    others wait for those pages (the short unrelated request does not) and then hit them."""
    shared = prompt(10, 200)
    first, second = (Req(rid=f"s{i}", input_ids=shared + prompt(100 + 9 * i, 6), sampling_params=greedy(3))
                     for i in range(2))
    other = Req(rid="other", input_ids=prompt(90, 12), sampling_params=greedy(3))
    for req in (first, second, other):
        scheduler.add(req)
    scheduler.step()
    scheduler.step()
    assert len(other.output_ids) >= 1 and second in scheduler.waiting  # it waits, the unrelated one goes
    while scheduler.has_work():
        scheduler.step()
    assert second.cached.device == len(shared) // PS * PS  # every whole page of the shared prefix
    for req in (first, second, other):
        assert req.output_ids == reference_greedy(tiny_llama, req.input_ids, 3), req.rid


def test_a_short_turn_goes_before_a_long_prompt_that_arrived_first(scheduler, tiny_llama) -> None:
    """A request whose uncached prompt fits the step's budget whole is admitted before an earlier one that does not
    (its first token this step); the earlier one still gets what is left of the budget."""
    long = Req(rid="long", input_ids=prompt(10, 200), sampling_params=greedy(2))
    short = Req(rid="short", input_ids=prompt(90, 20), sampling_params=greedy(2))
    scheduler.add(long)
    scheduler.add(short)
    scheduler.step()
    assert len(short.output_ids) == 1 and long.kv_len == CHUNK - len(short.input_ids)  # the rest of the budget
    while scheduler.has_work():
        scheduler.step()
    for req in (long, short):
        assert req.output_ids == reference_greedy(tiny_llama, req.input_ids, 2), req.rid
