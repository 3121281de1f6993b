"""CPU decode step with transformers' decoder modules vs fused q/k/v and gate/up (backends/torch/fused_projections.py),
and optionally the tied lm_head packed too (the CPU plan's pack_tied_lm_head), side by side in one process: one backend
per variant over the same synthetic model, decode steps of 1 and 8 requests at 64 tokens of context, rounds
alternating between the variants, per-step thread CPU time (other processes on a shared machine inflate it less
than wall time), median and min per variant, the ratios, linear calls per step and whether the logits are equal.

    python scripts/bench_fused_projections.py --synthetic llama-small --rounds 40 --steps 5
    python scripts/bench_fused_projections.py --synthetic qwen2.5-0.5b --variants unfused,fused,fused+tied
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from tierlm.backends.base import ForwardBatch, SamplingBatch
from tierlm.backends.model_source.synthetic import ensure_synthetic_model, synthetic_names
from tierlm.backends.torch.backend import TorchBackend
from tierlm.platforms.cpu_plan import PLAN_ENV

VARIANTS = ("unfused", "fused", "fused+tied")


def decode_batch(vocab: int, n: int, context: int, page_size: int = 16) -> ForwardBatch:
    kv = np.full(n, context, np.int32)
    pages = -(-context // page_size)
    table = np.arange(n * pages, dtype=np.int32).reshape(n, pages)
    return ForwardBatch(input_ids=(np.arange(n, dtype=np.int64) * 7 + 11) % vocab, positions=(kv - 1).astype(np.int64),
                        q_lens=np.ones(n, np.int32), kv_lens=kv, page_table=table,
                        sample_indices=np.arange(n, dtype=np.int64), sampling=SamplingBatch.greedy(n),
                        page_size=page_size)


def load(model_dir, variant: str, dtype: str, max_streams: int, context: int) -> TorchBackend:
    """A backend built under the variant's CPU plan overrides (read at load time), its pool filled with the same
    K/V."""
    os.environ[PLAN_ENV] = (f"fused_projections={'no' if variant == 'unfused' else 'yes'},"
                            f"pack_tied_lm_head={'yes' if variant == 'fused+tied' else 'no'}")
    backend = TorchBackend(model_dir, dtype=dtype)
    backend.init_kv_pool(max_streams * -(-context // 16) + 8, 16)
    torch.manual_seed(0)
    backend.pool.buffer.normal_()
    return backend


def linear_calls(backend: TorchBackend) -> int:
    return sum(isinstance(m, torch.nn.Linear) or "Linear" in type(m).__name__ for m in backend.model.modules())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", default="llama-small", choices=synthetic_names())
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", default="unfused,fused", help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per variant per round")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    streams = [int(s) for s in args.streams.split(",")]
    torch.set_num_threads(args.threads)
    model_dir = ensure_synthetic_model(args.synthetic)
    backends = {v: load(model_dir, v, args.dtype, max(streams), args.context) for v in variants}
    print(f"{args.synthetic} {args.dtype}, {torch.get_num_threads()} thread(s), context {args.context}, "
          f"{args.rounds} rounds x {args.steps} steps; linear calls per step: "
          + ", ".join(f"{v} {linear_calls(b)}" for v, b in backends.items())
          + "; weight MiB: " + ", ".join(f"{v} {b.weight_bytes() / 2**20:.0f}" for v, b in backends.items()))
    base = variants[0]
    for n in streams:
        batch = decode_batch(backends[base].info.vocab_size, n, args.context)
        ref = backends[base].forward_logits(batch)
        equal = all(torch.equal(ref, b.forward_logits(batch)) for b in backends.values())
        ms: dict[str, list[float]] = {v: [] for v in variants}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for v, b in backends.items():
                    b.forward(batch)  # warm this variant's caches after the others ran
                    t0 = time.thread_time()
                    for _ in range(args.steps):
                        b.forward(batch)
                    ms[v].append((time.thread_time() - t0) / args.steps * 1e3)
        med = {v: statistics.median(x) for v, x in ms.items()}
        low = {v: min(x) for v, x in ms.items()}
        print(f"  {n} stream(s), ms per step, median (min): "
              + ", ".join(f"{v} {med[v]:.2f} ({low[v]:.2f})" for v in variants)
              + "".join(f" | {base}/{v} {med[base] / med[v]:.3f}x ({low[base] / low[v]:.3f}x)" for v in variants[1:])
              + f" | logits equal: {equal}")


if __name__ == "__main__":
    main()
