"""MLXStatePool: the recurrent state of a hybrid model's linear layers on MLX, one slot per running request.

mlx-lm's layouts: per linear layer a conv state ``[slots, K-1, conv_dim]`` (channels-last, the last K-1 inputs)
in the model's dtype and a recurrent state in float32: gated DeltaNet ``[slots, Hv, Dv, Dk]`` (transposed against
transformers' ``[Hv, Dk, Dv]``), Mamba2 ``[slots, H, head_dim, d_state]``. The runtime owns the slot indices
(runtime/cache/state_slots.py); the contents belong here.
"""
from __future__ import annotations

import mlx.core as mx

from tierlm.backends.base import StateGeometry

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def mlx_rec_shape(geometry: StateGeometry, kind: str) -> tuple[int, ...]:
    """mlx-lm's recurrent state shape of one request."""
    if kind == "gdn":
        hv, dk, dv = geometry.rec_shape
        return (hv, dv, dk)
    return tuple(geometry.rec_shape)


class MLXStatePool:
    def __init__(self, geometry: StateGeometry, kind: str, num_slots: int) -> None:
        g = geometry
        self.num_slots = num_slots
        self.conv = [mx.zeros((num_slots, g.conv_kernel - 1, g.conv_dim), DTYPES[g.conv_dtype])
                     for _ in range(g.num_linear_layers)]
        self.rec = [mx.zeros((num_slots, *mlx_rec_shape(g, kind)), DTYPES[g.rec_dtype])
                    for _ in range(g.num_linear_layers)]
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        return self.conv + self.rec
