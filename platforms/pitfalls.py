"""Known platform traps, turned into log lines that say what is wrong and what to run.

``pitfalls(facts, env)`` is pure: every line comes from recorded facts and the environment, so the same
machine always gets the same advice (and tests can check it table-driven).
"""
from __future__ import annotations

from typing import Mapping

from tierlm.platforms.facts import Facts
from tierlm.platforms.install_commands import (
    JETSON_JP6_TORCH_COMMAND,
    install_command,
    install_set,
    is_jetson_before_cuda13,
    mlx_install_command,
)

CUDA_PTXAS = "/usr/local/cuda/bin/ptxas"


def _cuda_major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0]) if version else None
    except ValueError:
        return None


def pitfalls(facts: Facts, env: Mapping[str, str] | None = None) -> list[str]:
    """Actionable warnings for this machine; empty when nothing is known to bite."""
    env = env or {}
    out: list[str] = []
    if facts.is_dgx_spark:
        out += _gb10(facts, env)
    elif facts.is_jetson:
        out += _jetson(facts)
    elif facts.has_nvidia_gpu:
        out += _nvidia(facts)
    if facts.is_apple_silicon:
        out += _apple(facts)
    if facts.torch_error:
        out.append(f"torch is installed but fails to import ({facts.torch_error}): reinstall with {install_command(facts)}")
    if facts.mlx_error:
        out.append(f"mlx is installed but fails to import ({facts.mlx_error}): reinstall with {mlx_install_command(facts)}")
    return out


def _gb10(facts: Facts, env: Mapping[str, str]) -> list[str]:
    out: list[str] = []
    fix = f"pip install -r {install_set(facts)}"
    major = _cuda_major(facts.torch_cuda_version)
    if facts.torch_importable and (major is None or major < 13):
        build = f"CUDA {facts.torch_cuda_version}" if facts.torch_cuda_version else "a CPU build"
        out.append(
            f"GB10 (sm_121) needs a CUDA 13 build of torch for aarch64 (cu130); torch {facts.torch_version} is "
            f"{build}. Fix: {fix}"
        )
    elif not facts.torch_importable:
        out.append(f"GB10 (sm_121) needs the CUDA 13 aarch64 build of torch (cu130), which is not installed. Fix: {fix}")
    out.append(
        "torch's warning that GB10's cuda capability 12.1 is not supported (supported up to 12.0) is a false "
        "alarm on cu130 builds: sm_120 kernels run on sm_121. Nothing to do."
        + (f' (seen: "{facts.torch_warnings[0].splitlines()[0]}")' if facts.torch_warnings else "")
    )
    if not env.get("TRITON_PTXAS_PATH"):
        out.append(
            "Triton's bundled ptxas may not know sm_121a: if Triton kernels fail to compile, "
            f"export TRITON_PTXAS_PATH={CUDA_PTXAS} (the CUDA 13 toolkit's ptxas)"
        )
    return out


def _jetson(facts: Facts) -> list[str]:
    if is_jetson_before_cuda13(facts):
        if facts.torch_cuda_available:
            return []
        return [
            f"{facts.board_model or 'Jetson'} runs JetPack 6 (CUDA 12.x): the cu130 wheels need JetPack 7's driver, "
            f"so torch must be NVIDIA's JetPack build. Fix: {JETSON_JP6_TORCH_COMMAND}"
        ]
    return _nvidia(facts)


def _nvidia(facts: Facts) -> list[str]:
    if facts.torch_cuda_available:
        return []
    fix = install_command(facts)
    if not facts.torch_importable:
        return [f"an NVIDIA GPU ({facts.device_name}) is present but torch is not installed. Fix: {fix}"]
    if not facts.torch_cuda_version:
        return [
            f"an NVIDIA GPU ({facts.device_name}) is present but torch {facts.torch_version} is a CPU build, so "
            f"the server would run on the CPU. Fix: {fix}"
        ]
    driver = f" (driver {facts.driver_version})" if facts.driver_version else ""
    return [
        f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda_version} but cannot use the GPU "
        f"({facts.device_name}){driver}: CUDA 13 builds need an NVIDIA driver >= 580. Update the driver, "
        "or check CUDA_VISIBLE_DEVICES"
    ]


def _apple(facts: Facts) -> list[str]:
    if facts.rosetta:
        return [
            "Python runs under Rosetta (x86_64) on Apple Silicon: MLX and fast torch need a native arm64 Python. "
            "Install an arm64 Python (e.g. from python.org or `arch -arm64 brew install python`), then "
            f"{install_command(facts)}"
        ]
    if not (facts.mlx_importable and facts.mlx_lm_version):
        return [f"mlx/mlx-lm do not import, so Apple Silicon runs torch on the CPU (slow). Fix: {mlx_install_command(facts)}"]
    return []
