"""Per-request sampling settings and their validation (OpenAI / SGLang semantics)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tierlm.backends.base import MAX_TOP_LOGPROBS


class SamplingParamsError(ValueError):
    """A sampling setting is out of range; ``param`` names the offending field for the 400 response."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 -> off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # token id -> added to its logit before sampling (OpenAI's logit_bias, in [-100, 100]: -100 bans, 100 forces)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # structured output (SGLang's names; docs/api.md): at most one grammar per request
    json_schema: str | None = None  # a JSON schema (as JSON text)
    regex: str | None = None
    ebnf: str | None = None  # an EBNF grammar (GBNF style, start rule "root")
    structural_tag: str | None = None  # an xgrammar structural tag (JSON text); the chat route's forced tool calls
    grammar_param: str | None = None  # the request field the grammar came from (named by its 400); None: the kind
    # log-probabilities (SGLang's names; docs/logprobs.md)
    return_logprob: bool = False  # logprobs of the output tokens (and of the prompt from logprob_start_len)
    top_logprobs_num: int = 0  # alternatives per position, 0..MAX_TOP_LOGPROBS
    logprob_start_len: int = -1  # prompt logprobs from this prompt position on; -1: none

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def normalize(self) -> "SamplingParams":
        """Accept the forms clients send (a single stop string, top_k=0) and check every range."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == 0:
            self.top_k = -1
        self.verify()
        return self

    def verify(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise SamplingParamsError(f"max_tokens must be a non-negative integer, got {self.max_new_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamsError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty")
        if len(self.stop) > 16:
            raise SamplingParamsError(f"at most 16 stop strings are allowed, got {len(self.stop)}", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be non-negative integers", "stop_token_ids")
        self._verify_logit_bias()
        self._verify_grammar()
        self._verify_logprobs()

    def _verify_logit_bias(self) -> None:
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise SamplingParamsError(f"logit_bias keys must be token ids (non-negative integers), got {t!r}",
                                          "logit_bias")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
                raise SamplingParamsError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}",
                                          "logit_bias")

    def _verify_logprobs(self) -> None:
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got "
                                      f"{self.top_logprobs_num}", "top_logprobs_num")
        if self.logprob_start_len < -1:
            raise SamplingParamsError(f"logprob_start_len must be -1 (none) or a prompt position, got "
                                      f"{self.logprob_start_len}", "logprob_start_len")

    def _verify_grammar(self) -> None:
        given = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(self, k) is not None]
        if len(given) > 1:
            raise SamplingParamsError(f"send at most one of json_schema, regex and ebnf (their aliases included); "
                                      f"got {', '.join(given)}", self.grammar_param or given[1])
        for k in given:
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise SamplingParamsError(f"{k} must be a non-empty string", self.grammar_param or k)
