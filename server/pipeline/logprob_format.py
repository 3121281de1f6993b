"""Engine logprobs (runtime/io_struct.LogprobOutput) in each endpoint's response shape (docs/logprobs.md).

Token strings are the tokenizer's decoded piece of each token: ``decode([t, t])`` minus ``decode([t])``, so a
piece keeps the leading space a SentencePiece tokenizer drops at the start of a text (as it appears after other
tokens). ``text_offset`` is the running sum of piece lengths.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from tierlm.runtime.io_struct import GenerateOutput, LogprobOutput, TopList
from tierlm.runtime.tokenizer_protocol import Tokenizer


class Pieces:
    """Token id -> decoded piece, cached for one response."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        piece = self.cache.get(token)
        if piece is None:
            one = self.tokenizer.decode([token])
            two = self.tokenizer.decode([token, token])
            piece = two[len(one):] if two.startswith(one) and len(two) > len(one) else one
            self.cache[token] = piece
        return piece


def _top_dict(pieces: Pieces, top: TopList) -> dict[str, float]:
    d: dict[str, float] = {}
    for t, lp in top:
        d.setdefault(pieces(t), lp)  # sorted descending: a piece shared by two ids keeps the likelier
    return d


class CompletionLogprobBuilder:
    """OpenAI /v1/completions ``logprobs`` of one choice, chunk by chunk (offsets run across chunks)."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0) -> None:
        self.pieces = Pieces(tokenizer)
        self.offset = offset

    def build(self, lp: LogprobOutput | None, include_input: bool, output_offset: int | None = None
              ) -> dict[str, Any] | None:
        """The entries of ``lp`` (with ``include_input``, the prompt's first). ``output_offset``: where the
        output tokens' text starts (after an echoed prompt: its length), else the running offset."""
        if lp is None:
            return None
        head = self.inputs(lp) if include_input else _empty()
        if output_offset is not None:
            self.offset = output_offset
        tail = self.outputs(lp)
        return {k: head[k] + tail[k] for k in head}

    def inputs(self, lp: LogprobOutput) -> dict[str, list]:
        """The prompt tokens' entries (the first has null logprobs)."""
        tops = lp.input_top if lp.input_top is not None else None
        return self._entries(lp.input_token_ids, lp.input_logprobs, tops)

    def outputs(self, lp: LogprobOutput) -> dict[str, list]:
        return self._entries(lp.output_token_ids, lp.output_logprobs, lp.output_top)

    def _entries(self, ids: list[int], logprobs: list, tops: list[TopList] | None) -> dict[str, list]:
        d = _empty()
        for i, (t, v) in enumerate(zip(ids, logprobs)):
            piece = self.pieces(t)
            d["tokens"].append(piece)
            d["token_logprobs"].append(v)
            d["top_logprobs"].append(None if v is None else _top_dict(self.pieces, tops[i]) if tops else {})
            d["text_offset"].append(self.offset)
            self.offset += len(piece)
        return d


def without_stop_token(lp: LogprobOutput | None, out: GenerateOutput | None) -> LogprobOutput | None:
    """``lp`` without the entry of the stop token that ended ``out`` (EOS or a stop_token_ids id): the text leaves
    that token out, so the tokens must too, or they no longer join to the text (OpenAI lists no stop token)."""
    if lp is None or out is None or not out.finished or out.finish_reason != "stop":
        return lp
    stop = out.matched_stop
    if isinstance(stop, bool) or not isinstance(stop, int) or not lp.output_token_ids or lp.output_token_ids[-1] != stop:
        return lp
    return dataclasses.replace(lp, output_token_ids=lp.output_token_ids[:-1], output_logprobs=lp.output_logprobs[:-1],
                               output_top=None if lp.output_top is None else lp.output_top[:-1])


def _empty() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def chat_logprob_content(pieces: Pieces, lp: LogprobOutput | None) -> list[dict[str, Any]]:
    """OpenAI chat ``choices[].logprobs.content`` entries for the output tokens of ``lp``."""
    if lp is None:
        return []
    tops = lp.output_top or [[]] * len(lp.output_token_ids)
    out = []
    for t, v, top in zip(lp.output_token_ids, lp.output_logprobs, tops):
        piece = pieces(t)
        out.append({"token": piece, "logprob": v, "bytes": list(piece.encode("utf-8")),
                    "top_logprobs": [{"token": pieces(a), "logprob": b, "bytes": list(pieces(a).encode("utf-8"))}
                                     for a, b in top]})
    return out


class NativeLogprobs:
    """SGLang /generate ``meta_info`` logprob fields, accumulated over increments (streaming is cumulative)."""

    def __init__(self, tokenizer: Tokenizer, return_text: bool, top_n: int) -> None:
        self.pieces = Pieces(tokenizer)
        self.return_text = return_text
        self.top_n = top_n
        self.input: list[list[Any]] = []
        self.output: list[list[Any]] = []
        self.input_top: list[list[list[Any]] | None] = []
        self.output_top: list[list[list[Any]] | None] = []

    def _entry(self, lp: float | None, t: int) -> list[Any]:
        return [lp, t, self.pieces(t) if self.return_text else None]

    def add(self, lp: LogprobOutput | None) -> None:
        if lp is None:
            return
        self.input += [self._entry(v, t) for v, t in zip(lp.input_logprobs, lp.input_token_ids)]
        self.output += [self._entry(v, t) for v, t in zip(lp.output_logprobs, lp.output_token_ids)]
        if self.top_n:
            self.input_top += [None if v is None else [self._entry(b, a) for a, b in top]
                               for v, top in zip(lp.input_logprobs, lp.input_top or [])]
            self.output_top += [[self._entry(b, a) for a, b in top] for top in lp.output_top or []]

    def meta_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"input_token_logprobs": self.input, "output_token_logprobs": self.output}
        if self.top_n:
            info["input_top_logprobs"] = self.input_top
            info["output_top_logprobs"] = self.output_top
        return info
