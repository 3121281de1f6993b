"""Log-probabilities for the torch backend (docs/logprobs.md): log-softmax of the raw float32 logits, before any
sampling transform, for the sampled rows and the prompt rows a ForwardBatch names, in one batched pass."""
from __future__ import annotations

import numpy as np
import torch

from tierlm.backends.base import ForwardBatch, ForwardOutput
from tierlm.backends.logprob_rows import sort_top, split_into


def raw_logprobs(logits: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
    """float32 [rows, V] log-softmax of the rows that ask: the S sampled rows (when ``batch.sample_logprobs``)
    then the P prompt rows; None when no row asks. Taken before sampling, so no sampling transform shows."""
    S = len(batch.sample_indices)
    if not batch.sample_logprobs and not batch.num_logprob_rows:
        return None
    rows = logits if batch.sample_logprobs else logits[S:]
    return torch.log_softmax(rows.float(), dim=-1)


def fill_logprobs(out: ForwardOutput, lp: torch.Tensor, tokens: torch.Tensor, batch: ForwardBatch) -> None:
    """Chosen-token logprobs and sorted top-K lists from ``raw_logprobs``'s rows into ``out`` (numpy)."""
    S = len(batch.sample_indices) if batch.sample_logprobs else 0
    if lp.shape[0] == 0:
        return
    dev = lp.device
    targets = [tokens.reshape(-1).to(torch.int64)] if S else []
    if batch.num_logprob_rows:
        targets.append(torch.from_numpy(np.asarray(batch.logprob_targets, np.int64)).to(dev))
    chosen = lp.gather(1, torch.cat(targets).unsqueeze(1)).squeeze(1).cpu().numpy()
    K = int(batch.logprob_top_k)
    top_ids = top_vals = None
    if K > 0:
        vals, ids = torch.topk(lp, min(K, lp.shape[-1]), dim=-1, sorted=True)
        top_ids, top_vals = sort_top(ids.cpu().numpy(), vals.cpu().numpy())
    split_into(out, S, chosen, top_ids, top_vals)
