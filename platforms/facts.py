"""Plain facts about the machine: OS, CPU, memory, accelerator, and which of torch / mlx import.

``detect()`` never raises because a library or tool is missing: every probe is guarded, and what could not
be learned stays ``None``. ``Facts`` is a frozen record that round-trips through ``to_dict``/``from_dict``
so tests (and bug reports: ``tierlm doctor --json``) can replay a machine without having it.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from tierlm.platforms.cpu_features import CpuFeatures, detect_cpu_or_error, known_flags, normalize_arch

ACCELERATOR_CUDA = "cuda"
ACCELERATOR_APPLE = "apple"
ACCELERATOR_NONE = "none"

_DEVICE_TREE_MODEL = "/proc/device-tree/model"


@dataclass(frozen=True)
class Facts:
    os_name: str  # platform.system(): "Linux" | "Darwin" | "Windows"
    arch: str  # normalized: "x86_64" | "aarch64" (Apple's "arm64" included) | other as reported
    cpu_count: int
    ram_total_bytes: int
    ram_available_bytes: int  # the OS's view: includes reclaimable page cache (Linux MemAvailable)
    accelerator: str = ACCELERATOR_NONE  # "cuda" | "apple" | "none": the hardware, usable or not
    device_name: str | None = None  # "NVIDIA H100 80GB HBM3", "NVIDIA GB10", "Orin", "Apple M2 Max"
    device_count: int = 0
    compute_capability: tuple[int, int] | None = None  # CUDA only
    device_memory_total_bytes: int | None = None  # CUDA total; Apple: Metal's recommended working set
    device_memory_free_bytes: int | None = None  # CUDA's free figure (excludes page cache on GB10)
    driver_version: str | None = None
    unified_memory: bool = False  # CPU and accelerator share one physical memory (Apple, GB10, Jetson)
    board_model: str | None = None  # /proc/device-tree/model, e.g. "NVIDIA Jetson AGX Orin Developer Kit"
    rosetta: bool = False  # an x86_64 Python translated on an Apple Silicon Mac
    python_version: str = ""
    torch_version: str | None = None  # None: torch does not import
    torch_cuda_version: str | None = None  # torch.version.cuda; None for CPU builds
    torch_cuda_available: bool = False
    torch_error: str | None = None  # why an installed torch failed to import
    torch_warnings: tuple[str, ...] = ()  # warnings torch raised while probing CUDA (GB10 capability note)
    mlx_version: str | None = None  # None: mlx.core does not import
    mlx_lm_version: str | None = None  # None: mlx_lm is not installed
    mlx_metal_available: bool = False
    mlx_error: str | None = None  # why an installed mlx failed to import
    # The CPU as platforms/cpu_features.py reads it (Linux /proc/cpuinfo), after any TIERLM_CPU_ISA cap: the
    # instruction flags tierlm's decisions look at, the model name, physical cores, and the cap and what it dropped.
    cpu_flags: tuple[str, ...] = ()
    cpu_model: str = ""
    cpu_physical_cores: int = 0
    cpu_isa_cap: str | None = None
    cpu_isa_dropped: tuple[str, ...] = ()
    cpu_isa_error: str | None = None  # TIERLM_CPU_ISA names no level here: choose_backend stops startup with it

    # --- derived, so callers never repeat the string tests ---
    @property
    def cpu(self) -> CpuFeatures:
        return CpuFeatures(arch=self.arch, flags=frozenset(self.cpu_flags), model_name=self.cpu_model,
                           physical_cores=self.cpu_physical_cores, cap=self.cpu_isa_cap, dropped=self.cpu_isa_dropped)

    @property
    def cpu_bf16(self) -> str | None:
        """The CPU's native bf16 matmul instructions (amx_bf16 | avx512_bf16 | aarch64 bf16), or None."""
        return self.cpu.native_bf16

    @property
    def torch_importable(self) -> bool:
        return self.torch_version is not None

    @property
    def mlx_importable(self) -> bool:
        return self.mlx_version is not None

    @property
    def is_apple_silicon(self) -> bool:
        return self.os_name == "Darwin" and (self.arch == "aarch64" or self.rosetta)

    @property
    def is_dgx_spark(self) -> bool:
        """GB10 (DGX Spark and its OEM twins): Grace CPU + Blackwell GPU on one LPDDR5x memory."""
        if self.accelerator != ACCELERATOR_CUDA:
            return False
        return "GB10" in (self.device_name or "") or (
            self.arch == "aarch64" and self.compute_capability == (12, 1)
        )

    @property
    def is_jetson(self) -> bool:
        return "jetson" in (self.board_model or "").lower()

    @property
    def has_nvidia_gpu(self) -> bool:
        return self.accelerator == ACCELERATOR_CUDA

    @property
    def platform_kind(self) -> str:
        """One word for the machine class: dgx-spark | jetson | apple-silicon | nvidia-gpu | cpu."""
        if self.is_dgx_spark:
            return "dgx-spark"
        if self.is_jetson:
            return "jetson"
        if self.is_apple_silicon:
            return "apple-silicon"
        if self.has_nvidia_gpu:
            return "nvidia-gpu"
        return "cpu"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        d["torch_warnings"] = list(self.torch_warnings)
        d["cpu_flags"] = list(self.cpu_flags)
        d["cpu_isa_dropped"] = list(self.cpu_isa_dropped)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Facts":
        """Rebuild recorded facts. Unknown keys are an error so a typo in a recorded machine cannot hide."""
        names = {f.name for f in dataclasses.fields(cls)}
        d = dict(d)
        legacy_bf16 = d.pop("cpu_bf16", None)  # recordings before cpu_flags named only the bf16 flag
        if legacy_bf16 and not d.get("cpu_flags"):
            d["cpu_flags"] = [legacy_bf16]
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown fact(s) {unknown}; known facts are {sorted(names)}")
        kw = dict(d)
        if kw.get("compute_capability") is not None:
            major, minor = kw["compute_capability"]
            kw["compute_capability"] = (int(major), int(minor))
        for key in ("torch_warnings", "cpu_flags", "cpu_isa_dropped"):
            if key in kw:
                kw[key] = tuple(kw[key] or ())
        return cls(**kw)


