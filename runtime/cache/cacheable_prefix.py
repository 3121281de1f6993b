"""The cacheable-prefix rule: how much of a request's sequence the prefix cache may supply (every tier asks)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierlm.runtime.request import Req


def cacheable_prefix_len(req: Req) -> int:
    """How many leading tokens of ``req`` may come from the prefix cache: all but the last, and none at or past
    the next prompt row still to score (a cached position has no logits; runtime/logprobs.py)."""
    n = req.seq_len - 1
    st = req.logprobs
    if st is not None and st.prompt_rows_pending:
        n = min(n, st.prompt_next)
    return max(n, 0)
