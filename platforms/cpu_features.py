"""What this CPU can run, read once from /proc/cpuinfo, and the one switch that rules instructions out.

Every CPU kernel choice reads ``CpuFeatures``: whether oneDNN's bf16 weight prepacking runs (cpu_linear), which
instruction level the C decode kernel is compiled for (cpu_paged_decode), whether ``--dtype auto`` serves bf16
(backends/dtypes), and how many threads torch gets (SMT siblings counted once).

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
import shutil
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

# gcc/clang target flags per level: the C kernels use exactly the level's instructions (never -march=native, so a
# build cached in a shared home folder runs on any CPU of that level).
COMPILE_FLAGS = {
    "x86-64": ("-march=x86-64",),
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16"),
    "amx": ("-march=x86-64-v4", "-mavx512bf16"),  # the decode kernel has no tile code: AMX adds nothing to it
    "neon": ("-march=armv8-a",),
    "dotprod": ("-march=armv8.2-a+dotprod+fp16",),
    "bf16": ("-march=armv8.6-a",),  # 8.6 includes bf16 and i8mm
    "sve": ("-march=armv8.6-a+sve",),
    "sve2": ("-march=armv9-a+bf16+i8mm",),
}


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

    @property
    def compile_flags(self) -> tuple[str, ...]:
        """gcc/clang target flags for this level's C kernels (() where the architecture is not known)."""
        return COMPILE_FLAGS.get(self.level, ())

    def to_dict(self) -> dict[str, Any]:
        prepack, prepack_why = self.onednn_bf16_prepack
        known = sorted(self.flags & known_flags(self.arch))
        return {"arch": self.arch, "model_name": self.model_name, "level": self.level, "features": known,
                "native_bf16": self.native_bf16, "onednn_bf16_prepack": prepack, "onednn_bf16_prepack_why": prepack_why,
                "physical_cores": self.physical_cores or None, "cap": self.cap, "cap_dropped": list(self.dropped)}


PREFILL_ATTENTION_ENV = "TIERLM_CPU_PREFILL_ATTENTION"
PREFILL_ATTENTION_CHOICES = ("auto", "blocked", "sdpa")


