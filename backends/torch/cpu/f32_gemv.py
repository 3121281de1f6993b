"""float32 decode products on x86 CPUs: a few activation rows times a float32 [N, K] weight (a small C kernel).

Why: torch's float32 linear is MKL's, and on AMD CPUs MKL runs its generic code path for the one-row product
(``mkl_blas_def_xsgemv``: 88 % of a float32 llama-small decode step by perf on an EPYC). It streamed the weights at
10.7-19 GB/s on one core where the memory reads ~30, and oneDNN's packed float32 product did no better (12-19).
This kernel multiplies a tile of weight rows by every activation row (AVX-512: 4 x 4 rows a pass, 4 x 6 from
three rows; AVX2's 16 registers: 2 activation rows x 4 weight rows for one or two rows, 4 x 2 from three) and
prefetches the weight two tiles ahead into L2 (into L1 it gained less, without any prefetch it ran at MKL's
rate). On the EPYC, weights from DRAM, one core: 19-26 GB/s at one row (1.3-2.2x MKL; the AVX2 build 20-25,
1.2-2.1x), 12-16 GB/s at 8 rows (1.7-2.4x; the AVX2 build 10-13), before the AVX-512 4 x 6 tiles.
float32 is what ``--dtype auto`` serves on CPUs without native bf16 (AVX2-only x86), so this is their decode.
Two more entries, ``f32_linear_bf16w`` and ``f32_linear_f16w``, read a bf16- or fp16-held weight
(weights/stored_16bit.py: a 16-bit checkpoint's exact values in half the bytes) and widen it in registers (a
shift; F16C's conversion) before the same FMAs in the same order: the float32 weight's bits. The scalar tail is
written as explicit FMAs, so no compiler contracts one entry and not the other.

Numerics: float32 products and sums, in another order than MKL's (each output within float32 rounding of
``F.linear``), plus the bias; each row's sums in the same order whatever the row count. Only in decode steps
(``decode_step``: every request one token, up to ``MAX_ROWS`` of them; in a compiled step the step record says
it, step_record.py): MKL's GEMM gives a prefill's rows the
same bits whatever the chunking (2-62 rows measured), so prefill chunks, extends after a cache hit and short
prompts keep it, and a hit or a chunk size never changes a token (an fp8 KV cache turns any difference in the
K/V into other tokens). MKL's one-row product differed from its GEMM already; decode rows took it.

The C source is csrc/f32_gemv.c (built without -ffast-math); the plan's ``f32_products`` uses it where the library
has its AVX2 or AVX-512 code (ARM, an old x86: MKL / torch serves).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.backends.torch import ops
from tierlm.backends.torch.cpu import library
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.cpu.threads import column_threads, split_columns
from tierlm.backends.torch.weights.stored_16bit import HELD_DTYPES, store_in_16bit, widened_product

log = logging.getLogger(__name__)

# Activation rows the kernel takes: decode steps up to 8 streams (past that MKL's GEMM is compute-bound and fast).
MAX_ROWS = 8
# Below this many weights per thread a product stays on the calling thread (a hand-off costs ~30 us).
MIN_WEIGHTS_PER_THREAD = 1 << 20


class _Step(threading.local):
    decode = False


_STEP = _Step()


@contextlib.contextmanager
def decode_step(decode: bool = True) -> Iterator[None]:
    """Within this block the products are a decode step's (every request one token): the kernel takes them."""
    before, _STEP.decode = _STEP.decode, decode
    try:
        yield
    finally:
        _STEP.decode = before


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            lib: KernelLibrary | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) in float32, weight float32, bf16 or fp16 (weights/stored_16bit.py):
    the kernel of ``lib`` (default: the process's library) for 1..MAX_ROWS rows of a decode step, else F.linear (on
    the 16-bit weight widened)."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if _STEP.decode and 0 < rows <= MAX_ROWS:
        lib = lib if lib is not None else library.load()
    else:
        lib = None
    if lib is None or not lib.has("f32_gemv") or x.dtype != torch.float32 or not weight.is_contiguous():
        if weight.dtype in HELD_DTYPES and x.dtype == torch.float32:
            return widened_product(x, weight, bias)
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    N = weight.shape[0]
    y = torch.empty((rows, N), dtype=torch.float32)
    args = (x2.data_ptr(), rows, K, weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), N)
    fn = lib.f32_linear_bf16w if weight.dtype == torch.bfloat16 else \
        lib.f32_linear_f16w if weight.dtype == torch.float16 else lib.f32_linear
    split_columns(lambda n0, n1: fn(*args, n0, n1), N, column_threads(N * K, MIN_WEIGHTS_PER_THREAD))
    return y.view(*x.shape[:-1], N)


ops.implement("f32_linear", lambda x, weight, bias: product(x, weight, bias),
              lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))


class F32GemvLinear(nn.Linear):
    """``nn.Linear`` (same weight, same state dict) whose decode-sized float32 products run on the kernel; its
    weight float32, or bf16 / fp16 where weights/stored_16bit.py holds it so (the products still float32); ``lib``:
    the kernel library (set by ``use_for_linears``)."""

    lib: KernelLibrary | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the graph records one opaque op (ops.py), with the step record if any
            return ops.f32_linear(x, self.weight, self.bias, getattr(self, ops.BUFFER, None))
        return product(x, self.weight, self.bias, self.lib)


def use_for_linears(model: nn.Module, kernels) -> int:
    """Give every float32 CPU ``nn.Linear`` of ``model`` (exactly that class: quantized or adapted subclasses keep
    their forward) the kernel's forward, in place, where ``kernels`` (the model's CpuKernels) plans
    ``f32_products=gemv``; returns how many."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32
               and m.weight.device.type == "cpu" and m.weight.is_contiguous()]
    plan = kernels.plan
    if not linears:
        return 0
    if plan.f32_products.value != "gemv":
        log.info("CPU float32 linear layers: torch's F.linear (%s)", plan.f32_products.why)
        return 0
    for m in linears:
        m.__class__ = F32GemvLinear
        m.lib = kernels.lib
    log.info("CPU float32: %d linear layers run products of up to %d rows on tierlm's kernel (%s library)",
             len(linears), MAX_ROWS, kernels.lib.level)
    if plan.f32_16bit_weights.value == "yes":  # a bf16 / fp16 checkpoint's weights: half the bytes, the same values
        store_in_16bit(model, linears)
    else:
        log.info("CPU float32 weights: kept float32 (%s)", plan.f32_16bit_weights.why)
    return len(linears)
