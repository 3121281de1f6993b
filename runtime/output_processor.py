"""Per-token output handling: stop rules, incremental detokenization, timing metrics, output increments."""
from __future__ import annotations

import time

from tierlm.runtime.detokenizer import IncrementalDetokenizer
from tierlm.runtime.io_struct import GenerateOutput
from tierlm.runtime.logprobs import take_logprobs
from tierlm.runtime.metrics import EngineMetrics
from tierlm.runtime.request import Req
from tierlm.runtime.stop_checker import StopChecker
from tierlm.runtime.tokenizer_protocol import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], metrics: EngineMetrics) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.metrics = metrics

    def init_request(self, req: Req) -> None:
        p = req.sampling_params
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.input_ids, p.skip_special_tokens)
        req.stop_checker = StopChecker(p.stop, p.stop_token_ids, self.eos_token_ids, p.ignore_eos, p.max_new_tokens)
        if p.max_new_tokens == 0:
            req.finish_reason = "length"

    def on_token(self, req: Req, token: int, now: float) -> None:
        req.output_ids.append(token)
        req.pending_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.record_first_token(now - req.arrival)
        else:
            assert req.last_token_time is not None  # set with first_token_time
            self.metrics.record_inter_token(now - req.last_token_time)
        req.last_token_time = now
        matched: int | str | None
        stop, detok = req.stop_checker, req.detokenizer
        assert stop is not None and detok is not None  # set by init_request
        reason, matched = stop.check_token(token, len(req.output_ids))
        done = False
        if reason != "stop":  # a stop token's own text is never output
            text, done, stop_str = stop.process_text(detok.add([token]))
            req.pending_text += text
            if done:
                reason, matched = "stop", stop_str
        if reason is not None and not done:
            req.pending_text += stop.finish(detok.flush())
            if stop.finished:
                matched = stop.matched_stop
                reason = "stop"
        if reason is not None:
            req.finish_reason, req.matched_stop = reason, matched

    def end(self, req: Req, reason: str) -> None:
        """End ``req`` after its last token for a reason outside the stop rules (a complete grammar): the text the
        stop rules held back is released."""
        assert req.stop_checker is not None and req.detokenizer is not None  # set by init_request
        req.pending_text += req.stop_checker.finish(req.detokenizer.flush())
        req.finish_reason = reason

    def delta(self, req: Req) -> GenerateOutput:
        out = GenerateOutput(rid=req.rid, text=req.pending_text, token_ids=req.pending_ids,
                             prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids),
                             cached=req.cached)
        req.pending_text, req.pending_ids = "", []
        out.logprobs = take_logprobs(req, everything=False)
        return out

    def final(self, req: Req) -> GenerateOutput:
        """The last increment: the rest of the text (all of it when not streaming) and the accounting."""
        if req.stream:
            out = self.delta(req)
        else:
            out = GenerateOutput(rid=req.rid, text=req.pending_text, token_ids=list(req.output_ids),
                                 prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids),
                                 cached=req.cached)
            out.logprobs = take_logprobs(req, everything=True)
        out.finished = True
        out.finish_reason = req.finish_reason
        out.matched_stop = req.matched_stop
        out.e2e_latency = time.perf_counter() - req.arrival
        if req.spec is not None:
            out.spec = req.spec.meta_info()
        self.metrics.record_finished(req.finish_reason, len(req.input_ids), len(req.output_ids),
                                     req.cached.to_dict(), out.e2e_latency,
                                     None if req.first_token_time is None else req.first_token_time - req.arrival)
        return out
