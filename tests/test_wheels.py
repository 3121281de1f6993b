"""Every wheels/ install set parses and carries the indexes and markers its platform needs."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from tierlm.platforms.install_commands import INSTALL_SETS

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / "wheels"
TORCH = "2.13.0"
PYTORCH_INDEX = "https://download.pytorch.org/whl/"
ALLOWED_OPTIONS = {"--index-url", "--extra-index-url", "-e"}

# pip's marker environments of the target machines.
LINUX_X86 = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
LINUX_ARM = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64"}
WINDOWS_X86 = {"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64"}
MAC_ARM = {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"}
MAC_X86 = {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "x86_64"}


def parse_set(path: Path) -> tuple[dict[str, list[str]], dict[str, Requirement]]:
    """(options by name, requirements by name); fails on any line pip would not read as intended."""
    options: dict[str, list[str]] = {}
    reqs: dict[str, Requirement] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        assert not line.endswith("\\"), f"{path.name}:{n}: no line continuations, keep one requirement a line"
        if line.startswith("-"):
            name, _, value = line.partition(" ")
            name, _, inline = name.partition("=")
            assert name in ALLOWED_OPTIONS, f"{path.name}:{n}: unexpected option {name}"
            value = (inline or value).strip()
            assert value and len(shlex.split(value)) == 1, f"{path.name}:{n}: {name} needs exactly one value"
            options.setdefault(name, []).append(value)
            continue
        req = Requirement(line)  # raises InvalidRequirement on bad syntax
        assert req.name not in reqs, f"{path.name}:{n}: {req.name} listed twice"
        reqs[req.name] = req
    return options, reqs


def applies(req: Requirement, env: dict[str, str]) -> bool:
    return req.marker is None or req.marker.evaluate({**default_environment(), **env})


SETS = sorted(WHEELS.glob("*.txt"))


def test_the_install_sets_are_exactly_the_ones_the_platform_layer_names():
    assert {str(p.relative_to(REPO)) for p in SETS} == set(INSTALL_SETS.values())


@pytest.mark.parametrize("path", SETS, ids=lambda p: p.name)
def test_set_parses_and_installs_tierlm_itself(path):
    options, reqs = parse_set(path)
    (editable,) = options["-e"]
    assert editable == "." or editable.startswith(".["), "tierlm itself, from the repository root"
    assert "tierlm" not in reqs
    assert "--index-url" not in options, "keep PyPI as the main index: tierlm's other dependencies live there"
    torch = reqs["torch"]
    assert [s.operator for s in torch.specifier] == ["=="], "torch is pinned per platform"
    assert next(iter(torch.specifier)).version.split("+")[0] == TORCH


def test_cpu_set_is_cpu_torch_plus_mlx_on_linux():
    options, reqs = parse_set(WHEELS / "cpu.txt")
    assert options["--extra-index-url"] == [PYTORCH_INDEX + "cpu"]
    assert str(reqs["torch"].specifier) == f"=={TORCH}"  # matches the local +cpu wheel and the CPU index's build
    for env in (LINUX_X86, LINUX_ARM):
        assert applies(reqs["torch"], env)
        assert applies(reqs["mlx"], env) and applies(reqs["mlx-lm"], env)
    assert "cpu" in reqs["mlx"].extras, "mlx needs its CPU backend on Linux"
    assert not applies(reqs["mlx"], WINDOWS_X86) and not applies(reqs["mlx"], MAC_X86)
    assert "test" in parse_set(WHEELS / "cpu.txt")[0]["-e"][0], "CI installs this set and runs pytest"


@pytest.mark.parametrize("name, machine, wrong", [
    ("nvidia-x86_64-cu130.txt", LINUX_X86, [LINUX_ARM, MAC_ARM]),
    ("nvidia-arm64-cu130.txt", LINUX_ARM, [LINUX_X86, WINDOWS_X86, MAC_ARM]),
])
def test_nvidia_sets_take_cu130_torch_for_their_architecture(name, machine, wrong):
    options, reqs = parse_set(WHEELS / name)
    assert options["--extra-index-url"] == [PYTORCH_INDEX + "cu130"]
    torch = reqs["torch"]
    assert str(torch.specifier) == f"=={TORCH}+cu130", "the +cu130 pin can only come from the cu130 index"
    assert applies(torch, machine)
    for env in wrong:
        assert not applies(torch, env)
    assert "mlx" not in reqs


def test_nvidia_x86_64_set_also_serves_windows():
    _, reqs = parse_set(WHEELS / "nvidia-x86_64-cu130.txt")
    assert applies(reqs["torch"], WINDOWS_X86)


def test_apple_set_is_mlx_without_any_cuda_index():
    options, reqs = parse_set(WHEELS / "apple-silicon.txt")
    assert "--extra-index-url" not in options, "PyPI only: no CUDA (or any other) torch index on a Mac"
    for name in ("mlx", "mlx-lm"):
        assert applies(reqs[name], MAC_ARM)
        assert not applies(reqs[name], MAC_X86) and not applies(reqs[name], LINUX_X86)
    assert "+" not in str(reqs["torch"].specifier), "PyPI's macOS torch, no local build tag"
    assert applies(reqs["torch"], MAC_ARM) and not applies(reqs["torch"], LINUX_X86)


def test_mlx_pins_agree_across_sets():
    cpu, apple = parse_set(WHEELS / "cpu.txt")[1], parse_set(WHEELS / "apple-silicon.txt")[1]
    for name in ("mlx", "mlx-lm"):
        assert str(cpu[name].specifier) == str(apple[name].specifier)


@pytest.mark.parametrize("path", sorted(INSTALL_SETS.values()))
def test_install_doc_gives_each_sets_command(path):
    assert f"pip install -r {path}" in (REPO / "docs" / "install.md").read_text()


def test_this_environment_satisfies_the_cpu_set():
    """pip reads cpu.txt and finds every pin already installed here (offline: no index is contacted)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "-r", "wheels/cpu.txt"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Would install torch" not in out.stdout and "Would install mlx" not in out.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not available")
def test_wheelhouse_script_is_valid_bash():
    script = WHEELS / "build_wheelhouse.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "--no-index --find-links" in script.read_text()


def test_every_code_folder_is_a_listed_package():
    """pyproject lists the packages by hand (the code folders map into tierlm.*): a folder left out works in an
    editable install and is missing from a built wheel."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"tierlm"}
    for top in ("runtime", "backends", "platforms", "server"):
        for init in (root / top).rglob("__init__.py"):
            found.add(".".join(["tierlm", *init.parent.relative_to(root).parts]))
    assert listed == found
