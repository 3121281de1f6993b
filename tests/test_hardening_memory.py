"""Several instances on one machine must not kill each other (issue #33).

Two servers with HiCache on and default sizes, started one after the other inside a memory cgroup the test
creates: each sizes its pools from the memory the cgroup leaves (not the machine's), commits its host pool before
it reports ready (so the second counts the first's as used), and keeps its CPU default within the stated share of
RAM. Both must stay alive and serve. --context-length is raised far past what the pools can hold, so memory
and not the context cap decides the sizes (on today's main the first server takes ~7 GB of KV inside a 3 GiB
bound and the kernel kills it).
"""
from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import httpx
import pytest
from conftest import STORIES_PROMPT
from e2e_server import ServerStartError, start_server

import e2e_server
from tierlm.platforms.memory_limits import CGROUP_ROOT, PROC_CGROUP, bounded_by_cgroup, cgroup_memory
from tierlm.platforms.memory_plan import DEFAULT_CPU_KV_SHARE

pytestmark = pytest.mark.slow

LIMIT_BYTES = 3 * 1024**3  # two small-model servers (~0.5 GB each) and what the default lets their KV take


def _own_memory_cgroup() -> Path | None:
    """The cgroup-v1 memory folder this process is in (None: no v1 memory controller here)."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            folder = CGROUP_ROOT / "memory" / rel.lstrip("/")
            return folder if folder.is_dir() else None
    return None


@pytest.fixture
def memory_cgroup():
    """A child memory cgroup of LIMIT_BYTES under this process's own (skips where cgroups cannot be made)."""
    parent = _own_memory_cgroup()
    if parent is None:
        pytest.skip("no cgroup-v1 memory controller for this process (the test bounds its servers with one)")
    folder = parent / f"tierlm-test-{secrets.token_hex(4)}"
    try:
        folder.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup under {parent} ({e}); run as root in a container or VM")
    try:
        (folder / "memory.limit_in_bytes").write_text(str(LIMIT_BYTES))
        yield folder
    finally:
        try:
            folder.rmdir()
        except OSError:
            pass


def test_two_servers_in_a_row_under_a_memory_bound_both_stay_alive(stories_dir, tmp_path, memory_cgroup,
                                                                     monkeypatch):
    launcher = tmp_path / "in-cgroup"  # the server process joins the cgroup before Python starts
    launcher.write_text(f"#!/bin/sh\necho $$ > {memory_cgroup / 'cgroup.procs'} || exit 97\n"
                        f"exec {sys.executable} \"$@\"\n")
    launcher.chmod(0o755)
    monkeypatch.setattr(e2e_server.sys, "executable", str(launcher))
    args = ["--model-path", str(stories_dir), "--skip-warmup", "--enable-hierarchical-cache",
            "--context-length", "1000000"]
    env = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1", "TIERLM_NO_PROGRESS": "1"}
    body = {"prompt": STORIES_PROMPT, "max_tokens": 8, "temperature": 0}
    servers = []
    try:
        for _ in range(2):
            try:
                servers.append(start_server(args, env=env, log_dir=tmp_path, timeout=180))
            except ServerStartError as e:
                pytest.fail(f"server {len(servers) + 1} did not start inside the {LIMIT_BYTES / 2**30:g} GiB bound"
                            f" (earlier servers alive: {[s.proc.poll() is None for s in servers]}): {e}")
        texts = []
        for i, server in enumerate(servers):
            assert server.proc.poll() is None, f"server {i + 1} died:\n{server.log_text()}"
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            info = httpx.get(f"{server.url}/server_info", timeout=10).json()
            kv = info["kv_pool"]["total_bytes"] + info["tiers"]["host"]["total_bytes"]
            assert kv <= DEFAULT_CPU_KV_SHARE * LIMIT_BYTES, (kv, info["tiers"])
            log = server.log_text()
            assert "memory cgroup" in log and "KV budget inputs" in log and "host KV pool committed" in log
        assert texts[0] == texts[1]
        assert all(s.proc.poll() is None for s in servers), "a server was killed after the second started"
    finally:
        for server in servers:
            server.stop()


def test_cgroup_limit_narrows_the_ram_facts(tmp_path):
    """The cgroup reader on a fake v1 tree: the tightest limit on the path, usage less inactive page cache."""
    from tierlm.platforms.facts import Facts

    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/outer/inner\n0::/\n")
    root = tmp_path / "fs"
    outer, inner = root / "memory" / "outer", root / "memory" / "outer" / "inner"
    inner.mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # the root: no limit
    (outer / "memory.limit_in_bytes").write_text(str(4 * 10**9))
    (outer / "memory.usage_in_bytes").write_text(str(3 * 10**9))
    (outer / "memory.stat").write_text("total_inactive_file 500000000\n")
    (inner / "memory.limit_in_bytes").write_text(str(6 * 10**9))
    (inner / "memory.usage_in_bytes").write_text(str(1 * 10**9))
    found = cgroup_memory(proc, root)
    assert found is not None and found.limit_bytes == 4 * 10**9 and found.used_bytes == 25 * 10**8
    facts = Facts(os_name="Linux", arch="x86_64", cpu_count=2, ram_total_bytes=24 * 10**9,
                  ram_available_bytes=20 * 10**9)
    bounded, why = bounded_by_cgroup(facts, found)
    assert (bounded.ram_total_bytes, bounded.ram_available_bytes) == (4 * 10**9, 15 * 10**8)
    assert "limit 4.00 GB" in why
    assert bounded_by_cgroup(facts, None) == (facts, None)
    assert os.path.basename(found.path) == "outer"
