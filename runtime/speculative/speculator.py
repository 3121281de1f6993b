"""Speculative decoding in the scheduler's own batch: which decoding requests get draft tokens this step, and how
many of them the model's outputs accept.

A decoding request with drafts d1..dk runs 1 + k positions in the step's forward (its last token, then the drafts:
a short extend over its cached KV) and gets the greedy token o0..ok at every position. o0 is always the next
token; d(i+1) is right exactly when it equals oi, and then o(i+1) is right too. So the accepted tokens are
o0..om where m is the number of leading drafts that match, checked one token at a time against the stop rules by
the scheduler. The KV written for rejected positions lies past the request's kv_len, in its own pages: those pages
are freed and never reach the radix tree.

Only greedy rows without penalties, grammar or logprobs get drafts (for them exact-match acceptance leaves the
output unchanged); every other row decodes one token a step, in the same batch.

Drafts are not free everywhere: a verify forward of 1 + k tokens costs about what a decode forward does on a GPU
or with bf16 weights on a CPU, but about twice as much with float32 weights on a CPU. The warm-up measures that
ratio (verify_cost.py); a request whose drafts lately earned fewer accepted tokens per step than the extra cost
stops proposing them, and tries again after 1, 2, 4 ... 32 decode steps (an exponential back-off), so text that
never repeats costs almost nothing and a request that starts copying is found again quickly.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tierlm.backends.base import ModelBackend
from tierlm.runtime.metrics import EngineMetrics
from tierlm.runtime.speculative.ngram import NgramDrafter
from tierlm.runtime.speculative.spec_stats import SpecStats
from tierlm.runtime.speculative.verify_cost import measure_verify_cost

if TYPE_CHECKING:
    from tierlm.runtime.request import Req
    from tierlm.runtime.server_args import ServerArgs

log = logging.getLogger(__name__)

MAX_BACKOFF_STEPS = 32  # longest pause of a request's drafts; a copy that starts is picked up within this many tokens


class NgramSpeculator:
    def __init__(self, drafter: NgramDrafter, num_draft_tokens: int, metrics: EngineMetrics) -> None:
        self.drafter = drafter
        self.max_drafts = num_draft_tokens - 1  # the verified positions include the request's current token
        # extra cost of a verify forward over a decode forward, in decode forwards (measure_cost; 0 until measured:
        # then drafts are always proposed)
        self.draft_cost = 0.0
        self.verify_steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        metrics.counter("tierlm_spec_verify_steps", "Decode steps of requests that could take draft tokens",
                        lambda: self.verify_steps)
        metrics.counter("tierlm_spec_draft_tokens", "Draft tokens proposed (NGRAM)", lambda: self.draft_tokens)
        metrics.counter("tierlm_spec_accepted_tokens", "Draft tokens accepted", lambda: self.accepted_tokens)
        metrics.gauge("tierlm_spec_accept_length", "Tokens per verify step since start (1 = no draft accepted)",
                      self.accept_length)
        metrics.gauge("tierlm_spec_accept_rate", "Accepted / proposed draft tokens since start", self.accept_rate)

    @classmethod
    def create(cls, args: ServerArgs, metrics: EngineMetrics) -> "NgramSpeculator | None":
        if args.speculative_algorithm is None:
            return None
        drafter = NgramDrafter(args.speculative_ngram_min_match_window_size,
                               args.speculative_ngram_max_match_window_size, args.speculative_ngram_branch_length,
                               args.speculative_ngram_capacity, args.speculative_ngram_match_type)
        spec = cls(drafter, args.num_draft_tokens, metrics)
        log.info("speculative decoding: NGRAM, up to %d draft tokens per step (%d positions verified), match window "
                 "%d..%d tokens, match type %s, shared n-gram store of %d tokens; greedy requests only",
                 spec.max_drafts, args.num_draft_tokens, args.speculative_ngram_min_match_window_size,
                 args.speculative_ngram_max_match_window_size, args.speculative_ngram_match_type,
                 args.speculative_ngram_capacity)
        return spec

    def measure_cost(self, backend: ModelBackend, page_size: int, num_pages: int) -> None:
        """Time a verify forward against a decode forward on this backend (at warm-up) and set ``draft_cost``."""
        ratio = measure_verify_cost(backend, page_size, num_pages, self.max_drafts)
        self.draft_cost = max(0.0, ratio - 1.0)
        log.info("speculative decoding: a verify forward of %d tokens costs %.2fx a decode forward here; a request "
                 "keeps proposing drafts while they earn %.2f accepted tokens per step or more", 1 + self.max_drafts,
                 ratio, self.draft_cost)

    # ------------------------------------------------------------ per step
    @staticmethod
    def eligible(req: Req) -> bool:
        """Greedy without penalties, grammar or logprobs: exact-match acceptance keeps its output unchanged."""
        p = req.sampling_params
        return p.is_greedy and not p.uses_penalties and req.grammar is None and req.logprobs is None

    def drafts(self, req: Req) -> list[int]:
        """Draft tokens to verify after ``req``'s last token this step (possibly none)."""
        if not self.eligible(req):
            return []
        if req.spec is None:
            req.spec = SpecStats()
            req.spec_state = self.drafter.new_state(req.input_ids)
            req.spec_seen = 0
        appended = req.output_ids[req.spec_seen:]
        req.spec_seen = len(req.output_ids)
        # never past max_new_tokens: the step's first token is always kept, each accepted draft adds one
        room = min(self.max_drafts, req.sampling_params.max_new_tokens - len(req.output_ids) - 1)
        st = req.spec
        if st.wait > 0:  # backing off: the drafter still indexes the new tokens
            st.wait -= 1
            room = 0
        assert req.spec_state is not None  # set with req.spec above
        return self.drafter.propose(req.spec_state, appended, max(room, 0))

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        st = req.spec
        assert st is not None  # drafts() set it before the verify step
        st.verify_ct += 1
        st.draft_tokens += proposed
        st.accepted_tokens += accepted
        if proposed:
            st.gain = 0.5 * st.gain + 0.5 * accepted
            if st.gain < self.draft_cost:  # drafts lately cost more than they gave: pause them, longer each time
                st.backoff = min(max(1, 2 * st.backoff), MAX_BACKOFF_STEPS)
                st.wait = st.backoff
            else:
                st.backoff = 0
        self.verify_steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted

    def finish(self, req: Req) -> None:
        """``req`` is done: its tokens go into the shared n-gram store."""
        if req.spec_state is not None:
            self.drafter.finish(req.spec_state)
            req.spec_state = None

    # ------------------------------------------------------------ reporting
    def accept_length(self) -> float:
        return (self.verify_steps + self.accepted_tokens) / self.verify_steps if self.verify_steps else 1.0

    def accept_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def info(self) -> dict[str, Any]:
        return {"algorithm": "NGRAM", "max_draft_tokens": self.max_drafts, "draft_cost": round(self.draft_cost, 3),
                "verify_steps": self.verify_steps,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accept_length": round(self.accept_length(), 4), "accept_rate": round(self.accept_rate(), 4),
                **self.drafter.stats()}

