"""The last decoder layer computes only the rows whose logits are read.

A prefill of T tokens samples from one row (more with prompt logprobs or speculative verification), yet every layer
runs all T rows. Below the last layer each row feeds later rows through its K/V, so all of them are needed; in the
last layer only its K/V reach anyone else. There ``ReadRowsLayer`` computes q/k/v and writes the K/V for every row,
then runs the attention's queries, o_proj, the residuals, the post-attention norm and the MLP on the read rows only
(llama.cpp skips the last layer's FFN for such rows the same way). On llama-small (8 layers) that is ~11 % of a
2016-token prefill's arithmetic; on the Qwen2.5-0.5B shape (24 layers) ~4 %. A prefill chunk that is not a
request's last reads no row at all and runs none of it.

Each row of these ops depends on its own row only (products, norms, residual adds), and the attention of a row on
its own query and every key, so the read rows get the values the full layer would give them (the tests compare
logits bit for bit). The backend asks for it through ``only(rows)`` around an eager forward; a compiled step (whose
graph was traced over all rows) and everything outside ``only`` run transformers' layer unchanged.

Covered: transformers' own decoder layers of llama, qwen2, qwen3 and mistral (one forward, the pre-norm
attention + MLP block). With tierlm's fused attention (fused_projections.py) the attention computes only the read
rows' queries; with transformers' attention the whole attention runs and the read rows are taken after it.
TIERLM_LAST_LAYER_READ_ROWS=0 keeps every row (benchmarks compare both).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)

ENV = "TIERLM_LAST_LAYER_READ_ROWS"
# transformers' decoder layer classes whose forward is the pre-norm block ReadRowsLayer repeats
COVERED = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer",
           "mistral": "MistralDecoderLayer"}


class _Rows(threading.local):
    rows: torch.Tensor | None = None  # int64 row indices into the step's flat tokens, in the order the logits want


_ROWS = _Rows()


@contextlib.contextmanager
def only(rows: torch.Tensor | None) -> Iterator[None]:
    """Within this block the covered last layer outputs ``rows`` of its input (in that order), not all of them;
    None: all rows. The caller reads every row of the model's output (``logits_to_keep=0``)."""
    _ROWS.rows = rows
    try:
        yield
    finally:
        _ROWS.rows = None


class ReadRowsLayer(nn.Module):
    """transformers' decoder layer forward with the read rows taken right after the K/V are written (module
    docstring). Mixed in front of the family's class, on the last layer only."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        rows = _ROWS.rows
        if rows is None or torch.compiler.is_compiling():
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        residual = hidden_states.index_select(1, rows)
        hidden_states = self.input_layernorm(hidden_states)
        takes_rows = getattr(self.self_attn, "takes_out_rows", False)
        if takes_rows:
            kwargs["out_rows"] = rows
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, cache=cache, use_cache=use_cache,
                                          position_embeddings=position_embeddings, **kwargs)
        if not takes_rows:  # transformers' attention: all rows computed, the read ones kept
            hidden_states = hidden_states.index_select(1, rows)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


_CLASSES: dict[type, type] = {}


def _covered(layer: nn.Module) -> bool:
    cls = type(layer)
    return any(cls.__name__ == name and cls.__module__ == f"transformers.models.{fam}.modeling_{fam}"
               for fam, name in COVERED.items())


def install(model: nn.Module) -> str:
    """Give the model's last decoder layer ``ReadRowsLayer``'s forward when it is a covered class; returns what was
    decided and why (logged)."""
    if os.environ.get(ENV, "1") == "0":
        why = f"every row ({ENV}=0)"
    else:
        layers = getattr(getattr(model, "model", None), "layers", None)
        last = layers[-1] if isinstance(layers, nn.ModuleList) and len(layers) else None
        if last is None:
            why = "every row (no decoder layer list at model.model.layers)"
        elif isinstance(last, ReadRowsLayer):
            why = "read rows only"
        elif not _covered(last):
            why = f"every row ({type(last).__name__} is not a layer class it covers: transformers' " \
                  f"{', '.join(COVERED.values())})"
        else:
            cls = type(last)
            if cls not in _CLASSES:
                _CLASSES[cls] = type(f"TierlmReadRows{cls.__name__}", (ReadRowsLayer, cls), {})
            last.__class__ = _CLASSES[cls]
            why = "read rows only"
    log.info("last decoder layer: %s", why)
    return why


def installed(model: nn.Module) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return isinstance(layers, nn.ModuleList) and len(layers) > 0 and isinstance(layers[-1], ReadRowsLayer)
