"""What the tests of tierlm's x86 vector kernels with AVX-512 and AVX2 code share (tests/test_cpu_int8_gemv.py,
tests/test_cpu_f32_gemv.py, tests/test_cpu_16bit_stored_weights.py): one CPU level's kernel library as the install
built it (backends/torch/cpu/library.py ``load_level``), at this CPU's level or one below it."""
from __future__ import annotations

import pytest

from tierlm.backends.torch.cpu import library
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.platforms.cpu_features import level_names, this_cpu


def library_at_level(level: str) -> KernelLibrary:
    """``level``'s library (skips where this CPU, after a TIERLM_CPU_ISA cap, cannot run that level's code); asserts
    it is built for that level. A library that fails to load fails the test: the install builds every level."""
    cpu = this_cpu()
    levels = level_names(cpu.arch)
    if level not in levels:
        pytest.skip(f"{level} is not a CPU level of {cpu.arch} ({', '.join(levels) or 'none'})")
    if levels.index(cpu.level) < levels.index(level):
        pytest.skip(f"this CPU's level is {cpu.level}: it cannot run the {level} code")
    lib = library.load_level(level)
    assert lib.level == level, lib.describe()
    return lib
