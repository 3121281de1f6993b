"""NGRAM draft tokens (SGLang's --speculative-algorithm NGRAM): no draft model, the drafts are the tokens that
followed an earlier occurrence of the sequence's last w tokens (w from the max match window down to the min; the
longest match wins), proposed as one chain.

Two sources, the longer match wins and the request's own tokens win ties:
  * own: the request's prompt + output so far, any earlier occurrence of its suffix (never the suffix itself).
    BFS takes the most recent occurrence; PROB the next token seen most often after that n-gram (over its
    ``PROB_SCAN`` most recent occurrences; ties -> most recent), then follows that occurrence.
  * store: shared across requests, filled when a request finishes with each of its n-grams (length min..max
    window) -> the up to ``branch_length`` tokens that followed its most recent occurrence (for both match types).
    LRU-bounded: ``capacity`` counts stored tokens, each entry costing its key (w tokens) plus its continuation;
    a hit counts as a use.

N-grams are keyed by a 64-bit polynomial hash (one dict per window size); the prompt is hashed with numpy at
``new_state`` and each appended token adds its max_window n-grams. A hit is checked against the tokens, so a hash
collision only loses a match; drafts are verified by the model anyway, so they never change the output.

Timing (CPython 3.11, numpy 2.4, windows 1..12, 2 loaded cores): new_state of a 4k prompt 4.4-5.3 ms; propose 5-6 us
per 1 appended token (no match 5 us, PROB 8-15 us, 5 appended 20-40 us); finish of 4.2k tokens 10-18 ms
(~33k store entries); up to 2x all round under heavier load.
"""
from __future__ import annotations

import operator
from collections import Counter
from itertools import repeat
from typing import Any, Sequence

import numpy as np

MATCH_TYPES = ("BFS", "PROB")
PROB_SCAN = 128  # PROB counts next tokens over this many most recent occurrences: bounded per-step cost
_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd, so multiplying by it is a bijection mod 2**64


def _window_hashes(tokens: Sequence[int], max_window: int) -> list[np.ndarray]:
    """hs[w][e] = hash of tokens[e-w:e] for e >= w (hs[0] unused). Same arithmetic as ``_suffix_hashes``."""
    n = len(tokens)
    v = np.asarray(tokens, dtype=np.int64).astype(np.uint64) + np.uint64(1)
    base = np.uint64(_BASE)
    h = np.zeros(n + 1, dtype=np.uint64)
    out = [h]
    for w in range(1, min(max_window, n) + 1):
        h = h.copy()
        h[w:] = v[:n + 1 - w] + base * h[w:]  # prepend tokens[e-w] to the (w-1)-gram ending at e; wraps mod 2**64
        out.append(h)
    return out


def _suffix_hashes(seq: list[int], end: int, max_window: int) -> list[int]:
    """[0, hash of seq[end-1:end], ..., hash of seq[end-w:end]] for w up to min(max_window, end)."""
    out = [0]
    h = 0
    for k in range(1, min(max_window, end) + 1):
        h = (seq[end - k] + 1 + _BASE * h) & _MASK
        out.append(h)
    return out


class NgramState:
    """One request's sequence and its n-gram index: per window w, hash -> last end position e (seq[e-w:e] was
    followed by seq[e]); for PROB also e -> the previous end with the same hash."""

    __slots__ = ("seq", "last", "prev", "cached", "finished")

    def __init__(self, seq: list[int], last: list[dict[int, int]],
                 prev: list[dict[int, int] | None] | None) -> None:
        self.seq = seq
        self.last = last
        self.prev = prev
        self.cached: tuple[int, list[int]] | None = None  # suffix hashes of the last propose, reused to index it
        self.finished = False


