"""bf16 prefill and extend attention on CPU: blocks of query rows through two bf16 matmuls and a C row softmax.

torch's CPU flash-attention kernel runs bf16 at ~30 GFLOP/s on one core without AMX (measured on AVX512-BF16: a
2016-token causal llama-small layer took 64 ms), while oneDNN's bf16 matmuls run an order of magnitude faster.
Here each block of query rows takes scores = q_blk @ K[:E]^T (bf16), the softmax in one C pass per row
(csrc/blocked_attention.c's ``softmax_rows_bf16``: scale, causal / length limit, float32 softmax, bf16
probabilities, the masked tail zeroed) and p @ V[:E], where E is the last key any row of the block sees, so blocks above the diagonal
are never computed.

On AVX512-BF16 levels each block runs as one C pass instead (blocked_one_pass.py: scores, softmax and P.V in
registers, no score matrix written and read back; the same rounding points): the plan's ``prefill_attention`` is
``one_pass`` there, ``blocked`` for the GEMMs.

Where the CPU has AMX, torch's fused SDPA kernel multiplies on its tiles and is faster (~3x at 2016 tokens): the
plan sends bf16 prefill there instead (``sdpa``), within bf16 rounding of these numerics (SDPA's online softmax
rounds at other points).

Numerics are transformers' bf16 eager attention (the tests' reference): scores rounded to bf16, scaled and
rounded again, softmax in float32, probabilities rounded to bf16, one rounding of the output; the decode kernel
rounds at the same points, so prefill, extend and decode of one request agree in how they round.
"""
from __future__ import annotations

import numpy as np
import torch

from tierlm.backends.torch.cpu import blocked_one_pass
from tierlm.backends.torch.cpu.blocked_one_pass import MIN_SCORES_PER_THREAD
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.cpu.threads import helper_threads

# Query rows per block: 64 measured fastest for llama-small and the Qwen2.5-0.5B shape at 2016 tokens (one core;
# 32: +4 %, 128: +20 %): the block's scores (H x 64 x E bf16) stay in the L2 cache between the three passes.
BLOCK_ROWS = 64


def softmax_rows(lib: KernelLibrary, scores: torch.Tensor, limits: np.ndarray, rows_per_group: int, b: int,
                 scale: float, work: torch.Tensor) -> None:
    """``softmax_rows_bf16`` over every row of ``scores`` [R, E] (see the C source), split between torch's intra-op
    threads when the block is large; ``work`` [threads, E] float32."""
    R, E = scores.shape[0] * scores.shape[1], scores.shape[-1]
    n = max(1, min(work.shape[0], torch.get_num_threads(), R * E // MIN_SCORES_PER_THREAD))
    args = (E, limits.ctypes.data, rows_per_group, b, float(scale))
    if n == 1:
        lib.softmax_rows_bf16(scores.data_ptr(), 0, R, *args, work.data_ptr())
        return
    cuts = [R * t // n for t in range(n + 1)]
    futures = [helper_threads(n - 1).submit(lib.softmax_rows_bf16, scores.data_ptr(), cuts[t], cuts[t + 1], *args,
                                            work[t].data_ptr()) for t in range(1, n)]
    lib.softmax_rows_bf16(scores.data_ptr(), cuts[0], cuts[1], *args, work[0].data_ptr())
    for f in futures:
        f.result()


def usable(lib: KernelLibrary | None, q: torch.Tensor, k: torch.Tensor) -> bool:
    """bf16 queries and K/V on CPU, ``lib`` the library where the plan has the blocked path (else None)."""
    return lib is not None and q.device.type == "cpu" and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16


def causal_limits(T: int) -> np.ndarray:
    """Keys each row of a fresh T-token prefill sees: row i sees keys 0..i."""
    return np.arange(1, T + 1, dtype=np.int32)[None, :]


def blocked_attention(lib: KernelLibrary, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: np.ndarray,
                      scale: float, one_pass: bool = True) -> torch.Tensor:
    """q [G, H, Q, D], k/v [G, Hkv, L, D] (bf16), limits [G, Q] int32: query row i of request g sees keys
    0..limits[g, i]-1 (1 <= limits <= L) -> [G, H, Q, D]. ``one_pass``: each block in one C pass where the library
    has it (the plan's ``prefill_attention=one_pass``), else the GEMMs and the C softmax."""
    G, H, Q, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    n = H // Hkv
    qv = q.reshape(G * Hkv, n, Q, D)  # head h = kv * n + j (GQA without repeating K/V)
    out = torch.empty((G * Hkv, n, Q, D), dtype=q.dtype)
    lim = np.ascontiguousarray(limits, dtype=np.int32)
    threads = max(1, torch.get_num_threads())
    if one_pass and D % 16 == 0 and blocked_one_pass.runs(lib):  # one C pass a block: K and V as bf16 pairs
        kp = blocked_one_pass.key_pairs(k.reshape(G * Hkv, L, D))
        vp = blocked_one_pass.value_pairs(v.reshape(G * Hkv, L, D))
        work = torch.empty((threads, blocked_one_pass.work_floats(L)), dtype=torch.float32)

        def block(qb: torch.Tensor, blk: np.ndarray, b: int, E: int) -> torch.Tensor:
            return blocked_one_pass.attend(lib, qb.contiguous(), kp, vp, blk, Hkv, E, scale, work)
    else:
        # K^T made contiguous once per layer: a [D, :E] slice of it goes to the GEMM as is, where a transposed view
        # of K[:E] was copied inside every block's bmm (207 vs 359 us for 128 rows x 1000 keys here)
        kt = k.reshape(G * Hkv, L, D).transpose(1, 2).contiguous()  # [G*Hkv, D, L]
        # V made contiguous once per layer too: the P.V GEMM read a strided V[:E] slower in every block (one
        # 2016-token llama-small layer 36.0 -> 34.7 ms, the copy included; the same bits)
        vb = v.reshape(G * Hkv, L, D).contiguous()
        work = torch.empty((threads, L), dtype=torch.float32)

        def block(qb: torch.Tensor, blk: np.ndarray, b: int, E: int) -> torch.Tensor:
            scores = torch.bmm(qb, kt[:, :, :E])  # [G*Hkv, n*b, E], contiguous bf16
            softmax_rows(lib, scores, blk, H * b, b, scale, work)
            return torch.bmm(scores, vb[:, :E])

    for s in range(0, Q, BLOCK_ROWS):
        b = min(BLOCK_ROWS, Q - s)
        blk = np.ascontiguousarray(lim[:, s:s + b])
        E = min(int(blk.max()), L)  # the C softmax writes E columns per row: never past the scores
        qb = qv[:, :, s:s + b].reshape(G * Hkv, n * b, D)
        out[:, :, s:s + b] = block(qb, blk, b, E).view(G * Hkv, n, b, D)
    return out.view(G, H, Q, D)
