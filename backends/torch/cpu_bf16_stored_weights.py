"""float32 serving with the linear weights held as bf16, where they are exactly bf16 (every bf16 checkpoint).

Why: on a CPU without native bf16 matmuls (AVX2-only x86) ``--dtype auto`` serves float32, so a bf16 checkpoint
(most Hugging Face ones) is widened to float32 at load and a decode step, bound by the bytes it reads, reads
twice the bytes vLLM CPU's bf16 weights are. Widening bf16 to float32 is exact (a bf16's bits are a float32's
upper half), so holding those weights as bf16 halves the bytes read and the memory and changes no value:

- decode steps (cpu_f32_gemv.decode_step, up to MAX_ROWS rows): cpu_f32_gemv's kernel reads the bf16 weight and
  widens it in registers: the same products and sums in the same order, so the same bits as its float32 weight.
- every other product (prefill chunks, extends after a hit, steps of more than MAX_ROWS rows): the weight is
  widened slice by slice of output rows into a reused float32 buffer and each slice multiplied by torch's
  F.linear (MKL): the same bits as F.linear on the whole float32 weight, since an output column's sum does not
  depend on the other columns as long as a slice is not a few columns narrow (MKL takes another path there:
  every slice has at least MIN_SLICE_ROWS; tests/test_cpu_bf16_stored_weights.py checks the bits).
  Long steps take wide slices (MKL's GEMM is compute-bound and slower on narrow ones: 2016 rows x 896 x 4864 ran
  199 ms in 208-row slices against 177 ms whole), short ones narrow slices that stay in cache.

Which layers: cpu_f32_gemv's (plain float32 linears of an unquantized model, where its kernel loaded) whose weight
widens back exactly. An lm_head tied to the input embedding gets a bf16 copy of its own; the embedding stays
float32 (a lookup reads one row a token, and transformers takes the model's dtype from its first parameter).
``TIERLM_CPU_BF16_WEIGHTS=0`` keeps float32 weights.
"""
from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.backends.torch.cpu_quant_embedding import tied_lm_head

log = logging.getLogger(__name__)

ENV = "TIERLM_CPU_BF16_WEIGHTS"
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
        buf = _SCRATCH.buf = torch.empty(n, dtype=torch.float32)
    return buf


def widened_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ weight[N, K] (bf16).T (+ bias), bit for bit F.linear on ``weight.float()``."""
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


def exactly_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 weight is a bf16 (the round trip changes no bit)."""
    return not bool(torch.count_nonzero(weight.contiguous().view(torch.int32) & 0xFFFF))


def decision(env: dict[str, str] | None = None) -> tuple[bool, str]:
    """(on, why) for holding exactly-bf16 float32 weights as bf16."""
    if (env if env is not None else os.environ).get(ENV, "1") == "0":
        return False, f"{ENV}=0: float32 weights kept"
    return True, "float32 weights that are exactly bf16 held as bf16 (half the bytes, the same values and outputs)"


def store_in_bf16(model: nn.Module, layers: list[nn.Linear]) -> int:
    """Hold the weight of each of ``layers`` (cpu_f32_gemv's, float32) as bf16 where that is exact, in place;
    returns how many. A weight shared with another module (a tied lm_head) is replaced by a bf16 copy of its own
    in the layer only."""
    on, why = decision()
    if not on:
        log.info("CPU float32 weights: %s", why)
        return 0
    tied = tied_lm_head(model)  # read before the swap gives the lm_head a weight of its own
    done = 0
    for m in layers:
        if exactly_bf16(m.weight.detach()):
            m.weight = nn.Parameter(m.weight.detach().to(torch.bfloat16), requires_grad=False)
            done += 1
    if done:
        log.info("CPU float32: %d of %d linear weights held as bf16, exactly (%s)%s", done, len(layers), why,
                 f"; {len(layers) - done} are not bf16 values and stay float32" if done < len(layers) else "")
    if tied and model.get_output_embeddings().weight.dtype == torch.bfloat16:
        log.info("CPU float32: the lm_head tied to the input embedding has its own bf16 copy; the embedding stays "
                 "float32")
    return done
