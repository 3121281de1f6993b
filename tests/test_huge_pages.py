"""Weights on transparent huge pages (platforms/huge_pages.py decides, backends/torch/cpu/huge_pages.py applies).

What must hold: the decision follows the kernel's THP mode, its version (MADV_COLLAPSE from 6.1) and the switch (the
CPU plan's override huge_pages=no, TIERLM_CPU_PLAN; the old TIERLM_HUGE_PAGES=0 is read as it), on
texts recorded from real machines; moving memory onto huge pages never changes its contents and the kernel really
maps it with huge pages where the plan says it can; the backend reports what it moved, and keeps 4 KB pages when
switched off.
"""
from __future__ import annotations

import os
import re

import pytest

from tierlm.platforms.huge_pages import HugePagePlan, plan, this_machine

MIB = 2 ** 20
# /sys/kernel/mm/transparent_hugepage/enabled as Debian, Ubuntu and RHEL ship it, and with THP turned off
MADVISE, ALWAYS, NEVER = "always [madvise] never\n", "[always] madvise never\n", "always madvise [never]\n"
# The switch that keeps 4 KB pages, and what the plan says set it: the CPU plan's override, and the old variable
OFF = {"TIERLM_CPU_PLAN": "huge_pages=no"}
OFF_SAID = "TIERLM_CPU_PLAN huge_pages=no"
OLD_OFF = {"TIERLM_HUGE_PAGES": "0"}
OLD_OFF_SAID = "TIERLM_HUGE_PAGES=0"


def test_the_plan_follows_the_thp_mode_and_the_kernel_version():
    on = plan({}, "Linux", "6.18.44-fc-v1252", MADVISE, "2097152\n")
    assert on.use and on.collapse and on.page_bytes == 2 * MIB and "madvise" in on.why
    assert plan({}, "Linux", "6.1.0-27-amd64", ALWAYS, "2097152\n").collapse
    old = plan({}, "Linux", "5.15.0-119-generic", MADVISE, "2097152\n")  # Ubuntu 22.04: asks, cannot move
    assert old.use and not old.collapse and "khugepaged" in old.why
    # aarch64 with 16 KB base pages: a PMD maps 32 MiB, more than tierlm asks for
    assert plan({}, "Linux", "6.8.0", MADVISE, "33554432\n").page_bytes == 32 * MIB


@pytest.mark.parametrize("env,system,enabled,said", [
    (OFF, "Linux", MADVISE, OFF_SAID),
    (OLD_OFF, "Linux", MADVISE, OLD_OFF_SAID),
    ({}, "Linux", NEVER, "echo madvise"),
    ({}, "Linux", None, "no transparent huge pages"),
    ({}, "Darwin", None, "Darwin"),
])
def test_no_huge_pages_says_why(env, system, enabled, said):
    p = plan(env, system, "6.18.0", enabled, None)
    assert not p.use and said in p.why


def test_ranges_and_the_bytes_inside_them():
    from tierlm.backends.torch.cpu.huge_pages import bytes_per_range

    page = 2 * MIB
    regions = [(3 * MIB, 2 * MIB), (5 * MIB, MIB), (10 * MIB + 100, 100)]  # 3-5 MiB crosses the 4 MiB boundary
    assert bytes_per_range(regions, page) == {2 * MIB: MIB, 4 * MIB: 2 * MIB, 10 * MIB: 100}


def test_huge_pages_larger_than_2_mib_are_not_asked_for():
    p = plan({}, "Linux", "6.8.0-1010-nvidia-64k", MADVISE, "536870912\n")  # aarch64, 64 KB base pages
    assert not p.use and "512 MiB" in p.why


