"""Continuous-batching scheduler: admits requests by free pages in the --schedule-policy order
(runtime/schedule_policy.py), mixes prefill chunks and decode steps into one batched forward per step, reuses
cached prefixes, and retracts requests when pages run out.

Runs on the engine's scheduler thread only; nothing here is thread-safe on purpose.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from tierlm.backends.base import ModelBackend
from tierlm.runtime.batch_builder import build_forward_batch
from tierlm.runtime.cache.kv_cache_manager import KVCacheManager
from tierlm.runtime.grammar.manager import GrammarManager
from tierlm.runtime.io_struct import GenerateOutput
from tierlm.runtime.logprobs import add_logprob_rows, init_logprobs, record_logprobs, samples
from tierlm.runtime.metrics import EngineMetrics
from tierlm.runtime.output_processor import OutputProcessor
from tierlm.runtime.request import Req
from tierlm.runtime.schedule_policy import SchedulePolicy
from tierlm.runtime.speculative.speculator import NgramSpeculator

log = logging.getLogger(__name__)
# waiting requests checked per step for an uncached prompt that fits the step's budget whole (each check walks the
# radix tree once, without locking or loading anything)
SHORT_SCAN = 32


class Scheduler:
    def __init__(self, backend: ModelBackend, cache: KVCacheManager, *, max_running_requests: int,
                 chunked_prefill_size: int, metrics: EngineMetrics, outputs: OutputProcessor,
                 emit: Callable[[Req, GenerateOutput], None], grammar: GrammarManager | None = None,
                 max_prefill_tokens: int | None = None, stream_interval: int = 1, schedule_policy: str = "fcfs",
                 random_seed: int = 0, speculator: NgramSpeculator | None = None) -> None:
        self.backend = backend
        self.cache = cache
        self.page_size = cache.page_size
        self.max_running = max_running_requests
        self.chunk = chunked_prefill_size
        # One step's prefill budget: --chunked-prefill-size, lowered by --max-prefill-tokens (SGLang's cap on the
        # prompt tokens of one prefill batch) when that is smaller.
        self.prefill_budget = min(chunked_prefill_size, max_prefill_tokens or chunked_prefill_size)
        self.stream_interval = max(1, stream_interval)  # --stream-interval: an increment every N tokens
        self.metrics = metrics
        self.outputs = outputs
        self.emit = emit
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.steps = 0
        self.grammar = grammar or GrammarManager(None)  # structured output (None: every grammar is refused)
        # --schedule-policy: the order waiting requests are offered for admission (self.waiting keeps arrival order)
        self.policy = SchedulePolicy(schedule_policy, cache, seed=random_seed)
        log.info("schedule policy %s", self.policy.describe())
        self.spec = speculator  # --speculative-algorithm NGRAM: draft tokens verified in this batch
        self._drafts: dict[Req, list[int]] = {}  # this step's draft tokens per request

    # ------------------------------------------------------------ queue control
    def add(self, req: Req) -> None:
        self.outputs.init_request(req)
        init_logprobs(req)  # max_tokens=0 with prompt logprobs still prefills (prefill_only)
        if req.finish_reason is not None:  # req.finished, e.g. max_tokens=0: nothing to compute
            self._finish(req, req.finish_reason)
            return
        self.cache.on_request_added(req)
        self.grammar.attach(req)  # starts compiling its grammar (if any) off this thread
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._finish(req, "abort")
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ one step
    def step(self) -> bool:
        """Schedule, run one batched forward, process its tokens. Returns False when there was nothing to do."""
        self.cache.sweep_pins()  # expiry is lazy; this keeps the pin table short
        items = self._schedule()
        if not items:
            return False
        drafts = self._drafts
        self.cache.plan_snapshots(items)  # hybrids: where this step's forward keeps a copy of a request's state
        batch, row_reqs = build_forward_batch(items, self.page_size, drafts)
        batch.sampling.token_bitmask = self.grammar.fill_bitmask(row_reqs)  # None: no constrained row
        scored = add_logprob_rows(batch, items, row_reqs)
        result = self.backend.forward(batch)
        tokens = result.next_token_ids.tolist()
        record_logprobs(result, row_reqs, scored)
        now = time.perf_counter()
        for req, n in items:
            if req in drafts:
                continue  # its kv_len grows by the tokens it accepts (_take_verified)
            req.kv_len += n
            if req.snap_at:
                self.cache.snapshot_taken(req)
            if n > 1:
                self.cache.cache_unfinished(req)
        self.steps += 1
        i = 0
        while i < len(row_reqs):
            req = row_reqs[i]
            d = drafts.get(req)
            if d is None:
                self.outputs.on_token(req, tokens[i], now)
                self._grammar_token(req, tokens[i])
                if req.spec is not None:
                    assert self.spec is not None  # req.spec comes from the speculator
                    self.spec.record(req, 0, 0)  # a verify step that had no draft to check
                added, i = 1, i + 1
            else:
                added = self._take_verified(req, d, tokens[i:i + 1 + len(d)], now)
                i += 1 + len(d)
            if req.finish_reason is not None:  # req.finished
                self.running.remove(req)
                self._finish(req, req.finish_reason)
            elif req.stream and self._stream_now(req, added):
                self.emit(req, self.outputs.delta(req))
        self._finish_prefill_only(items)
        return True

    def _take_verified(self, req: Req, drafts: list[int], outputs: list[int], now: float) -> int:
        """Keep the greedy outputs of a verify step up to the first wrong draft, one token at a time through the
        stop rules; roll the KV of the rest back. Returns the number of tokens added."""
        added = 0
        for j, tok in enumerate(outputs):
            self.outputs.on_token(req, tok, now)
            added += 1
            if req.finished or j == len(drafts) or drafts[j] != tok:
                break
        req.kv_len += added  # the inputs at rows 0..added-1 (last token, accepted drafts) are the sequence's
        assert self.spec is not None  # drafts come from the speculator
        self.spec.record(req, len(drafts), added - 1)
        self.cache.trim(req, req.kv_len + 1)  # pages that only hold rejected drafts' KV go back to the pool
        return added

    def _stream_now(self, req: Req, added: int = 1) -> bool:
        """--stream-interval: the first token at once, then every N tokens; the final increment carries the rest.
        A verify step adds several tokens: an increment when they reach or cross a multiple of N."""
        n, k = len(req.output_ids), self.stream_interval
        return n - added == 0 or n // k > (n - added) // k

    def _finish_prefill_only(self, items: list[tuple[Req, int]]) -> None:
        """Requests that only wanted prompt logprobs (max_tokens=0) end when their prefill is done."""
        for req, _ in items:
            if req.kv_len == req.seq_len and not samples(req) and req in self.running:
                self.running.remove(req)
                self._finish(req, "length")

    def _schedule(self) -> list[tuple[Req, int]]:
        items: dict[Req, int] = {}
        # 1. every running request that decodes gets its next token (pages permitting), with draft tokens to
        #    verify when speculative decoding has some for it
        drafts = self._drafts = {}
        for req in list(self.running):
            if req not in self.running or req.remaining_prefill != 1:
                continue  # retracted meanwhile, or still prefilling
            while not self.cache.reserve(req, req.kv_len + 1):
                victim = self._retract_one(protect=req)
                if victim is None:
                    break
                items.pop(victim, None)
                drafts.pop(victim, None)
            else:
                items[req] = 1
                d = self.spec.drafts(req) if self.spec is not None else None
                if d and self.cache.reserve(req, req.kv_len + 1 + len(d)):
                    drafts[req] = d
                    items[req] = 1 + len(d)
        # 2. prefill within the token budget. New requests go before the prefills in progress, so a short one that
        #    arrives during a long prefill is admitted at the next chunk boundary instead of after the whole prompt
        #    (an agent's side request next to its 64k-token main turn). The oldest prefill in progress takes its
        #    chunk of half the budget (and its pages) first, so a stream of new requests cannot starve it.
        budget = self.prefill_budget
        chunked = [req for req in self.running if req.remaining_prefill > 1]
        prefilling = list(chunked)  # and those admitted below: what a waiting request may wait for
        if chunked:
            n = self._prefill_chunk(chunked[0], budget // 2 or budget)
            if n:
                items[chunked[0]] = n
                budget -= n
        # 3. new requests, in the policy's order (computed once per step, only when one can be admitted): first
        #    those whose uncached prompt fits whole in what is left (an agent's next turn of a few hundred tokens
        #    after a long cached prefix, a side request: their first token this step), then the others
        if self.waiting and budget > 0 and len(self.running) < self.max_running:
            order = self.policy.order(self.waiting)
            budget = self._admit(order[:SHORT_SCAN], budget, items, prefilling, whole=True)
            # still waiting: neither admitted nor ended by the first pass (a grammar that failed to compile)
            budget = self._admit([r for r in order if r not in items and r.finish_reason is None], budget, items,
                                 prefilling, whole=False)
        # 4. the prefills in progress grow their chunks with what is left, the fewest tokens left first
        for req in sorted(chunked, key=lambda r: r.remaining_prefill):
            if budget <= 0:
                break
            had = items.get(req, 0)
            n = self._prefill_chunk(req, had + budget)
            if n > had:
                items[req] = n
                budget -= n - had
        self.policy.deferred.clear()  # this step's hold-backs only; drop the references
        return list(items.items())

    def _admit(self, order: list[Req], budget: int, items: dict[Req, int], prefilling: list[Req],
               whole: bool) -> int:
        """Admit requests of ``order`` (waiting, in the policy's order) into this step within ``budget`` prompt
        tokens; ``whole``: only those whose uncached prompt fits entirely (the others stay for the second pass).
        ``prefilling``: the prefills in progress, which the admitted ones join. Returns the budget left."""
        pos = 0
        passed = 0  # requests ahead that did not fit whole: each keeps a running slot, so short ones cannot starve it
        while pos < len(order) and budget > 0 and len(self.running) + passed < self.max_running:
            admissible, pos = self._next_admissible(order, pos)
            if admissible is None:
                break  # every waiting request's grammar is still compiling
            req = admissible
            cached = self.cache.cached_prefix(req)[0] if whole else None  # one tree walk serves both checks
            if self.policy.waits_for(req, prefilling, cached) is not None:
                continue  # a running prefill computes its next pages: a few chunks later it hits them instead
            if cached is not None and len(req.input_ids) - cached > budget:
                passed += 1
                continue
            if not self.cache.ready_to_admit(req):
                if whole:
                    continue
                break  # its storage pages are still arriving (prefetch policy "timeout")
            self.cache.match(req)
            n = self._prefill_chunk(req, budget)
            if n == 0:
                self.cache.release(req, cache_kv=False)
                break
            self.waiting.remove(req)
            self.running.append(req)
            self.metrics.record_prefill(req.remaining_prefill)
            items[req] = n
            budget -= n
            prefilling.append(req)
        return budget

    # ------------------------------------------------------------ structured output
    def _next_admissible(self, order: list[Req], pos: int) -> tuple[Req | None, int]:
        """The first request of ``order[pos:]`` whose grammar is compiled (or that has none), and the position
        after it. A request whose grammar still compiles stays queued without holding up the ones behind it; one
        whose grammar failed ends with the compiler's message."""
        while pos < len(order):
            req = order[pos]
            pos += 1
            if not self.grammar.ready(req):
                continue
            if req.grammar is not None and req.grammar.error is not None:
                self.waiting.remove(req)
                self._fail(req, req.grammar.error)
                continue
            return req, pos
        return None, pos

    def _grammar_token(self, req: Req, token: int) -> None:
        """Advance a constrained request's matcher; a complete grammar ends the request with "stop"."""
        if req.grammar is None or req.finished:
            return
        verdict = self.grammar.accept(req, token)
        if verdict == "stop":
            self.outputs.end(req, "stop")
        elif verdict == "rejected":  # the bitmask allows only what the matcher accepts: a bug, never silent
            log.error("request %s: the grammar rejected sampled token %d; ending the request", req.rid, token)
            self.outputs.end(req, "abort")

    def _fail(self, req: Req, message: str) -> None:
        """End a waiting request with an error (GenerateOutput.error) and nothing computed."""
        req.finish_reason = "abort"
        self.cache.release(req, cache_kv=False)
        out = self.outputs.final(req)
        out.error = message
        self.emit(req, out)

    def _prefill_chunk(self, req: Req, budget: int) -> int:
        """Reserve pages for the next prefill chunk of ``req``; returns its token count (0: no pages)."""
        n = min(req.remaining_prefill, budget)
        if n < req.remaining_prefill and n > self.page_size:
            n -= (req.kv_len + n) % self.page_size  # end chunks on a page boundary so they can be cached
        return n if self.cache.reserve(req, req.kv_len + n) else 0

    def _retract_one(self, protect: Req) -> Req | None:
        """Give the newest other running request's pages back (its prefix stays cached) and requeue it."""
        victims = [r for r in self.running if r is not protect]
        if not victims:
            return None
        victim = victims[-1]
        self.running.remove(victim)
        self.cache.release(victim, cache_kv=True)
        self.waiting.appendleft(victim)
        self.metrics.record_retraction()
        log.warning("retracted request %s (out of KV pages); it resumes when pages free up", victim.rid)
        return victim

    def _finish(self, req: Req, reason: str) -> None:
        if req.finish_reason is None:
            req.finish_reason = reason
        self.cache.release(req, cache_kv=True)  # pins the prompt prefixes req.pins asks for
        if self.spec is not None:
            self.spec.finish(req)
        out = self.outputs.final(req)
        out.pinned_tokens = req.pinned_tokens
        self.emit(req, out)

    def fail_all(self, message: str) -> None:
        """A step raised: end every request with an error; their KV is not trusted, so nothing is cached."""
        for req in list(self.running) + list(self.waiting):
            req.finish_reason = "abort"
            try:
                self.cache.release(req, cache_kv=False)
            except Exception:  # noqa: BLE001 - keep failing the others
                log.exception("could not release the pages of %s", req.rid)
            out = self.outputs.final(req)
            out.error = message
            self.emit(req, out)
        self.running.clear()
        self.waiting.clear()

    def register_gauges(self, metrics: EngineMetrics) -> None:
        metrics.gauge("tierlm_num_running_requests", "Running requests", lambda: len(self.running))
        metrics.gauge("tierlm_num_waiting_requests", "Waiting requests", lambda: len(self.waiting))

    def flush_cache(self, storage: bool = False) -> bool:
        if self.running or self.waiting:
            return False
        self.cache.flush(storage=storage)
        return True
