"""The host (L2) pool's memory is faulted in on a background thread without changing what the pool holds."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from tierlm.backends.base import HostKVPool, HostStatePool, StateGeometry
from tierlm.backends.host_memory import allocate_host_bytes


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pool_starts_zeroed_and_keeps_pages_written_while_it_is_faulted_in(layout: str) -> None:
    pool = HostKVPool(num_pages=512, page_bytes=4 * 16384, num_layers=4, layout=layout)  # 32 MiB
    page = np.arange(pool.page_bytes, dtype=np.uint64).astype(np.uint8)
    pool.page_from_bytes(7, page.tobytes())  # written while the background thread may still be populating
    pool.page_from_bytes(511, page.tobytes())
    assert pool.faulted_in.wait(30)
    assert pool.page_to_bytes(7) == page.tobytes() == pool.page_to_bytes(511)
    assert not pool.data.reshape(-1)[: 7 * pool.page_bytes if layout == "page_first" else 0].any()
    assert pool.total_bytes == 512 * pool.page_bytes


def _rss_kib(addr: int) -> int:
    """Resident KiB of the mapping that holds ``addr`` (/proc/self/smaps)."""
    rss, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1])
    assert rss is not None, "mapping not found"
    return rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux only")
def test_populated_memory_is_resident_and_unpopulated_is_not() -> None:
    lazy, _ = allocate_host_bytes(16 << 20, prefault=False)
    assert _rss_kib(lazy.__array_interface__["data"][0]) < 1024  # untouched: nothing resident yet
    data, done = allocate_host_bytes(16 << 20)
    assert done.wait(30)
    assert _rss_kib(data.__array_interface__["data"][0]) >= 16 << 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux only")
def test_the_hybrid_host_state_pool_is_resident_once_committed() -> None:
    # commit_host_pool (runtime/engine_setup.py) waits on this event for the state pool too, before ready
    geometry = StateGeometry(num_linear_layers=4, conv_dim=256, conv_kernel=4, rec_shape=(8, 64, 64),
                             conv_dtype="float32", rec_dtype="float32")
    pool = HostStatePool(32, geometry)  # 32 slots x 4 layers x (3 KiB + 128 KiB)
    assert pool.total_bytes > 16 << 20
    assert pool.faulted_in.wait(30)
    assert _rss_kib(pool.data.__array_interface__["data"][0]) >= pool.total_bytes >> 10
