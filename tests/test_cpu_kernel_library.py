"""The CPU kernel libraries (backends/torch/cpu/): built per CPU level by CMake at install (build.py,
csrc/CMakeLists.txt), the best one this CPU runs loaded by its level, and nothing loaded unchecked: a library opens
only when its manifest was made from these sources against this torch, its bytes are the ones the build recorded, and
its folder is not writable by others (a cache folder: the user's own); otherwise the CPU's level is built on first
use into tierlm's cache folder, visibly."""
from __future__ import annotations

import ast
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from tierlm.backends.torch.cpu import build, library
from tierlm.backends.torch.cpu.library import LibraryRefused
from tierlm.platforms.cpu_features import apply_cap, level_names, this_cpu

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (library.INSTALLED / build.MANIFEST).exists(),
                                reason="no kernel library was built at install (pip install -e . builds them)")


def _manifest() -> dict:
    return json.loads((library.INSTALLED / build.MANIFEST).read_text())


def _copy_install(tmp_path: Path) -> Path:
    """The installed libraries and manifest in a folder of the test's own (mode 755, as pip leaves them)."""
    folder = tmp_path / "lib"
    shutil.copytree(library.INSTALLED, folder, ignore=shutil.ignore_patterns(".build-*"))
    folder.chmod(0o755)
    return folder


def test_the_process_loads_the_best_installed_level_this_cpu_runs():
    cpu = this_cpu()
    lib = library.load()
    manifest = _manifest()
    assert lib is not None, library.status()["why"]
    assert lib.level == library.best_installed_level(cpu, manifest) and lib.origin == "installed"
    levels = level_names(cpu.arch)
    assert levels.index(lib.level) <= levels.index(cpu.level)
    assert sorted(lib.kernels) == manifest["libraries"][lib.level]["kernels"]
    status = library.status()
    assert status["level"] == lib.level and status["installed"]["levels"] == sorted(manifest["libraries"])


def test_every_level_of_the_architecture_was_built_and_each_has_its_levels_kernels():
    """One library per level the architecture has (a level this CPU cannot run is built too), each with the kernels
    of the levels below it and its own: what it reports is what it was compiled with."""
    manifest = _manifest()
    arch_levels = list(level_names(this_cpu().arch))
    assert manifest["levels"] == arch_levels  # CMakeLists.txt names the levels cpu_features detects
    assert not manifest["failed"], manifest["failed"]
    have = [set(manifest["libraries"][level]["kernels"]) for level in arch_levels]
    assert all(lower <= higher for lower, higher in zip(have, have[1:]))
    if this_cpu().arch == "x86_64":
        assert "f32_gemv" not in have[0] and "f32_gemv" in have[1]  # x86-64 has no vector products
        assert {"avx512_linear", "blocked_attention"} <= have[3] - have[2]  # AVX512-BF16's own
        assert {"amx_linear", "paged_extend_amx"} == have[4] - have[3]  # the tile kernels, on the amx level only


def test_cmake_and_cpu_features_name_the_same_levels():
    text = (build.CSRC / "CMakeLists.txt").read_text()
    found = dict(re.findall(r'MATCHES "\^\((\w+)\|.*?"\)\s*\n\s*set\(ALL_LEVELS ([^)]*)\)', text))
    assert tuple(found["x86_64"].split()) == level_names("x86_64")
    assert tuple(found["aarch64"].split()) == level_names("aarch64")


def test_a_library_whose_bytes_differ_from_its_build_is_refused(tmp_path):
    folder = _copy_install(tmp_path)
    manifest = library.read_manifest(folder, own=False)
    level = library.load().level
    lib_file = folder / manifest["libraries"][level]["file"]
    data = bytearray(lib_file.read_bytes())
    data[-1] ^= 0xFF
    lib_file.write_bytes(bytes(data))
    with pytest.raises(LibraryRefused, match="SHA-256 differs"):
        library.open_level(folder, manifest, level, "test")


def test_a_folder_others_can_write_or_another_user_owns_is_refused(tmp_path, monkeypatch):
    folder = _copy_install(tmp_path)
    assert library.read_manifest(folder, own=True)["libraries"]
    folder.chmod(0o777)
    with pytest.raises(LibraryRefused, match="writable by other users"):
        library.read_manifest(folder, own=False)
    folder.chmod(0o755)
    monkeypatch.setattr(library.os, "getuid", lambda: os.stat(folder).st_uid + 4242)
    with pytest.raises(LibraryRefused, match="not to this user"):
        library.check_folder(folder, own=True)


