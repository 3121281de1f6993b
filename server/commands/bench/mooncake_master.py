"""A real ``mooncake_master`` on free loopback ports, for benchmarks and tests that share L3 between servers, and a
``mooncake_client`` (Mooncake's standalone real client: it lends the store its segment and serves the servers of
its host as dummy clients through shared memory, runtime/cache/storage/stores/mooncake/shm.py).

The binaries ship in the ``mooncake-transfer-engine`` wheels (``pip install 'tierlm[mooncake]'``) and needs
Debian's ``libibverbs1`` even over TCP. ``MooncakeMaster.unavailable()`` says which of the two is missing, so a
caller can skip with the fix instead of failing.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tierlm.server.commands.bench.server_process import free_port

INSTALL_HINT = "pip install 'tierlm[mooncake]' and apt-get install -y libibverbs1"
LISTEN_TIMEOUT_S = 10.0


class MooncakeMasterError(RuntimeError):
    """The master could not be started; the message names the fix."""


def master_binary(name: str = "mooncake_master") -> str | None:
    """The mooncake_master (or ``name``) executable: on PATH, or inside the installed ``mooncake`` package."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / name
    return str(path) if path.exists() else None


def _wait_listening(proc: subprocess.Popen, port: int, what: str) -> None:
    """Return once ``proc`` accepts connections on 127.0.0.1:port; MooncakeMasterError if it exits or stays deaf."""
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
            hint = f" ({INSTALL_HINT})" if "libibverbs" in err else ""
            raise MooncakeMasterError(f"{what} exited with {proc.returncode}{hint}: {err}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise MooncakeMasterError(f"{what} did not listen within {LISTEN_TIMEOUT_S:.0f} s") from None
            time.sleep(0.05)


def _stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _ListeningProcess:
    """A Mooncake binary started as a child that must be listening on its port before ``start`` returns, stopped
    at the end of a ``with`` block."""

    proc: subprocess.Popen | None = None

    def start(self):  # pragma: no cover - each subclass starts its own binary
        raise NotImplementedError

    def _spawn(self, cmd: list[str], port: int, what: str, **popen: object) -> None:
        self.proc = subprocess.Popen(cmd, **popen)
        try:
            _wait_listening(self.proc, port, what)
        except MooncakeMasterError:
            self.stop()
            raise

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        _stop_process(proc)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MooncakeMaster(_ListeningProcess):
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
        self._spawn([master_binary(), f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
                     f"-metrics_port={free_port()}", "-metrics_host=127.0.0.1"], self.rpc_port, "mooncake_master",
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self


class MooncakeRealClient(_ListeningProcess):
    """``with MooncakeRealClient(master, segment_bytes) as c:`` a ``mooncake_client`` on ``c.address``
    ("127.0.0.1:port") lending the master ``segment_bytes`` until the block ends; servers given
    ``client_server_address`` = ``c.address`` read and write pages through it in shared memory."""

    def __init__(self, master_address: str, segment_bytes: int, port: int | None = None,
                 log_path: Path | None = None) -> None:
        self.master_address = master_address
        self.segment_bytes = segment_bytes
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @staticmethod
    def unavailable() -> str | None:
        """Why a real client cannot run here (with the install command), or None when it can."""
        return MooncakeMaster.unavailable() or (
            None if master_binary("mooncake_client") else f"no mooncake_client binary: {INSTALL_HINT}")

    def start(self) -> "MooncakeRealClient":
        why = self.unavailable()
        if why:
            raise MooncakeMasterError(why)
        # Its log (glog on stderr) goes to log_path when given: a pipe nobody reads would fill and block it. The
        # file is closed here once the child holds it.
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._spawn([master_binary("mooncake_client"), f"-master_server_address={self.master_address}",
                         "-metadata_server=P2PHANDSHAKE", "-host=127.0.0.1", f"-port={self.port}", "-protocol=tcp",
                         f"-global_segment_size={self.segment_bytes}"], self.port, "mooncake_client",
                        stdout=log, stderr=subprocess.STDOUT)
        finally:
            if self.log_path:
                log.close()
        return self
