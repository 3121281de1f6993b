"""Platform layer, table-driven over recorded machines: facts, backend choice, tier sizing, pitfalls, doctor."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierlm.platforms import (BackendChoiceError, Decision, Facts, MemoryPlanError, choose_backend, detect,
                              install_command, pitfalls, plan_memory, plan_memory_for_args, size_kv_tiers)
from tierlm.platforms import facts as facts_mod
from tierlm.platforms.facts import parse_nvidia_smi_row
from tierlm.platforms.memory_plan import (DEFAULT_CPU_FRACTION, DEFAULT_CPU_KV_SHARE, DEFAULT_UNIFIED_FRACTION,
                                          default_gpu_fraction, headroom_for)
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.commands import doctor as doctor_cmd

GiB = 1024**3
REPO = Path(__file__).resolve().parent.parent
GB10_WARNING = ("Found GPU0 NVIDIA GB10 which is of cuda capability 12.1.\n    Minimum and Maximum cuda capability "
                "supported by this version of PyTorch is\n    (8.0) - (12.0)")

# Recorded machines (as `tierlm doctor --json` would report them), minus fields left at their defaults.
MACHINES: dict[str, dict] = {
    "dgx_spark": dict(
        os_name="Linux", arch="aarch64", cpu_count=20, ram_total_bytes=121 * GiB, ram_available_bytes=110 * GiB,
        accelerator="cuda", device_name="NVIDIA GB10", device_count=1, compute_capability=[12, 1],
        device_memory_total_bytes=int(119.7 * GiB), device_memory_free_bytes=60 * GiB,  # CUDA: no page cache
        driver_version="580.95.05", unified_memory=True, python_version="3.12.3",
        torch_version="2.13.0+cu130", torch_cuda_version="13.0", torch_cuda_available=True,
        torch_warnings=[GB10_WARNING],
    ),
    "dgx_spark_cu128": dict(
        os_name="Linux", arch="aarch64", cpu_count=20, ram_total_bytes=121 * GiB, ram_available_bytes=110 * GiB,
        accelerator="cuda", device_name="NVIDIA GB10", device_count=1, compute_capability=[12, 1],
        driver_version="580.95.05", unified_memory=True, torch_version="2.7.1+cu128", torch_cuda_version="12.8",
        torch_cuda_available=True,
    ),
    "h100": dict(
        os_name="Linux", arch="x86_64", cpu_count=104, ram_total_bytes=2015 * GiB, ram_available_bytes=1900 * GiB,
        accelerator="cuda", device_name="NVIDIA H100 80GB HBM3", device_count=8, compute_capability=[9, 0],
        device_memory_total_bytes=85_031_714_816, device_memory_free_bytes=84_500_000_000, driver_version="580.65.06",
        torch_version="2.13.0+cu130", torch_cuda_version="13.0", torch_cuda_available=True,
    ),
    "h200": dict(
        os_name="Linux", arch="x86_64", cpu_count=96, ram_total_bytes=1500 * GiB, ram_available_bytes=1400 * GiB,
        accelerator="cuda", device_name="NVIDIA H200", device_count=1, compute_capability=[9, 0],
        device_memory_total_bytes=150_754_820_096, device_memory_free_bytes=150_000_000_000,
        torch_version="2.13.0+cu130", torch_cuda_version="13.0", torch_cuda_available=True,
    ),
    "gpu_box_cpu_torch": dict(  # an NVIDIA GPU seen by nvidia-smi, but a CPU build of torch installed
        os_name="Linux", arch="x86_64", cpu_count=32, ram_total_bytes=256 * GiB, ram_available_bytes=240 * GiB,
        accelerator="cuda", device_name="NVIDIA L40S", device_count=1, compute_capability=[8, 9],
        device_memory_total_bytes=48 * GiB, device_memory_free_bytes=47 * GiB, torch_version="2.13.0+cpu",
    ),
    "apple_m2_max_mlx": dict(
        os_name="Darwin", arch="aarch64", cpu_count=12, ram_total_bytes=64 * GiB, ram_available_bytes=40 * GiB,
        accelerator="apple", device_name="Apple M2 Max", device_count=1, device_memory_total_bytes=48 * GiB,
        unified_memory=True, torch_version="2.13.0", mlx_version="0.32.4", mlx_lm_version="0.32.2",
        mlx_metal_available=True,
    ),
    "apple_m1_no_mlx": dict(
        os_name="Darwin", arch="aarch64", cpu_count=8, ram_total_bytes=16 * GiB, ram_available_bytes=7 * GiB,
        accelerator="apple", device_name="Apple M1", device_count=1, unified_memory=True, torch_version="2.13.0",
    ),
    "apple_rosetta": dict(
        os_name="Darwin", arch="x86_64", cpu_count=8, ram_total_bytes=16 * GiB, ram_available_bytes=9 * GiB,
        accelerator="apple", device_name="Apple M1", device_count=1, unified_memory=True, rosetta=True,
        torch_version="2.2.2",
    ),
    "cpu_x86_64": dict(  # this CI machine
        os_name="Linux", arch="x86_64", cpu_count=2, ram_total_bytes=int(23.5 * GiB), ram_available_bytes=int(22.9 * GiB),
        torch_version="2.13.0+cpu", mlx_version="0.32.4", mlx_lm_version="0.32.2",
    ),
    "cpu_aarch64": dict(  # e.g. a Graviton server, no MLX installed
        os_name="Linux", arch="aarch64", cpu_count=64, ram_total_bytes=128 * GiB, ram_available_bytes=120 * GiB,
        torch_version="2.13.0+cpu",
    ),
    "jetson_orin": dict(
        os_name="Linux", arch="aarch64", cpu_count=12, ram_total_bytes=int(61.4 * GiB), ram_available_bytes=50 * GiB,
        accelerator="cuda", device_name="Orin", device_count=1, compute_capability=[8, 7],
        device_memory_total_bytes=int(61.4 * GiB), device_memory_free_bytes=30 * GiB, unified_memory=True,
        board_model="NVIDIA Jetson AGX Orin Developer Kit", torch_version="2.8.0", torch_cuda_version="12.6",
        torch_cuda_available=True,
    ),
    "jetson_orin_cpu_torch": dict(
        os_name="Linux", arch="aarch64", cpu_count=6, ram_total_bytes=int(7.4 * GiB), ram_available_bytes=5 * GiB,
        accelerator="cuda", device_name="NVIDIA Jetson Orin Nano Developer Kit", device_count=1,
        unified_memory=True, board_model="NVIDIA Jetson Orin Nano Developer Kit", torch_version="2.13.0+cpu",
    ),
    "no_backend": dict(
        os_name="Linux", arch="x86_64", cpu_count=4, ram_total_bytes=16 * GiB, ram_available_bytes=12 * GiB,
    ),
}

MACHINES["cpu_x86_64_no_mlx_lm"] = {**MACHINES["cpu_x86_64"], "mlx_lm_version": None}


def machine(name: str, **changes) -> Facts:
    return dataclasses.replace(Facts.from_dict(MACHINES[name]), **changes)


# ------------------------------------------------------------------------------------------------- facts


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_recorded_facts_round_trip_through_json(name):
    facts = Facts.from_dict(MACHINES[name])
    assert Facts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


def test_unknown_fact_is_rejected():
    with pytest.raises(ValueError, match="gpu_nmae"):
        Facts.from_dict({**MACHINES["h100"], "gpu_nmae": "typo"})


@pytest.mark.parametrize("name, kind, unified", [
    ("dgx_spark", "dgx-spark", True), ("h100", "nvidia-gpu", False), ("h200", "nvidia-gpu", False),
    ("apple_m2_max_mlx", "apple-silicon", True), ("apple_m1_no_mlx", "apple-silicon", True),
    ("apple_rosetta", "apple-silicon", True), ("cpu_x86_64", "cpu", False), ("cpu_aarch64", "cpu", False),
    ("jetson_orin", "jetson", True), ("gpu_box_cpu_torch", "nvidia-gpu", False),
])
def test_platform_kind(name, kind, unified):
    f = machine(name)
    assert f.platform_kind == kind
    assert f.unified_memory is unified


def test_detect_on_this_machine():
    f = detect()
    assert f.arch in ("x86_64", "aarch64") and f.os_name == os.uname().sysname
    assert f.ram_total_bytes >= f.ram_available_bytes > 0 and f.cpu_count >= 1
    assert f.torch_importable == (importlib.util.find_spec("torch") is not None)
    assert Facts.from_dict(f.to_dict()) == f


def test_detect_survives_missing_torch_mlx_and_nvidia_smi(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(facts_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in ("torch", "mlx", "mlx_lm") else real_find_spec(name, *a))
    monkeypatch.setattr(facts_mod.shutil, "which", lambda name: None)
    f = detect()
    assert (f.torch_version, f.mlx_version, f.accelerator) == (None, None, "none")
    with pytest.raises(BackendChoiceError, match="neither torch nor mlx"):
        choose_backend(f, {})


def test_detect_reports_a_broken_torch_instead_of_crashing(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(facts_mod.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torch" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "torch", None)  # installed, but `import torch` raises ImportError
    f = detect()
    assert f.torch_version is None and "import of torch halted" in f.torch_error
    assert any("fails to import" in line for line in pitfalls(f))


def test_nvidia_smi_row_on_gb10_has_no_memory_figures():
    row = parse_nvidia_smi_row("NVIDIA GB10, 12.1, [N/A], [N/A], 580.95.05")
    assert row["compute_capability"] == (12, 1) and row["driver_version"] == "580.95.05"
    assert row["device_memory_total_bytes"] is None and row["device_memory_free_bytes"] is None
    h100 = parse_nvidia_smi_row("NVIDIA H100 80GB HBM3, 9.0, 81559, 81000, 580.65.06")
    assert h100["device_memory_total_bytes"] == 81559 * 2**20


# ---------------------------------------------------------------------------------------- backend choice

CHOICES = [
    # machine, env, --device, override, backend, device, a reason fragment
    ("dgx_spark", {}, "auto", None, "torch", "cuda", "sees a CUDA GPU (NVIDIA GB10)"),
    ("h100", {}, "auto", None, "torch", "cuda", "sees a CUDA GPU (NVIDIA H100"),
    ("h200", {}, "cuda", None, "torch", "cuda", "--device cuda"),
    ("apple_m2_max_mlx", {}, "auto", None, "mlx", "mps", "Apple Silicon and mlx 0.32.4 imports"),
    ("apple_m1_no_mlx", {}, "auto", None, "torch", "cpu", "mlx/mlx-lm do not import"),
    ("cpu_x86_64", {}, "auto", None, "torch", "cpu", "no CUDA GPU on this machine"),
    ("cpu_aarch64", {}, "auto", None, "torch", "cpu", "no CUDA GPU on this machine"),
    ("jetson_orin", {}, "auto", None, "torch", "cuda", "sees a CUDA GPU (Orin)"),
    ("gpu_box_cpu_torch", {}, "auto", None, "torch", "cpu", "is a CPU build"),
    ("cpu_x86_64", {"SGLANG_USE_MLX": "1"}, "auto", None, "mlx", "cpu", "SGLANG_USE_MLX=1 selects the mlx backend"),
    ("apple_m2_max_mlx", {"SGLANG_USE_MLX": "1"}, "auto", None, "mlx", "mps", "SGLANG_USE_MLX=1"),
    ("apple_m2_max_mlx", {"SGLANG_USE_MLX": "0"}, "auto", None, "torch", "cpu", "never MLX"),
    ("apple_m2_max_mlx", {"TIERLM_BACKEND": "torch"}, "auto", None, "torch", "cpu", "TIERLM_BACKEND=torch selects"),
    ("apple_m2_max_mlx", {}, "cpu", None, "torch", "cpu", "--device cpu"),
    ("apple_m2_max_mlx", {"SGLANG_USE_MLX": "1"}, "cpu", None, "mlx", "cpu", "MLX on CPU"),
    ("apple_m2_max_mlx", {"SGLANG_USE_MLX": "0"}, "mps", None, "mlx", "mps", "--device mps overrides SGLANG_USE_MLX=0"),
    ("h100", {"SGLANG_USE_MLX": "1"}, "cuda", None, "torch", "cuda", "--device cuda overrides SGLANG_USE_MLX=1"),
    ("cpu_x86_64", {"TIERLM_BACKEND": "mlx", "SGLANG_USE_MLX": "0"}, "auto", None, "mlx", "cpu",
     "TIERLM_BACKEND=mlx overrides SGLANG_USE_MLX=0"),
    ("cpu_x86_64", {"TIERLM_BACKEND": "torch"}, "auto", "mlx", "mlx", "cpu", "wins over TIERLM_BACKEND=torch"),
    ("cpu_x86_64", {"SGLANG_USE_MLX": ""}, "auto", None, "torch", "cpu", "no CUDA GPU"),  # empty = unset
]


@pytest.mark.parametrize("name, env, device_flag, override, backend, device, reason", CHOICES)
def test_choose_backend(name, env, device_flag, override, backend, device, reason):
    d = choose_backend(machine(name), env, device_flag, override)
    assert (d.backend, d.device) == (backend, device)
    assert any(reason in r for r in d.reasons), d.reasons


ERRORS = [
    # machine, env, --device, override, fragments the message must contain
    ("cpu_aarch64", {"SGLANG_USE_MLX": "1"}, "auto", None, ["mlx is not installed", 'pip install "mlx[cpu]" mlx-lm',
                                                            "unset SGLANG_USE_MLX"]),
    ("apple_m1_no_mlx", {"SGLANG_USE_MLX": "1"}, "auto", None, ["pip install -r wheels/apple-silicon.txt"]),
    ("apple_m1_no_mlx", {}, "mps", None, ["pip install -r wheels/apple-silicon.txt"]),
    ("cpu_x86_64", {}, "cuda", None, ["no NVIDIA GPU", "--device cpu"]),
    ("gpu_box_cpu_torch", {}, "cuda", None, ["CPU build", "pip install -r wheels/nvidia-x86_64-cu130.txt"]),
    ("cpu_x86_64", {"TIERLM_BACKEND": "mlx"}, "cuda", None, ["TIERLM_BACKEND=mlx", "--device cuda", "drop one"]),
    ("cpu_x86_64", {"TIERLM_BACKEND": "tensorflow"}, "auto", None, ["TIERLM_BACKEND must be torch or mlx"]),
    ("cpu_x86_64", {"SGLANG_USE_MLX": "maybe"}, "auto", None, ["SGLANG_USE_MLX must be 1 or 0"]),
    ("cpu_x86_64", {}, "mps", None, ["needs Metal", "--device cpu"]),
    ("apple_rosetta", {}, "mps", None, ["mlx is not installed"]),
    ("cpu_x86_64", {}, "tpu", None, ["--device must be one of"]),
    ("no_backend", {}, "auto", None, ["neither torch nor mlx", "pip install -r wheels/cpu.txt"]),
    ("no_backend", {"TIERLM_BACKEND": "torch"}, "auto", None, ["torch is not installed", "wheels/cpu.txt"]),
    ("cpu_x86_64_no_mlx_lm", {"SGLANG_USE_MLX": "1"}, "auto", None, ["mlx-lm is not installed"]),
]


@pytest.mark.parametrize("name, env, device_flag, override, fragments", ERRORS)
def test_choose_backend_errors_say_what_to_do(name, env, device_flag, override, fragments):
    with pytest.raises(BackendChoiceError) as e:
        choose_backend(machine(name), env, device_flag, override)
    assert isinstance(e.value, ValueError)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------ memory

KV_8B = 2 * 32 * 8 * 128 * 2  # Llama-3-8B, bf16: 131072 bytes per token
W_8B = 16_000_000_000


def plan(name, decision=None, **kw):
    f = machine(name)
    d = decision or choose_backend(f, {})
    kw.setdefault("weight_bytes", W_8B)
    kw.setdefault("kv_bytes_per_token", KV_8B)
    kw.setdefault("page_size", 16)
    return f, plan_memory(f, d, **kw)


def used_bytes(p):
    return p.weight_bytes + p.device_kv_bytes + p.host_kv_bytes


def test_dgx_spark_sizes_from_the_os_available_memory_not_cuda_free():
    f, p = plan("dgx_spark")
    assert p.memory_kind == "unified" and p.available_bytes == f.ram_available_bytes
    expected = (DEFAULT_UNIFIED_FRACTION * f.ram_available_bytes - W_8B) // KV_8B // 16 * 16
    assert p.device_kv_tokens == expected
    # CUDA's free figure (60 GiB) would have allowed far fewer tokens than the OS's available memory does.
    assert p.device_kv_bytes + W_8B > f.device_memory_free_bytes
    assert any("OS's available memory" in r and "page cache" in r for r in p.reasons)
    assert p.host_kv_tokens == 0 and p.hicache_ratio is None and p.warnings == []


@pytest.mark.parametrize("name", ["dgx_spark", "apple_m2_max_mlx", "jetson_orin"])
def test_unified_default_hicache_fits_one_budget_at_the_requested_ratio(name):
    f, p = plan(name, weight_bytes=4_000_000_000, enable_hierarchical_cache=True, hicache_ratio=2.0)
    assert p.memory_kind == "unified"
    assert used_bytes(p) + p.headroom_bytes <= f.ram_available_bytes
    assert p.host_kv_tokens >= 2 * p.device_kv_tokens - 16 and math.isclose(p.hicache_ratio, 2.0, abs_tol=0.01)
    assert p.warnings == []


def test_unified_overcommitting_ratio_is_reduced_with_the_numbers():
    f, p = plan("dgx_spark", mem_fraction_static=0.5, enable_hierarchical_cache=True, hicache_ratio=2.0)
    avail, headroom = f.ram_available_bytes, headroom_for(f.ram_total_bytes)
    l1 = (0.5 * avail - W_8B) // KV_8B // 16 * 16 * KV_8B
    room = avail - headroom - W_8B - l1
    assert p.device_kv_bytes == l1
    assert p.host_kv_bytes == room // (KV_8B * 16) * KV_8B * 16  # everything left, no more
    assert 1 < p.hicache_ratio < 2
    assert used_bytes(p) + p.headroom_bytes <= avail
    (warning,) = p.warnings
    for fragment in ("--hicache-ratio 2", f"{2 * l1 / 1e9:.2f} GB", f"{avail / 1e9:.2f} GB", "reduced to",
                     f"{room / 1e9:.2f} GB", "To keep ratio 2, use --mem-fraction-static"):
        assert fragment in warning, warning
    # The suggested fraction really keeps ratio 2 within the budget.
    suggested = float(re.search(r"--mem-fraction-static ([0-9.]+) or lower", warning).group(1))
    assert 0.3 < suggested < 0.5
    _, kept = plan("dgx_spark", mem_fraction_static=suggested, enable_hierarchical_cache=True, hicache_ratio=2.0)
    assert kept.warnings == [] and kept.hicache_ratio == pytest.approx(2.0, abs=0.01)


def test_unified_overcommitting_hicache_size_is_reduced():
    f, p = plan("apple_m2_max_mlx", weight_bytes=2_000_000_000, enable_hierarchical_cache=True, hicache_size_gb=500,
                mem_fraction_static=0.2)
    assert p.host_kv_bytes < 500e9 and p.host_kv_tokens > p.device_kv_tokens
    assert "--hicache-size 500 GB" in p.warnings[0]
    assert used_bytes(p) + p.headroom_bytes <= f.ram_available_bytes


def test_unified_reduction_below_the_device_tier_is_refused():
    with pytest.raises(MemoryPlanError, match="host tier must be larger than the device tier"):
        plan("dgx_spark", mem_fraction_static=0.8, enable_hierarchical_cache=True, hicache_ratio=2.0)


def test_unified_weights_that_do_not_fit_are_refused():
    with pytest.raises(MemoryPlanError, match="do not fit"):
        plan("apple_m1_no_mlx", decision=Decision("torch", "cpu"), weight_bytes=7 * GiB)


def test_apple_metal_working_set_caps_weights_plus_device_kv():
    f = machine("apple_m2_max_mlx", ram_available_bytes=62 * GiB, device_memory_total_bytes=40 * GiB)
    p = plan_memory(f, choose_backend(f, {}), weight_bytes=W_8B, kv_bytes_per_token=KV_8B, page_size=16)
    assert p.weight_bytes + p.device_kv_bytes <= 40 * GiB
    assert p.device_kv_tokens == (40 * GiB - W_8B) // KV_8B // 16 * 16
    assert any("working set" in r for r in p.reasons)


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_discrete_gpu_sizes_device_kv_as_sglang(name):
    f, p = plan(name)
    frac = default_gpu_fraction(f.device_memory_total_bytes)
    l1 = f.device_memory_free_bytes - W_8B - f.device_memory_total_bytes * (1 - frac)
    assert p.memory_kind == "discrete" and p.mem_fraction_static == frac
    assert p.device_kv_tokens == int(l1 // KV_8B) // 16 * 16
    assert 0.85 < frac < 0.92


def test_default_gpu_fraction_leaves_more_room_on_small_gpus():
    assert 0.74 < default_gpu_fraction(8 * GiB) < default_gpu_fraction(80 * GiB) < 0.9


def test_discrete_host_tier_comes_from_ram_at_the_ratio():
    f, p = plan("h100", enable_hierarchical_cache=True, hicache_ratio=3.0)
    assert p.host_kv_tokens == (3 * p.device_kv_bytes) // (KV_8B * 16) * 16
    assert p.hicache_ratio == pytest.approx(3.0, abs=0.01) and p.warnings == []


def test_discrete_host_tier_larger_than_ram_is_an_error_with_the_fix():
    with pytest.raises(MemoryPlanError) as e:
        plan("h100", enable_hierarchical_cache=True, hicache_size_gb=3000)
    msg = str(e.value)
    assert "--hicache-size 3000 GB needs 3000.00 GB" in msg and "host RAM" in msg
    assert "Use --hicache-ratio" in msg and "--hicache-size 2029" in msg


def test_discrete_weights_larger_than_the_gpu_are_an_error():
    with pytest.raises(MemoryPlanError, match="no GPU memory left.*Raise --mem-fraction-static"):
        plan("h100", weight_bytes=90_000_000_000)


def test_discrete_gpu_without_memory_figures_asks_for_explicit_sizes():
    f = machine("h100", device_memory_total_bytes=None, device_memory_free_bytes=None)
    with pytest.raises(MemoryPlanError, match="--max-total-tokens"):
        plan_memory(f, Decision("torch", "cuda"), weight_bytes=W_8B, kv_bytes_per_token=KV_8B)


@pytest.mark.parametrize("name", ["cpu_x86_64", "cpu_aarch64"])
def test_cpu_device_kv_is_a_fraction_of_available_ram(name):
    f, p = plan(name, weight_bytes=1_000_000_000)
    assert p.memory_kind == "cpu"
    l1 = min(DEFAULT_CPU_FRACTION * f.ram_available_bytes - 1e9, DEFAULT_CPU_KV_SHARE * f.ram_total_bytes)
    assert p.device_kv_tokens == int(l1 // KV_8B) // 16 * 16


def test_cpu_default_hicache_fits_and_explicit_overcommit_is_an_error():
    f, p = plan("cpu_x86_64", weight_bytes=1_000_000_000, enable_hierarchical_cache=True)
    assert used_bytes(p) + p.headroom_bytes <= f.ram_available_bytes and p.hicache_ratio == pytest.approx(2, abs=0.01)
    with pytest.raises(MemoryPlanError) as e:
        plan("cpu_x86_64", weight_bytes=1_000_000_000, enable_hierarchical_cache=True, mem_fraction_static=0.3,
             hicache_ratio=3.0)
    msg = str(e.value)
    assert "--hicache-ratio 3 x device KV" in msg and "exceeds the" in msg and "drop --mem-fraction-static" in msg
    fit = float(re.search(r"Use --hicache-ratio ([0-9.]+)", msg).group(1))
    assert 1 < fit < 3  # and that ratio does fit:
    plan("cpu_x86_64", weight_bytes=1_000_000_000, enable_hierarchical_cache=True, mem_fraction_static=0.3,
         hicache_ratio=fit)
    with pytest.raises(MemoryPlanError, match="host tier must be larger than the device tier"):
        plan("cpu_x86_64", weight_bytes=1_000_000_000, enable_hierarchical_cache=True, mem_fraction_static=0.6)


def test_device_cpu_on_a_gpu_machine_plans_in_ram():
    f, p = plan("dgx_spark", decision=Decision("torch", "cpu"))
    assert p.memory_kind == "cpu" and p.available_bytes == f.ram_available_bytes


def test_max_total_tokens_caps_device_kv_to_whole_pages():
    _, p = plan("h100", max_total_tokens=10_000)
    assert p.device_kv_tokens == 10_000 // 16 * 16
    assert any("--max-total-tokens 10000" in r for r in p.reasons)


def test_plan_memory_for_args_reads_server_args():
    f = machine("dgx_spark")
    d = choose_backend(f, {})
    args = ServerArgs(page_size=32, mem_fraction_static=0.5, enable_hierarchical_cache=True, hicache_ratio=1.5,
                      max_total_tokens=200_000)
    direct = plan_memory(f, d, weight_bytes=W_8B, kv_bytes_per_token=KV_8B, page_size=32, mem_fraction_static=0.5,
                         enable_hierarchical_cache=True, hicache_ratio=1.5, max_total_tokens=200_000)
    assert plan_memory_for_args(f, d, args, weight_bytes=W_8B, kv_bytes_per_token=KV_8B) == direct
    assert direct.device_kv_tokens == 200_000 // 32 * 32


def test_size_kv_tiers_caps_by_context_and_sizes_the_host_tier_from_the_capped_pool():
    f = machine("h100")
    d = choose_backend(f, {})
    args = ServerArgs(enable_hierarchical_cache=True, hicache_ratio=2.0)  # page 16, 32 running requests
    tiers = size_kv_tiers(f, d, args, weight_bytes=W_8B, kv_bytes_per_token=KV_8B, context_length=2048)
    assert tiers.device_tokens == 4 * 2048 * 32 and tiers.device_pages == 4 * 2048 * 32 // 16
    assert tiers.host_pages == 2 * tiers.device_pages and tiers.hicache_ratio == 2.0
    assert any("capped at 4 x context length 2048 x max running requests 32" in r for r in tiers.reasons)
    # --max-total-tokens replaces the context cap; a pool is never smaller than two pages.
    tiny = size_kv_tiers(f, d, ServerArgs(max_total_tokens=1), weight_bytes=W_8B, kv_bytes_per_token=KV_8B,
                         context_length=2048)
    assert (tiny.device_pages, tiny.host_pages) == (2, 0)
    assert any("holds only 32 tokens" in w for w in tiny.warnings)


def test_size_kv_tiers_in_bytes_names_no_tokens():
    f = machine("h100")
    tiers = size_kv_tiers(f, choose_backend(f, {}), ServerArgs(), weight_bytes=0, kv_bytes_per_token=None,
                          context_length=None)
    out = tiers.to_dict()
    assert out["sized_in"] == "bytes" and out["device_kv_bytes"] == tiers.memory.device_kv_tokens > 0
    assert not [k for k in out if "token" in k or "page" in k]


# ---------------------------------------------------------------------------------------------- pitfalls

PITFALLS = [
    # machine, env, fragments every one of which must appear in some line, fragments none may contain
    ("dgx_spark", {}, ["false alarm", "TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas", "Found GPU0 NVIDIA GB10"],
     ["needs a CUDA 13 build"]),
    ("dgx_spark", {"TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas"}, ["false alarm"], ["TRITON_PTXAS_PATH="]),
    ("dgx_spark_cu128", {}, ["needs a CUDA 13 build of torch for aarch64 (cu130)", "CUDA 12.8",
                             "pip install -r wheels/nvidia-arm64-cu130.txt"], []),
    ("gpu_box_cpu_torch", {}, ["CPU build", "pip install -r wheels/nvidia-x86_64-cu130.txt"], []),
    ("apple_m1_no_mlx", {}, ["pip install -r wheels/apple-silicon.txt"], []),
    ("apple_rosetta", {}, ["Rosetta", "arm64 Python"], []),
    ("jetson_orin_cpu_torch", {}, ["JetPack 6", "pypi.jetson-ai-lab.io/jp6/cu126"], []),
]


@pytest.mark.parametrize("name, env, present, absent", PITFALLS)
def test_pitfalls(name, env, present, absent):
    lines = pitfalls(machine(name), env)
    for fragment in present:
        assert any(fragment in line for line in lines), (fragment, lines)
    for fragment in absent:
        assert not any(fragment in line for line in lines), (fragment, lines)


@pytest.mark.parametrize("name", ["h100", "h200", "apple_m2_max_mlx", "cpu_x86_64", "cpu_aarch64", "jetson_orin"])
def test_healthy_machines_have_no_pitfalls(name):
    assert pitfalls(machine(name), {}) == []


@pytest.mark.parametrize("name, command", [
    ("dgx_spark", "pip install -r wheels/nvidia-arm64-cu130.txt"),
    ("h100", "pip install -r wheels/nvidia-x86_64-cu130.txt"),
    ("gpu_box_cpu_torch", "pip install -r wheels/nvidia-x86_64-cu130.txt"),
    ("apple_m2_max_mlx", "pip install -r wheels/apple-silicon.txt"),
    ("apple_rosetta", "pip install -r wheels/apple-silicon.txt"),
    ("cpu_x86_64", "pip install -r wheels/cpu.txt"),
    ("cpu_aarch64", "pip install -r wheels/cpu.txt"),
    ("jetson_orin", "pip install torch --index-url https://pypi.jetson-ai-lab.io/jp6/cu126 && pip install -e ."),
    ("jetson_orin", None),  # Thor (sm_110, JetPack 7) takes the cu130 set: checked below
])
def test_install_command(name, command):
    if command is None:
        thor = machine(name, compute_capability=(11, 0), board_model="NVIDIA Jetson AGX Thor Developer Kit")
        assert install_command(thor) == "pip install -r wheels/nvidia-arm64-cu130.txt"
    else:
        assert install_command(machine(name)) == command


# ------------------------------------------------------------------------------------------------ doctor


def run_doctor(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_MLX", "TIERLM_BACKEND")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "tierlm.server.commands.doctor", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)


def test_doctor_json_reports_torch_on_cpu_here():
    out = run_doctor("--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["decision"]["backend"], report["decision"]["device"]) == ("torch", "cpu")
    assert report["install_command"] == "pip install -r wheels/cpu.txt"
    assert report["facts"]["torch_version"].startswith("2.13.0") and report["errors"] == []
    assert report["memory"]["memory_kind"] == "cpu" and report["memory"]["device_kv_bytes"] > 0


@pytest.mark.mlx
def test_doctor_reports_mlx_with_sglang_use_mlx():
    out = run_doctor("--json", env_extra={"SGLANG_USE_MLX": "1"})
    assert out.returncode == 0, out.stderr
    decision = json.loads(out.stdout)["decision"]
    assert decision["backend"] == "mlx" and "SGLANG_USE_MLX=1 selects the mlx backend" in decision["reasons"]


@pytest.mark.parametrize("as_json", [True, False])
def test_doctor_without_mlx_gives_a_clear_error(monkeypatch, capsys, as_json):
    monkeypatch.setattr(doctor_cmd, "detect", lambda: machine("cpu_aarch64"))
    monkeypatch.setenv("SGLANG_USE_MLX", "1")
    monkeypatch.delenv("TIERLM_BACKEND", raising=False)
    assert doctor_cmd.main(["--json"] if as_json else []) == 1
    out = capsys.readouterr().out
    assert 'pip install \\"mlx[cpu]\\" mlx-lm' in out if as_json else 'pip install "mlx[cpu]" mlx-lm' in out
    if as_json:
        assert json.loads(out)["decision"] is None


def test_doctor_text_on_a_recorded_dgx_spark(monkeypatch, capsys):
    monkeypatch.setattr(doctor_cmd, "detect", lambda: machine("dgx_spark"))
    monkeypatch.delenv("SGLANG_USE_MLX", raising=False)
    monkeypatch.delenv("TIERLM_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    assert doctor_cmd.main(["--enable-hierarchical-cache"]) == 0
    out = capsys.readouterr().out
    for fragment in ("Machine (dgx-spark)", "NVIDIA GB10 (cuda, sm_121)", "torch on cuda", "host KV (L2)",
                     "OS's available memory", "pip install -r wheels/nvidia-arm64-cu130.txt", "false alarm",
                     "TRITON_PTXAS_PATH"):
        assert fragment in out, fragment


def test_doctor_sizes_tiers_in_tokens_for_a_local_model(tmp_path, monkeypatch, capsys):
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, hidden_size=256, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(1024, np.float32)}, str(tmp_path / "model.safetensors"))  # served as bf16: 2 KiB
    monkeypatch.setattr(doctor_cmd, "detect", lambda: machine("h100"))
    monkeypatch.delenv("SGLANG_USE_MLX", raising=False)
    monkeypatch.delenv("TIERLM_BACKEND", raising=False)
    assert doctor_cmd.main(["--json", "--model-path", str(tmp_path), "--max-total-tokens", "4096"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 2 and report["model"]["weight_bytes"] == 2048
    assert report["memory"]["device_kv_tokens"] == 4096 and report["memory"]["kv_bytes_per_token"] == 1024
    assert report["architecture"] == {"architecture": "LlamaForCausalLM", "model_type": "llama", "verified": True}


def _cpu_model(folder: Path) -> Path:
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, hidden_size=256, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(1024, np.float32)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("env", [{}, {"TIERLM_CPU_PLAN": "decode_attention=torch,fused_projections=no"},
                                 {"TIERLM_CPU_KERNELS": "0"}])
def test_doctor_reports_the_cpu_plan_serve_builds(tmp_path, monkeypatch, capsys, env):
    """torch on this CPU: doctor's cpu_kernels are the CPU plan's fields (platforms/cpu_plan.py), each "value (why)",
    decided from the model's config and the kernel library the install built, plus the library, the decode step and
    the weight pages; the text report shows them."""
    from tierlm.backends.torch.cpu import library
    from tierlm.platforms import cpu_plan
    from tierlm.platforms.facts import detect

    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the library's switch is read from the process, as serve reads it
    facts = detect()
    report = doctor_cmd.diagnose(facts, {"TIERLM_BACKEND": "torch", **env},
                                 ["--json", "--model-path", str(_cpu_model(tmp_path)), "--device", "cpu"])
    assert report["errors"] == [], report["errors"]
    model = report["model"]
    lib = library.installed_facts(facts.cpu, env)
    plan = cpu_plan.decide(facts.cpu, cpu_plan.ModelFacts(model["dtype"], model["kv_cache_dtype"], 8, 2, 32,
                                                          model.get("weight_format") or "none"), lib, env)
    kernels = report["cpu_kernels"]
    fields = {name: f"{c['value']} ({c['why']})" for name, c in plan.to_dict().items()
              if name not in ("cpu", "kernels")}
    assert set(kernels) == set(fields) | {"kernel_library", "decode_step", "weight_pages"}
    assert {k: v for k, v in kernels.items() if k in fields} == fields
    assert kernels["kernel_library"] == f"{lib.level or 'none'} ({lib.why})"
    if "TIERLM_CPU_KERNELS" in env:
        assert kernels["kernel_library"] == "none (TIERLM_CPU_KERNELS=0)"
        assert kernels["decode_attention"].startswith("torch (no kernel library (TIERLM_CPU_KERNELS=0))")
    if "TIERLM_CPU_PLAN" in env:
        assert kernels["decode_attention"] == "torch (TIERLM_CPU_PLAN decode_attention=torch)"
        assert kernels["fused_projections"] == "no (TIERLM_CPU_PLAN fused_projections=no)"
    text = doctor_cmd.render_text(report)
    for label in ("kernel library", "decode attn", "prefill attn", "decode step", "weight pages"):
        assert label in text, label


def test_doctor_reports_an_override_the_plan_cannot_run_as_an_error(tmp_path):
    """A well-formed override of a value this CPU or its library cannot run: an error with the reason, as at
    startup, and no plan."""
    from tierlm.platforms.facts import detect

    facts = detect()
    if facts.cpu.has("amx_bf16", "amx_tile"):
        pytest.skip("this CPU runs the AMX kernel")
    env = {"TIERLM_BACKEND": "torch", "TIERLM_CPU_PLAN": "decode_products=amx"}
    report = doctor_cmd.diagnose(facts, env, ["--json", "--model-path", str(_cpu_model(tmp_path)), "--device", "cpu",
                                              "--dtype", "bfloat16"])
    if report["model"]["dtype"] != "bfloat16" or not facts.cpu.onednn_bf16_prepack[0]:
        pytest.skip("no packed bf16 weights here: the decode-product kernels do not apply")
    assert any("decode_products=amx cannot run here" in e for e in report["errors"]), report["errors"]
    assert report["cpu_kernels"] is None


def test_tierlm_cli_dispatches_doctor(capsys, monkeypatch):
    from tierlm.cli import main as cli_main

    monkeypatch.setattr(doctor_cmd, "detect", lambda: machine("apple_m2_max_mlx"))
    monkeypatch.delenv("SGLANG_USE_MLX", raising=False)
    monkeypatch.delenv("TIERLM_BACKEND", raising=False)
    assert cli_main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["decision"]["backend"], report["decision"]["device"]) == ("mlx", "mps")
    assert report["install_command"] == "pip install -r wheels/apple-silicon.txt"
