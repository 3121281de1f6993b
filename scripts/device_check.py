"""The GPU check: tierlm's device-dependent test suites and benchmarks on one NVIDIA GPU, with no network.

    bash scripts/device_check.sh [--dry-run] [--out DIR] [--wheels DIR] [--only STEP,...] [--budget SECONDS]

Steps, in order, each with its own timeout inside one overall budget (default 420 s, so the whole check ends
inside an 8-minute slot): ``machine`` (nvidia-smi, torch.cuda), ``deps`` (tierlm's dependencies the machine
lacks, from the wheels scripts/device_wheels.sh prepared), ``tierlm`` (``pip install --no-deps -e .``), the
pytest suites with ``TIERLM_TEST_DEVICE=cuda`` (backend conformance, engine reference, Triton attention against
torch_native, gpt-oss, quantized checkpoints (MXFP4 gpt-oss, compressed-tensors FP8), HiCache; the torch
backend only), then ``tierlm bench prefix`` and ``tierlm bench decode`` on the Qwen2.5-0.5B-shaped synthetic
model in bfloat16.

It writes ``report.json`` (per step: command, rc, seconds, status, pytest counts and failures, bench JSON),
``summary.txt`` and ``device-check.log`` (every step's output) to ``$OUT``, or ``./device-report/`` when OUT is
unset; the report is rewritten after every step, so a run cut short still leaves one.

``--dry-run`` (or ``DEVICE_CHECK_DRY_RUN=1``) runs the same steps on the CPU: ``TIERLM_TEST_DEVICE=cpu``, a few
tests per suite, the ``tiny`` synthetic model in float32; no GPU is required and nothing is installed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
REPORT_VERSION = 1

# The pytest suites: (step name, test file, -k of the real run, -k of the dry run).
SUITES = [
    ("conformance", "tests/test_backend_conformance.py", "not mlx",
     "not mlx and (test_model_info_and_sizes or test_copy_to_host_is_byte_exact_in_bfloat16)"),
    ("engine_reference", "tests/test_engine_reference.py", "not mlx", "not mlx and test_abort_frees_pages"),
    ("triton_attention", "tests/test_triton_attention.py", "not mlx", "test_attention_backend_choice"),
    ("gpt_oss", "tests/test_gpt_oss.py", "not mlx", "not mlx and test_tiny_config_is_gpt_oss_shaped"),
    # A tiny MXFP4 gpt-oss (experts packed on the GPU) and a tiny compressed-tensors FP8 model, greedy against the
    # references; each prints a "RESIDENT ..." line with its weight bytes.
    ("quantized", "tests/test_device_quantized.py", "not mlx", "test_mxfp4_gpt_oss_greedy_and_resident_bytes"),
    ("hicache", "tests/test_hicache.py", "not mlx", "not mlx and test_startup_errors_are_actionable"),
    ("decode_graphs", "tests/test_decode_graphs.py", "not mlx", "test_buckets"),
    ("host_copies", "tests/test_host_copies.py", "not mlx", "test_unknown_io_backend_is_refused"),
]
# Seconds each step may take at most (the overall budget may cut it shorter).
TIMEOUTS = {"machine": 60, "deps": 120, "tierlm": 120, "conformance": 90, "engine_reference": 90,
            "triton_attention": 120, "gpt_oss": 90, "quantized": 90, "hicache": 120, "decode_graphs": 120,
            "host_copies": 60, "bench_prefix": 150, "bench_decode": 180}
# Bench settings: (real run, dry run).
# Prefix first: the decode benchmark's transformers baseline is the step most likely to run long.
BENCH = {
    "bench_prefix": (["prefix", "--synthetic", "qwen2.5-0.5b", "--dtype", "bfloat16", "--prefix-tokens", "8192"],
                     ["prefix", "--synthetic", "tiny", "--dtype", "float32", "--prefix-tokens", "64"]),
    "bench_decode": (["decode", "--synthetic", "qwen2.5-0.5b", "--dtype", "bfloat16", "--prompt-tokens", "64",
                      "--new-tokens", "64", "--streams", "32", "--stagger-ms", "5", "--repeats", "3"],
                     ["decode", "--synthetic", "tiny", "--dtype", "float32", "--prompt-tokens", "16",
                      "--new-tokens", "8", "--streams", "2", "--stagger-ms", "0", "--bandwidth-mib", "16"]),
}
STEP_ORDER = ["machine", "deps", "tierlm"] + [s[0] for s in SUITES] + list(BENCH)
MIN_STEP_S = 15  # a step that would get less than this is skipped, not started

def probe_machine() -> dict[str, Any]:
    """What the report says about the machine: GPU (nvidia-smi, torch.cuda), torch, triton, key versions.
    Runs in a child process (``device_check.py --probe-machine``) so a CUDA start that hangs only costs its timeout."""
    import platform
    from importlib.metadata import version

    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                            "platform": platform.platform(), "nvidia_smi": None, "torch": None,
                            "cuda_available": False}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = (r.stdout or r.stderr).strip()
    try:
        import torch

        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if info["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            info.update(gpu_name=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                        capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                        device_count=torch.cuda.device_count())
    except Exception as e:  # noqa: BLE001
        info["torch_error"] = repr(e)
    for name in ("triton", "transformers", "huggingface_hub", "tokenizers", "xgrammar", "fastapi", "pydantic",
                 "numpy"):
        try:
            info[name] = version(name)
        except Exception:  # noqa: BLE001
            info[name] = None
    return info


# ---------------------------------------------------------------- parsing
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?|rerun)\b")


def parse_pytest(output: str) -> dict[str, int] | None:
    """Counts from pytest's final summary line (``3 failed, 10 passed, 2 skipped in 12.34s``); None if absent."""
    for line in reversed(output.splitlines()):
        if re.search(r"\bin \d+(\.\d+)?s\b", line) and (_COUNT.search(line) or "no tests ran" in line):
            counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0}
            for n, word in _COUNT.findall(line):
                key = {"error": "errors", "warning": "warnings"}.get(word, word)
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return None


