"""runtime/cache/hit_stages.py: the stages of a cache hit add up the way `tierlm bench prefix` prints them."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tierlm.runtime.cache.hit_stages import STAGES, HitStages


def test_storage_stages_come_from_the_store_and_split_its_read_time():
    stages = HitStages()
    snap = stages.snapshot({"read_seconds": 1.0, "checksum_seconds": 0.25, "copy_seconds": 0.125})
    assert list(snap) == list(STAGES)
    assert snap["storage_read"] == pytest.approx(0.625) and snap["checksum"] == 0.25 and snap["host_copy"] == 0.125
    # a store that reports no parts: all of its read time is the read; no store: zeros
    assert stages.snapshot({"read_seconds": 0.5})["storage_read"] == 0.5
    assert set(stages.snapshot(None).values()) == {0.0}


def test_the_wait_ends_at_admission_less_its_copies_and_the_forward_runs_to_the_first_token():
    stages = HitStages()
    req = SimpleNamespace()
    arrival = time.perf_counter() - 0.5  # arrived half a second ago
    before = stages.copies()
    stages.add("host_to_device", 0.2)  # admission copied pages for 0.2 s of that
    stages.admitted(req, arrival, before)
    elapsed = time.perf_counter() - arrival
    snap = stages.snapshot()
    assert 0.3 <= snap["scheduler_wait"] <= elapsed - 0.2 and snap["host_to_device"] == 0.2
    admitted_by = time.perf_counter()
    stages.released(req, admitted_by + 0.1)  # its first token came 0.1 s after this moment
    forward = stages.snapshot()["forward"]
    assert 0.1 <= forward <= 0.1 + (admitted_by - arrival)
    stages.released(req, admitted_by + 5)  # released once only: nothing more is added
    assert stages.snapshot()["forward"] == forward


def test_a_request_released_without_a_first_token_adds_no_forward():
    stages = HitStages()
    req = SimpleNamespace()
    stages.admitted(req, time.perf_counter(), stages.copies())
    stages.released(req, None)  # aborted before its first token
    stages.released(SimpleNamespace(), time.perf_counter())  # never admitted
    assert stages.snapshot()["forward"] == 0.0
