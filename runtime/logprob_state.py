"""One request's log-probability bookkeeping (runtime/logprobs.py fills it): what it asked for, what was scored."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Optional, TypeVar

from tierlm.runtime.io_struct import TopList


# a logprob: float, or float | None for prompt tokens (the first prompt token has none)
LP = TypeVar("LP", bound=Optional[float])


@dataclass
class _Entries(Generic[LP]):
    ids: list[int] = field(default_factory=list)
    logprobs: list[LP] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    sent: int = 0  # entries already handed out in increments

    def take(self, everything: bool, with_top: bool) -> tuple[list[int], list[LP], list[TopList] | None]:
        start = 0 if everything else self.sent
        self.sent = len(self.ids)
        top = None
        if with_top:
            top = [list(zip(i, v)) for i, v in zip(self.top_ids[start:], self.top_logprobs[start:])]
        return self.ids[start:], self.logprobs[start:], top


@dataclass
class LogprobState:
    """What one request asked for and what has been scored so far."""

    top_k: int
    output: bool  # logprobs of the output tokens
    prompt_start: int  # first prompt token reported; -1: no prompt logprobs
    prompt_len: int
    prompt_next: int  # next prompt row to score: row p scores prompt token p + 1 (rows p < prompt_len - 1)
    prefill_only: bool = False  # max_new_tokens == 0 with prompt logprobs: prefill, sample nothing, finish
    inputs: _Entries[float | None] = field(default_factory=_Entries)
    outputs: _Entries[float] = field(default_factory=_Entries)

    @property
    def prompt_rows_pending(self) -> bool:
        return self.prompt_start >= 0 and self.prompt_next < self.prompt_len - 1
