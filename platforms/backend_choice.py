"""Pick the backend (torch | mlx) and device (cpu | cuda | mps) from facts, environment and flags, with reasons.

Precedence, strongest first:
  1. an explicit backend: ``backend_override`` (a flag), then ``TIERLM_BACKEND`` (torch | mlx);
  2. ``--device``: ``mps`` means MLX on Apple Silicon's GPU, ``cuda`` means torch on an NVIDIA GPU;
  3. ``SGLANG_USE_MLX``: 1 -> MLX, 0 -> never MLX (SGLang's switch, so SGLang setups behave the same);
  4. automatic: MLX on Apple Silicon when mlx imports, else torch on CUDA when usable, else torch on CPU.
A stronger setting that overrides a weaker one says so in the reasons. Two explicit settings that contradict
each other, or a choice this machine cannot run, raise ``BackendChoiceError`` saying what to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from tierlm.platforms.cpu_plan import CpuPlanError, kernels_override, read_overrides
from tierlm.platforms.facts import Facts
from tierlm.platforms.install_commands import install_command, mlx_install_command

BACKENDS = ("torch", "mlx")
DEVICES = ("auto", "cpu", "cuda", "mps")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class BackendChoiceError(ValueError):
    """The requested backend/device cannot run here; the message says what to install or change."""


@dataclass(frozen=True)
class Decision:
    backend: str  # "torch" | "mlx"
    device: str  # "cpu" | "cuda" | "mps" (mps: MLX on Apple Silicon's GPU)
    reasons: list[str] = field(default_factory=list)
    # torch on a CPU with native bf16 matmuls (Facts.cpu_bf16): --dtype auto serves bfloat16 (backends/dtypes.py)
    native_bf16: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "device": self.device, "reasons": list(self.reasons),
                "native_bf16": self.native_bf16}


def choose_backend(
    facts: Facts,
    env: Mapping[str, str] | None = None,
    device_flag: str = "auto",
    backend_override: str | None = None,
) -> Decision:
    """Pure: the same facts, env and flags always give the same Decision (or the same error)."""
    env = env or {}
    if facts.cpu_isa_error:
        raise BackendChoiceError(facts.cpu_isa_error)
    try:  # a misspelt plan override or kernel switch stops startup here, not inside the first prefill
        read_overrides(env)
        kernels_override(env)
    except CpuPlanError as e:
        raise BackendChoiceError(str(e)) from None
    device_flag = (device_flag or "auto").strip().lower()
    if device_flag not in DEVICES:
        raise BackendChoiceError(f"--device must be one of {', '.join(DEVICES)}, got {device_flag!r}")
    reasons: list[str] = []

    forced, source = _explicit_backend(env, backend_override, reasons)
    use_mlx = _sglang_use_mlx(env)
    implied = {"mps": "mlx", "cuda": "torch"}.get(device_flag)

    if forced and implied and forced != implied:
        raise BackendChoiceError(
            f"{source} asks for {forced} but --device {device_flag} runs the {implied} backend: "
            f"drop one of them ({_device_hint(forced)})"
        )
    if forced:
        backend = forced
        reasons.append(f"{source} selects the {backend} backend")
        if use_mlx is not None and use_mlx != (backend == "mlx"):
            reasons.append(f"{source} overrides SGLANG_USE_MLX={env.get('SGLANG_USE_MLX')}")
    elif implied:
        backend, source = implied, f"--device {device_flag}"
        reasons.append(f"--device {device_flag} runs the {implied} backend")
        if use_mlx is not None and use_mlx != (backend == "mlx"):
            reasons.append(f"--device {device_flag} overrides SGLANG_USE_MLX={env.get('SGLANG_USE_MLX')}")
    elif use_mlx is True:
        backend, source = "mlx", "SGLANG_USE_MLX=1"
        reasons.append("SGLANG_USE_MLX=1 selects the mlx backend")
    elif use_mlx is False:
        backend, source = "torch", "SGLANG_USE_MLX=0"
        reasons.append("SGLANG_USE_MLX=0: never MLX, so the torch backend")
    else:
        backend, source = _auto_backend(facts, device_flag, reasons), "the automatic choice"

    _require_backend(facts, backend, source, env)
    device = _device_for(facts, backend, device_flag, reasons)
    native_bf16 = backend == "torch" and device == "cpu" and facts.cpu_bf16 is not None
    if backend == "torch" and device == "cpu":
        reasons.append(f"the CPU has native bf16 matmuls ({facts.cpu_bf16}): --dtype auto serves bfloat16"
                       if native_bf16 else "no native bf16 matmuls on this CPU (AVX512-BF16, AMX-BF16 or Arm BF16): "
                       "--dtype auto serves float32")
        reasons.append(f"CPU level {facts.cpu.level}" + (f" (capped by TIERLM_CPU_ISA={facts.cpu_isa_cap})"
                                                          if facts.cpu_isa_cap else ""))
    return Decision(backend=backend, device=device, reasons=reasons, native_bf16=native_bf16)


def _explicit_backend(
    env: Mapping[str, str], backend_override: str | None, reasons: list[str]
) -> tuple[str | None, str | None]:
    env_value = (env.get("TIERLM_BACKEND") or "").strip().lower()
    for value, name in ((backend_override, "the backend override"), (env_value, "TIERLM_BACKEND")):
        if value and value.strip().lower() not in BACKENDS:
            raise BackendChoiceError(f"{name} must be torch or mlx, got {value!r}")
    if backend_override:
        override = backend_override.strip().lower()
        if env_value and env_value != override:
            reasons.append(f"the backend override ({override}) wins over TIERLM_BACKEND={env_value}")
        return override, f"the backend override ({override})"
    if env_value:
        return env_value, f"TIERLM_BACKEND={env_value}"
    return None, None


def _sglang_use_mlx(env: Mapping[str, str]) -> bool | None:
    raw = env.get("SGLANG_USE_MLX")
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise BackendChoiceError(f"SGLANG_USE_MLX must be 1 or 0, got {raw!r}")


def _auto_backend(facts: Facts, device_flag: str, reasons: list[str]) -> str:
    if facts.is_apple_silicon and device_flag == "auto":
        if facts.mlx_importable and facts.mlx_lm_version:
            reasons.append(f"Apple Silicon and mlx {facts.mlx_version} imports: the mlx backend")
            return "mlx"
        reasons.append("Apple Silicon but mlx/mlx-lm do not import, so not MLX")
    if facts.torch_cuda_available and device_flag == "auto":
        reasons.append(f"torch {facts.torch_version} sees a CUDA GPU ({facts.device_name}): the torch backend")
        return "torch"
    if facts.torch_importable:
        why = "--device cpu" if device_flag == "cpu" else _why_no_cuda(facts)
        reasons.append(f"{why}: the torch backend on CPU")
        return "torch"
    if facts.mlx_importable and facts.mlx_lm_version:
        reasons.append("torch does not import but mlx does: the mlx backend")
        return "mlx"
    raise BackendChoiceError(
        "neither torch nor mlx imports, so there is no backend to run. "
        f"Install this platform's set: {install_command(facts)}"
        + (f" (torch failed with {facts.torch_error})" if facts.torch_error else "")
    )


def _why_no_cuda(facts: Facts) -> str:
    if not facts.has_nvidia_gpu:
        return "no CUDA GPU on this machine"
    if not facts.torch_cuda_version:
        return f"an NVIDIA GPU is present but torch {facts.torch_version} is a CPU build"
    return f"torch {facts.torch_version} (CUDA {facts.torch_cuda_version}) cannot use the GPU ({facts.device_name})"


def _require_backend(facts: Facts, backend: str, source: str, env: Mapping[str, str]) -> None:
    if backend == "torch" and not facts.torch_importable:
        detail = f"torch fails to import ({facts.torch_error})" if facts.torch_error else "torch is not installed"
        raise BackendChoiceError(f"{source} needs torch but {detail}. Install it: {install_command(facts)}")
    if backend == "mlx":
        fix = mlx_install_command(facts)
        undo = " (or unset SGLANG_USE_MLX to use torch)" if env.get("SGLANG_USE_MLX") else ""
        if not facts.mlx_importable:
            detail = f"mlx fails to import ({facts.mlx_error})" if facts.mlx_error else "mlx is not installed"
            raise BackendChoiceError(f"{source} needs MLX but {detail}. Install it: {fix}{undo}")
        if not facts.mlx_lm_version:
            raise BackendChoiceError(f"{source} needs MLX: mlx imports but mlx-lm is not installed. Install it: {fix}{undo}")


def _device_for(facts: Facts, backend: str, device_flag: str, reasons: list[str]) -> str:
    # --device cuda always means torch and mps always means MLX (conflicts were rejected above).
    if backend == "torch":
        if device_flag == "cuda":
            if not facts.torch_cuda_available:
                raise BackendChoiceError(f"--device cuda but {_why_no_cuda(facts)}. {_cuda_fix(facts)}")
            reasons.append(f"--device cuda: {facts.device_name}")
            return "cuda"
        if device_flag == "auto" and facts.torch_cuda_available:
            return "cuda"
        if device_flag == "cpu":
            reasons.append("--device cpu")
        return "cpu"
    # mlx
    if device_flag == "mps":
        if not facts.mlx_metal_available:
            where = "Python runs under Rosetta (x86_64)" if facts.rosetta else "this is not Apple Silicon"
            raise BackendChoiceError(f"--device mps needs Metal, but {where}: use --device cpu for MLX on CPU")
        reasons.append(f"--device mps: MLX on {facts.device_name or 'Apple Silicon'} (Metal)")
        return "mps"
    if device_flag == "auto" and facts.mlx_metal_available:
        reasons.append(f"MLX on {facts.device_name or 'Apple Silicon'} (Metal)")
        return "mps"
    reasons.append("MLX on CPU" + ("" if device_flag == "cpu" else " (no Metal GPU here)"))
    return "cpu"


def _cuda_fix(facts: Facts) -> str:
    if not facts.has_nvidia_gpu:
        return "This machine has no NVIDIA GPU: use --device cpu (or --device auto)."
    return f"Install a CUDA build of torch: {install_command(facts)}"


def _device_hint(backend: str) -> str:
    return "MLX runs on --device cpu or mps" if backend == "mlx" else "torch runs on --device cpu or cuda"
