"""Weights on transparent huge pages (platforms/huge_pages.py decides, backends/torch/huge_pages.py applies).

What must hold: the decision follows the kernel's THP mode, its version (MADV_COLLAPSE from 6.1) and the switch, on
texts recorded from real machines; moving memory onto huge pages never changes its contents and the kernel really
maps it with huge pages where the plan says it can; the backend reports what it moved, and keeps 4 KB pages when
switched off.
"""
from __future__ import annotations

import os
import re

import pytest

from tierlm.platforms.huge_pages import SWITCH_ENV, HugePagePlan, plan, this_machine

MIB = 2 ** 20
# /sys/kernel/mm/transparent_hugepage/enabled as Debian, Ubuntu and RHEL ship it, and with THP turned off
MADVISE, ALWAYS, NEVER = "always [madvise] never\n", "[always] madvise never\n", "always madvise [never]\n"


def test_the_plan_follows_the_thp_mode_and_the_kernel_version():
    on = plan({}, "Linux", "6.18.44-fc-v1252", MADVISE, "2097152\n")
    assert on.use and on.collapse and on.page_bytes == 2 * MIB and "madvise" in on.why
    assert plan({}, "Linux", "6.1.0-27-amd64", ALWAYS, "2097152\n").collapse
    old = plan({}, "Linux", "5.15.0-119-generic", MADVISE, "2097152\n")  # Ubuntu 22.04: asks, cannot move
    assert old.use and not old.collapse and "khugepaged" in old.why
    # aarch64 with 64 KB base pages: a PMD maps 512 MiB
    assert plan({}, "Linux", "6.8.0-1010-nvidia-64k", MADVISE, "536870912\n").page_bytes == 512 * MIB


@pytest.mark.parametrize("env,system,enabled,said", [
    ({SWITCH_ENV: "0"}, "Linux", MADVISE, f"{SWITCH_ENV}=0"),
    ({}, "Linux", NEVER, "echo madvise"),
    ({}, "Linux", None, "no transparent huge pages"),
    ({}, "Darwin", None, "Darwin"),
])
def test_no_huge_pages_says_why(env, system, enabled, said):
    p = plan(env, system, "6.18.0", enabled, None)
    assert not p.use and said in p.why


def test_ranges_and_the_bytes_inside_them():
    from tierlm.backends.torch.huge_pages import bytes_inside, page_ranges

    page = 2 * MIB
    regions = [(3 * MIB, 2 * MIB), (10 * MIB + 100, 100)]  # 3-5 MiB crosses the 4 MiB boundary
    assert page_ranges(regions, page) == [2 * MIB, 4 * MIB, 10 * MIB]
    assert bytes_inside(regions, {4 * MIB}, page) == MIB
    assert bytes_inside(regions, {2 * MIB, 4 * MIB, 10 * MIB}, page) == 2 * MIB + 100


def test_the_switch_for_torchs_allocator_is_set_unless_the_user_set_it():
    from tierlm.backends.torch.huge_pages import ALLOC_ENV, ask_at_allocation

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


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, from /proc/self/smaps."""
    inside, kib = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                kib = int(line.split()[1])
    return kib


def test_memory_moved_onto_huge_pages_keeps_its_contents():
    import numpy as np

    from tierlm.backends.torch.huge_pages import move_onto_huge_pages

    machine = this_machine(os.environ)
    if not (machine.use and machine.collapse):
        pytest.skip(f"this machine cannot move memory onto huge pages now: {machine.why}")
    from numpy._core.multiarray import _set_madvise_hugepage

    was = _set_madvise_hugepage(False)  # numpy asks for huge pages itself for large arrays: not this one
    try:
        data = np.random.default_rng(0).integers(0, 2 ** 31, size=12 * MIB // 4, dtype=np.int32)
    finally:
        _set_madvise_hugepage(was)
    copy = data.copy()
    address = data.ctypes.data
    before = _anon_huge_kib(address) * 1024
    report = move_onto_huge_pages([(address, data.nbytes)], machine)
    assert report.weight_bytes == data.nbytes
    # at least the whole pages inside the array moved (the edge ranges may cross into another mapping)
    assert report.on_huge_pages >= data.nbytes - 2 * machine.page_bytes
    assert _anon_huge_kib(address) * 1024 >= before + report.on_huge_pages - 2 * machine.page_bytes
    assert np.array_equal(data, copy)


@pytest.mark.parametrize("switch", ["on", "off"])
def test_the_backend_reports_its_weight_pages_and_the_switch_keeps_4k_pages(tiny_llama, monkeypatch, switch):
    from tierlm.backends.torch.backend import TorchBackend

    if switch == "off":
        monkeypatch.setenv(SWITCH_ENV, "0")
    backend = TorchBackend(tiny_llama, dtype="bfloat16")
    said = backend.kernels()["weight_pages"]
    report = backend.huge_pages
    assert report.weight_bytes > 0
    machine = this_machine(os.environ)
    if switch == "off":
        assert report.on_huge_pages == 0 and f"{SWITCH_ENV}=0" in said
    elif machine.use and machine.collapse:
        # the tiny model's weights lie among other allocations: most of their ranges move
        assert report.on_huge_pages > 0 and "on huge pages" in said
    else:
        assert report.on_huge_pages == 0 and said == machine.why


def test_doctor_says_where_the_weights_will_lie(tiny_llama):
    from tierlm.platforms.facts import detect
    from tierlm.server import doctor_cmd

    def pages(env):
        report = doctor_cmd.diagnose(detect(), {"TIERLM_BACKEND": "torch", **env},
                                     ["--json", "--model-path", str(tiny_llama), "--device", "cpu"])
        return report, report["cpu_kernels"]["weight_pages"]

    report, said = pages({})
    assert said == this_machine({}).why
    assert "weight pages" in doctor_cmd.render_text(report)
    assert f"{SWITCH_ENV}=0" in pages({SWITCH_ENV: "0"})[1]
