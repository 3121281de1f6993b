"""scripts/peers_check.py (issue 27's side-by-side check), on any CPU: which classes it accepts, the environment
each side gets, the peer process started, waited for and stopped (a stand-in `vllm` command serving /health), and
the summary. The whole check needs vLLM CPU and half an hour per model: it is run by hand."""
from __future__ import annotations

import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tierlm.platforms.cpu_features import ISA_ENV, parse_cpuinfo

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import peers_check as pc  # noqa: E402

AVX512_BF16 = parse_cpuinfo("flags\t: fpu sse sse2 avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16\n",
                            "x86_64")
AVX2 = parse_cpuinfo("flags\t: fpu sse sse2 avx avx2 fma\n", "x86_64")


def test_classes_at_or_below_the_cpu_are_accepted_and_others_refused():
    assert pc.caps_error(["native", "avx2", "avx512", "avx512_bf16"], AVX512_BF16) is None
    assert pc.caps_error(["native", "avx2"], AVX2) is None
    why = pc.caps_error(["native", "avx512"], AVX2)
    assert why is not None and "avx512" in why and "(avx2)" in why
    assert pc.caps_error(["amx"], AVX512_BF16) is not None  # above this CPU: cannot be emulated
    assert pc.caps_error(["avx9"], AVX512_BF16) is not None


def test_each_side_gets_the_same_class():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "4", ISA_ENV: "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    native_vllm, native_tierlm = pc.vllm_env(base, None), pc.tierlm_env(base, None)
    for env in (native_vllm, native_tierlm):  # a cap left in the caller's shell never leaks into a native run
        assert ISA_ENV not in env and "ONEDNN_MAX_CPU_ISA" not in env and env["PATH"] == "/bin"
    assert "OMP_NUM_THREADS" not in native_vllm  # vLLM binds its own threads
    assert native_vllm["VLLM_CPU_KVCACHE_SPACE"] == "2"
    capped = pc.vllm_env(base, "avx512")
    assert capped["ATEN_CPU_CAPABILITY"] == "avx512" and capped["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert pc.tierlm_env(base, "avx512")[ISA_ENV] == "avx512"


FAKE_VLLM = textwrap.dedent("""\
    #!{python}
    # a stand-in for `vllm serve MODEL ... --port P`: answers /health, or exits at once with FAKE_VLLM_FAIL
    import http.server, os, sys
    if os.environ.get("FAKE_VLLM_FAIL"):
        print("RuntimeError: no model here", flush=True)
        sys.exit(3)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    open(os.environ["FAKE_VLLM_ENV"], "w").write(os.environ.get("ONEDNN_MAX_CPU_ISA", "-"))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    exe = tmp_path / "vllm"
    exe.write_text(FAKE_VLLM.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_ENV", str(tmp_path / "env_seen"))
    return exe


def test_the_peer_is_started_with_its_class_waited_for_and_stopped(fake_vllm, tmp_path):
    port = _free_port()
    server = pc.Vllm(fake_vllm, tmp_path, port, "avx2", tmp_path / "vllm.log")
    try:
        server.wait_ready()
        assert pc.healthy(server.url)
        assert (tmp_path / "env_seen").read_text() == "AVX2"
    finally:
        server.stop()
    assert server.proc.returncode is not None
    deadline = time.monotonic() + 5
    while pc.healthy(server.url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pc.healthy(server.url)


def test_a_peer_that_dies_at_startup_stops_the_check_with_its_log(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    server = pc.Vllm(fake_vllm, tmp_path, _free_port(), None, tmp_path / "vllm.log")
    with pytest.raises(pc.RunFailed, match="no model here"):
        server.wait_ready()
    assert server.proc.returncode == 3


def test_a_port_already_served_is_refused(fake_vllm, tmp_path):
    port = _free_port()
    first = pc.Vllm(fake_vllm, tmp_path, port, None, tmp_path / "a.log")
    try:
        first.wait_ready()
        with pytest.raises(SystemExit, match="already serves"):
            pc.Vllm(fake_vllm, tmp_path, port, None, tmp_path / "b.log")
    finally:
        first.stop()


def test_summary_lists_every_target_with_missed_marked_and_failed_runs_named():
    report = {"targets": [{"name": "1-stream decode vs vllm", "goal": ">= 1.2x", "measured": "1.85x", "met": True},
                          {"name": "cold TTFT vs vllm", "goal": "<= 0.8x", "measured": "0.91x", "met": False}]}
    lines = pc.summary_lines([("native (amx)", "qwen2.5-0.5b", report)])
    assert lines[2] == "| native (amx) | qwen2.5-0.5b | 1-stream decode vs vllm | >= 1.2x | 1.85x | met |"
    assert lines[3].endswith("| 0.91x | **missed** |") and len(lines) == 4
    failed = pc.summary_lines([("avx2", "llama-small", "vLLM did not come up (exit 3); its log x ends:\nboom")])
    assert failed[2] == ("| avx2 | llama-small | every target | - | not measured: vLLM did not come up (exit 3); "
                         "its log x ends: | **failed** |")


def test_a_failed_bench_is_reported_with_its_log(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "tierlm"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho \"bench saw TIERLM_CPU_ISA=$TIERLM_CPU_ISA\"\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    with pytest.raises(pc.RunFailed, match="exited with 2") as e:
        pc.bench("llama-small", "http://127.0.0.1:1", "avx2", 1, tmp_path, "avx2-llama-small")
    assert str(tmp_path / "avx2-llama-small.txt") in str(e.value)
    assert (tmp_path / "avx2-llama-small.txt").read_text() == "bench saw TIERLM_CPU_ISA=avx2\n"
