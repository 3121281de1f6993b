"""TorchStatePool: the device recurrent state of a hybrid model's linear layers, one slot per running request.

Per linear layer (in ``HybridLayout.linear_layers`` order) a conv state ``[slots, conv_dim, K]`` in the model's
dtype (all K columns: transformers' ``causal_conv1d_update`` shifts the state in place, K wide) and a recurrent
state ``[slots, *rec_shape]`` in float32. The runtime owns the slot *indices* (runtime/cache/state_slots.py), like page
indices; the contents belong here.
"""
from __future__ import annotations

import torch

from tierlm.backends.base import StateGeometry

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchStatePool:
    def __init__(self, geometry: StateGeometry, num_slots: int, device: torch.device) -> None:
        g = geometry
        self.geometry = g
        self.num_slots = num_slots
        self.conv = torch.zeros((g.num_linear_layers, num_slots, g.conv_dim, g.conv_kernel),
                                dtype=TORCH_DTYPES[g.conv_dtype], device=device)
        self.rec = torch.zeros((g.num_linear_layers, num_slots, *g.rec_shape), dtype=TORCH_DTYPES[g.rec_dtype],
                               device=device)

    @property
    def total_bytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.rec.numel() * self.rec.element_size()