def test_a_manifest_others_can_write_or_that_names_another_file_is_refused(tmp_path):
    folder = _copy_install(tmp_path)
    (folder / build.MANIFEST).chmod(0o664)
    with pytest.raises(LibraryRefused, match="manifest.json is writable by other users"):
        library.read_manifest(folder, own=False)
    (folder / build.MANIFEST).chmod(0o644)
    manifest = library.read_manifest(folder, own=False)
    level = library.load().level
    manifest["libraries"][level]["file"] = "../elsewhere.so"
    with pytest.raises(LibraryRefused, match="names '../elsewhere.so'"):
        library.open_level(folder, manifest, level, "installed")


def test_a_build_of_other_sources_or_for_another_torch_is_refused(tmp_path):
    folder = _copy_install(tmp_path)
    manifest = json.loads((folder / build.MANIFEST).read_text())
    for key, value, message in (("sources", "0" * 64, "other sources"), ("torch", "1.0.0+cpu", "for torch 1.0.0"),
                                ("format", 0, "another format")):
        (folder / build.MANIFEST).write_text(json.dumps({**manifest, key: value}))
        with pytest.raises(LibraryRefused, match=message):
            library.read_manifest(folder, own=False)
    # another build of the same torch release (+cpu, +cu130) has the same headers and ABI: accepted
    release = build.torch_release(manifest["torch"])
    (folder / build.MANIFEST).write_text(json.dumps({**manifest, "torch": f"{release}+cu130"}))
    assert library.read_manifest(folder, own=False)["libraries"]


def test_without_a_usable_install_this_cpus_level_is_built_on_first_use_then_cached(tmp_path, monkeypatch, caplog):
    """An editable checkout without a build (or edited since): the level is built into the cache folder from the same
    sources, logged; the next process finds it there, checked; a tampered cached library is built again."""
    cpu = apply_cap(this_cpu(), "x86-64")  # the quickest level to build
    monkeypatch.setattr(library, "INSTALLED", tmp_path / "no-build")
    monkeypatch.setattr(library, "cache_root", lambda: tmp_path / "cache" / "kernels")
    monkeypatch.setattr(library, "_OPENED", {})
    with caplog.at_level(logging.INFO, logger="tierlm.backends.torch.cpu.library"):
        lib, why = library.library_for(cpu)
    assert lib is not None and lib.level == "x86-64" and lib.origin == "built on first use", why
    assert "no build in" in why and "building the x86-64 library into" in caplog.text
    folder = library.cached_build_folder("x86-64")
    assert folder.parent.parent == tmp_path / "cache" / "kernels" and (folder.stat().st_mode & 0o077) == 0
    assert json.loads((folder / build.MANIFEST).read_text())["sources"] == build.sources_hash()
    assert not list(folder.glob(".build-*")) and not list(folder.parent.parent.glob(".build-*"))
    again, _ = library.library_for(cpu)
    assert again.origin == "cached first-use build"
    cached = folder / build.library_file("x86-64")
    swapped = folder / "swapped"  # another file put in its place (never rewritten in place: this process maps it)
    swapped.write_bytes(cached.read_bytes() + b"\0")
    os.replace(swapped, cached)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierlm.backends.torch.cpu.library"):
        rebuilt, _ = library.library_for(cpu)
    assert rebuilt.origin == "built on first use" and "SHA-256 differs" in caplog.text