# --------------------------------------------------------------------------------------------- detection


def detect() -> Facts:
    """Probe this machine. Slow parts: importing torch (~1 s) and one nvidia-smi call when torch sees no GPU."""
    os_name = platform.system()
    arch = normalize_arch(platform.machine())
    rosetta = os_name == "Darwin" and arch == "x86_64" and _sysctl("sysctl.proc_translated") == "1"
    ram_total, ram_available = _ram()
    facts: dict[str, Any] = dict(
        os_name=os_name,
        arch=arch,
        cpu_count=os.cpu_count() or 1,
        ram_total_bytes=ram_total,
        ram_available_bytes=ram_available,
        rosetta=rosetta,
        python_version=platform.python_version(),
        board_model=_board_model(),
    )
    if os_name == "Linux":
        facts.update(_probe_cpu(arch))
    facts.update(_probe_torch())
    facts.update(_probe_mlx())

    if facts.get("torch_cuda_available"):
        facts.update(_probe_cuda_with_torch())
    else:
        facts.update(_probe_nvidia_smi())
    if not facts.get("accelerator") and facts["board_model"] and "jetson" in facts["board_model"].lower():
        # Jetson images often lack nvidia-smi; the device tree still names the board and its integrated GPU.
        facts["accelerator"] = ACCELERATOR_CUDA
        facts["device_name"] = facts["board_model"]
        facts["device_count"] = 1
    if not facts.get("accelerator") and os_name == "Darwin" and (arch == "aarch64" or rosetta):
        facts.update(_probe_apple(facts))
    if not facts.get("accelerator"):
        facts["accelerator"] = ACCELERATOR_NONE

    probe = Facts(**{k: v for k, v in facts.items() if k != "unified_memory"})
    unified = probe.is_apple_silicon or probe.is_dgx_spark or probe.is_jetson
    return dataclasses.replace(probe, unified_memory=unified)


def _ram() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception:  # psutil missing or unsupported: fall back to /proc/meminfo, then to "unknown" (0)
        pass
    try:
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    except Exception:
        return 0, 0


def _probe_cpu(arch: str) -> dict[str, Any]:
    """/proc/cpuinfo through platforms/cpu_features.py, with TIERLM_CPU_ISA applied (a bad value is kept as an
    error for choose_backend to report, and the machine's own flags are used meanwhile)."""
    cpu, error = detect_cpu_or_error(machine=arch)
    return {"cpu_flags": tuple(sorted(cpu.flags & known_flags(arch))), "cpu_model": cpu.model_name,
            "cpu_physical_cores": cpu.physical_cores,
            "cpu_isa_cap": cpu.cap, "cpu_isa_dropped": cpu.dropped, "cpu_isa_error": error}


def _board_model() -> str | None:
    try:
        with open(_DEVICE_TREE_MODEL, "rb") as f:
            return f.read().rstrip(b"\x00\n").decode("utf-8", "replace") or None
    except OSError:
        return None


