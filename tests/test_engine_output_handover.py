"""The scheduler thread hands a step's outputs to the event loop in one call per loop (runtime/engine.py), not one
per request and token: every request still gets all its increments, in order, and the same tokens as unstreamed."""
from __future__ import annotations

import threading

from engine_harness import greedy, pool_is_clean, run, start_engine

from tierlm.runtime import engine as engine_module

PROMPTS = [list(range(10, 17)), list(range(40, 60)), [5, 9, 11], list(range(100, 131))]


def test_a_steps_outputs_reach_the_loop_in_one_handover(tiny_llama, monkeypatch):
    handovers: list[tuple[str, list[int]]] = []  # (thread that handed over, the request queues in the batch)
    real_send = engine_module.Engine._send_outputs

    def send_outputs(self):
        for items in self._outbox.values():
            handovers.append((threading.current_thread().name, [id(q) for q, _ in items]))
        real_send(self)

    monkeypatch.setattr(engine_module.Engine, "_send_outputs", send_outputs)
    engine = start_engine(tiny_llama, page_size=4, max_total_tokens=2048)
    try:
        streamed = run(engine, PROMPTS, greedy(12), stream=True)
        whole = run(engine, PROMPTS, greedy(12))
    finally:
        engine.shutdown()
    for s, w in zip(streamed, whole):
        assert s.token_ids == w.token_ids and len(s.token_ids) == 12
        assert s.increments >= 12 and s.last.finished  # one increment a token, then the final one (or with it)
    assert pool_is_clean(engine)
    assert handovers and all(name == "tierlm-scheduler" for name, _ in handovers)
    # 4 requests decoding together: their outputs of one step share a handover (one queue each in it)
    assert max(len(set(queues)) for _, queues in handovers) == len(PROMPTS)
    increments = sum(s.increments for s in streamed) + sum(w.increments for w in whole)
    assert len(handovers) < increments / 2
