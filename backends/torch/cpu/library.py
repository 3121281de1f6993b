"""The CPU kernel library this process runs: the best level this CPU can run, found, checked and loaded once.

setup.py builds one library per CPU level at install (build.py, csrc/CMakeLists.txt) into ``lib/`` beside this file,
with a manifest of what it built. Loading picks, as ggml picks its CPU variants by score, the highest built level at
or below this CPU's (after a TIERLM_CPU_ISA cap: platforms/cpu_features.py), and opens it only after

- its manifest was made from these sources (an editable checkout edited since its install is not) and against this
  torch release (the torch ops use its C++ ABI),
- the file is the one the build named and its SHA-256 the one it recorded,
- neither the folder, the manifest nor the file is writable by other users, and each belongs to this user (or, for
  an installed package, to root); in tierlm's cache folder to this user only.

Where the install built no usable library (an editable checkout without a build, sources edited since, another
torch), this CPU's level is built on first use into tierlm's cache folder (``<cache>/kernels/<sources>-torch<v>/
<level>``, the user's own, mode 700) from the same sources with the same build, under a lock, and logged; a level
the compiler cannot build there gives way to the next one below. A cached build is checked the same way before it is
loaded, and built again when it fails a check. Whatever goes wrong is a WARNING with the compiler's or the loader's
own message, and torch's kernels serve: ``tierlm doctor`` and /server_info show the library, its level and why
(``status``).
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import shutil
import stat
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from tierlm.backends.torch.cpu import build
from tierlm.platforms.cpu_features import CpuFeatures, level_names, this_cpu
from tierlm.platforms.cpu_plan import KERNELS_ENV, LibraryFacts, kernels_override

log = logging.getLogger(__name__)

INSTALLED = Path(__file__).resolve().parent / "lib"

# --- ctypes signatures: every function of kernels.h ---
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


class KernelLibrary:
    """One loaded library: its level, its kernels (the families its level's build has), where it came from; its
    exported functions are attributes, typed (``lib.paged_decode_bf16(...)``; a function its level's build lacks is
    not there). Compared and hashed by identity: a library is opened once."""

    def __init__(self, level: str, path: Path, origin: str, kernels: frozenset[str], cdll: ctypes.CDLL) -> None:
        self.level, self.path, self.origin, self.kernels, self.cdll = level, path, origin, kernels, cdll
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(cdll, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
                setattr(self, name, fn)

    def has(self, kernel: str) -> bool:
        return kernel in self.kernels

    def describe(self) -> dict:
        return {"level": self.level, "path": str(self.path), "origin": self.origin, "kernels": sorted(self.kernels)}

    def __repr__(self) -> str:
        return f"KernelLibrary({self.level!r}, {str(self.path)!r}, {self.origin!r})"


class LibraryRefused(Exception):
    """A library (or its folder, or its manifest) failed a check: the message says which."""


def _torch_version() -> str | None:
    """The installed torch's version, without importing it (doctor reads manifests before torch loads)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def _check_path(path: Path, kind: int, own: bool) -> None:
    """Raises LibraryRefused unless ``path`` is a real folder / regular file (``kind``: stat.S_IFDIR / S_IFREG) that
    no other user can write, belonging to this user (``own``) or to this user or root (an installed package)."""
    try:
        info = path.lstat()
    except OSError as e:
        raise LibraryRefused(f"{path}: {e.strerror}") from None
    if stat.S_IFMT(info.st_mode) != kind:
        raise LibraryRefused(f"{path} is not a {'folder' if kind == stat.S_IFDIR else 'regular file'}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LibraryRefused(f"{path} is writable by other users (mode {stat.filemode(info.st_mode)})")
    if info.st_uid not in ((os.getuid(),) if own else (os.getuid(), 0)):
        raise LibraryRefused(f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")


def check_folder(folder: Path, own: bool) -> None:
    _check_path(folder, stat.S_IFDIR, own)


def read_manifest(folder: Path, own: bool) -> dict:
    """The folder's manifest once the folder and the manifest pass their checks and the manifest was made from these
    sources against this torch release; raises LibraryRefused saying why not."""
    if not os.path.lexists(folder):
        raise LibraryRefused(f"no build in {folder}")
    check_folder(folder, own)
    path = folder / build.MANIFEST
    if not os.path.lexists(path):
        raise LibraryRefused(f"no build in {folder}")
    _check_path(path, stat.S_IFREG, own)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LibraryRefused(f"{path} is unreadable ({e})") from None
    if manifest.get("format") != build.MANIFEST_FORMAT:
        raise LibraryRefused(f"{path} is of another format")
    if build.CSRC.is_dir() and manifest.get("sources") != build.sources_hash():
        raise LibraryRefused(f"the build in {folder} is of other sources than {build.CSRC} (edited since)")
    built_for = manifest.get("torch")
    if built_for is not None and build.torch_release(built_for) != build.torch_release(_torch_version()):
        raise LibraryRefused(f"the build in {folder} is for torch {built_for}, this is {_torch_version()}")
    return manifest


def open_level(folder: Path, manifest: dict, level: str, origin: str) -> KernelLibrary:
    """``level``'s library from a checked folder, after its name, owner, mode and hash matched; raises
    LibraryRefused."""
    entry = manifest["libraries"].get(level)
    if entry is None:
        raise LibraryRefused(f"the build in {folder} has no {level} library" + (
            f" ({manifest['failed'][level]})" if level in manifest.get("failed", {}) else ""))
    if entry.get("file") != build.library_file(level):  # the manifest never names another file to open
        raise LibraryRefused(f"the manifest in {folder} names {entry.get('file')!r} for {level}")
    path = folder / entry["file"]
    _check_path(path, stat.S_IFREG, origin != "installed")
    if build.file_hash(path) != entry["sha256"]:
        raise LibraryRefused(f"{path} is not the file its build recorded (SHA-256 differs)")
    import torch  # noqa: F401 - the library's libc10 / libtorch_cpu / libgomp are the ones torch loaded

    try:
        cdll = ctypes.CDLL(str(path))
    except OSError as e:
        raise LibraryRefused(f"the loader refused {path}: {e}") from None
    lib = KernelLibrary(level, path, origin, frozenset(), cdll)
    found = lib.tierlm_library_level().decode()
    if found != level:
        raise LibraryRefused(f"{path} says it is built for {found}, its manifest says {level}")
    lib.kernels = frozenset(lib.tierlm_kernel_names().decode().split(","))
    return lib


# --- the first-use build into tierlm's cache folder ---

def cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("tierlm")) / "kernels"


def _private_folder(path: Path) -> Path:
    """``path`` created (parents too) with mode 700 where missing, made 700 where it is this user's and others could
    write it (an older tierlm made it with the umask); raises LibraryRefused when it belongs to another user."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.info("CPU kernels: %s was writable by other users (mode %s): made 700", path,
                 stat.filemode(info.st_mode))
        os.chmod(path, 0o700)
    check_folder(path, own=True)
    return path


def cached_build_folder(level: str) -> Path:
    """Where the first-use build of ``level`` from these sources against this torch release lives."""
    return cache_root() / f"{build.sources_hash()[:16]}-torch{build.torch_release(_torch_version())}" / level


def build_on_first_use(level: str) -> KernelLibrary:
    """``level``'s library from tierlm's cache folder: the cached build when it passes every check, else built now
    (under a lock: servers starting together build once). Raises LibraryRefused or build.BuildError."""
    if not build.CSRC.is_dir():
        raise LibraryRefused(f"no kernel sources at {build.CSRC} to build from")
    root = _private_folder(cache_root())
    folder = cached_build_folder(level)
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if folder.exists():
                try:
                    return open_level(folder, read_manifest(folder, own=True), level, "cached first-use build")
                except LibraryRefused as e:
                    log.warning("CPU kernels: the cached %s build is not used (%s); building it again", level, e)
                    shutil.rmtree(folder)
            log.warning("CPU kernels: building the %s library into %s (first use of these sources: ~10-60 s on two "
                        "cores, once)", level, folder)
            _private_folder(folder.parent)
            staged = _private_folder(root / f".build-{os.getpid()}")
            try:
                build.build(staged, staged / "tree", [level], say=lambda line: log.info("%s", line))
                shutil.rmtree(staged / "tree")
                os.replace(staged, folder)
            finally:
                shutil.rmtree(staged, ignore_errors=True)
            return open_level(folder, read_manifest(folder, own=True), level, "built on first use")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def first_use(cpu: CpuFeatures) -> KernelLibrary:
    """The first-use build of ``cpu``'s level, else of the next level below it the compiler can build (an old
    compiler without the amx level's flags still builds avx512_bf16); raises with every level's reason."""
    levels = level_names(cpu.arch)
    reasons = []
    for level in reversed(levels[:levels.index(cpu.level) + 1]):
        try:
            return build_on_first_use(level)
        except (LibraryRefused, build.BuildError) as e:
            reasons.append(f"{level}: {e}")
            if isinstance(e, (LibraryRefused, build.NoCmake)):
                break  # no sources, no cmake, a folder of another user: no level will do better
    raise build.BuildError("; ".join(reasons))


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


def _installed(level: str, manifest: dict | None = None) -> KernelLibrary:
    """The install's ``level`` library, opened once (``manifest``: the install's, where the caller read it)."""
    key = (str(INSTALLED), level)
    if key not in _OPENED:
        manifest = manifest if manifest is not None else read_manifest(INSTALLED, own=False)
        _OPENED[key] = open_level(INSTALLED, manifest, level, "installed")
    return _OPENED[key]


def best_installed_level(cpu: CpuFeatures, manifest: dict) -> str | None:
    """The highest level the install built at or below ``cpu``'s level (the score: a level's place among them)."""
    levels = level_names(cpu.arch)
    if cpu.level not in levels:
        return None
    runnable = levels[:levels.index(cpu.level) + 1]
    return next((lv for lv in reversed(runnable) if lv in manifest.get("libraries", {})), None)


def library_for(cpu: CpuFeatures) -> tuple[KernelLibrary | None, str]:
    """(the library for ``cpu``, why it or none): the best installed level, else a first-use build."""
    off = kernels_override(os.environ)
    if off:
        return None, off
    if sys.platform != "linux" or cpu.arch not in ("x86_64", "aarch64"):
        return None, f"no CPU kernel library on {sys.platform} {cpu.arch} (Linux x86_64 and aarch64 only)"
    refused = ""
    try:
        manifest = read_manifest(INSTALLED, own=False)
        _STATE.installed = manifest
        level = best_installed_level(cpu, manifest)
        if level is not None:
            lib = _installed(level, manifest)
            note = "" if level == cpu.level else f"; the install has no {cpu.level} library" + (
                f" ({manifest['failed'][cpu.level]})" if cpu.level in manifest.get("failed", {}) else "")
            return lib, f"the installed {level} library{note}"
        refused = f"the install built no library this CPU ({cpu.level}) runs"
    except LibraryRefused as e:
        refused = str(e)
    try:
        lib = first_use(cpu)
        return lib, f"{lib.origin} ({refused})"
    except (build.BuildError, OSError) as e:
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
        key = (str(cached_build_folder(level)), level)
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
                            "compiler": installed.get("compiler"), "torch": installed.get("torch"),
                            "torch_ops": installed.get("torch_ops")}
    return out


def reset_for_tests() -> None:
    """Forget the process's choice (tests: the next ``load`` decides again; libraries opened stay open)."""
    with _LOCK:
        _STATE.library, _STATE.why, _STATE.done, _STATE.installed = None, "not loaded yet", False, {}
