"""tierlm's build: the Python packages (pyproject.toml) plus the CPU kernel libraries, one per CPU level.

setuptools stays the build backend (it maps the four code folders into tierlm.* and installs editable checkouts);
CMake builds the kernels (backends/torch/cpu/csrc/CMakeLists.txt: per-source flags for each level, -Wall, a
compile_commands.json for editors), driven by backends/torch/cpu/build.py, which the first-use build shares. The
libraries land in tierlm/backends/torch/cpu/lib (a wheel) or backends/torch/cpu/lib (an editable checkout), with
the manifest the loader checks them against.

A machine without a C/C++ compiler or cmake still installs: the build says why, and tierlm serves with torch's own
kernels (or builds its kernels on first use once a compiler is there). TIERLM_KERNELS_WERROR=1 (CI) turns compiler
warnings into errors and a level that fails to build into a failed install.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
KERNELS = "tierlm.backends.torch.cpu"  # the package the libraries belong to


def _builder():
    """backends/torch/cpu/build.py, loaded by path: tierlm itself is not installed yet."""
    spec = importlib.util.spec_from_file_location("tierlm_kernel_build", ROOT / "backends" / "torch" / "cpu" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildCpuKernels(build_ext):
    """build_ext for the kernel libraries: CMake instead of setuptools' one-module-per-extension compile."""

    def run(self) -> None:
        out = (ROOT / "backends" / "torch" / "cpu" / "lib") if self.inplace else \
            Path(self.build_lib, *KERNELS.split("."), "lib")
        werror = os.environ.get("TIERLM_KERNELS_WERROR") == "1"
        if sys.platform != "linux":
            print(f"tierlm CPU kernels: not built on {sys.platform} (Linux x86_64 / aarch64 only); torch's kernels "
                  "serve", flush=True)
            return
        builder = _builder()
        try:
            manifest = builder.build(out, Path(self.build_temp) / "cpu-kernels", werror=werror,
                                     say=lambda line: print(line, flush=True))
        except Exception as e:  # noqa: BLE001 - an install without kernels still serves (with torch's)
            if werror:
                raise
            print(f"WARNING: tierlm CPU kernels: {type(e).__name__}: {e}\nWARNING: tierlm installs without them: "
                  "torch's kernels serve until a build succeeds (tierlm doctor says what is missing)", flush=True)
            return
        if werror and manifest["failed"]:
            raise RuntimeError("tierlm CPU kernels failed to build with TIERLM_KERNELS_WERROR=1: "
                               + "; ".join(f"{k}: {v}" for k, v in manifest["failed"].items()))
        self._outputs = [str(out / lib["file"]) for lib in manifest["libraries"].values()] + \
            [str(out / builder.MANIFEST)]

    def get_outputs(self) -> list[str]:
        return list(getattr(self, "_outputs", []))

    def get_output_mapping(self) -> dict[str, str]:
        return {}


# A marker extension: it makes the wheel a platform wheel and runs build_ext; BuildCpuKernels builds the real ones.
setup(ext_modules=[Extension(f"{KERNELS}.lib", sources=[])], cmdclass={"build_ext": BuildCpuKernels})
