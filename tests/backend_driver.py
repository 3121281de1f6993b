"""A tiny greedy driver over any ModelBackend, with no scheduler: it builds ForwardBatch objects by hand.

Each step batches every active request: a request still prefilling contributes its next chunk (up to
``chunk_size`` tokens), a request that is decoding contributes its last sampled token. Request i joins at
step ``i * stagger``, so steps really mix prefill chunks with other requests' decode steps.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest

from tierlm.backends.base import ForwardBatch, ModelBackend, SamplingBatch


# The device the torch backend runs on in the tests: TIERLM_TEST_DEVICE=cuda puts it on the GPU
# (scripts/device_check.sh); unset, each test keeps its own default (cpu).
TEST_DEVICE = os.environ.get("TIERLM_TEST_DEVICE", "").strip().lower()


def device_under_test(default: str = "cpu") -> str:
    """TIERLM_TEST_DEVICE, else ``default``. With cuda and no GPU visible, the calling test is skipped."""
    device = TEST_DEVICE or default
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("TIERLM_TEST_DEVICE=cuda, but torch.cuda.is_available() is False: no GPU here")
    return device


@dataclass
class DriverRequest:
    prompt: list[int]
    max_new_tokens: int
    pages: list[int]  # device pages, in position order
    start_step: int = 0
    temperature: float = 0.0  # 0 -> greedy
    seed: int | None = None
    output: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions whose K/V are in the pool

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    def next_chunk(self, chunk_size: int | None) -> list[int]:
        """The tokens this request feeds in the next step."""
        if self.kv_len < len(self.prompt):
            end = len(self.prompt) if chunk_size is None else min(len(self.prompt), self.kv_len + chunk_size)
            return self.prompt[self.kv_len:end]
        return [self.output[-1]]


class GreedyDriver:
    def __init__(self, backend: ModelBackend, page_size: int, num_pages: int, chunk_size: int | None = None,
                 init_pool: bool = True) -> None:
        self.backend = backend
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.num_pages = num_pages
        self.requests: list[DriverRequest] = []
        self.step_count = 0
        self.batch_shapes: list[tuple[int, ...]] = []  # q_lens of every step, so tests can check the mix
        if init_pool:
            backend.init_kv_pool(num_pages, page_size)

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # The last sampled token is never fed back, so its K/V is never written.
        return -(-(prompt_len + max_new_tokens - 1) // self.page_size)

    def add(self, prompt: list[int], max_new_tokens: int, pages: list[int], start_step: int = 0,
            **sampling) -> DriverRequest:
        """Queue a request; ``sampling`` may set ``temperature`` and ``seed`` (default greedy)."""
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if len(pages) < self.pages_needed(len(prompt), max_new_tokens):
            raise ValueError(f"{len(pages)} pages cannot hold {len(prompt)} + {max_new_tokens} tokens")
        req = DriverRequest(list(prompt), max_new_tokens, list(pages), start_step, **sampling)
        self.requests.append(req)
        return req

    def step(self) -> bool:
        """Run one forward over every active request; False when there was nothing to run."""
        active = [r for r in self.requests if not r.done and r.start_step <= self.step_count]
        self.step_count += 1
        if not active:
            return any(not r.done for r in self.requests)
        chunks = [r.next_chunk(self.chunk_size) for r in active]
        q_lens = np.array([len(c) for c in chunks], np.int32)
        kv_lens = np.array([r.kv_len + len(c) for r, c in zip(active, chunks)], np.int32)
        positions = np.concatenate([np.arange(r.kv_len, r.kv_len + len(c)) for r, c in zip(active, chunks)])
        max_pages = max(-(-int(k) // self.page_size) for k in kv_lens)
        page_table = np.zeros((len(active), max_pages), np.int32)
        for i, r in enumerate(active):
            n = -(-int(kv_lens[i]) // self.page_size)
            page_table[i, :n] = r.pages[:n]
        # A request samples when its chunk reaches the end of what it has to feed (prompt end or a decode).
        samples = [i for i, (r, k) in enumerate(zip(active, kv_lens)) if k >= len(r.prompt)]
        ends = np.cumsum(q_lens) - 1
        batch = ForwardBatch(
            input_ids=np.concatenate([np.asarray(c, np.int64) for c in chunks]),
            positions=positions.astype(np.int64),
            q_lens=q_lens,
            kv_lens=kv_lens,
            page_table=page_table,
            sample_indices=ends[samples].astype(np.int64),
            sampling=sampling_batch([active[i] for i in samples]),
            page_size=self.page_size,
        )
        tokens = self.backend.forward(batch).next_token_ids
        assert tokens.shape == (len(samples),), f"backend returned {tokens.shape} for {len(samples)} samples"
        self.batch_shapes.append(tuple(int(q) for q in q_lens))
        for r, k in zip(active, kv_lens):
            r.kv_len = int(k)
        for i, t in zip(samples, tokens):
            active[i].output.append(int(t))
        return True

    def run(self) -> None:
        while self.step():
            pass


def sampling_batch(reqs: list[DriverRequest]) -> SamplingBatch:
    """Greedy for every request unless one has a temperature (then plain temperature sampling, no filters)."""
    batch = SamplingBatch.greedy(len(reqs))
    if any(r.temperature > 0 for r in reqs):
        batch.temperature = np.array([r.temperature for r in reqs], np.float32)
        batch.seeds = [r.seed for r in reqs]
        batch.output_ids = [list(r.output) for r in reqs]
        batch.prompt_ids = [list(r.prompt) for r in reqs]
        batch.all_greedy = False
    return batch


def run_greedy(backend: ModelBackend, prompts: list[list[int]], max_new_tokens: int, page_size: int = 4,
               chunk_size: int | None = None, num_pages: int | None = None, stagger: int = 1,
               driver_out: list | None = None) -> list[list[int]]:
    """Greedy outputs of every prompt; pages are assigned sequentially per request, request i joins at step
    ``i * stagger``. ``driver_out`` (a list) receives the driver, for tests that inspect the steps."""
    needed = [-(-(len(p) + max_new_tokens - 1) // page_size) for p in prompts]
    total = sum(needed)
    driver = GreedyDriver(backend, page_size, num_pages or total, chunk_size)
    if driver.num_pages < total:
        raise ValueError(f"num_pages={num_pages} is too small: the prompts need {total} pages")
    first = 0
    for i, (prompt, n) in enumerate(zip(prompts, needed)):
        driver.add(prompt, max_new_tokens, list(range(first, first + n)), start_step=i * stagger)
        first += n
    driver.run()
    if driver_out is not None:
        driver_out.append(driver)
    return [r.output for r in driver.requests]
