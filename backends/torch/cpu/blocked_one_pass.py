"""The blocked prefill attention in one C pass per block of query rows, on CPUs with AVX512-BF16.

blocked_attention.py's general path runs each block of query rows as scores = q @ K^T (oneDNN's bf16 GEMM,
written out as bf16), the C row softmax reading them back, then p @ V (another GEMM). Here one kernel
(csrc/blocked_attention.c) does the whole block, 4 query rows at a time:
- scores: 4 rows x 64 keys in 16 vector registers, summed with ``vdpbf16ps`` over K laid out in pairs ([D/2, keys]
  of bf16 pairs of dims, made once per layer), then rounded to bf16, scaled and rounded again, the row maximum
  kept, stored as float32 in a scratch row that stays in L1/L2;
- softmax: the C row softmax's exponent, sum and order; bf16 probabilities into a second scratch row;
- P.V: 4 rows x 64 dims in registers, each pair of keys' probabilities broadcast as one lane against V laid out
  in pairs of keys ([keys/2, D], made once per layer), rounded once to bf16.
No score or probability matrix makes a round trip through memory.

Numerics are the general path's (transformers' bf16 eager attention): the same rounding points, float32 sums of
exact bf16 products. On the AVX512-BF16 EPYC the outputs are the general path's bits, but for ~1 in 10^4 values
one bf16 ulp apart at 2016 keys, where oneDNN's GEMM splits the P.V sum over keys into blocks.

One 2016-token llama-small layer's attention (the EPYC VM): 35.4 -> 27.9 ms on one core, 27.1 -> 15.9 ms on two;
a 2016-token prefill 719.7 -> 664.0 ms, the Qwen2.5-0.5B shape 8552 -> 7918 ms (one core). On more than one
thread it runs where the library's C++ op splits it between torch's own threads (native_ops.py; ``runs``). The
AVX512-BF16 levels' libraries have it, and it needs D % 16 == 0: the plan's ``prefill_attention=one_pass``.
"""
from __future__ import annotations

import numpy as np
import torch

from tierlm.backends.torch.cpu import native_ops
from tierlm.backends.torch.cpu.library import KernelLibrary

ROWS = 4  # query rows per register block (the C source's BS_QR): a thread's slice of rows is a multiple of it
KEYS = 64  # keys per register block (BS_KV vectors of 16): K's and V's pair layouts are padded to a multiple of it
# Below this many scores per thread a block is not split further (blocked_attention.py's softmax split too).
MIN_SCORES_PER_THREAD = 1 << 17


def runs(lib: KernelLibrary) -> bool:
    """Whether blocks take the kernel now: torch runs one thread, or ``lib``'s C++ op can split it between torch's
    threads (else the general path: the GEMMs and the separate softmax)."""
    return lib.has("blocked_attention") and (torch.get_num_threads() == 1 or native_ops.registered(lib) is lib)


def key_pairs(k: torch.Tensor) -> torch.Tensor:
    """k [B, L, D] bf16 -> [B, D/2, Lp] int32: each bf16 pair (d, d+1) of a key as one 32-bit lane, keys along the
    last dim, zero-padded to Lp, a multiple of ``KEYS``."""
    B, L, D = k.shape
    kp = torch.zeros((B, D // 2, padded(L)), dtype=torch.int32)
    kp[:, :, :L] = k.contiguous().view(torch.int32).transpose(1, 2)
    return kp


def value_pairs(v: torch.Tensor) -> torch.Tensor:
    """v [B, L, D] bf16 -> [B, Lp/2, D] int32: dim d of keys t and t+1 (t even) as one 32-bit lane, zero past L."""
    B, L, D = v.shape
    vp = torch.zeros((B, padded(L), D), dtype=torch.bfloat16)
    vp[:, :L] = v
    return vp.view(B, -1, 2, D).transpose(2, 3).contiguous().view(torch.int32).view(B, -1, D)


def padded(L: int) -> int:
    return -(-L // KEYS) * KEYS


def work_floats(L: int) -> int:
    """Scratch floats a thread needs for L keys: float32 scores and bf16 probabilities of ROWS rows."""
    return (ROWS + ROWS // 2) * padded(L)


def attend(lib: KernelLibrary, qb: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, limits: np.ndarray, Hkv: int,
           E: int, scale: float, work: torch.Tensor) -> torch.Tensor:
    """qb [B, M, D] bf16 (contiguous), kp / vp from ``key_pairs`` / ``value_pairs``, limits [G, b] int32 (row r of
    batch g sees limits[g // Hkv, r % b] keys, at most E) -> the attention [B, M, D] bf16; ``work``
    [threads, work_floats(L)] float32. Split between torch's threads (``runs`` says when this may be called)."""
    B, M, D = qb.shape
    out = torch.empty((B, M, D), dtype=torch.bfloat16)
    if torch.get_num_threads() == 1:
        lib.blocked_attention_rows_bf16(qb.data_ptr(), kp.data_ptr(), vp.data_ptr(), out.data_ptr(), B, M, 0, M, D,
                                        kp.shape[2], E, limits.ctypes.data, Hkv, limits.shape[1], float(scale),
                                        work.data_ptr())
        return out
    grain = -(-MIN_SCORES_PER_THREAD // (B * ROWS * E))  # row slices a thread takes at least
    torch.ops.tierlm_native.blocked_attention(qb, kp, vp, out, torch.from_numpy(limits), E, Hkv, float(scale), work,
                                              grain)
    return out
