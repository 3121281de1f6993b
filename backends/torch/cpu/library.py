"""The CPU kernel library this process runs: the best level this CPU can run, found, checked and loaded once.

setup.py builds one library per CPU level at install (build.py, csrc/CMakeLists.txt) into ``lib/`` beside this file,
with a manifest of what it built. Loading picks, as ggml picks its CPU variants by score, the highest built level at
or below this CPU's (after a TIERLM_CPU_ISA cap: platforms/cpu_features.py), and opens it only after

- its manifest was made from these sources (an editable checkout edited since its install is not) and against this
  torch (the torch ops use its C++ ABI),
- the file's SHA-256 is the one the build recorded,
- its folder is not writable by other users (and, in tierlm's cache folder, is the user's own).

Where the install built no usable library (an editable checkout without a build, sources edited since, another
torch), this CPU's level is built on first use into tierlm's cache folder (``<cache>/kernels/<sources>-<torch>``,
the user's own, mode 700) from the same sources with the same build, under a lock, and logged; a cached build is
checked the same way before it is loaded, and rebuilt when it fails a check. Whatever goes wrong is a WARNING with
the compiler's or the loader's own message, and torch's kernels serve: ``tierlm doctor`` and /server_info show the
library, its level and why (``status``).
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import shutil
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from tierlm.backends.torch.cpu import build
from tierlm.platforms.cpu_features import CpuFeatures, level_names, this_cpu
from tierlm.platforms.cpu_plan import KERNELS_ENV, LibraryFacts, kernels_override

log = logging.getLogger(__name__)

INSTALLED = Path(__file__).resolve().parent / "lib"


@dataclass(frozen=True)
class KernelLibrary:
    """One loaded library: its level, its kernels (the families its level's build has), where it came from."""
    level: str
    path: Path
    origin: str  # "installed" | "built on first use" | "cached first-use build"
    kernels: frozenset[str]
    cdll: ctypes.CDLL = field(repr=False, compare=False)

    def has(self, kernel: str) -> bool:
        return kernel in self.kernels

    def __getattr__(self, name: str):
        """The library's exported functions (``lib.paged_decode_bf16(...)``), typed by ``bind``."""
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.cdll, name)

    def describe(self) -> dict:
        return {"level": self.level, "path": str(self.path), "origin": self.origin, "kernels": sorted(self.kernels)}


class LibraryRefused(Exception):
    """A library (or its folder) failed a check: the message says which."""


