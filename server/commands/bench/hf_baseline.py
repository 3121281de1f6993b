"""The transformers baseline for `tierlm bench decode`: `model.generate` on the same weights and dtype, in-process.

Greedy, EOS ignored (exactly ``new_tokens`` per sequence), transformers' default attention (sdpa) and its own
KV cache. Decode speed is separated from prefill by timing a 1-token generate next to the full one:
decode tokens/s = (new_tokens - 1) / (t_full - t_one).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from tierlm.backends.dtypes import serving_dtype


@dataclass
class GenerateTiming:
    batch: int
    prompt_tokens: int
    new_tokens: int
    first_token_s: float  # generate(max_new_tokens=1): prefill + one token
    total_s: float  # generate(max_new_tokens=new_tokens)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Per sequence, prefill excluded."""
        span = self.total_s - self.first_token_s
        return (self.new_tokens - 1) / span if span > 0 and self.new_tokens > 1 else None

    @property
    def aggregate_tokens_per_s(self) -> float:
        """All sequences' new tokens over the whole call, prefill included (what a client batch gets)."""
        return self.batch * self.new_tokens / self.total_s


class HFBaseline:
    def __init__(self, model_dir: str | Path, dtype: str = "auto") -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the benchmark has its own progress bar
        # the device a tierlm server picks by default: the GPU when there is one, so the ratio compares like with like
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        name = serving_dtype(dtype, self.device.type)  # as the torch backend resolves it
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.threads = torch.get_num_threads()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def _generate(self, prompts: torch.Tensor, new_tokens: int) -> float:
        prompts = prompts.to(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  temperature=None, top_p=None, top_k=None)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        assert out.shape[1] == prompts.shape[1] + new_tokens, "generate stopped early"
        return elapsed

    def time_generate(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> GenerateTiming:
        """One batch of equal-length prompts; a short warm-up generate runs first (allocations, first-call paths)."""
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
        self._generate(ids[:, :8], 2)
        first = self._generate(ids, 1)
        total = self._generate(ids, new_tokens)
        return GenerateTiming(batch=ids.shape[0], prompt_tokens=ids.shape[1], new_tokens=new_tokens,
                              first_token_s=first, total_s=total)

    def close(self) -> None:
        del self.model
