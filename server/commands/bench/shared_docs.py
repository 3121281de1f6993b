"""`tierlm bench multiturn --workload shared-docs`: many requests share a few long documents, each followed by a
one-shot question (a scan of suffixes no request reuses). Requests take the documents in turn (0, 1, .., D-1,
0, ..), so a document comes back after every other one has passed; the host tier (L2) is smaller than all the
tokens, so what it keeps depends on the eviction policy (--radix-eviction-policy).

It runs on the multiturn machinery (server modes, clients, tables): each request is a one-round client whose
"context" is its document. A request's "round" in the results is its document's use count (0: first use), so the
multiturn tables' r>=2 columns are a document's later uses.
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from tierlm.server.commands.bench.context import random_tokens

WORKLOADS = ("conversations", "shared-docs")


def add_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--workload", choices=WORKLOADS, default="conversations",
                   help="conversations: growing multi-turn chats; shared-docs: --requests one-shot questions "
                        "(--turn-tokens) over --docs shared documents of --doc-tokens, a scan over a few hot "
                        "prefixes (both hicache modes then get an L2 of --hicache-ratio x L1)")
    g.add_argument("--docs", type=int, default=4, help="shared-docs: documents")
    g.add_argument("--doc-tokens", type=int, default=256, help="shared-docs: tokens per document")
    g.add_argument("--requests", type=int, default=64, help="shared-docs: requests (one question each)")


def plan_sizes(ns: argparse.Namespace, page_size: int, slots: int) -> dict[str, int]:
    """L1 a share of all tokens (at least the running requests); L2 = --hicache-ratio x L1 in both HiCache modes,
    smaller than all the tokens."""
    up = lambda n: -(-int(n) // page_size) * page_size  # noqa: E731
    suffix = ns.turn_tokens + ns.answer_tokens
    working_set = ns.docs * ns.doc_tokens + ns.requests * suffix
    longest = ns.doc_tokens + suffix + page_size
    l1 = max(up(ns.l1_fraction * working_set), slots * up(longest) + 2 * page_size)
    return {"working_set": working_set, "l1": l1, "longest": longest, "l2_ratio": ns.hicache_ratio}


def prompts(ns: argparse.Namespace, seed: int, vocab: int) -> dict[str, Any]:
    """One "client" per request: no system prompt, its document as the context, its question as the one turn."""
    rng = np.random.default_rng(seed)
    docs = [random_tokens(rng, ns.doc_tokens, vocab) for _ in range(ns.docs)]
    return {"system": [], "contexts": [docs[i % ns.docs] for i in range(ns.requests)],
            "turns": [[random_tokens(rng, ns.turn_tokens, vocab)] for _ in range(ns.requests)]}


def document_uses(results: list[tuple[int, int, Any]], docs: int) -> list[tuple[int, int, Any]]:
    """(request, 0, result) -> (request, how many earlier requests had its document, result)."""
    return [(c, c // docs, r) for c, _, r in results]
