"""`tierlm bench prefix`'s "L3 other instance" row: a prefix computed by server A is served to server B from
Mooncake Store (one mooncake_master, both servers on it), as several instances behind sglang-router share L3.

Server A lends the store the memory its pages live in (``global_segment_size``); server B lends none and starts
with empty L1/L2, so every prefix token it reuses crossed from A through the store.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from tierlm.server.bench.mooncake_master import MooncakeMaster
from tierlm.server.bench.server_process import BenchServer

CASE = "L3 other instance"
SEGMENT_MARGIN_BYTES = 64 * 2**20
PAGE_HEADER_BYTES = 128  # runtime/cache/storage/page_header.py: each stored value is header + page


def unavailable() -> str | None:
    """Why the row cannot be measured here (with the install command), or None."""
    return MooncakeMaster.unavailable()


def mooncake_flags(master: str, segment_bytes: int) -> list[str]:
    extra = {"master_server_address": master, "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
             "protocol": "tcp", "global_segment_size": segment_bytes}
    return ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", json.dumps(extra)]


def measure(server_args: Callable[..., list[str]], log_dir: Path, prefixes: list[list[int]],
            prompt: Callable[[list[int]], list[int]], warm_ids: list[int], page_bytes: int, tokens_per_page: int,
            measure_one: Callable[[BenchServer, str, int, list[int]], dict[str, Any]],
            run_one: Callable[[str, list[int], int], Any], new: int, step: Callable[[str], None]
            ) -> list[dict[str, Any]]:
    """Server A computes every prefix (prompt(prefix) adds a fresh suffix); server B then serves them: one row
    per prefix, measured by ``measure_one(server, CASE, repeat, ids)``."""
    pages = sum(-(-len(p) // tokens_per_page) + 1 for p in prefixes)
    segment = 2 * pages * (page_bytes + PAGE_HEADER_BYTES) + SEGMENT_MARGIN_BYTES
    rows: list[dict[str, Any]] = []
    with MooncakeMaster() as master:
        a = BenchServer(server_args(*mooncake_flags(master.address, segment)), log_dir=log_dir,
                        name="l3-instance-a")
        b = BenchServer(server_args(*mooncake_flags(master.address, 0)), log_dir=log_dir, name="l3-instance-b")
        with a, b:
            step("L3 other instance: server A computes the prefixes")
            a.start()
            for prefix in prefixes:
                run_one(a.url, prompt(prefix), new)
            a.wait_storage_idle()  # every page is in the store before B asks
            step("L3 other instance: server B")
            b.start()
            run_one(b.url, warm_ids, 1)  # first HTTP request, off the clock
            for r, prefix in enumerate(prefixes):
                rows.append(measure_one(b, CASE, r, prompt(prefix)))
    return rows
