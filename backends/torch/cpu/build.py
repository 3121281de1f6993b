"""Building tierlm's CPU kernel libraries from csrc/ with CMake: at install (setup.py) and, where no built library
matches the sources, on first use (library.py).

One library per CPU level of the machine's architecture (csrc/CMakeLists.txt names the levels and their target
flags), each with every kernel its level can run and, where a C++ compiler and torch's headers are there, the torch
ops that call them. The build records what it made in ``manifest.json`` next to the libraries: the sources' hash,
the torch it was built against, the compiler, and each library's SHA-256 and kernels, which the loader checks before
it opens a library; a level that failed keeps the compiler's own message there.

Standard library only (setup.py loads this file by path, before tierlm is installed); torch is imported for its
headers and libraries only when a build runs.
"""
from __future__ import annotations

import functools
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
SOURCE_SUFFIXES = (".c", ".h", ".cpp", ".txt")  # what the build reads (CMakeLists.txt included)
# The compiler output kept per failed level (its last lines: the errors).
KEPT_OUTPUT_CHARS = 3000


def library_file(level: str) -> str:
    return f"{LIBRARY_PREFIX}{level}.so"


@functools.lru_cache(maxsize=4)
def sources_hash(csrc: Path = CSRC) -> str:
    """SHA-256 of the source tree the build reads (names and bytes; an editor's swap file is not a source): a build
    records it, and a library built from other sources is not the one these sources make."""
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES):
        digest.update(path.relative_to(csrc).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def torch_release(version: str | None) -> str | None:
    """A torch version without its local build label (2.13.0+cpu, 2.13.0+cu130 -> 2.13.0): builds of one release
    share the C++ headers and ABI the ops are compiled against."""
    return version.split("+")[0] if version else None


def torch_build_info() -> dict | None:
    """What the torch ops compile and link against: torch's headers, its library folder, its C++ ABI, its version;
    None where torch does not import (the libraries are then built without the torch ops)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None
    return {"include_dirs": cpp_extension.include_paths(), "library_dir": str(Path(torch.__file__).parent / "lib"),
            "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI), "version": torch.__version__}


def find_tool(name: str) -> str | None:
    """``name`` (cmake, ninja) on PATH, else the one its wheel installed beside this interpreter."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def _generator() -> list[str]:
    ninja = find_tool("ninja")
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else ["-G", "Unix Makefiles"]


class BuildError(RuntimeError):
    """The build could not run at all (no cmake, no working compiler, a configure failure): the message says what to
    do."""


class NoCmake(BuildError):
    """cmake is not installed: no level can be built here."""


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(cmd, -1, "", f"{type(e).__name__}: {e}")


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= KEPT_OUTPUT_CHARS else "..." + text[-KEPT_OUTPUT_CHARS:]


def build(out_dir: Path, work_dir: Path, levels: list[str] | None = None, werror: bool = False,
          jobs: int | None = None, say: Callable[[str], None] = print, torch_info: dict | None | bool = True) -> dict:
    """Build ``levels`` (default: every level of this architecture) into ``out_dir`` with ``manifest.json``, the build
    tree in ``work_dir``; returns the manifest. A level that fails to compile (or to load) is left out, its message in
    the manifest's ``failed``; raises BuildError when nothing can be built (no cmake, no working compiler).
    ``torch_info``: torch's headers and libraries (True: the torch that imports here; None: build without the torch
    ops)."""
    cmake = find_tool("cmake")
    if cmake is None:
        raise NoCmake("cmake was not found: install it (pip install cmake, or the system's cmake package)")
    torch_info = torch_build_info() if torch_info is True else torch_info
    jobs = jobs or os.cpu_count() or 1
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    torch_flags = [f"-DTORCH_INCLUDE_DIRS={';'.join(torch_info['include_dirs'])}",
                   f"-DTORCH_LIBRARY_DIR={torch_info['library_dir']}",
                   f"-DTORCH_CXX11_ABI={torch_info['cxx11_abi']}"] if torch_info else ["-DTORCH_INCLUDE_DIRS="]
    generator = _generator()
    configure = [cmake, "-S", str(CSRC), "-B", str(work_dir), *generator, "-DCMAKE_BUILD_TYPE=Release",
                 *torch_flags, f"-DTIERLM_WERROR={'ON' if werror else 'OFF'}", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                 f"-DTIERLM_LEVELS={';'.join(levels or [])}"]
    done = _run(configure, work_dir, 600)
    if done.returncode != 0:
        raise BuildError(f"configuring the CPU kernels failed (a C compiler is needed: gcc or clang; the torch ops "
                         f"also need g++): {_tail(done.stdout + done.stderr)}")
    planned = [line.split("\t") for line in (work_dir / "tierlm_levels.tsv").read_text().splitlines() if line]
    with_ops = (work_dir / "tierlm_torch_ops.txt").read_text().strip()
    manifest: dict = {"format": MANIFEST_FORMAT, "sources": sources_hash(),
                      "torch": torch_info["version"] if with_ops == "built" else None, "torch_ops": with_ops,
                      "compiler": _compiler_of(work_dir), "werror": werror, "libraries": {}, "failed": {},
                      "levels": [level for level, *_ in planned]}
    if with_ops != "built":
        say(f"tierlm CPU kernels: without the torch ops ({with_ops}): compiled steps call the kernels from Python")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out_dir, out_dir.stat().st_mode & 0o755)  # whatever the umask: the loader refuses what others can write
    configured = [(level, detail) for level, state, detail in planned if state == "configured"]
    for level, state, detail in planned:
        if state != "configured":
            manifest["failed"][level] = detail
            say(f"tierlm CPU kernels: {level} not built: {detail}")
    for level, _ in configured:  # an earlier build's library (a reused build tree) is never taken for this one's
        (work_dir / library_file(level)).unlink(missing_ok=True)
    say(f"tierlm CPU kernels: building {', '.join(level for level, _ in configured)} with {jobs} jobs")
    # every level at once (all cores busy); a level that failed is built again alone, for its own compiler output
    keep_going = ["--", "-k", "0"] if generator[1] == "Ninja" else ["--", "-k"]
    _run([cmake, "--build", str(work_dir), "--parallel", str(jobs), *keep_going], work_dir, 3600)
    for level, detail in configured:
        built = work_dir / library_file(level)
        if not built.exists():
            done = _run([cmake, "--build", str(work_dir), "--target", f"tierlm_cpu_{level}"], work_dir, 1800)
            if done.returncode != 0 or not built.exists():
                manifest["failed"][level] = f"the compiler failed: {_tail(done.stdout + done.stderr)}"
                say(f"tierlm CPU kernels: {level} failed to build:\n{_tail(done.stdout + done.stderr)}")
                continue
        try:
            kernels = kernel_names(built)
        except OSError as e:
            manifest["failed"][level] = f"the built library does not load: {e}"
            say(f"tierlm CPU kernels: {level} built but does not load: {e}")
            continue
        target = out_dir / library_file(level)
        staged = out_dir / f".{library_file(level)}.{os.getpid()}"
        shutil.copyfile(built, staged)
        os.chmod(staged, 0o755)
        os.replace(staged, target)  # whole or not at all: a server loading it never sees half a file
        manifest["libraries"][level] = {"file": target.name, "sha256": file_hash(target),
                                        "flags": detail.replace(";", " "), "kernels": kernels}
    say(f"tierlm CPU kernels: {len(manifest['libraries'])} of {len(planned)} levels built in "
        f"{time.monotonic() - started:.0f} s")
    manifest["build_seconds"] = round(time.monotonic() - started, 1)
    staged = out_dir / f".{MANIFEST}.{os.getpid()}"
    staged.write_text(json.dumps(manifest, indent=1) + "\n")
    os.chmod(staged, 0o644)
    os.replace(staged, out_dir / MANIFEST)
    if not manifest["libraries"]:
        raise BuildError("no CPU kernel library could be built: " + "; ".join(
            f"{level}: {why}" for level, why in manifest["failed"].items()))
    return manifest


def kernel_names(path: Path) -> list[str]:
    """The kernels a built library has (its own list, registry.c), read by loading it (beside torch, whose libraries
    a library with the torch ops links): what ``tierlm doctor`` plans with before a server loads anything."""
    import ctypes

    try:
        import torch  # noqa: F401 - libc10 / libtorch_cpu for a library with the torch ops
    except ImportError:
        pass
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
