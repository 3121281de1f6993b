"""Req: one request's state inside the scheduler (tokens, pages, cache locks, output bookkeeping)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierlm.runtime.cache.radix_cache import TreeNode
from tierlm.runtime.detokenizer import IncrementalDetokenizer
from tierlm.runtime.grammar.spec import RequestGrammar
from tierlm.runtime.io_struct import CachedTokens, PinRequest
from tierlm.runtime.logprob_state import LogprobState
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.runtime.speculative.ngram import NgramState
from tierlm.runtime.speculative.spec_stats import SpecStats
from tierlm.runtime.stop_checker import StopChecker

if TYPE_CHECKING:  # only HiCache creates one; a plain radix cache never loads the L3 modules
    from tierlm.runtime.cache.storage.storage_io import PrefetchHandle


@dataclass
class PendingPrefetch:
    """A waiting request's L3 read in flight: page ``start_page`` of its prompt onwards, started at
    ``started_at`` (time.perf_counter), loading through ``handle``."""

    start_page: int
    handle: PrefetchHandle
    started_at: float
    known_pages: int  # how many of its pages the storage's index knows; the rest are probed
    waited: bool = False  # the scheduler already waited briefly for it once (HiCacheManager.ready_to_admit)

@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping: positions 0..kv_len-1 have K/V in ``pages``; pages[:tree_pages] belong to the radix tree
    # (locked through ``last_node``), the rest to this request.
    kv_len: int = 0
    pages: list[int] = field(default_factory=list)
    tree_pages: int = 0
    last_node: TreeNode | None = None
    state_slot: int | None = None  # hybrids: the recurrent-state slot it runs in (runtime/cache/state_slots.py)
    # hybrids, prefix reuse (runtime/cache/state_snapshots.py): ``snap_slot`` holds the state after position snap_len - 1
    # (page-aligned), not yet on a tree node; ``fork_len`` is where the cached KV went deeper than any snapshot (a
    # snapshot is taken there); ``snap_at`` is the point this step's forward copies the state at (0: none).
    snap_slot: int | None = None
    snap_len: int = 0
    fork_len: int = 0
    snap_at: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    admitted_once: bool = False
    prefetch: PendingPrefetch | None = None  # HiCache: set while its L3 pages are read in the background
    grammar: RequestGrammar | None = None  # set by GrammarManager.attach for a structured-output request
    pins: list[PinRequest] = field(default_factory=list)  # prompt prefixes to pin when it ends (cache/pins.py)
    pinned_tokens: int = 0  # prompt tokens those pins held (GenerateOutput.pinned_tokens)
    logprobs: LogprobState | None = None  # set by runtime/logprobs.init_logprobs when the request asks for any
    # speculative decoding (runtime/speculative/): counts, the drafter's per-request index, output tokens it has seen
    spec: SpecStats | None = None  # once the request took part in a verify step
    spec_state: NgramState | None = None
    spec_seen: int = 0
    # output
    detokenizer: IncrementalDetokenizer | None = None  # set by OutputProcessor.init_request
    stop_checker: StopChecker | None = None
    pending_text: str = ""  # text produced since the last emit
    pending_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    # timing
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.input_ids)
        return self.input_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        return (self.input_ids + self.output_ids)[start:end]

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to run through the model before the next token can be sampled (1 when decoding)."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