def test_no_cmake_or_switched_off_means_no_library_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(library, "INSTALLED", tmp_path / "no-build")
    monkeypatch.setattr(library, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(build, "find_tool", lambda name: None)
    lib, why = library.library_for(this_cpu())
    assert lib is None and "cmake was not found: install it (pip install cmake" in why
    monkeypatch.setenv("TIERLM_CPU_KERNELS", "0")
    assert library.library_for(this_cpu()) == (None, "TIERLM_CPU_KERNELS=0")


def test_kernels_are_c_sources_never_strings_in_python():
    """The C/C++ lives in csrc/ (every file a real source: a compiler, -Wall and a formatter see it); no Python
    module of the project holds C in a string."""
    offenders = []
    for folder in ("backends", "platforms", "runtime", "server", "tierlm"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        re.search(r"#include\s*[<\"]|\bstatic inline\b|__m512", node.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
    sources = {p.name for p in build.CSRC.iterdir()}
    assert {"CMakeLists.txt", "kernels.h", "registry.c", "torch_ops.cpp"} <= sources


def test_the_install_builds_against_the_torch_the_install_sets_pin():
    """The torch ops are compiled against torch's headers in pip's build environment: the torch the install sets pin,
    or every install would rebuild them on first use (a manifest for another torch is refused)."""
    import tomllib

    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    pinned = [r.split(";")[0].strip() for r in requires if r.startswith("torch")]
    for name in ("cpu.txt", "apple-silicon.txt"):
        sets = (ROOT / "wheels" / name).read_text().splitlines()
        assert any(line.split(";")[0].strip() in pinned for line in sets if line.startswith("torch==")), name
    manifest = _manifest()
    if os.environ.get("TIERLM_KERNELS_WERROR") == "1":  # CI: every level built with -Wall -Werror
        assert manifest["werror"] is True


def test_the_constants_the_torch_ops_copy_are_the_python_sides():
    """torch_ops.cpp serves the Python op's cases only where its limits are the Python side's: each constant it
    copies names its source (``// module.NAME``), and the values agree."""
    import importlib

    found = re.findall(r"constexpr int64_t k\w+ = ([^;]+);\s*// (\w+)\.(\w+)", (build.CSRC / "torch_ops.cpp").read_text())
    assert len(found) == 4
    for value, module, name in found:
        assert eval(value) == getattr(importlib.import_module(f"tierlm.backends.torch.cpu.{module}"), name), name
    rows = re.search(r"#define BS_QR (\d+)", (build.CSRC / "blocked_attention.c").read_text())
    assert int(rows.group(1)) == importlib.import_module("tierlm.backends.torch.cpu.blocked_one_pass").ROWS


def test_without_torch_headers_or_a_cpp_compiler_the_kernels_build_without_the_torch_ops(tmp_path):
    """A machine with gcc but no g++ (or a build where torch does not import) still gets every C kernel; the library
    says it has no torch ops, and the plan then calls the kernels from Python in compiled steps."""
    from tierlm.platforms import cpu_plan

    (tmp_path / "lib").mkdir(mode=0o775)  # a umask of 002 (Ubuntu's default for users): the build takes group write
    os.chmod(tmp_path / "lib", 0o775)
    manifest = build.build(tmp_path / "lib", tmp_path / "tree", ["x86-64"], torch_info=None, say=lambda _: None)
    assert (tmp_path / "lib").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "lib" / build.MANIFEST).stat().st_mode & 0o777 == 0o644
    assert manifest["torch"] is None and manifest["torch_ops"].startswith("no torch headers")
    kernels = set(manifest["libraries"]["x86-64"]["kernels"])
    assert "paged_decode" in kernels and "torch_ops" not in kernels
    lib = library.open_level(tmp_path / "lib", library.read_manifest(tmp_path / "lib", own=True), "x86-64", "test")
    assert not hasattr(lib, "tierlm_register_torch_ops") and lib.tierlm_vector_bits() == 0
    facts = cpu_plan.LibraryFacts("x86-64", lib.kernels, "test")
    plan = cpu_plan.decide(apply_cap(this_cpu(), "x86-64"), cpu_plan.ModelFacts("float32", "float32", 8, 4, 64), facts,
                           {})
    assert plan.compiled_ops.value == "python" and plan.decode_attention.value == "paged"


def test_a_level_the_compiler_cannot_build_on_first_use_gives_way_to_the_one_below(monkeypatch):
    """An AMX machine whose gcc is older than 11 (no -mamx-tile) still gets the avx512_bf16 library built."""
    tried = []

    def build_level(level):
        tried.append(level)
        if level == "avx2":
            raise build.BuildError("the avx2 library is not built: the compiler does not take -march=x86-64-v3")
        return level

    monkeypatch.setattr(library, "build_on_first_use", build_level)
    assert library.first_use(apply_cap(this_cpu(), "avx2")) == "x86-64" and tried == ["avx2", "x86-64"]
    tried.clear()
    monkeypatch.setattr(library, "build_on_first_use", lambda level: (tried.append(level), (_ for _ in ()).throw(
        build.NoCmake("cmake was not found: install it")))[1])
    with pytest.raises(build.BuildError, match="avx2: cmake was not found"):
        library.first_use(apply_cap(this_cpu(), "avx2"))
    assert tried == ["avx2"]  # no cmake: no lower level would build either
