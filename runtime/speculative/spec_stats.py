"""SpecStats: one request's speculative decoding counts and its draft back-off (runtime/speculative/speculator.py
updates them; the final output reports them as SGLang's spec_* meta_info)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SpecStats:
    """One request's speculative decoding counts (SGLang's meta_info names in ``meta_info``)."""

    verify_ct: int = 0  # decode steps of this request while it could take drafts (with or without any)
    draft_tokens: int = 0  # drafts proposed
    accepted_tokens: int = 0  # drafts accepted
    # back-off: recent accepted drafts per step that had drafts (moving average), steps left without drafts, and
    # the length of the last pause
    gain: float = 2.0
    wait: int = 0
    backoff: int = 0

    def meta_info(self) -> dict[str, Any]:
        ct = self.verify_ct
        return {
            "spec_verify_ct": ct,
            "spec_draft_token_num": self.draft_tokens,
            "spec_accept_token_num": self.accepted_tokens,
            "spec_accept_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            # tokens per verify step (1.0 = no draft ever accepted)
            "spec_accept_length": (ct + self.accepted_tokens) / ct if ct else 1.0,
        }