def _torch_version() -> str:
    """The installed torch's version, without importing it (doctor reads manifests before torch loads)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def check_folder(folder: Path, own: bool) -> None:
    """Raises LibraryRefused unless ``folder`` is a real folder that no other user can write (``own``: and owned by
    this user, as tierlm's cache folder must be; an installed package may be owned by root)."""
    try:
        info = folder.lstat()
    except OSError as e:
        raise LibraryRefused(f"{folder}: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise LibraryRefused(f"{folder} is not a folder")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LibraryRefused(f"{folder} is writable by other users (mode {stat.filemode(info.st_mode)})")
    if info.st_uid not in ((os.getuid(),) if own else (os.getuid(), 0)):
        raise LibraryRefused(f"{folder} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")


def read_manifest(folder: Path, own: bool) -> dict:
    """The folder's manifest once the folder passes its checks and the manifest was made from these sources against
    this torch; raises LibraryRefused saying why not."""
    if not os.path.lexists(folder):
        raise LibraryRefused(f"no build in {folder}")
    check_folder(folder, own)
    try:
        manifest = json.loads((folder / build.MANIFEST).read_text())
    except FileNotFoundError:
        raise LibraryRefused(f"no build in {folder}") from None
    except (OSError, ValueError) as e:
        raise LibraryRefused(f"{folder / build.MANIFEST} is unreadable ({e})") from None
    if manifest.get("format") != build.MANIFEST_FORMAT:
        raise LibraryRefused(f"{folder / build.MANIFEST} is of another format")
    if build.CSRC.is_dir() and manifest.get("sources") != build.sources_hash():
        raise LibraryRefused(f"the build in {folder} is of other sources than {build.CSRC} (edited since)")
    if manifest.get("torch") != _torch_version():
        raise LibraryRefused(f"the build in {folder} is for torch {manifest.get('torch')}, this is {_torch_version()}")
    return manifest


def open_level(folder: Path, manifest: dict, level: str, origin: str) -> KernelLibrary:
    """``level``'s library from a checked folder, after its hash matched the manifest's; raises LibraryRefused."""
    entry = manifest["libraries"].get(level)
    if entry is None:
        raise LibraryRefused(f"the build in {folder} has no {level} library" + (
            f" ({manifest['failed'][level]})" if level in manifest.get("failed", {}) else ""))
    path = folder / entry["file"]
    try:
        info = path.lstat()
    except OSError as e:
        raise LibraryRefused(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LibraryRefused(f"{path} is not a regular file only its owner can write")
    if build.file_hash(path) != entry["sha256"]:
        raise LibraryRefused(f"{path} is not the file its build recorded (SHA-256 differs)")
    import torch  # noqa: F401 - the library's libc10 / libtorch_cpu / libgomp are the ones torch loaded

    try:
        cdll = ctypes.CDLL(str(path))
    except OSError as e:
        raise LibraryRefused(f"the loader refused {path}: {e}") from None
    bind(cdll)
    found = cdll.tierlm_library_level().decode()
    if found != level:
        raise LibraryRefused(f"{path} says it is built for {found}, its manifest says {level}")
    kernels = frozenset(cdll.tierlm_kernel_names().decode().split(","))
    return KernelLibrary(level, path, origin, kernels, cdll)


# --- ctypes signatures: every kernel of kernels.h, bound once per library ---
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_EXTEND = [_P] * 4 + [_I] + [_P] * 3 + [_I] * 6 + [_F, _P, _P, _I]
_DECODE = [_P] * 4 + [_I, _P] + [_I] * 5 + [_F, _P, _P, _I]
_SIGNATURES: dict[str, tuple[type | None, list]] = {
    "paged_decode_bf16": (None, _DECODE),
    "paged_decode_f32": (None, _DECODE),
    "paged_decode_step": (None, [_P, _L, _L] * 3 + [_P] * 4 + [_I, _P] + [_I] * 5 + [_F, _P, _P, _I, _I]),
    "paged_decode_step_floats": (_L, [_I] * 4),
    "paged_extend_bf16": (None, _EXTEND),
    "extend_work_floats": (_L, [_I, _I]),
    "paged_extend_amx": (None, _EXTEND),
    "amx_extend_work_floats": (_L, [_I, _I]),
    "paged_extend_f32": (None, _EXTEND),
    "extend_f32_work_floats": (_L, [_I, _I]),
    "softmax_rows_bf16": (None, [_P, _L, _L, _I, _P, _L, _I, _F, _P]),
    "blocked_attention_rows_bf16": (None, [_P] * 4 + [_I] * 7 + [_P, _I, _I, _F, _P]),
    "f32_linear": (None, [_P, _L, _L, _P, _P, _P, _L, _L, _L]),
    "f32_linear_bf16w": (None, [_P, _L, _L, _P, _P, _P, _L, _L, _L]),
    "f32_linear_f16w": (None, [_P, _L, _L, _P, _P, _P, _L, _L, _L]),
    "int8_linear_bf16": (None, [_P, _P, _I, _L, _L] + [_P] * 4 + [_L] * 3),
    "int8_linear_f32": (None, [_P, _P, _I, _L, _L] + [_P] * 4 + [_L] * 3),
    "avx512_linear_bf16": (None, [_P, _L, _L, _L, _P, _P, _P, _L, _L, _L, _L]),
    "amx_linear_bf16": (None, [_P, _L, _L, _L, _P, _P, _P, _L, _L, _L]),
    "amx_request_permission": (_I, []),
    "tierlm_library_level": (ctypes.c_char_p, []),
    "tierlm_vector_bits": (_I, []),
    "tierlm_kernel_names": (ctypes.c_char_p, []),
    "tierlm_step_record_fields": (ctypes.c_char_p, []),
    "tierlm_register_torch_ops": (_I, []),
}


def bind(cdll: ctypes.CDLL) -> None:
    """Set the argument and result types of every function the library exports (a level's library lacks the kernels
    its instructions cannot run: those are skipped, and its kernel names say so)."""
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            continue
        fn.restype, fn.argtypes = restype, argtypes


# --- the first-use build into tierlm's cache folder ---

def cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("tierlm")) / "kernels"


def _private_folder(path: Path) -> Path:
    """``path`` created (parents too) with mode 700 where missing; checked to be this user's and not writable by
    others either way (raises LibraryRefused)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_folder(path, own=True)
    return path


def cached_build_folder() -> Path:
    """Where the first-use build of these sources against this torch lives."""
    return cache_root() / f"{build.sources_hash()[:16]}-torch{_torch_version()}"


def build_on_first_use(level: str) -> KernelLibrary:
    """``level``'s library from tierlm's cache folder: the cached build when it passes every check, else built now
    (under a lock: servers starting together build once). Raises LibraryRefused or build.BuildError."""
    if not build.CSRC.is_dir():
        raise LibraryRefused(f"no kernel sources at {build.CSRC} to build from")
    root = _private_folder(cache_root())
    folder = cached_build_folder()
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if folder.exists():
                try:
                    return open_level(folder, read_manifest(folder, own=True), level, "cached first-use build")
                except LibraryRefused as e:
                    log.warning("CPU kernels: the cached build is not used (%s); building it again", e)
                    shutil.rmtree(folder)
            log.warning("CPU kernels: building the %s library into %s (first use of these sources: ~30-60 s on two "
                        "cores, once)", level, folder)
            staged = Path(_private_folder(root / f".build-{os.getpid()}"))
            try:
                build.build(staged, staged / "tree", [level], say=lambda line: log.info("%s", line))
                shutil.rmtree(staged / "tree")
                os.replace(staged, folder)
            finally:
                shutil.rmtree(staged, ignore_errors=True)
            return open_level(folder, read_manifest(folder, own=True), level, "built on first use")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --- the process's library ---

@dataclass
class _Loaded:
    library: KernelLibrary | None = None
    why: str = "not loaded yet"
    done: bool = False
    installed: dict = field(default_factory=dict)  # the install's manifest, for the report


_STATE = _Loaded()
_LOCK = threading.Lock()
_OPENED: dict[tuple[str, str], KernelLibrary] = {}  # (folder, level) -> library: a library is opened once


def _installed(level: str) -> KernelLibrary:
    key = (str(INSTALLED), level)
    if key not in _OPENED:
        _OPENED[key] = open_level(INSTALLED, read_manifest(INSTALLED, own=False), level, "installed")
    return _OPENED[key]


def best_installed_level(cpu: CpuFeatures, manifest: dict) -> str | None:
    """The highest level the install built at or below ``cpu``'s level (the score: a level's place among them)."""
    levels = level_names(cpu.arch)
    if cpu.level not in levels:
        return None
    runnable = levels[:levels.index(cpu.level) + 1]
    return next((lv for lv in reversed(runnable) if lv in manifest.get("libraries", {})), None)


def library_for(cpu: CpuFeatures) -> tuple[KernelLibrary | None, str]:
    """(the library for ``cpu``, why it or none): the best installed level, else a first-use build of ``cpu``'s."""
    off = kernels_override(os.environ)
    if off:
        return None, off
    if cpu.arch not in ("x86_64", "aarch64"):
        return None, f"no CPU kernel library for {cpu.arch} (x86_64 and aarch64 only)"
    refused = ""
    try:
        manifest = read_manifest(INSTALLED, own=False)
        _STATE.installed = manifest
        level = best_installed_level(cpu, manifest)
        if level is not None:
            lib = _installed(level)
            note = "" if level == cpu.level else f"; the install has no {cpu.level} library" + (
                f" ({manifest['failed'][cpu.level]})" if cpu.level in manifest.get("failed", {}) else "")
            return lib, f"the installed {level} library{note}"
        refused = f"the install built no library this CPU ({cpu.level}) runs"
    except LibraryRefused as e:
        refused = str(e)
    try:
        lib = build_on_first_use(cpu.level)
        return lib, f"{lib.origin} ({refused})"
    except (LibraryRefused, build.BuildError, OSError) as e:
        return None, f"{refused}; and no first-use build: {e}"


def load(cpu: CpuFeatures | None = None) -> KernelLibrary | None:
    """The process's kernel library (once, logged; None: torch's kernels serve, ``status()`` says why)."""
    if _STATE.done:
        return _STATE.library
    with _LOCK:
        if not _STATE.done:
            try:
                lib, why = library_for(cpu or this_cpu())
            except Exception as e:  # noqa: BLE001 - torch's kernels serve; the reason is logged and reported
                lib, why = None, f"could not set it up ({type(e).__name__}: {e})"
            _STATE.library, _STATE.why = lib, why
            _STATE.done = True
            if lib is None:
                (log.info if why.startswith(KERNELS_ENV) else log.warning)(
                    "CPU kernels: none loaded (%s); torch's kernels serve", why)
            else:
                log.info("CPU kernels: %s at %s (%s)", lib.level, lib.path, why)
    return _STATE.library


def load_level(level: str) -> KernelLibrary:
    """``level``'s library whatever this CPU runs (tests, benchmarks: a caller that runs its code checks first):
    the install's, else a first-use build. Raises LibraryRefused or build.BuildError."""
    try:
        return _installed(level)
    except LibraryRefused:
        key = (str(cached_build_folder()), level)
        if key not in _OPENED:
            _OPENED[key] = build_on_first_use(level)
        return _OPENED[key]


def installed_facts(cpu: CpuFeatures, env: Mapping[str, str]) -> LibraryFacts:
    """What a server on ``cpu`` would load under ``env``, from the install's manifest alone (nothing loaded, no hash
    read: ``tierlm doctor`` before any model loads); AMX tile state assumed granted where the CPU has AMX."""
    off = kernels_override(env)
    if off:
        return LibraryFacts(None, why=off)
    try:
        manifest = read_manifest(INSTALLED, own=False)
    except LibraryRefused as e:
        return LibraryFacts(None, why=f"{e}: a server builds this CPU's level on first use where a compiler is")
    level = best_installed_level(cpu, manifest)
    if level is None:
        return LibraryFacts(None, why=f"the install built no library this CPU ({cpu.level}) runs")
    kernels = frozenset(manifest["libraries"][level].get("kernels", ()))
    return LibraryFacts(level, kernels, f"the installed {level} library", amx_granted=cpu.has("amx_bf16", "amx_tile"))


def status() -> dict:
    """The library as loaded, for /server_info and doctor: level, path, origin, kernels and why (or why none), and
    what the install built."""
    lib = _STATE.library
    out = {"loaded": lib is not None, "why": _STATE.why, **(lib.describe() if lib else {})}
    installed = _STATE.installed
    if installed:
        out["installed"] = {"levels": sorted(installed.get("libraries", {})), "failed": installed.get("failed", {}),
                            "compiler": installed.get("compiler"), "torch": installed.get("torch")}
    return out


def reset_for_tests() -> None:
    """Forget the process's choice (tests: the next ``load`` decides again; libraries opened stay open)."""
    with _LOCK:
        _STATE.library, _STATE.why, _STATE.done, _STATE.installed = None, "not loaded yet", False, {}
