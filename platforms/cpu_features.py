"""What this CPU can run, read once from /proc/cpuinfo, and the one switch that rules instructions out.

Every CPU kernel choice reads ``CpuFeatures``: the CPU execution plan (platforms/cpu_plan.py: oneDNN's bf16
prepacking, the decode-product kernels, the attention paths), which level's kernel library loads
(backends/torch/cpu/library.py), whether ``--dtype auto`` serves bf16 (backends/dtypes), and how many threads
torch gets (SMT siblings counted once).

Instruction sets come in ordered *levels* per architecture (x86_64: x86-64 < avx2 < avx512 < avx512_bf16 < amx;
aarch64: neon < dotprod < bf16 < sve < sve2). ``TIERLM_CPU_ISA=<level>`` caps the machine at that level: every
flag above it is dropped before any decision, so an AMX machine runs the AVX2 path (CI, or a user ruling a kernel
out). A cap can only remove instructions, never add ones the CPU lacks (that would be SIGILL).

Decisions are pure functions of the flags, so tests replay recorded cpuinfo texts of real machines
(tests/data/cpuinfo/) without having them.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass, field
from typing import Any, Mapping

log = logging.getLogger(__name__)

ISA_ENV = "TIERLM_CPU_ISA"
_CPUINFO = "/proc/cpuinfo"

# Per architecture: (level, flags the level adds, flags a CPU needs to be at that level), lowest first.
# Flags of a level are dropped when the cap is below it. Flags no level names (vendor extras) are kept.
X86_LEVELS: tuple[tuple[str, frozenset[str], frozenset[str]], ...] = (
    ("x86-64", frozenset({"sse", "sse2", "sse3", "ssse3", "sse4_1", "sse4_2", "popcnt"}), frozenset()),
    ("avx2", frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}), frozenset({"avx2", "fma"})),
    ("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512ifma",
                          "avx512vbmi", "avx512_vbmi2", "avx512_fp16"}),
     frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    # VEX-coded newcomers (avx_vnni, avx_ne_convert) sit with bf16: no AVX2-only or plain AVX-512 part has them.
    ("avx512_bf16", frozenset({"avx512_bf16", "avx_vnni", "avx_ne_convert", "avx_vnni_int8"}),
     frozenset({"avx512_bf16"})),
    ("amx", frozenset({"amx_bf16", "amx_int8", "amx_tile", "amx_fp16"}), frozenset({"amx_bf16", "amx_tile"})),
)
ARM_LEVELS: tuple[tuple[str, frozenset[str], frozenset[str]], ...] = (
    ("neon", frozenset({"fp", "asimd"}), frozenset()),
    ("dotprod", frozenset({"asimddp", "asimdhp", "fphp"}), frozenset({"asimddp"})),
    ("bf16", frozenset({"bf16", "i8mm"}), frozenset({"bf16"})),
    ("sve", frozenset({"sve", "svebf16", "svei8mm"}), frozenset({"sve"})),
    ("sve2", frozenset({"sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4"}), frozenset({"sve2"})),
)
LEVELS = {"x86_64": X86_LEVELS, "aarch64": ARM_LEVELS}

# Arm's CPU part numbers (implementer 0x41): aarch64 cpuinfo has no model name line.
ARM_PARTS = {"0xd0c": "Neoverse-N1", "0xd40": "Neoverse-V1", "0xd49": "Neoverse-N2", "0xd4f": "Neoverse-V2",
             "0xd84": "Neoverse-V3", "0xd8e": "Neoverse-N3", "0xd85": "Cortex-X925", "0xd87": "Cortex-A725"}


# What the cap also tells torch's own kernels (ATen's vectorized ops, oneDNN), so a capped x86 process runs the
# lower level all the way down: ATen dispatches at its capability, oneDNN refuses instructions above its maximum
# (with ONEDNN_MAX_CPU_ISA=AVX2 torch rejects the bf16 weight reorder exactly as on an AVX2-only CPU).
TORCH_ISA_ENV = {
    "x86-64": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}


class CpuIsaError(ValueError):
    """TIERLM_CPU_ISA names no level of this architecture; the message lists the valid ones."""


@dataclass(frozen=True)
class CpuFeatures:
    arch: str  # "x86_64" | "aarch64" | other as reported
    flags: frozenset[str] = frozenset()  # the cpuinfo flags/Features after the cap
    model_name: str = ""
    physical_cores: int = 0  # distinct (package, core) pairs; 0: cpuinfo does not say
    cap: str | None = None  # the TIERLM_CPU_ISA level applied, when it removed something or was asked for
    dropped: tuple[str, ...] = field(default=())  # flags the cap removed (what the cap ruled out, for the log)

    # --- levels ---
    @property
    def level(self) -> str:
        """The highest level whose required flags are all present ("unknown" off x86_64/aarch64)."""
        levels = LEVELS.get(self.arch)
        if not levels:
            return "unknown"
        best = levels[0][0]
        for name, _adds, needs in levels:
            if needs <= self.flags:
                best = name
            else:
                break
        return best

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    # --- decisions every CPU kernel reads ---
    @property
    def native_bf16(self) -> str | None:
        """The bf16 matmul instructions, best first (amx_bf16, avx512_bf16; aarch64 bf16), or None."""
        if self.arch == "x86_64":
            return next((f for f in ("amx_bf16", "avx512_bf16") if f in self.flags), None)
        if self.arch == "aarch64" and "bf16" in self.flags:
            return "bf16"
        return None

    @property
    def onednn_bf16_prepack(self) -> tuple[bool, str]:
        """(whether oneDNN's bf16 weight reorder runs here, why). torch refuses it without avx_ne_convert or
        avx512bw+vl+dq ("mkldnn_reorder_linear_weight: bf16 path needs ..."); aarch64 builds route bf16 linears
        through Arm Compute Library, whose prepacked path tierlm has not measured, so plain F.linear runs there."""
        if self.arch != "x86_64":
            return False, f"{self.arch}: torch's plain bf16 linear (oneDNN prepacking is used on x86 only)"
        if self.has("avx512bw", "avx512vl", "avx512dq"):
            return True, "oneDNN-prepacked bf16 weights (AVX-512 BW/VL/DQ)"
        if "avx_ne_convert" in self.flags:
            return True, "oneDNN-prepacked bf16 weights (AVX-NE-CONVERT)"
        return False, ("torch's plain bf16 linear: oneDNN's bf16 prepacking needs AVX-512 BW/VL/DQ or "
                       "AVX-NE-CONVERT, which this CPU lacks")

    def to_dict(self) -> dict[str, Any]:
        prepack, prepack_why = self.onednn_bf16_prepack
        known = sorted(self.flags & known_flags(self.arch))
        return {"arch": self.arch, "model_name": self.model_name, "level": self.level, "features": known,
                "native_bf16": self.native_bf16, "onednn_bf16_prepack": prepack, "onednn_bf16_prepack_why": prepack_why,
                "physical_cores": self.physical_cores or None, "cap": self.cap, "cap_dropped": list(self.dropped)}


def known_flags(arch: str) -> frozenset[str]:
    """Every flag some level of ``arch`` names: the ones tierlm's decisions read (what Facts records)."""
    return frozenset().union(*(adds | needs for _n, adds, needs in LEVELS.get(arch, ())))


def level_names(arch: str) -> tuple[str, ...]:
    return tuple(name for name, _a, _n in LEVELS.get(arch, ()))


def parse_cpuinfo(text: str, arch: str) -> CpuFeatures:
    """The features in /proc/cpuinfo text: x86's ``flags`` line, aarch64's ``Features`` line (every core lists the
    same; the first is read), the model name, and physical cores from (physical id, core id) pairs."""
    flags: frozenset[str] | None = None
    model = ""
    cores: set[tuple[str, str]] = set()
    package = core = ""
    for line in text.splitlines() + [""]:
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key in ("flags", "features") and flags is None:
            flags = frozenset(value.lower().split())
        elif key == "model name" and not model:
            model = value
        elif key == "cpu part" and not model and value.lower() in ARM_PARTS:
            model = f"Arm {ARM_PARTS[value.lower()]}"
        elif key == "physical id":
            package = value
        elif key == "core id":
            core = value
        elif not key:  # a blank line ends one processor's block
            if core:
                cores.add((package, core))
            package = core = ""
    return CpuFeatures(arch=arch, flags=flags or frozenset(), model_name=model, physical_cores=len(cores))


def apply_cap(features: CpuFeatures, cap: str | None) -> CpuFeatures:
    """Drop every flag above level ``cap`` (TIERLM_CPU_ISA); unknown levels raise CpuIsaError with the valid ones."""
    cap = (cap or "").strip().lower()
    if cap in ("", "auto", "native"):
        return features
    levels = LEVELS.get(features.arch)
    names = level_names(features.arch)
    if not levels or cap not in names:
        valid = ", ".join(names) if names else "none on this architecture"
        raise CpuIsaError(f"{ISA_ENV}={cap!r} names no {features.arch} instruction level; use one of: {valid} "
                          "(or auto)")
    above = frozenset().union(*(adds | needs for _name, adds, needs in levels[names.index(cap) + 1:]))
    dropped = tuple(sorted(features.flags & above))
    return CpuFeatures(arch=features.arch, flags=features.flags - above, model_name=features.model_name,
                       physical_cores=features.physical_cores, cap=cap, dropped=dropped)


def torch_env_for_cap(env: Mapping[str, str]) -> dict[str, str]:
    """The ATen/oneDNN variables that carry TIERLM_CPU_ISA into torch, for those the user has not set. Must be
    applied before torch is imported (the entry points do it first thing)."""
    cap = (env.get(ISA_ENV) or "").strip().lower()
    return {k: v for k, v in TORCH_ISA_ENV.get(cap, {}).items() if not env.get(k)}


def read_cpuinfo(path: str = _CPUINFO) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def normalize_arch(machine: str) -> str:
    m = machine.lower()
    if m in ("x86_64", "amd64", "x64"):
        return "x86_64"
    if m in ("aarch64", "arm64", "armv8", "armv8l"):
        return "aarch64"
    return m or "unknown"


def detect_cpu(env: Mapping[str, str] | None = None, cpuinfo: str | None = None,
               machine: str | None = None) -> CpuFeatures:
    """This machine's features with ``TIERLM_CPU_ISA`` applied (raises CpuIsaError on a bad value)."""
    env = os.environ if env is None else env
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    features = parse_cpuinfo(text, normalize_arch(machine or platform.machine()))
    return apply_cap(features, env.get(ISA_ENV))


def detect_cpu_or_error(cpuinfo: str | None = None, machine: str | None = None) -> tuple[CpuFeatures, str | None]:
    """``detect_cpu`` that never raises: a bad TIERLM_CPU_ISA gives the uncapped machine and the error's text."""
    try:
        return detect_cpu(cpuinfo=cpuinfo, machine=machine), None
    except CpuIsaError as e:
        return detect_cpu(env={}, cpuinfo=cpuinfo, machine=machine), str(e)


@functools.lru_cache(maxsize=1)
def this_cpu() -> CpuFeatures:
    """The process-wide view every kernel choice reads (read once; a bad TIERLM_CPU_ISA stops ``tierlm serve`` at
    the platform decision and is an error in ``tierlm doctor``; here it falls back to the uncapped machine)."""
    cpu, error = detect_cpu_or_error()
    if error:
        log.warning("%s; using the machine's own level", error)
    if cpu.cap:
        log.info("CPU capped at %s by %s: %s ruled out", cpu.cap, ISA_ENV, " ".join(cpu.dropped) or "nothing")
    return cpu


__all__ = ["CpuFeatures", "CpuIsaError", "ISA_ENV", "apply_cap", "detect_cpu", "detect_cpu_or_error", "known_flags",
           "level_names", "normalize_arch", "parse_cpuinfo", "this_cpu", "torch_env_for_cap"]
