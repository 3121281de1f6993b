"""`tierlm bench prefix`'s "L3 other instance" row: a prefix computed by server A is served to server B from
Mooncake Store (one mooncake_master, both servers on it), as several instances behind sglang-router share L3.

Servers on one host share the store as Mooncake deploys it there: one ``mooncake_client`` (the real client) lends
the store the memory the pages live in, and both servers are its dummy clients, moving pages through shared memory
(transport "shm"). $TIERLM_BENCH_L3_TRANSPORT=tcp measures the TCP layout instead (the fallback, and the layout
across hosts): server A lends the memory itself and server B reads it over loopback TCP. Either way server B starts
with empty L1/L2, so every prefix token it reuses crossed from A through the store.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from tierlm.server.commands.bench.mooncake_master import MooncakeMaster, MooncakeRealClient
from tierlm.server.commands.bench.server_process import BenchServer

CASE = "L3 other instance"
SEGMENT_MARGIN_BYTES = 64 * 2**20
PAGE_HEADER_BYTES = 128  # runtime/cache/storage/page_header.py: each stored value is header + page
TRANSPORT_ENV = "TIERLM_BENCH_L3_TRANSPORT"


def unavailable() -> str | None:
    """Why the row cannot be measured here (with the install command), or None."""
    return MooncakeMaster.unavailable()


def transport() -> str:
    """The layout to measure: $TIERLM_BENCH_L3_TRANSPORT, "shm" by default ("tcp" where mooncake_client is missing)."""
    want = os.environ.get(TRANSPORT_ENV, "shm").strip().lower()
    if want not in ("shm", "tcp"):
        raise SystemExit(f"${TRANSPORT_ENV} must be shm or tcp, got {want!r}")
    return "tcp" if want == "tcp" or MooncakeRealClient.unavailable() else "shm"


def layout_note() -> str:
    """The report's note on how the row's pages travel."""
    if transport() == "shm":
        return (f"{CASE}: server B (empty L1/L2) and server A, which computed the prefixes, are dummy clients of one "
                "mooncake_client that lends the store its memory; pages move through shared memory "
                f"(${TRANSPORT_ENV}=tcp: over loopback TCP instead)")
    return (f"{CASE}: server B (empty L1/L2) on one mooncake_master with server A, which computed the prefixes and "
            "lends the store its memory; pages cross loopback TCP")


def mooncake_flags(master: str, segment_bytes: int, client: str = "") -> list[str]:
    extra = {"master_server_address": master, "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
             "protocol": "tcp", "global_segment_size": segment_bytes}
    if client:
        extra["client_server_address"] = client
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
    shm = transport() == "shm"
    with MooncakeMaster() as master, contextlib.ExitStack() as stack:
        if shm:  # the real client lends the memory; both servers are its dummy clients
            client = stack.enter_context(MooncakeRealClient(master.address, segment,
                                                            log_path=log_dir / "mooncake_client.log")).address
            a_flags, b_flags = mooncake_flags(master.address, 0, client), mooncake_flags(master.address, 0, client)
        else:  # server A lends it, server B reads over loopback TCP
            a_flags, b_flags = mooncake_flags(master.address, segment), mooncake_flags(master.address, 0)
        a = BenchServer(server_args(*a_flags), log_dir=log_dir, name="l3-instance-a")
        b = BenchServer(server_args(*b_flags), log_dir=log_dir, name="l3-instance-b")
        with a, b:
            step("L3 other instance: server A computes the prefixes")
            a.start()
            for prefix in prefixes:
                run_one(a.url, prompt(prefix), new)
            a.wait_storage_idle()  # every page is in the store before B asks
            step("L3 other instance: server B")
            b.start()
            run_one(b.url, warm_ids, 1)  # first HTTP request, off the clock
            # the transport server B really uses (it falls back to TCP when the mooncake_client does not answer)
            used = ((b.info().get("tiers") or {}).get("storage") or {}).get("transport") or "unknown"
            for r, prefix in enumerate(prefixes):
                row = measure_one(b, CASE, r, prompt(prefix))
                row["l3_transport"] = used
                rows.append(row)
    return rows