def parse_failures(output: str) -> list[str]:
    """The FAILED / ERROR lines of pytest's short test summary (-rfE), test id and message."""
    return [line.strip() for line in output.splitlines() if re.match(r"^(FAILED|ERROR) \S", line)]


def pytest_status(rc: int, counts: dict[str, int] | None) -> str:
    if counts is None:
        return "failed"
    if counts["failed"] or counts["errors"]:
        return "failed"
    if not counts["passed"]:
        return "no tests passed"  # all skipped or deselected: nothing was checked
    return "ok" if rc == 0 else "failed"


def tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


# ---------------------------------------------------------------- running
@dataclass
class StepResult:
    name: str
    command: str
    status: str = "skipped"  # ok | failed | timeout | skipped | no tests passed
    rc: int | None = None
    seconds: float = 0.0
    timeout_s: float = 0.0
    note: str = ""
    pytest: dict[str, int] | None = None
    failures: list[str] = field(default_factory=list)
    bench: Any = None
    output_tail: str = ""


def run_command(cmd: list[str], timeout: float, env: dict[str, str], log) -> tuple[int, str, float, bool]:
    """rc, output, seconds, timed out. The command runs in its own process group; on timeout the whole group
    (a benchmark's server processes too) gets SIGTERM, then SIGKILL."""
    log.write(f"\n$ {shlex.join(cmd)}   (timeout {timeout:.0f} s)\n")
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, _ = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                out = ""
    seconds = time.monotonic() - t0
    rc = 124 if timed_out else proc.returncode
    log.write(out or "")
    log.write(f"\n[rc {rc}, {seconds:.1f} s{', TIMED OUT' if timed_out else ''}]\n")
    log.flush()
    return rc, out or "", seconds, timed_out


