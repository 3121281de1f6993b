"""A CPU model's weights on transparent huge pages (why and when: platforms/huge_pages.py).

Two steps, both asking the kernel through ``madvise``:
- before the weights load, ``ask_at_allocation`` turns on torch's own switch (``THP_MEM_ALLOC_ENABLE``): c10's
  allocator advises every allocation of 2 MB or more onto huge pages as it is made, so large weights (and the KV
  pool) are born there and nothing is copied. c10 reads the switch once, at the process's first CPU allocation of
  any size: a process that allocated a tensor before (``tierlm serve`` does not; tests and notebooks do) keeps its
  allocations as they are, and the second step does the weights' work alone. The variable stays set for the
  process and its children.
- once the weights are loaded and packed, ``move_onto_huge_pages`` advises every huge-page-sized range that holds
  weight bytes (one call per run of adjacent ranges) and moves those at least half full of weights with
  ``MADV_COLLAPSE``: the weights smaller than 2 MB (llama-small's q/k/v and o are 1 and 0.5 MB), and all of them
  where the switch came too late. A collapse fills the range's untouched pages, so the sparse edges of a weight
  are only advised. A range may hold other memory of the process beside the weights; its contents never change,
  only the page size that maps them. The kernel may refuse a range (it crosses two mappings, no huge page could
  be put together, a memory cgroup's limit, THP off for the process): it stays on 4 KB pages, and the report says
  how many weight bytes made it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import os
import time
from typing import Iterable, MutableMapping

import torch
from torch import nn

from tierlm.platforms.huge_pages import HugePagePlan

log = logging.getLogger(__name__)

ALLOC_ENV = "THP_MEM_ALLOC_ENABLE"
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
PROGRESS_RANGES = 512  # a progress bar from this many ranges (1 GiB of 2 MiB pages)


@dataclasses.dataclass
class HugePageReport:
    weight_bytes: int = 0
    on_huge_pages: int = 0  # weight bytes in ranges the kernel moved (or advised, without MADV_COLLAPSE)
    ranges: int = 0
    not_moved: int = 0  # ranges left on 4 KB pages: too sparse to collapse, or refused by the kernel
    moved: bool = True  # False where the kernel has no MADV_COLLAPSE: the bytes were advised, khugepaged may move
    seconds: float = 0.0
    why: str = ""

    def summary(self) -> str:
        mib = 2 ** 20
        if not self.ranges:
            return self.why
        where = "on huge pages" if self.moved else "advised onto huge pages"
        return (f"{self.on_huge_pages / mib:.1f} of {self.weight_bytes / mib:.1f} MiB of weights {where} "
                f"({self.not_moved} of {self.ranges} ranges stayed on 4 KB pages; {self.seconds:.2f} s): {self.why}")


def ask_at_allocation(plan: HugePagePlan, env: MutableMapping[str, str] = os.environ) -> None:
    """torch's allocator puts allocations of 2 MB and more on huge pages from now on, unless the user set the
    switch (to anything) or the plan says no."""
    if plan.use:
        env.setdefault(ALLOC_ENV, "1")


def tensor_regions(module: nn.Module) -> list[tuple[int, int]]:
    """(address, bytes) of each CPU parameter and buffer's memory once: a oneDNN-packed weight's opaque buffer, a
    plain tensor's whole storage. Tensor subclasses without one storage (torchao's) are left out."""
    regions: dict[int, int] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device.type != "cpu":
            continue
        try:
            if t.is_mkldnn:
                address, nbytes = torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
            else:
                storage = t.untyped_storage()
                address, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass: no storage of its own
            continue
        if address and nbytes:
            regions[address] = max(nbytes, regions.get(address, 0))
    return sorted(regions.items())


def bytes_per_range(regions: Iterable[tuple[int, int]], page: int) -> dict[int, int]:
    """For each ``page``-aligned range holding any byte of ``regions``: how many of their bytes it holds."""
    per: dict[int, int] = {}
    for address, nbytes in regions:
        for r in range(address // page * page, address + nbytes, page):
            per[r] = per.get(r, 0) + min(address + nbytes, r + page) - max(address, r)
    return per


def move_onto_huge_pages(regions: list[tuple[int, int]], plan: HugePagePlan) -> HugePageReport:
    report = HugePageReport(weight_bytes=sum(n for _, n in regions), why=plan.why)
    if not plan.use or not regions:
        return report
    madvise = _madvise()
    if madvise is None:
        report.why = "no madvise in this C library: weights stay on 4 KB pages"
        return report
    page = plan.page_bytes
    per = bytes_per_range(regions, page)
    ranges = sorted(per)
    t0 = time.perf_counter()
    done: set[int] = set()
    steps = ranges
    if len(ranges) >= PROGRESS_RANGES:
        from tqdm import tqdm

        steps = tqdm(ranges, desc="weights onto huge pages", unit="MiB", unit_scale=page / 2 ** 20)
    advised = _advise_runs(madvise, ranges, page)
    for r in steps:
        if r not in advised and madvise(r, page, MADV_HUGEPAGE) != 0:
            continue
        if not plan.collapse:
            done.add(r)
        elif per[r] * 2 >= page and madvise(r, page, MADV_COLLAPSE) == 0:
            done.add(r)
    report.ranges, report.not_moved, report.moved = len(ranges), len(ranges) - len(done), plan.collapse
    report.on_huge_pages = sum(per[r] for r in done)
    report.seconds = time.perf_counter() - t0
    return report


def _runs(ranges: list[int], page: int) -> list[tuple[int, int]]:
    """(start, ranges) of each run of adjacent ranges in sorted ``ranges``."""
    runs: list[tuple[int, int]] = []
    for r in ranges:
        if runs and runs[-1][0] + runs[-1][1] * page == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


def _advise_runs(madvise, ranges: list[int], page: int) -> set[int]:
    """The ranges advised onto huge pages by one madvise per run of adjacent ranges. A mapping is split where an
    advised span begins or ends inside it, and not every kernel merges advised neighbours back (one CI machine
    left each 2 MiB range its own mapping): one span per run keeps a large model's mapping count near its number
    of allocations, under vm.max_map_count, and costs one call instead of thousands. A run the kernel refuses
    (an edge range reaches past the mapping) is tried again without its edges; what is left goes range by range."""
    advised: set[int] = set()
    for start, n in _runs(ranges, page):
        if n > 1 and madvise(start, n * page, MADV_HUGEPAGE) == 0:
            advised.update(range(start, start + n * page, page))
        elif n > 3 and madvise(start + page, (n - 2) * page, MADV_HUGEPAGE) == 0:  # an edge reached past the mapping
            advised.update(range(start + page, start + (n - 1) * page, page))
    return advised


def place_model(model: nn.Module, plan: HugePagePlan) -> HugePageReport:
    """The loaded (and packed) model's weights onto huge pages, as far as the kernel lets; logged."""
    report = move_onto_huge_pages(tensor_regions(model), plan)
    log.info("CPU weights: %s", report.summary())
    return report


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
