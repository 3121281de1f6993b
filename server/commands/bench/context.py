"""What every benchmark gets besides its own options: the model, the server flags, progress, the work folder."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class BenchContext:
    """What every benchmark needs besides its own options."""

    model_dir: Path
    model_label: str
    dtype: str
    page_size: int
    server_extra: list[str]
    seed: int
    progress: bool
    work_dir: Path
    command: str
    vocab_size: int = 0
    load_at_start: float | None = None

    def server_args(self, *more: str) -> list[str]:
        """Flags for `python -m tierlm.launch_server` common to every server this run starts."""
        return ["--model-path", str(self.model_dir), "--dtype", self.dtype, "--page-size", str(self.page_size),
                "--random-seed", str(self.seed), *more, *self.server_extra]

    def progress_bar(self, total: int, desc: str):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, disable=not self.progress, file=sys.stderr, leave=False,
                    dynamic_ncols=True)


def random_tokens(rng: Any, n: int, vocab_size: int) -> list[int]:
    """Distinct random prompts: ids 5.. (above the demo tokenizer's special tokens) within the vocabulary."""
    return rng.integers(5, vocab_size, size=n).tolist()
