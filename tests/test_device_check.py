"""scripts/device_check.py (the GPU check) and scripts/device_deps.py, on the CPU: pytest summary parsing, the
report and its summary, the overall budget, the dependency list; TIERLM_TEST_DEVICE in the test fixtures.
The whole dry run (`bash scripts/device_check.sh --dry-run`) takes minutes and is run by hand."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import device_check as dc  # noqa: E402
import device_deps  # noqa: E402


def test_pytest_summary_lines_parse():
    out = "....F.s\nFAILED tests/t.py::test_a[torch-llama] - assert 1 == 2\n" \
          "=== 1 failed, 5 passed, 1 skipped, 3 deselected, 2 warnings in 12.34s ===\n"
    counts = dc.parse_pytest(out)
    assert counts == {"passed": 5, "failed": 1, "skipped": 1, "errors": 0, "deselected": 3, "warnings": 2}
    assert dc.parse_failures(out) == ["FAILED tests/t.py::test_a[torch-llama] - assert 1 == 2"]
    assert dc.pytest_status(1, counts) == "failed"
    assert dc.parse_pytest("12 passed in 3.00s") == {"passed": 12, "failed": 0, "skipped": 0, "errors": 0,
                                                      "deselected": 0}
    assert dc.pytest_status(0, dc.parse_pytest("12 passed in 3.00s")) == "ok"
    assert dc.parse_pytest("1 error in 0.50s")["errors"] == 1
    assert dc.pytest_status(5, dc.parse_pytest("4 deselected in 0.10s")) == "no tests passed"
    assert dc.pytest_status(0, dc.parse_pytest("3 skipped in 0.10s")) == "no tests passed"
    assert dc.parse_pytest("Killed") is None and dc.pytest_status(137, None) == "failed"


def test_summary_names_each_step_and_the_bench_targets():
    bench = {"tables": [{"rows": [{"engine": "tierlm server", "shape": "1 stream", "decode_tps": 512.3,
                                   "ttft_s": 0.01, "tokens": 128}]}],
             "targets": [{"name": "batch 1 vs transformers", "goal": ">= 5x", "measured": "7.1x", "met": True}]}
    report = {"dry_run": False, "ok": False, "finished": True, "elapsed_s": 301.2, "started_utc": "2026-12-01T04:00",
              "machine": {"gpu_name": "NVIDIA H200", "torch": "2.11.0", "torch_cuda": "13.0", "triton": "3.6.0",
                          "transformers": "5.17.0", "python": "3.12.3"},
              "steps": [dict(vars(dc.StepResult("conformance", "pytest ...", status="failed", rc=1, seconds=20.0,
                                                pytest={"passed": 20, "failed": 1, "errors": 0, "skipped": 2},
                                                failures=["FAILED tests/x.py::y - boom"]))),
                        dict(vars(dc.StepResult("bench_decode", "tierlm bench decode", status="ok", rc=0,
                                                seconds=60.0, bench=bench)))]}
    text = dc.summary_text(report)
    assert "NOT OK" in text and "NVIDIA H200" in text and "torch 2.11.0" in text
    assert "conformance" in text and "20 passed, 1 failed" in text and "FAILED tests/x.py::y - boom" in text
    assert "tierlm server 1 stream: decode_tps=512.3, ttft_s=0.01" in text
    assert "target batch 1 vs transformers: goal >= 5x, measured 7.1x -> met" in text


def test_a_step_that_no_longer_fits_the_budget_is_skipped_and_reported(tmp_path):
    rc = dc.main(["--dry-run", "--only", "conformance,bench_prefix", "--budget", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 1  # nothing ran: not ok
    assert [s["name"] for s in report["steps"]] == ["conformance", "bench_prefix"]
    assert all(s["status"] == "skipped" and "budget" in s["note"] for s in report["steps"])
    assert report["finished"] and report["settings"]["test_device"] == "cpu"
    assert (tmp_path / "summary.txt").read_text().startswith("tierlm device check (DRY RUN, cpu): NOT OK")
    assert (tmp_path / "device-check.log").exists()


def test_unknown_steps_are_refused():
    with pytest.raises(SystemExit):
        dc.parse_args(["--only", "conformance,typo"])


def test_dry_run_machine_and_setup_steps_end_to_end(tmp_path):
    """The shell entry point, as the device tool runs it, with the cheap steps only (a few seconds)."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh"), "--dry-run",
                           "--only", "machine,deps,tierlm", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    report = json.loads((tmp_path / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["ok"] and report["machine"]["torch"] and "cuda_available" in report["machine"]
    assert steps["machine"]["status"] == "ok"
    assert steps["tierlm"]["status"] == "ok"  # the editable install of this checkout
    assert steps["deps"]["status"] in ("ok", "skipped")  # skipped where no wheels were prepared


def test_dependency_roots_never_include_torch_and_missing_names_pins(tmp_path, monkeypatch):
    names = {device_deps.norm(r.name) for r in device_deps.roots()}
    assert {"fastapi", "pydantic", "uvicorn", "xgrammar", "pytest", "openai"} <= names
    assert not names & {"torch", "triton", "numpy", "mlx"}
    pins = tmp_path / "requirements.txt"
    pins.write_text("fastapi==0.1.0\ntransformers==5.24.0\n")
    real = device_deps.version

    def installed(name):  # a GPU image: no fastapi, an older transformers, the rest as here
        if device_deps.norm(name) == "fastapi":
            raise device_deps.PackageNotFoundError(name)
        return "5.17.0" if device_deps.norm(name) == "transformers" else real(name)

    monkeypatch.setattr(device_deps, "version", installed)
    assert device_deps.missing(pins) == ["fastapi==0.1.0"]
    assert device_deps.missing(pins, ci=True) == ["transformers==5.24.0", "fastapi==0.1.0"]


def test_test_device_variable(monkeypatch):
    import backend_driver
    import conftest
    import torch

    monkeypatch.setattr(backend_driver, "TEST_DEVICE", "")
    assert backend_driver.device_under_test() == "cpu"
    monkeypatch.setattr(backend_driver, "TEST_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="no GPU"):
        backend_driver.device_under_test()

    marks = []
    item = SimpleNamespace(get_closest_marker={"mlx": pytest.mark.mlx}.get, add_marker=marks.append)  # needs MLX
    other = SimpleNamespace(get_closest_marker={}.get, add_marker=marks.append)
    monkeypatch.setattr(conftest, "mlx_importable", lambda: True)
    monkeypatch.setenv("TIERLM_TEST_DEVICE", "cuda")
    conftest.pytest_collection_modifyitems(None, [item, other])
    assert len(marks) == 1 and "MLX" in marks[0].kwargs["reason"]
    monkeypatch.delenv("TIERLM_TEST_DEVICE")
    conftest.pytest_collection_modifyitems(None, [item])
    assert len(marks) == 1
    monkeypatch.setattr(conftest, "mlx_importable", lambda: False)  # no MLX here: the same marker, one reason
    conftest.pytest_collection_modifyitems(None, [item, other])
    assert len(marks) == 2 and marks[1].kwargs["reason"] == conftest.MLX_MISSING
