"""gpt-oss MXFP4 experts on the torch backend, packed (backends/torch/mxfp4_experts.py) vs dequantized while
loading, side by side in one run: one stream's decode tokens/s, the resident weight bytes and whether both greedy
outputs agree, on seeded random gpt-oss models of a few shapes (tiny = the tests' model; the others: wider,
32 experts top-4 like gpt-oss-20b, fewer layers). Weights are random, so only speed and bytes mean anything.

    python scripts/bench_mxfp4_experts.py --device cpu --dtype bfloat16 --shapes tiny,h1024
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from backend_driver import GreedyDriver  # noqa: E402
from model_factory import GPT_OSS_TINY, build_tiny_gpt_oss  # noqa: E402

from tierlm.backends.torch.backend import TorchBackend  # noqa: E402

SHAPES = {
    "tiny": {},
    "h1024": dict(hidden_size=1024, intermediate_size=1024, num_local_experts=32, num_experts_per_tok=4,
                  num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64),
    "h2880": dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                  num_hidden_layers=1, layer_types=["sliding_attention"], num_attention_heads=64,
                  num_key_value_heads=8, head_dim=64),  # one gpt-oss-20b layer
}


def decode_rate(model_dir: Path, mode: str, device: str, dtype: str, tokens: int) -> dict:
    os.environ["TIERLM_MXFP4_EXPERTS"] = mode
    backend = TorchBackend(model_dir, dtype=dtype, device=device)
    driver = GreedyDriver(backend, page_size=16, num_pages=64)
    req = driver.add(list(range(3, 35)), tokens + 1, list(range(64)))
    driver.step()  # prefill (and the first token)
    driver.step()  # one decode step before the clock starts
    start = time.perf_counter()
    driver.run()
    elapsed = time.perf_counter() - start
    return {"tok_s": (tokens - 1) / elapsed, "weight_bytes": backend.weight_bytes(), "output": req.output}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="tiny,h1024")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in ns.shapes.split(","):
            spec = {**GPT_OSS_TINY, **SHAPES[shape]}
            model_dir = build_tiny_gpt_oss(Path(tmp) / shape, mxfp4=True, **SHAPES[shape])
            packed = decode_rate(model_dir, "packed", ns.device, ns.dtype, ns.tokens)
            dense = decode_rate(model_dir, "dequantized", ns.device, ns.dtype, ns.tokens)
            rows.append({"shape": shape, "hidden": spec["hidden_size"], "experts": spec["num_local_experts"],
                         "top_k": spec["num_experts_per_tok"], "packed_tok_s": round(packed["tok_s"], 1),
                         "dequantized_tok_s": round(dense["tok_s"], 1),
                         "packed/dequantized": round(packed["tok_s"] / dense["tok_s"], 2),
                         "packed_MiB": round(packed["weight_bytes"] / 2**20, 1),
                         "dequantized_MiB": round(dense["weight_bytes"] / 2**20, 1),
                         "same_tokens": packed["output"] == dense["output"]})
    if ns.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"device {ns.device}, dtype {ns.dtype}, {ns.tokens} decode tokens, one stream")
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
