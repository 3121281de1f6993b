"""A step's rows as a hybrid model's linear layers take them, backend-neutral (numpy): decode rows run in one call,
prefill segments one by one (backends/{torch,mlx}/linear_state.py turn these into their own index tensors)."""
from __future__ import annotations

import numpy as np

from tierlm.backends.base import ForwardBatch


class StateStepSplit:
    """``decode_rows`` / ``decode_slots``: flat row and state slot of each decode row (one token after a prefix);
    ``snap_src`` / ``snap_dst``: the decode rows whose state is copied into a snapshot slot after the step;
    ``prefills``: (slot, first row, end row, fresh, snapshot_at, snapshot_dst) of every other request."""

    def __init__(self, batch: ForwardBatch) -> None:
        if batch.state_slots is None:
            raise ValueError("a hybrid model's ForwardBatch needs state_slots (one state slot per request)")
        q_lens = np.asarray(batch.q_lens, np.int64)
        kv_lens = np.asarray(batch.kv_lens, np.int64)
        slots = np.asarray(batch.state_slots, np.int64)
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)
        fresh = kv_lens == q_lens
        decode = (q_lens == 1) & ~fresh
        self.decode_rows, self.decode_slots = starts[decode], slots[decode]
        none = np.full(len(q_lens), -1, np.int64)  # no snapshot in this step
        at = none if batch.snapshot_at is None else np.asarray(batch.snapshot_at, np.int64)
        dst = none if batch.snapshot_dst is None else np.asarray(batch.snapshot_dst, np.int64)
        snap = decode & (at > 0)  # a decode row's only point is after its token
        self.snap_src, self.snap_dst = slots[snap], dst[snap]
        self.prefills = [(int(slots[i]), int(starts[i]), int(starts[i] + q_lens[i]), bool(fresh[i]), int(at[i]),
                          int(dst[i])) for i in np.nonzero(~decode)[0]]
