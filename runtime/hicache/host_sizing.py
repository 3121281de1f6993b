"""How many host (L2) pages to allocate, and refusing a host pool that does not fit in RAM."""
from __future__ import annotations

import logging

from tierlm.runtime.errors import StartupError

log = logging.getLogger(__name__)

RAM_HEADROOM = 0.8  # never plan a host pool above 80% of currently available RAM


def available_ram_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def plan_host_pool(device_pages: int, page_bytes: int, ratio: float, size_gb: float,
                   available: int | None = None) -> int:
    """SGLang semantics: --hicache-size (GB) wins when > 0, else device pages x --hicache-ratio."""
    if size_gb and size_gb > 0:
        pages = int(size_gb * 1e9) // page_bytes
        why = f"--hicache-size {size_gb} GB"
    else:
        if ratio <= 1.0:
            raise StartupError(f"--hicache-ratio must be > 1 (the host tier holds the device tier and more), got {ratio}")
        pages = int(device_pages * ratio)
        why = f"{device_pages} device pages x --hicache-ratio {ratio}"
    if pages < 1:
        raise StartupError(f"the host pool would hold no pages ({why}); raise --hicache-size or --hicache-ratio")
    need = pages * page_bytes
    avail = available_ram_bytes() if available is None else available
    if need > avail * RAM_HEADROOM:
        fit = int(avail * RAM_HEADROOM) // page_bytes
        raise StartupError(
            f"the host KV pool needs {need / 2**30:.2f} GiB ({pages} pages x {page_bytes} bytes, from {why}) but only "
            f"{avail / 2**30:.2f} GiB of RAM is available (at most {RAM_HEADROOM:.0%} of it is used). Lower "
            f"--hicache-ratio or set --hicache-size to at most {fit * page_bytes / 1e9:.2f} GB.")
    log.info("host pool sized from %s: %d pages, %.1f MiB", why, pages, need / 2**20)
    return pages
