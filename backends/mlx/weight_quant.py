"""--quantization q4|q8[-g<group>] on the mlx backend: mlx.nn.quantize at load (affine mode), the layers mlx-lm
quantizes when it converts a checkpoint (every layer with ``to_quantized`` whose input width the group divides)."""
from __future__ import annotations

import logging

import mlx.nn as nn

from tierlm.backends.weight_format import WeightQuant

log = logging.getLogger(__name__)


def quantize_model(model: nn.Module, quant: WeightQuant) -> None:
    """Quantize ``model``'s linear and embedding layers in place (mlx's quantized kernels run them)."""
    group = quant.group_size

    def predicate(_path: str, m: nn.Module) -> bool:
        weight = getattr(m, "weight", None)
        return hasattr(m, "to_quantized") and weight is not None and weight.shape[-1] % group == 0

    nn.quantize(model, group_size=group, bits=quant.bits, class_predicate=predicate)
    log.info("weights quantized with mlx.nn.quantize: %d bits, group %d (%s)", quant.bits, group, quant.flag)
