"""Which wheels/ install set fits a machine, and the one command that installs it.

Paths are relative to the repository root: the sets install tierlm itself with ``-e .``, which pip resolves
against the current directory, so every command is run from the checkout's root.
"""
from __future__ import annotations

from tierlm.platforms.facts import Facts

CPU_SET = "wheels/cpu.txt"
NVIDIA_X86_64_SET = "wheels/nvidia-x86_64-cu130.txt"
NVIDIA_ARM64_SET = "wheels/nvidia-arm64-cu130.txt"
APPLE_SILICON_SET = "wheels/apple-silicon.txt"

# Every set, by the platform_kind-like key docs and tests use.
INSTALL_SETS: dict[str, str] = {
    "cpu": CPU_SET,
    "nvidia-x86_64": NVIDIA_X86_64_SET,
    "nvidia-arm64": NVIDIA_ARM64_SET,
    "apple-silicon": APPLE_SILICON_SET,
}

MLX_LINUX_COMMAND = 'pip install "mlx[cpu]" mlx-lm'
# JetPack 6 (Orin, CUDA 12.6) cannot run cu130 wheels; NVIDIA publishes its torch builds on this index.
JETSON_JP6_TORCH_COMMAND = "pip install torch --index-url https://pypi.jetson-ai-lab.io/jp6/cu126 && pip install -e ."


def install_set(facts: Facts) -> str:
    """The wheels/ file for this machine (a path relative to the repository root)."""
    if facts.is_apple_silicon:
        return APPLE_SILICON_SET
    if facts.has_nvidia_gpu:
        return NVIDIA_ARM64_SET if facts.arch == "aarch64" else NVIDIA_X86_64_SET
    return CPU_SET


def install_command(facts: Facts) -> str:
    """The one command that installs tierlm and the right torch/mlx for this machine."""
    if is_jetson_before_cuda13(facts):
        return JETSON_JP6_TORCH_COMMAND
    return f"pip install -r {install_set(facts)}"


def mlx_install_command(facts: Facts) -> str:
    """How to get an importable mlx + mlx-lm here (MLX runs on Apple Silicon and, CPU-only, on Linux)."""
    if facts.is_apple_silicon:
        return f"pip install -r {APPLE_SILICON_SET}"
    if facts.os_name == "Linux":
        return MLX_LINUX_COMMAND
    return "MLX is available for Apple Silicon macOS and Linux only; use the torch backend here"


def is_jetson_before_cuda13(facts: Facts) -> bool:
    """Jetson Orin and older (JetPack 6, CUDA 12.x): the cu130 aarch64 wheels need JetPack 7's driver."""
    if not facts.is_jetson:
        return False
    if facts.compute_capability is not None:
        return facts.compute_capability < (11, 0)  # Thor is sm_110 under CUDA 13; Orin is sm_87
    return "thor" not in (facts.board_model or "").lower()