class Check:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.dry = ns.dry_run
        self.out = Path(ns.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.wheels = Path(ns.wheels) if Path(ns.wheels).is_absolute() else REPO / ns.wheels
        self.work = Path(tempfile.mkdtemp(prefix="tierlm-device-check-"))
        self.t0 = time.monotonic()
        self.started = dt.datetime.now(dt.timezone.utc)
        self.machine: dict[str, Any] = {}
        self.steps: list[StepResult] = []
        self.log = open(self.out / "device-check.log", "w", encoding="utf-8")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TIERLM_NO_PROGRESS="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
                        TIERLM_TEST_DEVICE="cpu" if self.dry else "cuda")
        self.env.pop("PYTEST_ADDOPTS", None)

    # -- budget
    def left(self) -> float:
        return self.ns.budget - (time.monotonic() - self.t0)

    def timeout_for(self, name: str) -> float:
        return min(TIMEOUTS[name], self.left() - 5)

    def wanted(self, name: str) -> bool:
        return not self.ns.only or name in self.ns.only

    def step(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> tuple[StepResult, str]:
        res = StepResult(name=name, command=shlex.join(cmd))
        timeout = self.timeout_for(name)
        res.timeout_s = round(timeout)
        if timeout < MIN_STEP_S:
            res.note = f"not started: {self.left():.0f} s of the {self.ns.budget:.0f} s budget left"
            self.log.write(f"\n[{name}: {res.note}]\n")
            return res, ""
        print(f"[device-check] {name}: {res.command}", flush=True)
        rc, out, seconds, timed_out = run_command(cmd, timeout, env or self.env, self.log)
        res.rc, res.seconds, res.output_tail = rc, round(seconds, 1), tail(out)
        res.status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
        return res, out

    def record(self, res: StepResult) -> None:
        self.steps.append(res)
        extra = f" {res.pytest}" if res.pytest else ""
        print(f"[device-check] {res.name}: {res.status} (rc {res.rc}, {res.seconds} s){extra}", flush=True)
        self.write()

    # -- steps
    def machine_step(self) -> None:
        res, out = self.step("machine", [PY, str(Path(__file__).resolve()), "--probe-machine"])
        for line in out.splitlines():
            if line.startswith("MACHINE "):
                self.machine = json.loads(line[len("MACHINE "):])
        if res.status == "ok" and not self.dry and not self.machine.get("cuda_available"):
            res.status, res.note = "failed", "torch.cuda.is_available() is False: no GPU for this check"
        self.record(res)

    def deps_step(self) -> None:
        pins = self.wheels / "requirements.txt"
        if self.dry:
            # Nothing is installed on a dry run: check that every pin has a wheel this interpreter can install.
            if not pins.exists():
                res = StepResult("deps", "", note=f"{pins} is absent (run scripts/device_wheels.sh)")
                return self.record(res)
            res, _ = self.step("deps", [PY, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
                                        "--no-index", "--find-links", str(self.wheels), "-q", "-r", str(pins)])
            return self.record(res)
        probe = [PY, str(REPO / "scripts" / "device_deps.py"), "missing", str(pins if pins.exists() else "/dev/null")]
        if self.ns.deps == "ci":
            probe.append("--ci")
        found = subprocess.run(probe, capture_output=True, text=True, cwd=REPO)
        missing = [line.strip() for line in found.stdout.splitlines() if line.strip()]
        if found.returncode != 0:
            res = StepResult("deps", shlex.join(probe), status="failed", rc=found.returncode,
                             output_tail=tail(found.stderr))
            return self.record(res)
        if self.ns.deps == "pinned" and pins.exists():
            missing = ["-r", str(pins)]  # every carried wheel, at the version CI tests
        elif not missing:
            return self.record(StepResult("deps", shlex.join(probe), status="ok", rc=0,
                                          note="every dependency is already installed"))
        res, _ = self.step("deps", [PY, "-m", "pip", "install", "--no-index", "--find-links", str(self.wheels),
                                    "--no-cache-dir", "--no-compile", "-q", *missing])
        res.note = f"installed: {' '.join(missing)}"
        if not pins.exists():
            res.note += f" (no wheels at {self.wheels}: run scripts/device_wheels.sh and carry the folder)"
        self.record(res)

    def tierlm_step(self) -> None:
        probe = subprocess.run([PY, "-c", "import tierlm.runtime.engine, pathlib; import tierlm; "
                                "print(pathlib.Path(tierlm.__file__).resolve().parent.parent)"],
                               capture_output=True, text=True, cwd="/")
        if probe.returncode == 0 and Path(probe.stdout.strip()) == REPO:
            return self.record(StepResult("tierlm", "", status="ok", rc=0,
                                          note="tierlm is already importable from this checkout"))
        if self.dry:
            return self.record(StepResult("tierlm", "", note="dry run: tierlm is not installed from this checkout; "
                                                             "nothing is installed on a dry run"))
        pip = [PY, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir", "-q"]
        res, _ = self.step("tierlm", pip + ["-e", "."])
        if res.status == "failed":  # an old setuptools without editable wheels: a plain install of the checkout
            first = res.output_tail
            res, _ = self.step("tierlm", pip + ["."])
            res.note = "pip install -e . failed (its output is in device-check.log); installed non-editable"
            res.output_tail = tail(first, 1500) + "\n---\n" + res.output_tail
        self.record(res)

    def pytest_step(self, name: str, path: str, k_real: str, k_dry: str) -> None:
        if not (REPO / path).exists():
            return self.record(StepResult(name, path, note=f"{path} does not exist in this checkout"))
        cmd = [PY, "-m", "pytest", path, "-q", "-rfE", "-p", "no:cacheprovider", "--color=no",
               "-k", k_dry if self.dry else k_real]
        # The machine's own pytest plugins (xdist, cov, benchmark, hypothesis, ...) stay out: none is needed here.
        res, out = self.step(name, cmd, env=dict(self.env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
        if res.rc is not None:
            res.pytest = parse_pytest(out)
            res.failures = parse_failures(out)
            if res.status != "timeout":
                res.status = pytest_status(res.rc, res.pytest)
        self.record(res)

    def bench_step(self, name: str) -> None:
        args = list(BENCH[name][1 if self.dry else 0])
        json_file = self.work / f"{name}.json"
        cmd = [PY, "-m", "tierlm.cli", "bench", *args, "--no-progress", "--json", str(json_file),
               "--work-dir", str(self.work / name)]
        res, _ = self.step(name, cmd)
        if json_file.exists():
            try:
                res.bench = json.loads(json_file.read_text())
            except ValueError as e:
                res.note = f"unreadable bench JSON: {e}"
        elif res.rc == 0:
            res.status, res.note = "failed", "the benchmark wrote no JSON"
        self.record(res)

    def run(self) -> int:
        for name in STEP_ORDER:
            if not self.wanted(name):
                continue
            if name == "machine":
                self.machine_step()
                if self.steps[-1].status != "ok" and not self.dry:
                    break  # no GPU (or no torch): the rest would only skip
            elif name == "deps":
                self.deps_step()
            elif name == "tierlm":
                self.tierlm_step()
            elif name in BENCH:
                self.bench_step(name)
            else:
                self.pytest_step(*next(s for s in SUITES if s[0] == name))
        self.write(final=True)
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)
        print((self.out / "summary.txt").read_text(), end="")
        return 0 if self.ok() else 1

    # -- report
    def ok(self) -> bool:
        """Every step that ran passed, and at least one ran."""
        ran = [s for s in self.steps if s.status != "skipped"]
        return bool(ran) and all(s.status == "ok" for s in ran)

    def report(self, final: bool) -> dict[str, Any]:
        return {
            "tool": "tierlm scripts/device_check.py", "report_version": REPORT_VERSION, "dry_run": self.dry,
            "finished": final, "ok": self.ok(),
            "started_utc": self.started.isoformat(timespec="seconds"),
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "settings": {"test_device": self.env["TIERLM_TEST_DEVICE"], "budget_s": self.ns.budget,
                         "wheels": str(self.wheels), "deps": self.ns.deps, "only": self.ns.only or None},
            "machine": self.machine,
            "steps": [asdict(s) for s in self.steps],
        }

    def write(self, final: bool = False) -> None:
        report = self.report(final)
        tmp = self.out / "report.json.tmp"
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(self.out / "report.json")
        (self.out / "summary.txt").write_text(summary_text(report))


def summary_text(report: dict[str, Any]) -> str:
    m = report["machine"]
    gpu = m.get("gpu_name") or ("no GPU" if m else "machine not probed")
    lines = [f"tierlm device check{' (DRY RUN, cpu)' if report['dry_run'] else ''}: "
             f"{'OK' if report['ok'] else 'NOT OK'}{'' if report['finished'] else ' (unfinished)'}, "
             f"{report['elapsed_s']} s, started {report['started_utc']}",
             f"machine: {gpu}; torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), triton {m.get('triton')}, "
             f"transformers {m.get('transformers')}, python {m.get('python')}"]
    for s in report["steps"]:
        line = f"  {s['name']:<17} {s['status']:<8} {s['seconds']:>6.1f} s"
        if s["pytest"]:
            c = s["pytest"]
            line += f"  {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped"
        if s["note"]:
            line += f"  ({s['note']})"
        lines.append(line)
        lines += [f"      {f}" for f in s["failures"][:10]]
        if s["bench"] is not None:
            lines += [f"      {b}" for b in bench_lines(s["bench"])]
    return "\n".join(lines) + "\n"


def bench_lines(bench: Any) -> list[str]:
    """The few numbers of a `tierlm bench --json` report worth a summary line: its tables' rows and its targets."""
    if not isinstance(bench, dict):
        return ["(bench output in report.json)"]
    lines = []
    for table in bench.get("tables") or []:
        for row in (table.get("rows") or [])[:8]:
            label = " ".join(str(row[k]) for k in ("engine", "case", "shape") if row.get(k) is not None) or "row"
            nums = [f"{k}={v:.4g}" for k, v in row.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "tokens"][:5]
            lines.append(f"{label}: {', '.join(nums)}")
    for t in bench.get("targets") or []:
        verdict = {True: "met", False: "MISSED", None: "not credited"}.get(t.get("met"), "?")
        lines.append(f"target {t.get('name')}: goal {t.get('goal')}, measured {t.get('measured')} -> {verdict}")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/device_check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("DEVICE_CHECK_DRY_RUN") == "1",
                   help="the same steps on the CPU, smaller (also DEVICE_CHECK_DRY_RUN=1)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "device-report"),
                   help="report folder (default: $OUT, else ./device-report)")
    p.add_argument("--wheels", default=os.environ.get("DEVICE_CHECK_WHEELS", ".device-wheels"),
                   help="folder scripts/device_wheels.sh filled")
    p.add_argument("--deps", choices=["ci", "missing", "pinned"], default=os.environ.get("DEVICE_CHECK_DEPS", "ci"),
                   help="missing: install only what the machine lacks; ci: that, and the model libraries "
                        "(transformers, tokenizers, safetensors, huggingface-hub, xgrammar) at CI's version; "
                        "pinned: every carried wheel at CI's version")
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help=f"comma-separated steps to run (of {','.join(STEP_ORDER)})")
    p.add_argument("--budget", type=float, default=float(os.environ.get("DEVICE_CHECK_BUDGET_S", 420)),
                   help="seconds for the whole check; a step that no longer fits is skipped")
    ns = p.parse_args(argv)
    unknown = set(ns.only or []) - set(STEP_ORDER)
    if unknown:
        p.error(f"unknown steps {sorted(unknown)}; the steps are {','.join(STEP_ORDER)}")
    return ns


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--probe-machine"]:
        print("MACHINE " + json.dumps(probe_machine()))
        return 0
    return Check(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
