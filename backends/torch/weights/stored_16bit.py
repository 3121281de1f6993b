"""float32 serving with the linear weights held as bf16 or float16, where they are exactly that (every bf16 or fp16
checkpoint).

Why: on a CPU without native bf16 matmuls (AVX2-only x86) ``--dtype auto`` serves float32, so a bf16 or fp16
checkpoint (nearly every Hugging Face one) is widened to float32 at load and a decode step, bound by the bytes it
reads, reads twice the bytes vLLM CPU's 16-bit weights are. Widening bf16 or fp16 to float32 is exact, so holding
those weights in their 16 bits halves the bytes read and the memory and changes no value:

- decode steps (cpu/f32_gemv.decode_step, up to MAX_ROWS rows): cpu/f32_gemv.py's kernel reads the 16-bit weight and
  widens it in registers (bf16: a shift; fp16: F16C's conversion): the same products and sums in the same order,
  so the same bits as its float32 weight.
- every other product (prefill chunks, extends after a hit, steps of more than MAX_ROWS rows): the weight is
  widened slice by slice of output rows into a reused float32 buffer and each slice multiplied by torch's
  F.linear (MKL): the same bits as F.linear on the whole float32 weight, since an output column's sum does not
  depend on the other columns as long as a slice is not a few columns narrow (MKL takes another path there:
  every slice has at least MIN_SLICE_ROWS; tests/test_cpu_16bit_stored_weights.py checks the bits).
  Long steps take wide slices (MKL's GEMM is compute-bound and slower on narrow ones: 2016 rows x 896 x 4864 ran
  199 ms in 208-row slices against 177 ms whole), short ones narrow slices that stay in cache.

Which layers: cpu/f32_gemv.py's (plain float32 linears of an unquantized model, where its kernel loaded) whose weight
widens back exactly from bf16 (checked first: a bf16 checkpoint's values are rarely all fp16 values, whose
exponent range is narrower) or else from fp16. An lm_head tied to the input embedding gets a 16-bit copy of its
own; the embedding stays float32 (a lookup reads one row a token, and transformers takes the model's dtype from
its first parameter). The CPU plan decides (``f32_16bit_weights``; ``=no`` keeps float32 weights).
"""
from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.backends.torch.weights.quant_embedding import tied_lm_head

log = logging.getLogger(__name__)

# float32 values widened per slice: short steps (memory-bound) in slices that stay in L2/L3, long ones (compute-
# bound) in slices wide enough for MKL's GEMM to run at its rate.
SHORT_SLICE = 1 << 20
LONG_SLICE = 8 << 20
LONG_ROWS = 256
# MKL computes a product of a few output columns (8 or fewer here) another way, with other bits: no slice is
# narrower than this (a short last one joins the slice before it).
MIN_SLICE_ROWS = 64


class _Scratch(threading.local):
    buf: torch.Tensor | None = None


_SCRATCH = _Scratch()


def _buffer(n: int) -> torch.Tensor:
    """A float32 buffer of at least ``n`` values, reused by every product of this thread."""
    buf = _SCRATCH.buf
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: written by products inside inference mode and outside
            buf = _SCRATCH.buf = torch.empty(n, dtype=torch.float32)
    return buf


def widened_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight[N, K] (bf16 or fp16).T (+ bias), bit for bit F.linear on ``weight.float()``."""
    N, K = weight.shape
    per_slice = LONG_SLICE if x.numel() >= LONG_ROWS * K else SHORT_SLICE
    step = max(MIN_SLICE_ROWS, per_slice // max(K, 1) // 16 * 16)
    if step + MIN_SLICE_ROWS > N:  # one slice: the whole weight
        w = _buffer(N * K)[:N * K].view(N, K)
        w.copy_(weight)
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, K)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    cuts = list(range(0, N - MIN_SLICE_ROWS, step)) + [N]  # no slice narrower than MIN_SLICE_ROWS
    buf = _buffer((step + MIN_SLICE_ROWS) * K)
    for n0, n1 in zip(cuts, cuts[1:]):
        w = buf[:(n1 - n0) * K].view(n1 - n0, K)
        w.copy_(weight[n0:n1])
        y[:, n0:n1] = F.linear(x2, w, None if bias is None else bias[n0:n1])
    return y.view(*x.shape[:-1], N)


HELD_DTYPES = (torch.bfloat16, torch.float16)


def exact_16bit_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype every value of a float32 weight round-trips through unchanged: bf16 (checked first), else
    fp16, else None."""
    w = weight.contiguous()
    if not bool(torch.count_nonzero(w.view(torch.int32) & 0xFFFF)):  # a bf16's bits are a float32's upper half
        return torch.bfloat16
    if torch.equal(w.to(torch.float16).float().view(torch.int32), w.view(torch.int32)):
        return torch.float16
    return None


def store_in_16bit(model: nn.Module, layers: list[nn.Linear]) -> int:
    """Hold the weight of each of ``layers`` (cpu/f32_gemv.py's, float32) as bf16 or fp16 where that is exact, in
    place; returns how many. A weight shared with another module (a tied lm_head) is replaced by a 16-bit copy of
    its own in the layer only."""
    why = "float32 weights that are exactly bf16 or fp16 held so (half the bytes, the same values and outputs)"
    tied = tied_lm_head(model)  # read before the swap gives the lm_head a weight of its own
    held: dict[torch.dtype, int] = {}
    for m in layers:
        dtype = exact_16bit_dtype(m.weight.detach())
        if dtype is not None:
            m.weight = nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)
            held[dtype] = held.get(dtype, 0) + 1
    done = sum(held.values())
    if done:
        kinds = ", ".join(f"{n} as {str(d).removeprefix('torch.')}" for d, n in held.items())
        log.info("CPU float32: %d of %d linear weights held in 16 bits, exactly (%s; %s)%s", done, len(layers), kinds,
                 why, f"; {len(layers) - done} are not 16-bit values and stay float32" if done < len(layers) else "")
    if tied and model.get_output_embeddings().weight.dtype in HELD_DTYPES:
        log.info("CPU float32: the lm_head tied to the input embedding has its own 16-bit copy; the embedding stays "
                 "float32")
    return done
