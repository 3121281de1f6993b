"""Building tierlm's CPU kernel libraries from csrc/ with CMake: at install (setup.py) and, where no built library
matches the sources, on first use (library.py).

One library per CPU level of the machine's architecture (csrc/CMakeLists.txt names the levels and their target
flags), each with every kernel its level can run and the torch ops that call them. The build records what it made in
``manifest.json`` next to the libraries: the sources' hash, the torch it was built against, the compiler, and each
library's SHA-256, which the loader checks before it opens a library; a level that failed keeps the compiler's own
message there.

Standard library only (setup.py loads this file by path, before tierlm is installed); torch is imported for its
headers and libraries only when a build runs.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

CSRC = Path(__file__).resolve().parent / "csrc"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
LIBRARY_PREFIX = "libtierlm_cpu_"
# The compiler output kept per failed level (its last lines: the errors).
KEPT_OUTPUT_CHARS = 3000


def library_file(level: str) -> str:
    return f"{LIBRARY_PREFIX}{level}.so"


def sources_hash(csrc: Path = CSRC) -> str:
    """SHA-256 of every file of the source tree (names and bytes): a build records it, and a library built from other
    sources is not the one these sources make."""
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(csrc).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def torch_build_info() -> dict:
    """What the torch ops compile and link against: torch's headers, its library folder, its C++ ABI, its version."""
    import torch
    from torch.utils import cpp_extension

    return {"include_dirs": cpp_extension.include_paths(), "library_dir": str(Path(torch.__file__).parent / "lib"),
            "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI), "version": torch.__version__}


def find_cmake() -> str | None:
    """cmake on PATH, else the one the ``cmake`` wheel installed beside this interpreter."""
    found = shutil.which("cmake")
    if found:
        return found
    beside = Path(sys.executable).parent / "cmake"
    return str(beside) if beside.exists() else None


def _generator() -> list[str]:
    ninja = shutil.which("ninja") or (str(Path(sys.executable).parent / "ninja")
                                      if (Path(sys.executable).parent / "ninja").exists() else None)
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else ["-G", "Unix Makefiles"]


class BuildError(RuntimeError):
    """The build could not run at all (no cmake, no compiler, a configure failure): the message says what to do."""


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= KEPT_OUTPUT_CHARS else "..." + text[-KEPT_OUTPUT_CHARS:]


def build(out_dir: Path, work_dir: Path, levels: list[str] | None = None, werror: bool = False,
          jobs: int | None = None, say: Callable[[str], None] = print, torch_info: dict | None = None) -> dict:
    """Build ``levels`` (default: every level of this architecture) into ``out_dir`` with ``manifest.json``, the build
    tree in ``work_dir``; returns the manifest. A level that fails to compile is left out, its compiler output in the
    manifest's ``failed``; raises BuildError when nothing can be built (no cmake, no working compiler)."""
    cmake = find_cmake()
    if cmake is None:
        raise BuildError("cmake was not found: install it (pip install cmake, or the system's cmake package)")
    torch_info = torch_info or torch_build_info()
    jobs = jobs or os.cpu_count() or 1
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    configure = [cmake, "-S", str(CSRC), "-B", str(work_dir), *_generator(), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DTORCH_INCLUDE_DIRS={';'.join(torch_info['include_dirs'])}",
                 f"-DTORCH_LIBRARY_DIR={torch_info['library_dir']}", f"-DTORCH_CXX11_ABI={torch_info['cxx11_abi']}",
                 f"-DTIERLM_WERROR={'ON' if werror else 'OFF'}", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                 f"-DTIERLM_LEVELS={';'.join(levels or [])}"]
    done = _run(configure, work_dir, 600)
    if done.returncode != 0:
        raise BuildError(f"configuring the CPU kernels failed (a C/C++ compiler is needed: gcc/g++ or clang): "
                         f"{_tail(done.stdout + done.stderr)}")
    planned = [line.split("\t") for line in (work_dir / "tierlm_levels.tsv").read_text().splitlines() if line]
    manifest: dict = {"format": MANIFEST_FORMAT, "sources": sources_hash(), "torch": torch_info["version"],
                      "compiler": _compiler_of(work_dir), "werror": werror, "libraries": {}, "failed": {},
                      "levels": [level for level, *_ in planned]}
    out_dir.mkdir(parents=True, exist_ok=True)
    configured = [level for level, state, _ in planned if state == "configured"]
    for level, state, detail in planned:
        if state != "configured":
            manifest["failed"][level] = detail
            say(f"tierlm CPU kernels: {level} not built: {detail}")
    say(f"tierlm CPU kernels: building {', '.join(configured)} with {jobs} jobs")
    # every level at once (all cores busy); a level that failed is built again alone for its own compiler output
    _run([cmake, "--build", str(work_dir), "--parallel", str(jobs), *(["--", "-k", "0"] if "Ninja" in
                                                                      _generator()[1] else ["--", "-k"])],
         work_dir, 3600)
    for level, state, detail in planned:
        if state != "configured":
            continue
        built = work_dir / library_file(level)
        if not built.exists():
            done = _run([cmake, "--build", str(work_dir), "--target", f"tierlm_cpu_{level}"], work_dir, 1800)
            manifest["failed"][level] = f"the compiler failed: {_tail(done.stdout + done.stderr)}"
            say(f"tierlm CPU kernels: {level} failed to build:\n{_tail(done.stdout + done.stderr)}")
            continue
        target = out_dir / library_file(level)
        staged = out_dir / f".{library_file(level)}.{os.getpid()}"
        shutil.copyfile(built, staged)
        os.chmod(staged, 0o755)
        os.replace(staged, target)  # whole or not at all: a server loading it never sees half a file
        manifest["libraries"][level] = {"file": target.name, "sha256": file_hash(target),
                                        "flags": detail.replace(";", " "), "kernels": kernel_names(target)}
    say(f"tierlm CPU kernels: {len(manifest['libraries'])} of {len(planned)} levels built in "
        f"{time.monotonic() - started:.0f} s")
    manifest["build_seconds"] = round(time.monotonic() - started, 1)
    staged = out_dir / f".{MANIFEST}.{os.getpid()}"
    staged.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(staged, out_dir / MANIFEST)
    if not manifest["libraries"]:
        raise BuildError("no CPU kernel library could be built: " + "; ".join(
            f"{level}: {why}" for level, why in manifest["failed"].items()))
    return manifest


def kernel_names(path: Path) -> list[str]:
    """The kernels a built library has (its own list, registry.c), read by loading it beside torch (whose libraries
    it links): what ``tierlm doctor`` plans with before a server loads anything."""
    import ctypes

    import torch  # noqa: F401 - libc10 / libtorch_cpu for the library's links

    fn = ctypes.CDLL(str(path)).tierlm_kernel_names
    fn.restype = ctypes.c_char_p
    return sorted(fn().decode().split(","))


def _compiler_of(work_dir: Path) -> str:
    """The compiler CMake found: its id, version and paths (CMakeLists.txt writes them)."""
    return (work_dir / "tierlm_compiler.txt").read_text().strip()


def build_into(out_dir: Path, levels: list[str] | None = None, werror: bool = False,
               say: Callable[[str], None] = print) -> dict:
    """``build`` with its build tree in a temporary folder beside ``out_dir`` (removed after)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out_dir) as work:
        return build(out_dir, Path(work), levels, werror, say=say)


if __name__ == "__main__":  # python backends/torch/cpu/build.py OUT_DIR [LEVEL ...]: a build by hand
    build_into(Path(sys.argv[1]), sys.argv[2:] or None, werror=os.environ.get("TIERLM_KERNELS_WERROR") == "1")
