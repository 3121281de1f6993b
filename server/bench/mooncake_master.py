"""A real ``mooncake_master`` on free loopback ports, for benchmarks and tests that share L3 between servers.

The binary ships in the ``mooncake-transfer-engine`` wheels (``pip install 'tierlm[mooncake]'``) and needs
Debian's ``libibverbs1`` even over TCP. ``MooncakeMaster.unavailable()`` says which of the two is missing, so a
caller can skip with the fix instead of failing.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tierlm.server.bench.server_process import free_port

INSTALL_HINT = "pip install 'tierlm[mooncake]' and apt-get install -y libibverbs1"
LISTEN_TIMEOUT_S = 10.0


class MooncakeMasterError(RuntimeError):
    """The master could not be started; the message names the fix."""


def master_binary() -> str | None:
    """The mooncake_master executable: on PATH, or inside the installed ``mooncake`` package."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    return str(path) if path.exists() else None


class MooncakeMaster:
    """``with MooncakeMaster() as m:`` a master listening on ``m.address`` ("127.0.0.1:port") until the block ends."""

    def __init__(self, rpc_port: int | None = None) -> None:
        self.rpc_port = rpc_port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @staticmethod
    def unavailable() -> str | None:
        """Why a master cannot run here (with the install command), or None when it can."""
        try:
            import mooncake.store  # noqa: F401
        except ImportError as e:
            return f"mooncake is not importable ({e}): {INSTALL_HINT}"
        return None if master_binary() else f"no mooncake_master binary: {INSTALL_HINT}"

    def start(self) -> "MooncakeMaster":
        why = self.unavailable()
        if why:
            raise MooncakeMasterError(why)
        self.proc = subprocess.Popen(
            [master_binary(), f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
             f"-metrics_port={free_port()}", "-metrics_host=127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")[-500:]
                hint = f" ({INSTALL_HINT})" if "libibverbs" in err else ""
                raise MooncakeMasterError(f"mooncake_master exited with {self.proc.returncode}{hint}: {err}")
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), 0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise MooncakeMasterError(f"mooncake_master did not listen within {LISTEN_TIMEOUT_S:.0f} s")
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
