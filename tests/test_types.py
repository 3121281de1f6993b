"""The type-checker gate (issue 58): mypy, strict on the runtime and on the backend contract (backends/base.py).

The configuration is pyproject.toml's [tool.mypy]. The code folders live at the top level and map into ``tierlm.*``
(package-dir), and an installed tierlm may be another checkout (an editable install elsewhere) or none, so mypy reads
this checkout through a shim: a temporary ``tierlm/`` of links to the entry files and the four code folders, on
MYPYPATH. mypy runs in the temporary folder, so the checkout's own ``tierlm/`` (entry files only) does not shadow it,
with its cache there too: nothing is left behind.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_FOLDERS = ("runtime", "backends", "platforms", "server")
CHECKED = ("tierlm.runtime", "tierlm.backends.base")


def _shim(tmp_path: Path) -> Path:
    shim = tmp_path / "shim"
    package = shim / "tierlm"
    package.mkdir(parents=True)
    for entry in sorted((ROOT / "tierlm").glob("*.py")):
        (package / entry.name).symlink_to(entry)
    for folder in CODE_FOLDERS:
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    return shim


def test_runtime_and_the_backend_contract_type_check_strictly(tmp_path):
    shim = _shim(tmp_path)
    packages = [arg for name in CHECKED for arg in ("-p", name)]
    env = {**os.environ, "MYPYPATH": str(shim)}
    env.pop("MYPY_CACHE_DIR", None)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(tmp_path / "mypy_cache"), "--no-error-summary", "--show-error-codes",
                           *packages], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, (f"mypy ({' '.join(CHECKED)}, strict; [tool.mypy] in pyproject.toml) failed in "
                                  f"{took:.0f} s (mypy comes with the test extra: pip install -e .[test]):\n{output}")
