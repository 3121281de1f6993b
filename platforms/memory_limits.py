"""The memory bound of this process's cgroup (a container, a systemd slice, a test's cgroup), as RAM facts.

/proc/meminfo (what psutil reads) shows the whole machine; a process in a memory cgroup is killed at the
cgroup's limit however much the machine has free. ``bounded_by_cgroup`` narrows the RAM facts to the tightest
limit on the process's cgroup path: total = that limit, available = limit - what the cgroup already uses
(less its inactive page cache, which the kernel reclaims before it kills). cgroup v2 (memory.max,
memory.current) and v1 (memory.limit_in_bytes, memory.usage_in_bytes); nothing found leaves the facts as they are.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from tierlm.platforms.facts import Facts

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge page-rounded number


@dataclasses.dataclass(frozen=True)
class CgroupMemory:
    limit_bytes: int
    used_bytes: int  # usage less inactive page cache
    path: str  # the cgroup folder holding the limit


def cgroup_memory(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> CgroupMemory | None:
    """The tightest memory limit on this process's cgroup path, or None (no limit, not Linux, unreadable)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: CgroupMemory | None = None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: 0::/path
            found = _walk(root / rel.lstrip("/"), root, "memory.max", "memory.current", "inactive_file")
            if found is None and (root / "unified").is_dir():  # hybrid layout: v2 mounted at unified/
                found = _walk(root / "unified" / rel.lstrip("/"), root / "unified", "memory.max", "memory.current",
                              "inactive_file")
        elif "memory" in controllers.split(","):
            found = _walk(root / "memory" / rel.lstrip("/"), root / "memory", "memory.limit_in_bytes",
                          "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        room = None if found is None else found.limit_bytes - found.used_bytes
        if room is not None and (best is None or room < best.limit_bytes - best.used_bytes):
            best = found
    return best


def _walk(folder: Path, top: Path, limit_file: str, usage_file: str, inactive_key: str) -> CgroupMemory | None:
    """The limit with the least room left among ``folder`` and its parents up to ``top``."""
    best: CgroupMemory | None = None
    while True:
        limit = _read_int(folder / limit_file)
        if limit is not None and limit < _UNLIMITED:
            usage = _read_int(folder / usage_file) or 0
            used = max(0, usage - _stat(folder / "memory.stat", inactive_key))
            if best is None or limit - used < best.limit_bytes - best.used_bytes:
                best = CgroupMemory(limit, used, str(folder))
        if folder == top or top not in folder.parents:
            return best
        folder = folder.parent


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def bounded_by_cgroup(facts: Facts, memory: CgroupMemory | None) -> tuple[Facts, str | None]:
    """``facts`` with RAM narrowed to the cgroup's limit, and a sentence saying so (None: nothing changed)."""
    if memory is None or not facts.ram_total_bytes or memory.limit_bytes >= facts.ram_total_bytes:
        return facts, None
    room = max(0, memory.limit_bytes - memory.used_bytes)
    total, available = memory.limit_bytes, min(facts.ram_available_bytes, room)
    why = (f"memory cgroup {memory.path}: limit {memory.limit_bytes / 1e9:.2f} GB, {memory.used_bytes / 1e9:.2f} GB "
           f"used, so RAM is sized as {total / 1e9:.2f} GB total, {available / 1e9:.2f} GB available (the machine "
           f"has {facts.ram_total_bytes / 1e9:.2f} GB)")
    return dataclasses.replace(facts, ram_total_bytes=total, ram_available_bytes=available), why
