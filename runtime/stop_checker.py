"""When a request stops, and what text it may show while streaming (OpenAI semantics).

Token-level rules (``check_token``): an eos id (unless ignore_eos) or a stop_token_id finishes with "stop";
reaching max_new_tokens finishes with "length"; a stop token wins over length on the same token. The stop
token's own text is never part of the output: do not feed a token that stopped the request to the
detokenizer.

Text-level rules (``process_text``): a stop string anywhere in the output text, also across deltas, finishes
with "stop"; the output is cut just before it (the stop string is not included). While streaming, a suffix that
could still grow into a stop string is held back, so text that later turns out to start a stop string is never
sent.

The engine, per sampled token::

    reason, matched = stop.check_token(token, num_output_tokens)
    text, done = "", False
    if reason != "stop":                     # a stop token's text is not output
        text, done, stop_str = stop.process_text(detok.add([token]))
        if done:
            reason, matched = "stop", stop_str
    if reason is not None and not done:      # finished by a token rule: release what is held back
        text += stop.finish(detok.flush())
        if stop.finished:                    # the detokenizer's remainder completed a stop string
            reason, matched = "stop", stop.matched_stop
"""
from __future__ import annotations

from typing import Iterable, Sequence


class StopChecker:
    def __init__(
        self,
        stop_strings: Sequence[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        max_new_tokens: int | None = None,
    ) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self.max_new_tokens = max_new_tokens
        # Explicit stop_token_ids still stop under ignore_eos (vLLM does the same).
        self._stop_ids = set(int(t) for t in stop_token_ids)
        if not ignore_eos:
            self._stop_ids.update(int(t) for t in eos_token_ids)
        self._held = ""  # text not yet shown because it may be the start of a stop string
        self._longest_stop = max((len(s) for s in self.stop_strings), default=0)
        self.finished = False
        self.matched_stop: str | None = None

    def check_token(self, token_id: int, num_output_tokens: int) -> tuple[str | None, int | None]:
        """After a token is sampled (``num_output_tokens`` counts it): ("stop", token_id), ("length", None) or
        (None, None)."""
        if int(token_id) in self._stop_ids:
            return "stop", int(token_id)
        if self.max_new_tokens is not None and num_output_tokens >= self.max_new_tokens:
            return "length", None
        return None, None

    def process_text(self, delta: str) -> tuple[str, bool, str | None]:
        """Take the next text delta; return (text safe to show now, finished by a stop string, that string)."""
        if self.finished:
            return "", True, self.matched_stop
        if not self.stop_strings:
            return delta, False, None
        text = self._held + delta
        hit = self._earliest_stop(text)
        if hit is not None:
            start, stop = hit
            self._held = ""
            self.finished = True
            self.matched_stop = stop
            return text[:start], True, stop
        keep = self._partial_stop_suffix_length(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False, None

    def flush(self) -> str:
        """At a finish that is not a stop string: release the held-back text."""
        held, self._held = self._held, ""
        return "" if self.finished else held

    def finish(self, remainder: str = "") -> str:
        """At a token-rule finish: pass the detokenizer's remainder, get the final text to show.

        If the remainder completes a stop string the text is cut there and ``finished``/``matched_stop`` say so.
        """
        text, finished, _ = self.process_text(remainder)
        return text if finished else text + self.flush()

    def _earliest_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that occurs first in ``text`` (ties: the shortest, which completed first)."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop_strings:
            index = text.find(stop)
            if index >= 0 and (best is None or (index, len(stop)) < best[:2]):
                best = (index, len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _partial_stop_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._longest_stop - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self.stop_strings):
                return length
        return 0