def _sysctl(name: str) -> str | None:
    exe = shutil.which("sysctl")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "-n", name], capture_output=True, text=True, timeout=5)
    except Exception:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a half-imported or shadowed package
        return False


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()


def _probe_torch() -> dict[str, Any]:
    if not _has_module("torch"):
        return {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch

            cuda_available = bool(torch.cuda.is_available())
        return {
            "torch_version": str(torch.__version__),
            "torch_cuda_version": getattr(torch.version, "cuda", None),
            "torch_cuda_available": cuda_available,
            "torch_warnings": tuple(str(w.message).strip() for w in caught if "capability" in str(w.message)),
        }
    except Exception as e:  # a broken install (missing libcudart, ABI mismatch) must not stop detection
        return {"torch_error": _short_error(e)}


def _probe_cuda_with_torch() -> dict[str, Any]:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch

            props = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info(0)
            out = {
                "accelerator": ACCELERATOR_CUDA,
                "device_name": str(props.name),
                "device_count": int(torch.cuda.device_count()),
                "compute_capability": (int(props.major), int(props.minor)),
                "device_memory_total_bytes": int(total),
                "device_memory_free_bytes": int(free),
            }
        msgs = tuple(str(w.message).strip() for w in caught if "capability" in str(w.message))
        if msgs:
            out["torch_warnings"] = msgs
        smi = _probe_nvidia_smi()
        if smi.get("driver_version"):
            out["driver_version"] = smi["driver_version"]
        return out
    except Exception:
        return _probe_nvidia_smi()


def _probe_nvidia_smi() -> dict[str, Any]:
    """The GPU as the driver sees it, without torch (a CPU torch on a GPU box is a pitfall worth naming)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    query = "name,compute_cap,memory.total,memory.free,driver_version"
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        )
    except Exception:
        return {}
    rows = [r for r in out.stdout.strip().splitlines() if r.strip()] if out.returncode == 0 else []
    if not rows:
        return {}
    return parse_nvidia_smi_row(rows[0]) | {"device_count": len(rows)}


def parse_nvidia_smi_row(row: str) -> dict[str, Any]:
    """One CSV row of name,compute_cap,memory.total,memory.free,driver_version (MiB; GB10 says [N/A])."""
    cells = [c.strip() for c in row.split(",")]
    cells += [""] * (5 - len(cells))
    name, cap, total, free, driver = cells[:5]

    def mib(s: str) -> int | None:
        try:
            return int(float(s)) * 1024 * 1024
        except ValueError:  # "[N/A]", "[Not Supported]"
            return None

    capability = None
    if "." in cap:
        try:
            major, minor = cap.split(".", 1)
            capability = (int(major), int(minor))
        except ValueError:
            capability = None
    return {
        "accelerator": ACCELERATOR_CUDA,
        "device_name": name or None,
        "compute_capability": capability,
        "device_memory_total_bytes": mib(total),
        "device_memory_free_bytes": mib(free),
        "driver_version": driver or None,
    }


def _probe_mlx() -> dict[str, Any]:
    if not _has_module("mlx"):
        return {}
    out: dict[str, Any] = {"mlx_lm_version": _dist_version("mlx-lm") if _has_module("mlx_lm") else None}
    try:
        mx = importlib.import_module("mlx.core")  # fails on Linux when no backend (mlx[cpu]) is installed
        out["mlx_version"] = str(getattr(mx, "__version__", None) or _dist_version("mlx") or "unknown")
        try:
            out["mlx_metal_available"] = bool(mx.metal.is_available())
        except Exception:
            out["mlx_metal_available"] = False
    except Exception as e:
        out["mlx_error"] = _short_error(e)
    return out


def _probe_apple(facts: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"accelerator": ACCELERATOR_APPLE, "device_count": 1}
    out["device_name"] = _sysctl("machdep.cpu.brand_string") or "Apple Silicon"
    if facts.get("mlx_metal_available"):
        try:
            mx = sys.modules.get("mlx.core") or importlib.import_module("mlx.core")
            info_fn = getattr(mx, "device_info", None) or mx.metal.device_info
            info = info_fn()
            ws = info.get("max_recommended_working_set_size")
            if ws:
                out["device_memory_total_bytes"] = int(ws)
        except Exception:
            pass
    return out


__all__ = ["Facts", "detect", "parse_nvidia_smi_row", "ACCELERATOR_CUDA", "ACCELERATOR_APPLE", "ACCELERATOR_NONE"]