def bf16_prefill_attention(cpu: CpuFeatures, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """("blocked" | "sdpa", why): which kernel runs bf16 prefill and extend attention on this CPU. torch's fused SDPA
    (flash) kernel multiplies on AMX tiles where the CPU has them: a 2016-token causal llama-small layer took 23 ms
    there against 74 ms through the blocked path (backends/torch/cpu_blocked_attention.py). Without AMX it ran
    bf16 at ~30 GFLOP/s, and the blocked path (oneDNN bf16 GEMMs + a C softmax) was 2.6x faster (63.6 vs 24.3 ms
    on AVX512-BF16; AVX2 and Arm are not measured and keep the blocked path).
    TIERLM_CPU_PREFILL_ATTENTION=blocked|sdpa overrides (a TIERLM_CPU_ISA cap below amx also rules AMX out, for torch
    as well). Raises ValueError for another value."""
    choice = ((env if env is not None else os.environ).get(PREFILL_ATTENTION_ENV) or "auto").strip().lower()
    if choice not in PREFILL_ATTENTION_CHOICES:
        raise ValueError(f"{PREFILL_ATTENTION_ENV}={choice!r} is not one of {', '.join(PREFILL_ATTENTION_CHOICES)}; "
                         "unset it to let tierlm choose")
    if choice != "auto":
        return choice, f"{PREFILL_ATTENTION_ENV}={choice}"
    if cpu.arch == "x86_64" and cpu.has("amx_bf16", "amx_tile"):
        return "sdpa", "it multiplies on AMX tiles here: ~3x the blocked path"
    return "blocked", "torch's fused SDPA ran bf16 ~2.6x slower without AMX (measured on AVX512-BF16)"


def int8_weights(weight_format: str) -> bool:
    """Whether a weight format's linears are tierlm's int8 weight-only layers, the ones backends/torch/cpu_int8_gemv.py
    serves: --torchao-config int8wo on tierlm's CPU path (its label carries "+embedding"; plain "torchao:int8wo" is
    torchao's own path) and compressed-tensors int8 per-channel symmetric checkpoints (w8a8-int8, w8a16-channel;
    grouped or asymmetric int8 loads dequantized)."""
    if weight_format.startswith("checkpoint:compressed-tensors-"):
        scheme = weight_format.removeprefix("checkpoint:compressed-tensors-")
        return "-asym" not in scheme and (scheme == "w8a8-int8" or scheme.startswith(("w8a16-channel",
                                                                                         "w8int-channel-")))
    return weight_format == "torchao:int8wo+embedding"


AMX_LINEAR_ENV = "TIERLM_CPU_AMX_LINEAR"


def amx_linear_decision(cpu: CpuFeatures, env: Mapping[str, str]) -> tuple[bool, str]:
    """(whether bf16 products of up to 32 rows may run on tierlm's AMX kernel over oneDNN's packed weight, why not):
    x86 with AMX-BF16, not ruled out by TIERLM_CPU_AMX_LINEAR=0, and oneDNN itself not capped below AMX (its own
    products would not be tile products then: backends/torch/cpu_amx_linear.py)."""
    if env.get(AMX_LINEAR_ENV, "1") == "0":
        return False, f"off ({AMX_LINEAR_ENV}=0)"
    if cpu.arch != "x86_64" or not cpu.has("amx_bf16", "amx_tile"):
        return False, "no AMX-BF16 on this CPU"
    onednn_cap = env.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if onednn_cap not in ("", "ALL", "DEFAULT") and "AMX" not in onednn_cap:
        return False, f"ONEDNN_MAX_CPU_ISA={onednn_cap} rules AMX out of oneDNN"
    return True, "AMX-BF16"


AVX512_LINEAR_ENV = "TIERLM_CPU_AVX512_LINEAR"


def avx512_linear_decision(cpu: CpuFeatures, env: Mapping[str, str]) -> tuple[bool, str]:
    """(whether bf16 products of up to 32 rows may run on tierlm's AVX512-BF16 kernel over oneDNN's packed weight,
    why not): x86 with AVX512-BF16 whose oneDNN products are AVX512-BF16 dot products too (no AMX, or oneDNN capped
    below it; not capped below AVX512_CORE_BF16), not ruled out by TIERLM_CPU_AVX512_LINEAR=0
    (backends/torch/cpu_avx512_linear.py)."""
    if env.get(AVX512_LINEAR_ENV, "1") == "0":
        return False, f"off ({AVX512_LINEAR_ENV}=0)"
    if cpu.arch != "x86_64" or not cpu.has("avx512_bf16", "avx512bw", "avx512vl"):
        return False, "no AVX512-BF16 on this CPU"
    onednn_cap = env.get("ONEDNN_MAX_CPU_ISA", "").upper()
    uncapped = onednn_cap in ("", "ALL", "DEFAULT")
    if not uncapped and not any(t in onednn_cap for t in ("BF16", "FP16", "AMX", "AVX10")):
        return False, f"ONEDNN_MAX_CPU_ISA={onednn_cap} rules AVX512-BF16 out of oneDNN"
    if cpu.has("amx_bf16", "amx_tile") and (uncapped or "AMX" in onednn_cap):
        return False, "oneDNN multiplies on AMX tiles here (cpu_amx_linear.py reads its layout)"
    return True, "AVX512-BF16"


def cpu_kernel_plan(cpu: CpuFeatures, dtype: str, kv_dtype: str, compiler: str | None,
                    weight_format: str = "none", env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Which kernel each layer type of the torch backend will run on this CPU, before any model loads (for
    `tierlm doctor`; a running server reports what it set up, backends/torch/kernel_report.py). The rules are the
    backend's: prepacked bf16 linears where oneDNN's reorder runs (decode-sized products on tierlm's AMX kernel
    where ``amx_linear_decision`` allows), int8 weights through the C streaming kernel on
    x86 with AVX2 or AVX-512 (TIERLM_CPU_INT8_GEMV=0 rules it out), the C decode kernel for bf16 or float32 pages
    of the model's own dtype where a C compiler exists (TIERLM_CPU_PAGED_DECODE=0 rules it out), bf16 prefill
    attention as ``bf16_prefill_attention`` chooses (TIERLM_CPU_PREFILL_ATTENTION), float32 extends over cached pages
    on the C extend kernel on x86 with AVX2 or AVX-512 (the same library and switch as the decode kernel)."""
    if int8_weights(weight_format):
        prefill = "; bf16 prefill through oneDNN on the weight widened to bf16" if dtype == "bfloat16" else ""
        if (env or {}).get("TIERLM_CPU_INT8_GEMV", "1") == "0":
            why = "TIERLM_CPU_INT8_GEMV=0"
        elif dtype not in ("bfloat16", "float32"):
            why = f"the C kernel takes bfloat16 or float32 activations, not {dtype}"
        elif cpu.arch != "x86_64" or not cpu.has("avx2", "fma") or compiler is None:
            why = "the C kernel needs x86 AVX2 and a C compiler"
        else:
            why = ""
        linear = (f"int8 weight-only: torch _weight_int8pack_mm ({why}){prefill}" if why else
                  f"int8 weight-only: C streaming kernel for decode rows, built with {compiler} for {cpu.level}"
                  f"{prefill}")
    elif dtype == "bfloat16":
        prepack, why = cpu.onednn_bf16_prepack
        linear = why if prepack else why.replace("torch's plain bf16 linear", "torch F.linear bfloat16")
        if prepack and compiler is not None and amx_linear_decision(cpu, env or {})[0]:
            linear += f"; up to 32 rows on tierlm's AMX kernel over the packed weight, built with {compiler}"
        elif prepack and compiler is not None and avx512_linear_decision(cpu, env or {})[0]:
            linear += f"; up to 32 rows on tierlm's AVX512-BF16 kernel over the packed weight, built with {compiler}"
    else:
        linear = f"torch F.linear {dtype} (oneDNN/MKL GEMM)"
    kernels_off = (env or {}).get("TIERLM_CPU_PAGED_DECODE", "1") == "0"  # the C library of both attentions
    if dtype not in ("bfloat16", "float32") or kv_dtype != dtype:
        decode = f"torch over gathered pages (the C kernel reads {dtype} queries over {dtype} pages only)"
    elif kernels_off:
        decode = "torch over gathered pages (TIERLM_CPU_PAGED_DECODE=0)"
    elif compiler is None:
        decode = "torch over gathered pages (no C compiler: cc/gcc/clang)"
    else:
        decode = f"C paged kernel, built with {compiler} for {cpu.level} ({' '.join(cpu.compile_flags) or 'plain'})"
    prefill = "torch SDPA"
    if dtype == "bfloat16":  # whatever the pages: fp8 ones are dequantized to bf16 before attention
        choice, why = bf16_prefill_attention(cpu, env or {})
        prefill = f"torch SDPA ({why})" if choice == "sdpa" else \
            "torch SDPA (TIERLM_CPU_PAGED_DECODE=0)" if kernels_off else \
            "torch SDPA (no C compiler: cc/gcc/clang)" if compiler is None else \
            f"blocked bf16 GEMMs + C row softmax ({why}), built with {compiler} for {cpu.level}"
    elif dtype == "float32" and kv_dtype == dtype and not kernels_off and compiler is not None and \
            cpu.arch == "x86_64" and cpu.has("avx2", "fma"):
        prefill = f"torch SDPA; short extends: C float32 paged extend kernel, built with {compiler} for {cpu.level}"
    return {"linear": linear, "prefill_attention": prefill, "decode_attention": decode}


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


def find_c_compiler(env: Mapping[str, str]) -> str | None:
    """The C compiler the CPU kernels are built with: $CC, else cc, gcc, clang (None: none installed)."""
    return next((c for c in (env.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)


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


__all__ = ["AMX_LINEAR_ENV", "AVX512_LINEAR_ENV", "CpuFeatures", "CpuIsaError", "ISA_ENV", "amx_linear_decision",
           "apply_cap", "avx512_linear_decision", "bf16_prefill_attention", "cpu_kernel_plan", "int8_weights", "detect_cpu", "detect_cpu_or_error",
           "find_c_compiler", "known_flags", "level_names", "normalize_arch", "parse_cpuinfo", "this_cpu",
           "torch_env_for_cap"]
