"""Storage keys for KV pages: a SHA-256 chain over token ids, identical in every process and on every machine.

The key of page i commits to every token before it (through the previous page's key), so two prompts share a
key only when they share the whole prefix up to and including that page, which is exactly when the KV bytes
of that page are interchangeable. Python's ``hash()`` is salted per process and must never be used here.
The root page hashes its tokens alone; a later page hashes the 64 hex characters of its parent key first.
The two inputs differ in length, so a root page can never collide with a child page by construction.
"""
from __future__ import annotations

import hashlib
import re
from typing import Sequence

import numpy as np

_KEY_RE = re.compile(r"[0-9a-f]{64}")


def is_page_key(key: object) -> bool:
    """True for a well-formed page key (64 lowercase hex characters)."""
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def page_key(prior_key: str | None, page_token_ids: Sequence[int] | np.ndarray) -> str:
    """The key of one full page whose parent page has key ``prior_key`` (None or "" for the first page)."""
    prior = _check_prior(prior_key)
    tokens = _as_le_int64(page_token_ids)
    h = hashlib.sha256()
    h.update(prior.encode("ascii"))
    h.update(tokens.tobytes())
    return h.hexdigest()


def page_keys(token_ids: Sequence[int] | np.ndarray, page_size: int, prior_key: str | None = None) -> list[str]:
    """One key per FULL page of ``token_ids``; a partial trailing page gets no key (it is never stored).

    ``prior_key`` continues a chain: pass the key of the page just before ``token_ids[0]`` to key pages
    appended after an already-keyed prefix (the result equals keying the whole sequence at once).
    """
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    page_size = int(page_size)
    prev = _check_prior(prior_key)
    tokens = _as_le_int64(token_ids)
    keys: list[str] = []
    for start in range(0, tokens.shape[0] - page_size + 1, page_size):
        h = hashlib.sha256()
        h.update(prev.encode("ascii"))
        h.update(tokens[start:start + page_size].tobytes())
        prev = h.hexdigest()
        keys.append(prev)
    return keys


def _check_prior(prior_key: str | None) -> str:
    if prior_key is None or prior_key == "":
        return ""
    if not is_page_key(prior_key):
        raise ValueError(f"prior_key must be a page key from page_keys() (64 lowercase hex), got {prior_key!r}")
    return prior_key


def _as_le_int64(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    # Explicit little-endian int64 so the bytes (and the keys) do not depend on the host's byte order.
    return np.ascontiguousarray(arr, dtype="<i8")
