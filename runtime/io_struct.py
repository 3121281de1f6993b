"""The messages between the HTTP layer and the engine: what a client asks for and what it gets back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierlm.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class PinRequest:
    """After the request's prompt is in the cache, pin the KV of ``input_ids[:tokens]`` (rounded down to whole
    pages) for ``ttl_s`` seconds. Pinning an already pinned prefix refreshes its TTL (runtime/cache/pins.py)."""

    tokens: int
    ttl_s: float


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    pins: list[PinRequest] = field(default_factory=list)  # prompt-caching breakpoints (Anthropic cache_control)


@dataclass
class CachedTokens:
    """Prompt tokens whose KV was reused instead of prefilled, by the tier it came from."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage

    def to_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "storage": self.storage}


TopList = list[tuple[int, float]]  # (token id, logprob), sorted by logprob, descending


@dataclass
class LogprobOutput:
    """The logprobs of one output increment; lists align with the tokens they describe.

    ``input_*``: prompt tokens from ``logprob_start_len`` on (the first has logprob None); ``output_*``: the
    increment's output tokens (GenerateOutput.token_ids). ``*_top`` is None when top_logprobs_num is 0."""

    input_token_ids: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopList] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopList] | None = None


@dataclass
class GenerateOutput:
    """One increment of a request's output. ``text``/``token_ids`` are the new part only (a delta).

    The engine emits increments as tokens are produced (detokenized incrementally, never splitting a
    multi-byte character); the last one has ``finished=True`` and the final accounting.
    """

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    matched_stop: int | str | None = None  # the stop string or token id that ended the request
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)
    error: str | None = None  # set when the request failed inside the engine
    e2e_latency: float = 0.0
    logprobs: LogprobOutput | None = None  # the increment's logprobs, when the request asked (runtime/logprobs.py)
    spec: dict[str, Any] | None = None  # speculative decoding counts (SGLang's spec_* meta_info), final output only
    pinned_tokens: int = 0  # prompt tokens newly pinned or refreshed by this request's pins, final output only

    def meta_info(self) -> dict[str, Any]:
        """SGLang's /generate meta_info."""
        fr: Any = None
        if self.finish_reason is not None:
            fr = {"type": self.finish_reason}
            if self.finish_reason == "length":
                fr["length"] = self.completion_tokens
            elif self.matched_stop is not None:
                fr["matched"] = self.matched_stop
        return {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached.total,
            "cached_tokens_details": self.cached.to_dict(),
            "finish_reason": fr,
            "e2e_latency": self.e2e_latency,
            **(self.spec or {}),
        }