def test_sparse_ranges_are_advised_not_collapsed_and_without_collapse_the_report_says_advised(monkeypatch):
    from tierlm.backends.torch.cpu import huge_pages

    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda addr, n, advice: calls.append((addr, n, advice)) or 0)
    page = 2 * MIB
    regions = [(page, page + 100)]  # one full range, then 100 bytes of the next
    report = huge_pages.move_onto_huge_pages(regions, HugePagePlan(True, page, True, ""))
    # the two adjacent ranges advised in one call, the full one collapsed, the sparse one only advised
    assert calls == [(page, 2 * page, huge_pages.MADV_HUGEPAGE), (page, page, huge_pages.MADV_COLLAPSE)]
    assert report.on_huge_pages == page and report.not_moved == 1 and "on huge pages" in report.summary()
    calls.clear()
    advised = huge_pages.move_onto_huge_pages(regions, HugePagePlan(True, page, False, ""))
    assert calls == [(page, 2 * page, huge_pages.MADV_HUGEPAGE)]
    assert advised.on_huge_pages == page + 100 and "advised onto huge pages" in advised.summary()


def test_one_advice_per_run_of_adjacent_ranges_and_a_refused_run_falls_back(monkeypatch):
    from tierlm.backends.torch.cpu import huge_pages

    page, calls = 2 * MIB, []
    mapped = [(10 * MIB, 21 * MIB), (30 * MIB, 32 * MIB), (40 * MIB, 48 * MIB + 8192)]

    def madvise(addr, n, advice):  # a kernel that refuses any span reaching past what is mapped
        calls.append((addr, n, advice))
        return 0 if any(lo <= addr and addr + n <= hi for lo, hi in mapped) else -1

    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    regions = [(10 * MIB, 3 * MIB), (13 * MIB, 3 * MIB),  # side by side: one run of three ranges
               (18 * MIB, 3 * MIB),  # a run of two whose last range reaches past its mapping
               (30 * MIB, 2 * MIB),  # one range alone
               (40 * MIB + 4096, 8 * MIB)]  # a run of five whose last range reaches past its mapping
    report = huge_pages.move_onto_huge_pages(regions, HugePagePlan(True, page, True, ""))
    advices = [(a, n) for a, n, advice in calls if advice == huge_pages.MADV_HUGEPAGE]
    assert advices == [(10 * MIB, 3 * page), (18 * MIB, 2 * page), (40 * MIB, 5 * page),
                       (42 * MIB, 3 * page),  # the refused run of five without its edges
                       (18 * MIB, page), (20 * MIB, page), (30 * MIB, page), (40 * MIB, page), (48 * MIB, page)]
    collapsed = [a for a, n, advice in calls if advice == huge_pages.MADV_COLLAPSE]
    assert collapsed == [10 * MIB, 12 * MIB, 14 * MIB, 18 * MIB, 30 * MIB, 40 * MIB, 42 * MIB, 44 * MIB, 46 * MIB]
    assert report.ranges == 11 and report.not_moved == 2 and report.on_huge_pages == 18 * MIB - 4096


def test_the_switch_for_torchs_allocator_is_set_unless_the_user_set_it():
    from tierlm.backends.torch.cpu.huge_pages import ALLOC_ENV, ask_at_allocation

    yes = HugePagePlan(True, 2 * MIB, True, "")
    env: dict[str, str] = {}
    ask_at_allocation(yes, env)
    assert env == {ALLOC_ENV: "1"}
    env = {ALLOC_ENV: "0"}
    ask_at_allocation(yes, env)
    assert env == {ALLOC_ENV: "0"}
    env = {}
    ask_at_allocation(HugePagePlan(False, 2 * MIB, False, ""), env)
    assert env == {}


def _mappings_over(lo: int, hi: int) -> int:
    """How many mappings of /proc/self/maps overlap [lo, hi)."""
    with open("/proc/self/maps") as f:
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f]
    return sum(a < hi and b > lo for a, b in spans)


def _anon_huge_kib_inside(lo: int, hi: int) -> int:
    """AnonHugePages of every mapping that lies wholly in [lo, hi), from /proc/self/smaps. madvise splits a mapping
    at the ranges it is given, and whether the kernel merges the pieces back differs between kernels: the sum over
    the pieces is what the memory holds, whichever layout the kernel left."""
    inside, kib = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = lo <= int(m.group(1), 16) and int(m.group(2), 16) <= hi
            elif inside and line.startswith("AnonHugePages:"):
                kib += int(line.split()[1])
    return kib


