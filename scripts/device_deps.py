"""Which Python distributions a GPU machine needs for tierlm and its device check, read from pyproject.toml.

    python scripts/device_deps.py closure            pins of every distribution the roots need (here, with PyPI)
    python scripts/device_deps.py missing PINS       the roots this interpreter lacks, as pins from PINS
    python scripts/device_deps.py missing PINS --ci  the same, plus the model libraries not at CI's version

The roots are tierlm's own requirements plus the test tools the device check runs; torch and what ships with
it (triton, nvidia-*, numpy) and MLX are never part of it: the GPU machine's torch install has its own.
"""
from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, distribution, requires, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion

REPO = Path(__file__).resolve().parent.parent
TEST_TOOLS = ["pytest", "openai", "httpx"]
# What the references and model loading depend on: with --ci these are installed at CI's version even where the
# machine has another (its transformers 5.17, say, loads an MXFP4 reference in bfloat16 where CI's loads float32).
MODEL_LIBRARIES = ["transformers", "tokenizers", "safetensors", "huggingface-hub", "xgrammar"]
# Never carried: the GPU machine's torch build brings these (and a carried copy could shadow its CUDA ones).
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|numpy|nvidia-.*|mlx.*|cuda-.*)$")
# Markers are evaluated for the device machine (Linux x86_64, CPython 3.12) whatever machine runs this.
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project_dependencies() -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the installed tierlm's metadata, extras left out
        return [r for r in requires("tierlm") or [] if "extra ==" not in r]
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def roots() -> list[Requirement]:
    reqs = [Requirement(r) for r in _project_dependencies()] + [Requirement(r) for r in TEST_TOOLS]
    return [r for r in reqs if not NEVER.match(norm(r.name))]


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(dict(TARGET, extra=e)) for e in ({""} | extras))


def closure() -> dict[str, str]:
    """name -> installed version of every root and everything it needs here (the CI install set)."""
    pins: dict[str, str] = {}
    todo = [(r.name, set(r.extras)) for r in roots()]
    while todo:
        name, extras = todo.pop()
        key = norm(name)
        if NEVER.match(key) or key in pins:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: install the CI set first (pip install -r wheels/cpu.txt)")
        pins[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if _applies(req, extras):
                todo.append((req.name, set(req.extras)))
    return dict(sorted(pins.items()))


def satisfied(req: Requirement) -> bool:
    try:
        have = version(req.name)
    except PackageNotFoundError:
        return False
    try:
        return req.specifier.contains(have, prereleases=True)
    except InvalidVersion:
        return True


def missing(pins_file: Path, ci: bool = False) -> list[str]:
    """Pins (from ``pins_file``) of the roots this interpreter lacks or has at a version the spec refuses; with
    ``ci`` also of the MODEL_LIBRARIES installed at another version than their pin."""
    pins: dict[str, Requirement] = {}
    for line in pins_file.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pins[norm(req.name)] = req
    exact = {norm(n) for n in MODEL_LIBRARIES} if ci else set()
    out = []
    for r in roots():
        pin = pins.get(norm(r.name))
        if not satisfied(r) or (norm(r.name) in exact and pin is not None and not satisfied(pin)):
            out.append(str(pin or r))
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["closure"]:
        for name, v in closure().items():
            print(f"{name}=={v}")
        return 0
    if len(argv) in (2, 3) and argv[0] == "missing" and argv[2:] in ([], ["--ci"]):
        for line in missing(Path(argv[1]), ci=argv[2:] == ["--ci"]):
            print(line)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
