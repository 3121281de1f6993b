"""What the tests of tierlm's x86 vector kernels with AVX-512 and AVX2 code share (tests/test_cpu_int8_gemv.py,
tests/test_cpu_f32_gemv.py): a fresh build into a test folder, at this CPU's level or one capped below it."""
from __future__ import annotations

import pytest

from tierlm.backends.torch.c_kernel_build import KernelBuild
from tierlm.platforms import cpu_features
from tierlm.platforms.cpu_features import CpuFeatures, apply_cap, this_cpu


def fresh_build(kernel_module, monkeypatch, tmp_path, cpu: CpuFeatures) -> KernelBuild:
    """``kernel_module``'s build for ``cpu``, compiled into ``tmp_path`` (not the shared cache)."""
    monkeypatch.setattr(kernel_module, "default_cache_dir", lambda: tmp_path)
    return kernel_module._load(cpu)


def build_at_level(kernel_module, level: str, monkeypatch, tmp_path) -> KernelBuild:
    """The build for this CPU capped at ``level`` (skips where the CPU cannot run that level's code); asserts it
    built for that level."""
    cpu = this_cpu()
    levels = cpu_features.level_names(cpu.arch)
    if levels.index(cpu.level) < levels.index(level):
        pytest.skip(f"this CPU's level is {cpu.level}: it cannot run the {level} code")
    build = fresh_build(kernel_module, monkeypatch, tmp_path, apply_cap(cpu, level))
    assert build.lib is not None and build.level == level, build.why
    return build
