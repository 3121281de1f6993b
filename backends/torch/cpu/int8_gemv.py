"""The decode matmul of weight-only int8 layers on x86 CPUs: a few activation rows times an int8 [N, K] weight with
one scale per output row, read straight from the int8 weight (a small C kernel).

Why not torch's ``_weight_int8pack_mm``: decode multiplies 1-8 rows, so the matmul is a stream over the weight, and
torch's kernel streams int8 no faster than oneDNN streams bf16 (~15 G weights/s on one AVX-512 core here): int8
halved the bytes and gained nothing (docs/models.md). This kernel widens 4 weight rows at a time to float32 (16
lanes with AVX-512, 8 with AVX2), multiplies every activation row by them, and prefetches the weight rows two tiles
ahead: without the prefetch it ran at 10 GB/s, with it 25-31 GB/s, 1.9-2.3x oneDNN's bf16 GEMV and 1.7-5x
torch's int8 kernel per matrix of the Qwen2.5-0.5B shape (one thread, weights from DRAM). It takes bf16 and
float32 activations alike (torch's kernel is vectorized for bf16 only: float32 ran a scalar loop).

Numerics: float32 products and sums (the activations widened exactly), times the row's scale, plus the bias, one
rounding to the output dtype (torch's bf16 kernel rounds its product before it adds the bias, then again).

bf16 activations use it for at most ``MAX_ROWS`` rows: past that the float32 multiply-adds, not the bytes, set the
pace, and bf16 prefill is faster through oneDNN on the widened weight (weights/quant_linear.py); float32 activations
use it for any count (it outran MKL's float32 GEMM on the widened weight at every count tried, up to 512 rows).
The C source is csrc/int8_gemv.c; the plan's ``int8_products`` uses it where the library has its AVX2 or AVX-512
code (an ARM CPU, an old x86: torch's kernel runs).
"""
from __future__ import annotations

import torch

from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.cpu.threads import column_threads, split_columns

KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# bf16 activation rows the kernel takes (decode batches); past 8 it ran no faster than torch's kernel (bound by the
# float32 multiply-adds).
MAX_ROWS = 8
# Below this many weights per thread a matmul stays on the calling thread (a hand-off costs ~30 us).
MIN_WEIGHTS_PER_THREAD = 1 << 20


def takes(rows: int, dtype: torch.dtype) -> bool:
    """Whether a matmul of ``rows`` activation rows in ``dtype`` goes to this kernel (where the plan has it): bf16
    decode rows, and float32 at any count (torch's kernel runs a scalar loop for float32)."""
    return 0 < rows and dtype in KERNEL_DTYPES and (dtype != torch.bfloat16 or rows <= MAX_ROWS)


def int8_linear(lib: KernelLibrary, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] contiguous (bf16 or float32, the dtype of ``scales`` and ``bias``), qweight int8 [N, K]
    contiguous, scales [N] -> [M, N] in x's dtype; call only where ``takes`` said yes."""
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    fn = lib.int8_linear_bf16 if bf16 else lib.int8_linear_f32
    xf = torch.empty((M, K), dtype=torch.float32) if bf16 else x
    args = (x.data_ptr(), xf.data_ptr())
    tail = (M, K, qweight.data_ptr(), scales.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), N)
    threads = column_threads(N * K, MIN_WEIGHTS_PER_THREAD)
    convert = int(bf16 and threads == 1)  # one thread widens x itself; for several it is widened once here
    if bf16 and not convert:
        xf.copy_(x)
    split_columns(lambda n0, n1: fn(*args, convert, *tail, n0, n1), N, threads)
    return y
