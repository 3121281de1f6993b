"""What the tests of tierlm's decode-product kernels over oneDNN's packed weight share (tests/test_cpu_linear.py,
tests/test_cpu_amx_linear.py, tests/test_cpu_avx512_linear.py, tests/test_cpu_native_ops.py): this CPU's plan for a
bf16 model (whether it packs the weights, which kernel it runs decode-sized products on), oneDNN's own product as
the reference, and a record of the kernel's calls."""
from __future__ import annotations

import os

import torch

from tierlm.backends.torch.cpu import linear, plan
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.cpu.plan import CpuKernels
from tierlm.platforms.cpu_plan import PLAN_ENV


def bf16_kernels(overrides: str = "") -> CpuKernels:
    """The CPU plan of a bf16 model on this machine with the process's library, as a server started with this
    environment (ONEDNN_MAX_CPU_ISA included) would decide it; ``overrides``: TIERLM_CPU_PLAN's value instead of
    the environment's."""
    env = dict(os.environ)
    if overrides:
        env[PLAN_ENV] = overrides
    return plan.for_model(torch.bfloat16, env=env)


def packing_refusal() -> str | None:
    """Why bf16 linears are not packed in this process (the plan's reason, or torch's refusal), else None."""
    choice = bf16_kernels().plan.bf16_linear
    if choice.value != "packed":
        return f"bf16 linears are not packed here: {choice}"
    return linear.torch_refusal()


def planned_kernel(name: str) -> tuple[KernelLibrary | None, str]:
    """(the library, "") where this CPU's plan runs decode-sized bf16 products on ``name``'s kernel ("amx",
    "avx512_bf16"), else (None, why not)."""
    kernels = bf16_kernels()
    choice = kernels.plan.decode_products
    if choice.value != name:
        return None, f"the plan's decode_products is {choice}"
    assert kernels.lib is not None and name in linear.KERNELS
    return kernels.lib, ""


def onednn_product(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """oneDNN's product over ``lin``'s weight packed as PackedLinear packs it: the bits the kernels must give."""
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), linear.PACK_BATCH_HINT)
    return torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], "")


def record_products(monkeypatch, kernel_module) -> list[tuple[tuple[int, ...], bool]]:
    """The products ``kernel_module.product`` is asked for from now on: (x's shape, whether the kernel served it
    rather than declining)."""
    calls: list[tuple[tuple[int, ...], bool]] = []
    real = kernel_module.product

    def recorded(lib, x, *args):
        y = real(lib, x, *args)
        calls.append((tuple(x.shape), y is not None))
        return y

    monkeypatch.setattr(kernel_module, "product", recorded)
    return calls
