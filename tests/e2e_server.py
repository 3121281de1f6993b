"""Start a real `python -m tierlm.launch_server` process for end-to-end tests.

    with start_server(["--model-path", str(model_dir)]) as server:
        httpx.post(f"{server.url}/v1/completions", json={...})

The server gets a free port (unless the args name one), its output goes to a log file (so a chatty
server can never block on a full pipe), and startup failures raise with that log in the message.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    """A running server process; a context manager that stops it on exit."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, log_dir: Path | None = None) -> None:
        args = list(args)
        if "--port" not in args:
            args += ["--port", str(free_port())]
        if "--host" not in args:
            args += ["--host", "127.0.0.1"]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if "--dtype" not in args and full_env.get("TIERLM_BACKEND", "torch") == "torch":
            args += ["--dtype", "float32"]  # the references' dtype (auto is bfloat16 on a CPU with native bf16)
        self.port = int(args[args.index("--port") + 1])
        self.host = args[args.index("--host") + 1]
        self.url = f"http://{self.host}:{self.port}"
        self.args = args
        self._log_file = tempfile.NamedTemporaryFile(prefix="tierlm-server-", suffix=".log", delete=False,
                                                     dir=log_dir)
        self.log_path = Path(self._log_file.name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierlm.launch_server", *args],
            stdout=self._log_file, stderr=subprocess.STDOUT, env=full_env, cwd=REPO_ROOT,
        )

    @property
    def base_url(self) -> str:
        """The OpenAI client's base_url."""
        return f"{self.url}/v1"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        """Wait for GET /health == 200. Raises ServerStartError (with the log) if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(f"server exited with status {code} before it was ready:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"server not ready within {timeout:.0f} s:\n{self.log_text()}")

    def wait_exit(self, timeout: float = 60.0) -> int:
        """For tests of failed startups: the exit status (raises TimeoutError if still running)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"server still running after {timeout:.0f} s:\n{self.log_text()}") from None

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log_file.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 120.0,
                 wait: bool = True, log_dir: Path | None = None) -> ServerProcess:
    """Launch a server; with ``wait`` (default) block until it is healthy. Use as a context manager.

    The log file stays after stop() so a test can read it; pass ``log_dir`` (e.g. tmp_path) to keep /tmp clean.
    """
    server = ServerProcess(args, env, log_dir)
    if wait:
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
    return server
