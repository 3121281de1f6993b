"""What the tests of tierlm's decode-product kernels over oneDNN's packed weight share (tests/test_cpu_amx_linear.py,
tests/test_cpu_avx512_linear.py): oneDNN's own product as the reference, and a record of the kernel's calls."""
from __future__ import annotations

import torch

from tierlm.backends.torch import cpu_linear


def onednn_product(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """oneDNN's product over ``lin``'s weight packed as PackedLinear packs it: the bits the kernels must give."""
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), cpu_linear.PACK_BATCH_HINT)
    return torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], "")


def record_products(monkeypatch, kernel_module) -> list[tuple[tuple[int, ...], bool]]:
    """The products ``kernel_module.product`` is asked for from now on: (x's shape, whether the kernel served it
    rather than declining)."""
    calls: list[tuple[tuple[int, ...], bool]] = []
    real = kernel_module.product

    def recorded(x, *args):
        y = real(x, *args)
        calls.append((tuple(x.shape), y is not None))
        return y

    monkeypatch.setattr(kernel_module, "product", recorded)
    return calls
