"""The ops a compiled step records where inductor cannot trace: their schemas, defined once here at the bottom of the
torch backend, and the calls the graph records.

Each ``tierlm::`` op is implemented by the module that owns the computation (``implement``: paged_attention.py,
cpu/linear.py, cpu/f32_gemv.py, weights/quant_linear.py), so nothing here imports a kernel and no kernel imports the
compile path. Where the CPU plan has the C++ ops (cpu/native_ops.py), a layer carries what its native call takes (a
packed linear its kernel's block and K chunks, the float32 linears and the attention modules the step record) and
the graph records ``tierlm_native::`` instead: the same schema plus those arguments, the same outputs (the C++ op
hands every case it does not serve to the ``tierlm::`` op).

The ops are registered with the dispatcher's low-level API, not ``torch.library.custom_op``: a custom_op call pays
its Python wrapper and an output-aliasing check on every call (31 us against 14 us per call here, and ~11 % of a
compiled llama-small decode step by py-spy: 40 calls a step). So an implementation must return a new tensor, never
an input or a view of one (nothing checks it, as custom_op did).
"""
from __future__ import annotations

from typing import Callable

import torch

# The buffer that carries a compiled model's step record (cpu/step_record.py) on the modules whose calls take it.
BUFFER = "tierlm_step"

# Defined once per process: a second "DEF" library of the namespace raises, and dropping the first one would
# unregister its ops. importlib.reload (autoreload) runs this file again in the same module dict, so the library of
# the first run is kept from there and serves on.
if "_LIB" not in globals():
    _LIB = torch.library.Library("tierlm", "DEF")
    _LIB.define("paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scaling, "
                "int sliding_window, Tensor? s_aux) -> Tensor")
    _LIB.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, int fast_rows, "
                "int block) -> Tensor")
    _LIB.define("int8_weight_only(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, bool kernel) -> Tensor")
    _LIB.define("f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    _IMPLEMENTED: set[str] = set()


def implement(name: str, fn: Callable, fake: Callable) -> None:
    """Register ``fn`` as ``tierlm::name``'s CPU/CUDA implementation and ``fake`` as its shape rule (once: a module
    reloaded keeps its first registration)."""
    if name in _IMPLEMENTED:
        return
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tierlm::{name}", lib=_LIB)(fake)
    _IMPLEMENTED.add(name)


# --- the calls a compiled graph records ---

def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
              sliding_window: int | None, s_aux: torch.Tensor | None) -> torch.Tensor:
    """The attention op in place of paged attention: the C++ one with the step record where the module carries it."""
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    args = (query, key, value, int(module.layer_idx), scale, int(sliding_window or 0), s_aux)
    step = getattr(module, BUFFER, None)
    if step is not None:
        return torch.ops.tierlm_native.paged_attention(*args, step)
    return torch.ops.tierlm.paged_attention(*args)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                  fast_rows: int, block: int, k_chunks: list[int], native: bool) -> torch.Tensor:
    """A packed bf16 product (``block``: the column block of the layer's decode-product kernel, 0 for none): the C++
    op where the layer calls its kernel from C++, with its K chunks."""
    if native:
        return torch.ops.tierlm_native.packed_linear(x, packed_weight, bias, out_features, fast_rows, block,
                                                     k_chunks)
    return torch.ops.tierlm.packed_linear(x, packed_weight, bias, out_features, fast_rows, block)


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               step: torch.Tensor | None) -> torch.Tensor:
    """A float32 product: the C++ op with the step record where the layer carries it."""
    if step is not None:
        return torch.ops.tierlm_native.f32_linear(x, weight, bias, step)
    return torch.ops.tierlm.f32_linear(x, weight, bias)


def int8_weight_only(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     kernel: bool) -> torch.Tensor:
    """An int8 weight-only product (``kernel``: on tierlm's streaming kernel, where the layer's plan has it)."""
    return torch.ops.tierlm.int8_weight_only(x, qweight, scales, bias, kernel)