class NgramDrafter:
    def __init__(self, min_window: int, max_window: int, branch_length: int, capacity: int,
                 match_type: str = "BFS") -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"ngram match windows must satisfy 1 <= min ({min_window}) <= max ({max_window})")
        if match_type not in MATCH_TYPES:
            raise ValueError(f"ngram match type must be BFS or PROB, got {match_type!r}")
        self.min_window = min_window
        self.max_window = max_window
        self.branch_length = branch_length
        self.capacity = capacity
        self.prob = match_type == "PROB"
        if max_window + branch_length >= 1 << 16:
            raise ValueError("ngram max window + branch length must be < 65536 (a store entry's cost is 16 bits)")
        self._store: dict[int, int] = {}  # see _record
        self._store_tokens = 0
        self._seqs: dict[int, list[Any]] = {}  # sequence id -> [tokens: list[int], live entries: int]
        self._next_sid = 0

    # ------------------------------------------------------------ per request
    def new_state(self, prompt: Sequence[int]) -> NgramState:
        seq = list(prompt)
        n = len(seq)
        hs = _window_hashes(seq, self.max_window)
        last: list[dict[int, int]] = [{} for _ in range(self.max_window + 1)]
        for w in range(self.min_window, min(self.max_window, n - 1) + 1):
            # ends w..n-1 each have a next token; the suffix (end n) is not indexed. Later ends overwrite: the most
            # recent occurrence wins
            last[w] = dict(zip(hs[w][w:n].tolist(), range(w, n)))
        # PROB's occurrence chains are built the first time a window needs one
        prev: list[dict[int, int] | None] | None = [None] * (self.max_window + 1) if self.prob else None
        return NgramState(seq, last, prev)

    def _index_end(self, state: NgramState, e: int, hs: list[int]) -> None:
        """seq[e] has just arrived: the n-grams ending at e now have a continuation."""
        last, prev = state.last, state.prev
        for w in range(self.min_window, len(hs)):
            h = hs[w]
            d = last[w]
            if prev is not None and (chain := prev[w]) is not None:
                p = d.get(h)
                if p is not None:
                    chain[e] = p
            d[h] = e

    def propose(self, state: NgramState, tokens_appended: Sequence[int], max_drafts: int) -> list[int]:
        if state.finished:
            return []
        seq = state.seq
        cached = state.cached
        for t in tokens_appended:
            e = len(seq)
            hs = cached[1] if cached is not None and cached[0] == e else _suffix_hashes(seq, e, self.max_window)
            cached = None
            self._index_end(state, e, hs)
            seq.append(t)
        n = min(max_drafts, self.branch_length)
        if n <= 0:
            state.cached = cached
            return []
        L = len(seq)
        hs = _suffix_hashes(seq, L, self.max_window)
        state.cached = (L, hs)
        best_w, best_e = self._own_match(state, hs)
        if self._store:
            store = self._store
            src: list[int]
            for w in range(len(hs) - 1, max(best_w, self.min_window - 1), -1):
                h = hs[w]
                v = store.get(h)
                if v is None:
                    continue
                src, end = self._seqs[v >> 48][0], v & 0xFFFFFFFF
                if end >= w and src[end - w:end] == seq[L - w:]:
                    del store[h]  # re-insert: most recently used
                    store[h] = v
                    return src[end:end + n]
        if best_w:
            return seq[best_e:best_e + n]
        return []

    def _own_match(self, state: NgramState, hs: list[int]) -> tuple[int, int]:
        """(w, e) of the longest earlier occurrence of the suffix (w = 0: none); e is where its continuation starts."""
        seq, last = state.seq, state.last
        L = len(seq)
        best_w, best_e = 0, -1
        # a match at w implies one at every shorter w (same occurrence): climb until the first miss
        for w in range(self.min_window, min(len(hs), L)):
            e = last[w].get(hs[w])
            if e is None:
                break
            best_w, best_e = w, e
        # a hash collision only costs the match: step down to the longest verified one
        while best_w and seq[best_e - best_w:best_e] != seq[L - best_w:]:
            best_w -= 1
            e = last[best_w].get(hs[best_w]) if best_w >= self.min_window else None
            if e is None:
                best_w, best_e = 0, -1
            else:
                best_e = e
        if best_w and state.prev is not None:
            best_e = self._prob_pick(state, best_w, best_e)
        return best_w, best_e

    def _prob_pick(self, state: NgramState, w: int, e: int) -> int:
        """Among the occurrences of the matched w-gram, the most recent one followed by its most frequent next
        token (ties -> the most recent)."""
        assert state.prev is not None  # only PROB matching picks, and a PROB state has its chains
        seq, prev = state.seq, state.prev[w]
        if prev is None:
            prev = state.prev[w] = self._chain(seq, w)
        counts: dict[int, int] = {}
        recent: dict[int, int] = {}
        for _ in range(PROB_SCAN):  # the chain runs from the most recent occurrence back
            t = seq[e]
            if t in counts:
                counts[t] += 1
            else:
                counts[t] = 1
                recent[t] = e
            p = prev.get(e)
            if p is None:
                break
            e = p
        best = max(counts, key=lambda tok: (counts[tok], recent[tok]))
        return recent[best]

    def _chain(self, seq: list[int], w: int) -> dict[int, int]:
        """end -> the previous end of the same w-gram, over the ends indexed so far (w..len(seq)-1)."""
        n = len(seq)
        keys = _window_hashes(seq, w)[w][w:n]
        order = np.argsort(keys, kind="stable")  # equal keys stay in sequence order
        same = keys[order[1:]] == keys[order[:-1]]
        return dict(zip((order[1:][same] + w).tolist(), (order[:-1][same] + w).tolist()))

    def finish(self, state: NgramState) -> None:
        if state.finished:
            return
        seq = state.seq
        state.finished = True
        state.seq, state.last, state.prev, state.cached = [], [], None, None  # the store now owns seq
        self._record(seq)

    # ------------------------------------------------------------ shared store
    # entry: n-gram hash -> (sequence id << 48) | (cost << 32) | end, an int (cheaper to build than a tuple by far);
    # a plain dict keeps insertion order, so re-inserting on use makes its first items the least recently used
    def _record(self, seq: list[int]) -> None:
        n = len(seq)
        if n <= self.min_window:
            return
        store = self._store
        sid = self._next_sid
        self._next_sid += 1
        self._seqs[sid] = [seq, 0]
        hs = _window_hashes(seq, self.max_window)
        # longest windows first: the shorter keys of a request are then the newer ones and outlive the longer
        for w in range(min(self.max_window, n - 1), self.min_window - 1, -1):
            keys = hs[w][w:n]
            _, first = np.unique(keys[::-1], return_index=True)
            sel = np.sort(len(keys) - 1 - first)  # each key's most recent end, in sequence order
            ends = sel + w
            costs = w + np.minimum(self.branch_length, n - ends)
            keys_l = keys[sel].tolist()
            dup = store.keys() & keys_l
            if dup:  # popped and re-inserted at the end: this is their newest use
                self._release(list(map(store.pop, dup)))
            packed = ((costs << 32) | ends).tolist()
            store.update(zip(keys_l, map(operator.or_, repeat(sid << 48), packed)))
            self._seqs[sid][1] += len(keys_l)
            self._store_tokens += int(costs.sum())
        if self._store_tokens > self.capacity:
            over = self._store_tokens - self.capacity
            drop = []
            for k, v in store.items():  # oldest first
                drop.append(k)
                over -= (v >> 32) & 0xFFFF
                if over <= 0:
                    break
            self._release(list(map(store.pop, drop)))

    def _release(self, values: list[int]) -> None:
        """Entries left the store: their tokens, and the sequences no entry points into any more."""
        # map over builtins runs in C; ints, not numpy: sequence ids grow past 16 bits
        self._store_tokens -= sum(map(operator.and_, map(operator.rshift, values, repeat(32)), repeat(0xFFFF)))
        for sid, c in Counter(map(operator.rshift, values, repeat(48))).items():
            rec = self._seqs[sid]
            rec[1] -= c
            if rec[1] == 0:
                del self._seqs[sid]

    def stats(self) -> dict[str, int]:
        return {"store_entries": len(self._store), "store_tokens": self._store_tokens, "capacity": self.capacity}
