"""Per-request log-probabilities inside the engine (docs/logprobs.md).

The numbers come from the backend (``ForwardOutput``): the model's log-softmax of the raw logits, before any
sampling transform. Prompt logprobs need logits at prompt positions, and a cached prefix has none: a request
that asks for prompt logprobs from position ``s`` reuses cached KV only for positions < s (SGLang's rule), and
the prompt token at ``s`` itself is reported with logprob None (the row before it is never scored). Rows are
scored chunk by chunk with the prefill; only requests that ask add rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tierlm.backends.base import ForwardBatch, ForwardOutput
from tierlm.runtime.io_struct import LogprobOutput
from tierlm.runtime.logprob_state import LogprobState

if TYPE_CHECKING:
    from tierlm.runtime.request import Req


def init_logprobs(req: Req) -> None:
    """Set ``req.logprobs`` when its sampling params ask for any (None otherwise: no cost at all). A request
    with max_new_tokens == 0 that asks for prompt logprobs still runs its prefill (``prefill_only``)."""
    p = req.sampling_params
    if not p.return_logprob:
        req.logprobs = None
        return
    n = len(req.input_ids)
    start = min(p.logprob_start_len, n) if p.logprob_start_len >= 0 else -1
    st = LogprobState(top_k=p.top_logprobs_num, output=True, prompt_start=start, prompt_len=n,
                      prompt_next=start if start >= 0 else n)
    if 0 <= start < n:  # the first reported prompt token: no scored row precedes it
        st.inputs.ids.append(req.input_ids[start])
        st.inputs.logprobs.append(None)
        st.inputs.top_ids.append([])
        st.inputs.top_logprobs.append([])
    req.logprobs = st
    if req.finish_reason == "length" and p.max_new_tokens == 0 and st.prompt_rows_pending:
        req.finish_reason = None
        st.prefill_only = True


def samples(req: Req) -> bool:
    """False for a prefill-only request: its last prefill row is never sampled."""
    return req.logprobs is None or not req.logprobs.prefill_only


def add_logprob_rows(batch: ForwardBatch, items: list[tuple[Req, int]], sampling_reqs: list[Req]
                     ) -> list[tuple[Req, int]]:
    """Ask ``batch`` for the logprobs its requests want; returns (request, prompt rows) in row order."""
    K = 0
    if any(r.logprobs is not None and r.logprobs.output for r in sampling_reqs):
        batch.sample_logprobs = True
        K = max(r.logprobs.top_k for r in sampling_reqs if r.logprobs is not None and r.logprobs.output)
    scored: list[tuple[Req, int]] = []
    rows: list[np.ndarray] = []
    targets: list[int] = []
    start = 0
    for req, n in items:
        st = req.logprobs
        if st is not None and st.prompt_rows_pending:
            lo, hi = max(req.kv_len, st.prompt_next), min(req.kv_len + n, st.prompt_len - 1)
            if hi > lo:
                rows.append(np.arange(start + lo - req.kv_len, start + hi - req.kv_len, dtype=np.int64))
                targets.extend(req.input_ids[lo + 1:hi + 1])
                scored.append((req, hi - lo))
                K = max(K, st.top_k)
        start += n
    if scored:
        batch.logprob_indices = np.concatenate(rows)
        batch.logprob_targets = np.asarray(targets, np.int64)
    batch.logprob_top_k = K
    return scored


def record_logprobs(result: ForwardOutput, sampling_reqs: list[Req], scored: list[tuple[Req, int]]) -> None:
    """Store what the backend computed for this step (before the new tokens are processed)."""
    if result.logprobs is not None:
        lps = result.logprobs.tolist()
        ids = result.next_token_ids.tolist()
        tids = result.top_ids.tolist() if result.top_ids is not None else None
        tlps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for i, req in enumerate(sampling_reqs):
            st = req.logprobs
            if st is None or not st.output:
                continue
            e = st.outputs
            e.ids.append(ids[i])
            e.logprobs.append(lps[i])
            e.top_ids.append(tids[i][:st.top_k] if tids is not None else [])
            e.top_logprobs.append(tlps[i][:st.top_k] if tlps is not None else [])
    if not scored:
        return
    assert result.prompt_logprobs is not None, "the backend returned no prompt logprobs for the rows asked"
    lps = result.prompt_logprobs.tolist()
    tids = result.prompt_top_ids.tolist() if result.prompt_top_ids is not None else None
    tlps = result.prompt_top_logprobs.tolist() if result.prompt_top_logprobs is not None else None
    at = 0
    for req, count in scored:
        st = req.logprobs
        assert st is not None  # only requests that asked for logprobs are scored
        inp = st.inputs
        lo = st.prompt_next
        inp.ids.extend(req.input_ids[lo + 1:lo + 1 + count])
        inp.logprobs.extend(lps[at:at + count])
        k = st.top_k if tids is not None else 0
        if k:
            assert tids is not None and tlps is not None  # the backend returns both top arrays or neither
            inp.top_ids.extend(row[:k] for row in tids[at:at + count])
            inp.top_logprobs.extend(row[:k] for row in tlps[at:at + count])
        else:
            inp.top_ids.extend([] for _ in range(count))
            inp.top_logprobs.extend([] for _ in range(count))
        st.prompt_next = lo + count
        at += count


def take_logprobs(req: Req, everything: bool) -> LogprobOutput | None:
    """The logprobs of the next increment: what was not handed out yet, or all of them (``everything``)."""
    st = req.logprobs
    if st is None:
        return None
    with_top = st.top_k > 0
    out = LogprobOutput()
    out.input_token_ids, out.input_logprobs, out.input_top = st.inputs.take(everything, with_top)
    out.output_token_ids, out.output_logprobs, out.output_top = st.outputs.take(everything, with_top)
    return out
