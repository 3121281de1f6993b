"""Whether the CPU backend puts its weights on transparent huge pages, and why (Linux).

A decode step streams every weight once. On 4 KB pages one core's stream stalls on a TLB miss every 4 KB (80 MB of
weights are 20,000 pages; the second-level TLB covers ~12 MB): the decode-product kernel read 18-20 GB/s where
numpy's read rate on this machine was 31-34 GB/s, and numpy asks for huge pages for its large arrays. On 2 MB pages
the same kernel read 33-37 GB/s (AMD EPYC VM, lm_head 32000 x 512). The backend applies this plan
(backends/torch/cpu/huge_pages.py): it asks for huge pages before the weights load, and moves weights that still lie on
4 KB pages onto huge pages with ``MADV_COLLAPSE`` (Linux 6.1+) once they are loaded and packed.

The kernel's THP mode decides what is allowed: ``always`` and ``madvise`` let tierlm ask; ``never`` refuses, and
the plan says what to change. ``TIERLM_CPU_PLAN=huge_pages=no`` keeps 4 KB pages (platforms/cpu_plan.py).
"""
from __future__ import annotations

import dataclasses
import platform
import re
from pathlib import Path
from typing import Mapping

from tierlm.platforms.cpu_plan import override

THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
DEFAULT_PAGE_BYTES = 2 << 20
# Larger huge pages (512 MiB on aarch64 kernels with 64 KB base pages) are not asked for: a collapse fills every
# untouched page of its range, which would be up to that much memory the plan never counted.
MAX_PAGE_BYTES = 2 << 20
COLLAPSE_SINCE = (6, 1)  # MADV_COLLAPSE: a synchronous move of mapped pages onto huge pages


@dataclasses.dataclass(frozen=True)
class HugePagePlan:
    use: bool
    page_bytes: int  # the huge page size (PMD): 2 MiB on x86_64 and on aarch64 with 4 KB base pages
    collapse: bool  # weights already on 4 KB pages can be moved now (else the kernel's khugepaged may, later)
    why: str


def thp_mode(enabled_text: str | None) -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled ("always [madvise] never" -> "madvise")."""
    m = re.search(r"\[(\w+)\]", enabled_text or "")
    return m.group(1) if m else None


def kernel_version(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def plan(env: Mapping[str, str], system: str, release: str, enabled_text: str | None,
         pmd_size_text: str | None) -> HugePagePlan:
    """The decision from the machine's texts (``system``/``release``: platform.system()/release(); the two THP
    files' contents, None where absent)."""
    page = int(pmd_size_text) if (pmd_size_text or "").strip().isdigit() else DEFAULT_PAGE_BYTES
    asked = override(env, "huge_pages")
    if asked is not None and asked[0] == "no":
        return HugePagePlan(False, page, False, f"{asked[1]}: weights stay on 4 KB pages")
    if system != "Linux":
        return HugePagePlan(False, page, False, f"{system}: no transparent huge pages to ask for")
    mode = thp_mode(enabled_text)
    if mode is None:
        return HugePagePlan(False, page, False, "this kernel has no transparent huge pages "
                                                "(no /sys/kernel/mm/transparent_hugepage/enabled)")
    if mode == "never":
        return HugePagePlan(False, page, False,
                            "transparent huge pages are off in this kernel (never): weights stream from 4 KB pages, "
                            "~1.3x slower decode here; `echo madvise | sudo tee "
                            "/sys/kernel/mm/transparent_hugepage/enabled` lets tierlm ask for them")
    if page > MAX_PAGE_BYTES:
        return HugePagePlan(False, page, False, f"huge pages here are {page >> 20} MiB (64 KB base pages): too coarse "
                                                "to ask for around the weights; they stay on base pages")
    collapse = kernel_version(release) >= COLLAPSE_SINCE
    how = "moved onto them after loading (MADV_COLLAPSE)" if collapse else \
        f"advised only: Linux {release} has no MADV_COLLAPSE (6.1+), khugepaged moves them when it gets to them"
    return HugePagePlan(True, page, collapse, f"THP mode {mode}: weights on {page >> 20} MiB pages, {how}")


def this_machine(env: Mapping[str, str]) -> HugePagePlan:
    return plan(env, platform.system(), platform.release(), _read(THP_DIR / "enabled"),
                _read(THP_DIR / "hpage_pmd_size"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