def test_memory_moved_onto_huge_pages_keeps_its_contents():
    import mmap

    import numpy as np

    from tierlm.backends.torch.cpu.huge_pages import move_onto_huge_pages

    machine = this_machine(os.environ)
    if not (machine.use and machine.collapse):
        pytest.skip(f"this machine cannot move memory onto huge pages now: {machine.why}")
    page = machine.page_bytes
    # a private mapping of the test's own, so that no other memory of the process shares its huge-page ranges
    # (malloc may serve 12 MiB from the heap, beside whatever else lives there); the array starts off a page
    # boundary, so the edge ranges are partly the array's, and they stay inside the mapping
    mapping = mmap.mmap(-1, 12 * MIB + 4 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(mapping, dtype=np.uint8)
    lo, hi = base.ctypes.data, base.ctypes.data + base.nbytes
    offset = (-lo) % page + page // 8
    data = base[offset:offset + 12 * MIB].view(np.int32)
    data[:] = np.random.default_rng(0).integers(0, 2 ** 31, size=data.size, dtype=np.int32)
    copy = data.copy()
    try:
        report = move_onto_huge_pages([(data.ctypes.data, data.nbytes)], machine)
        assert report.weight_bytes == data.nbytes
        # at least the whole pages inside the array moved (the edge ranges are only partly the array's)
        assert report.on_huge_pages >= data.nbytes - 2 * page
        # the kernel maps each range reported moved with a huge page, whole (THP mode always may have put more there)
        assert _anon_huge_kib_inside(lo, hi) * 1024 >= report.on_huge_pages
        # one advice for the whole run: the mapping is split at most where the run begins and ends, whether or not
        # this kernel merges advised neighbours
        assert _mappings_over(lo, hi) <= 3
        assert np.array_equal(data, copy)
    finally:
        del data, base
        mapping.close()


@pytest.mark.parametrize("switch", ["on", "off", "old off"])
def test_the_backend_reports_its_weight_pages_and_the_switch_keeps_4k_pages(tiny_llama, monkeypatch, switch):
    from tierlm.backends.torch.backend import TorchBackend

    env, off_said = {"off": (OFF, OFF_SAID), "old off": (OLD_OFF, OLD_OFF_SAID)}.get(switch, ({}, None))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    backend = TorchBackend(tiny_llama, dtype="bfloat16")
    said = backend.kernels()["weight_pages"]
    report = backend.huge_pages
    assert report.weight_bytes > 0
    machine = this_machine(os.environ)
    decided = backend.cpu_kernels.plan.extra["huge_pages"]  # the plan's record of the decision
    assert decided.value == ("yes" if machine.use else "no") and decided.why == machine.why
    if off_said:
        assert report.on_huge_pages == 0 and off_said in said and not machine.use and off_said in decided.why
    elif machine.use and machine.collapse:
        # the tiny model's weights lie among other allocations; how many ranges the kernel moves depends on them
        assert report.ranges > 0 and "of weights on huge pages" in said
    else:
        assert report.on_huge_pages == 0 and said == machine.why


def test_doctor_says_where_the_weights_will_lie(tiny_llama):
    from tierlm.platforms.facts import detect
    from tierlm.server.commands import doctor as doctor_cmd

    def pages(env):
        report = doctor_cmd.diagnose(detect(), {"TIERLM_BACKEND": "torch", **env},
                                     ["--json", "--model-path", str(tiny_llama), "--device", "cpu"])
        return report, report["cpu_kernels"]["weight_pages"]

    report, said = pages({})
    assert said == this_machine({}).why
    assert "weight pages" in doctor_cmd.render_text(report)
    assert OFF_SAID in pages(OFF)[1]
    assert OLD_OFF_SAID in pages(OLD_OFF)[1]
