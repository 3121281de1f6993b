"""Incremental detokenization: turn a stream of token ids into text deltas that concatenate exactly.

The prefix_offset / read_offset method of vLLM and TGI: decode a short window ``ids[prefix_offset:]`` and the
part of it already shown, ``ids[prefix_offset:read_offset]``; the delta is the difference. Decoding a window
rather than a single token keeps the context a tokenizer needs (SentencePiece drops the leading space of the
first token it decodes; byte-level BPE splits one character over several tokens). A window whose text ends in
U+FFFD ends inside a multi-byte character, so nothing is shown until the character completes.

The first window starts a few tokens into the prompt, so a completion that begins with a space keeps it.
"""
from __future__ import annotations

from typing import Any, Sequence

from tierlm.runtime.tokenizer_protocol import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (vLLM uses 5 as well)
# A UTF-8 character has at most 4 bytes, so an honest partial character is complete within a few tokens; a
# window that still ends in U+FFFD after this many held tokens is a real U+FFFD (the model emitted invalid
# bytes), and holding it longer would only make each step slower.
MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    """Per-request detokenizer; ``add`` costs one decode of a short window, not of the whole output."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        # transformers tokenizers clean up text across token boundaries (" ." -> ".") unless told not to, which
        # would make two window decodes disagree; a bare tokenizers.Tokenizer has no such option.
        self._decode_kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if hasattr(tokenizer, "clean_up_tokenization_spaces"):
            self._decode_kwargs["clean_up_tokenization_spaces"] = False
        # The window: ids[:read_offset] were shown already (their text is prefix_text), ids[read_offset:] not yet.
        # Only the window is kept, so memory and the cost of a decode stay small.
        prompt = [int(t) for t in prompt_ids]
        self._ids: list[int] = prompt[max(len(prompt) - PROMPT_CONTEXT_TOKENS, 0):]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new output tokens; return the text they complete (may be "" while a character is partial)."""
        if len(token_ids) == 0:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        window_text = self._decode(self._ids)
        held_tokens = len(self._ids) - self._read_offset
        if window_text.endswith(REPLACEMENT_CHAR) and held_tokens < MAX_HELD_TOKENS:
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """At finish: the text still held back (a trailing partial character decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids))

    def _emit(self, window_text: str) -> str:
        prefix = self._prefix_text
        shown = len(prefix) if window_text.startswith(prefix) else _common_prefix_length(window_text, prefix)
        delta = window_text[shown:]
        if not delta:
            # The new tokens add no text (skipped special tokens): drop them so the window cannot grow, keep the
            # context that produced prefix_text.
            del self._ids[self._read_offset:]
            return ""
        # Slide the window: the tokens just read become the context of the next decode.
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._decode_kwargs) if ids else ""


def _common_prefix_length(a: str, b: str) -> int:
    """Length of the common prefix; used when a window's context decodes differently once more tokens follow."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
