"""Every CPU-class decision (platforms/cpu_features.py) from recorded /proc/cpuinfo texts of real machines
(tests/data/cpuinfo/), so the AVX2, AVX-512, AMX and aarch64 paths are all decided and checked on any machine;
the TIERLM_CPU_ISA cap; and Facts carrying the CPU through a recording."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierlm.backends.dtypes import dtype_decision
from tierlm.platforms.backend_choice import BackendChoiceError, choose_backend
from tierlm.platforms.cpu_features import CpuIsaError, apply_cap, detect_cpu, known_flags, parse_cpuinfo
from tierlm.platforms.facts import Facts

RECORDED = Path(__file__).parent / "data" / "cpuinfo"
GiB = 1 << 30


def recorded(name: str, arch: str):
    return parse_cpuinfo((RECORDED / name).read_text(), arch)


# file, arch, level, native bf16, oneDNN bf16 prepacking, target flags of the C kernel, physical cores
MACHINES = [
    ("amd-epyc-zen3-avx2.txt", "x86_64", "avx2", None, False, ("-march=x86-64-v3",), 1),
    ("intel-xeon-skylake-avx512.txt", "x86_64", "avx512", None, True, ("-march=x86-64-v4",), 2),
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", "amx", "amx_bf16", True,
     ("-march=x86-64-v4", "-mavx512bf16"), 2),
    ("aws-graviton3-neoverse-v1.txt", "aarch64", "sve", "bf16", False, ("-march=armv8.6-a+sve",), 0),
    ("nvidia-grace-neoverse-v2.txt", "aarch64", "sve2", "bf16", False, ("-march=armv9-a+bf16+i8mm",), 0),
    ("ampere-altra-neoverse-n1.txt", "aarch64", "dotprod", None, False, ("-march=armv8.2-a+dotprod+fp16",), 0),
]


@pytest.mark.parametrize("name, arch, level, bf16, prepack, flags, cores", MACHINES)
def test_each_recorded_machine_gets_its_decisions(name, arch, level, bf16, prepack, flags, cores):
    cpu = recorded(name, arch)
    assert cpu.level == level
    assert cpu.native_bf16 == bf16
    assert cpu.onednn_bf16_prepack[0] is prepack and cpu.onednn_bf16_prepack[1]
    assert cpu.compile_flags == flags
    assert cpu.physical_cores == cores
    assert cpu.model_name  # x86 "model name", aarch64 named from its CPU part
    # --dtype auto on torch/CPU: bf16 exactly where the CPU has native bf16 matmuls
    expected = "bfloat16" if bf16 else "float32"
    assert dtype_decision("auto", "cpu", "bfloat16", cpu_bf16=bf16 is not None)[0] == expected


def test_the_smt_machine_counts_cores_not_hardware_threads():
    epyc = recorded("amd-epyc-zen3-avx2.txt", "x86_64")  # 1 core, 2 hardware threads
    from tierlm.platforms.thread_count import cpu_thread_count, usable_cores

    cores, counted = usable_cores(epyc, logical=2, total=2)
    assert cores == 1 and "2 hardware threads" in counted
    assert cpu_thread_count({}, cores, counted)[0] == 1
    spr = recorded("intel-xeon-sapphire-rapids-amx.txt", "x86_64")  # 2 cores x 2 threads
    assert usable_cores(spr, logical=4, total=4)[0] == 2
    assert usable_cores(spr, logical=2, total=4)[0] == 1  # a cpuset of half the machine
    skylake = recorded("intel-xeon-skylake-avx512.txt", "x86_64")  # no SMT: every CPU is a core
    assert usable_cores(skylake, logical=2, total=2) == (2, "2 usable cores")


@pytest.mark.parametrize("cap, level, prepack, bf16", [
    ("avx512_bf16", "avx512_bf16", True, "avx512_bf16"),
    ("avx512", "avx512", True, None),
    ("avx2", "avx2", False, None),
    ("x86-64", "x86-64", False, None),
])
def test_a_cap_makes_an_amx_machine_decide_like_a_lower_one(cap, level, prepack, bf16):
    cpu = apply_cap(recorded("intel-xeon-sapphire-rapids-amx.txt", "x86_64"), cap)
    assert (cpu.level, cpu.onednn_bf16_prepack[0], cpu.native_bf16) == (level, prepack, bf16)
    assert cpu.cap == cap and "amx_bf16" in cpu.dropped
    # the capped machine is exactly the recorded AVX2 one in every flag a decision reads
    if cap == "avx2":
        epyc = recorded("amd-epyc-zen3-avx2.txt", "x86_64")
        assert cpu.flags & known_flags("x86_64") == epyc.flags & known_flags("x86_64")


def test_a_cap_never_adds_what_the_cpu_lacks_and_a_bad_one_names_the_levels():
    epyc = recorded("amd-epyc-zen3-avx2.txt", "x86_64")
    assert apply_cap(epyc, "amx").level == "avx2" and apply_cap(epyc, "amx").dropped == ()
    assert apply_cap(epyc, "auto") == epyc
    grace = recorded("nvidia-grace-neoverse-v2.txt", "aarch64")
    capped = apply_cap(grace, "neon")
    assert capped.level == "neon" and capped.native_bf16 is None and "sve2" in capped.dropped
    with pytest.raises(CpuIsaError, match="x86-64, avx2, avx512, avx512_bf16, amx"):
        apply_cap(epyc, "sve")
    with pytest.raises(CpuIsaError, match="neon, dotprod, bf16, sve, sve2"):
        detect_cpu(env={"TIERLM_CPU_ISA": "avx2"}, cpuinfo=(RECORDED / "nvidia-grace-neoverse-v2.txt").read_text(),
                   machine="aarch64")


def test_an_unknown_architecture_decides_nothing_it_cannot_know():
    cpu = parse_cpuinfo("processor : 0\nisa : rv64imafdc\n", "riscv64")
    assert cpu.level == "unknown" and cpu.compile_flags == () and cpu.native_bf16 is None
    assert cpu.onednn_bf16_prepack[0] is False


def _facts(**kw) -> Facts:
    return Facts(os_name="Linux", arch="x86_64", cpu_count=2, ram_total_bytes=16 * GiB,
                 ram_available_bytes=12 * GiB, python_version="3.11.9", torch_version="2.13.0", **kw)


def test_facts_record_the_cpu_and_replay_it():
    cpu = recorded("intel-xeon-sapphire-rapids-amx.txt", "x86_64")
    facts = _facts(cpu_flags=tuple(sorted(cpu.flags & known_flags("x86_64"))), cpu_model=cpu.model_name,
                   cpu_physical_cores=cpu.physical_cores)
    again = Facts.from_dict(facts.to_dict())
    assert again == facts and again.cpu.level == "amx" and again.cpu_bf16 == "amx_bf16"
    d = choose_backend(again, {}, "cpu")
    assert d.native_bf16 and any("CPU level amx" in r for r in d.reasons)
    legacy = facts.to_dict() | {"cpu_bf16": "avx512_bf16", "cpu_flags": []}  # a recording from before cpu_flags
    assert Facts.from_dict(legacy).cpu_bf16 == "avx512_bf16"


def test_a_bad_cap_stops_the_platform_decision_with_the_reason():
    with pytest.raises(BackendChoiceError, match="TIERLM_CPU_ISA='avx3'"):
        choose_backend(_facts(cpu_isa_error="TIERLM_CPU_ISA='avx3' names no x86_64 instruction level; use one of: "
                                            "x86-64, avx2, avx512, avx512_bf16, amx (or auto)"), {}, "cpu")


def test_server_info_names_the_cpu_and_the_kernel_of_each_layer_type(tiny_llama):
    from engine_harness import start_engine

    from tierlm.platforms.cpu_features import this_cpu

    engine = start_engine(tiny_llama, dtype="bfloat16", device="cpu")
    try:
        info = engine.server_info()
    finally:
        engine.shutdown()
    cpu, kernels = info["cpu"], info["kernels"]
    assert cpu["level"] == this_cpu().level and cpu["features"] and "onednn_bf16_prepack_why" in cpu
    assert set(kernels) == {"linear", "prefill_attention", "decode_attention", "weight_pages", "last_layer"}
    assert kernels["last_layer"] == "read rows only"  # last_layer_rows.py: llama is covered
    # the linear kernel named is the one the CPU decision allows
    assert ("oneDNN-prepacked" in kernels["linear"]) == (cpu["onednn_bf16_prepack"] and
                                                         "refuses" not in kernels["linear"])
    from tierlm.backends.torch.cpu_linear import decode_kernel

    # tiny_llama's projections are whole blocks of 64 columns: they take the decode-product kernel where it runs
    kernel = decode_kernel() if "oneDNN-prepacked" in kernels["linear"] else None
    assert ("kernel over the packed weight" in kernels["linear"]) == (kernel is not None)
    if kernel is not None:
        assert f"rows on tierlm's {kernel.NAME} kernel" in kernels["linear"]
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    assert f"q/k/v fused in {layers} layers, gate/up in {layers}" in kernels["linear"]  # fused_projections.py
    from tierlm.backends.torch import cpu_paged_decode

    from tierlm.backends.torch import cpu_blocked_attention

    blocked = cpu_paged_decode.load() is not None and cpu_blocked_attention.choice()[0] == "blocked"
    assert ("blocked bf16 GEMMs" in kernels["prefill_attention"]) == blocked
    sdpa = cpu_blocked_attention.choice()[0] == "sdpa"
    assert (cpu_blocked_attention.choice()[1] in kernels["prefill_attention"]) == sdpa  # SDPA says why it runs


@pytest.mark.parametrize("name, arch, streams", [("amd-epyc-zen3-avx2.txt", "x86_64", True),
                                                 ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", True),
                                                 ("nvidia-grace-neoverse-v2.txt", "aarch64", False)])
def test_doctor_plans_int8_weights_on_the_streaming_kernel_where_x86_vector_code_runs(name, arch, streams):
    from tierlm.platforms.cpu_features import cpu_kernel_plan, int8_weights

    cpu = recorded(name, arch)
    for fmt in ("torchao:int8wo+embedding", "checkpoint:compressed-tensors-w8a8-int8",
                "checkpoint:compressed-tensors-w8a16-channel"):
        assert int8_weights(fmt)
        plan = cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc", fmt)["linear"]
        assert ("C streaming kernel" in plan) == streams and ("_weight_int8pack_mm" in plan) != streams, plan
    fmt = "torchao:int8wo+embedding"
    assert "_weight_int8pack_mm" in cpu_kernel_plan(cpu, "float32", "float32", None, fmt)["linear"]  # no compiler
    assert "TIERLM_CPU_INT8_GEMV=0" in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc", fmt,
                                                       {"TIERLM_CPU_INT8_GEMV": "0"})["linear"]
    assert "not float16" in cpu_kernel_plan(cpu, "float16", "float16", "cc", fmt)["linear"]
    # torchao's own int8wo path (TIERLM_CPU_QUANT_LINEAR=0 drops "+embedding"), and int8 loaded dequantized
    for fmt in ("none", "torchao:int8wo", "torchao:int8dq", "torchao:int4wo-128+embedding",
                "checkpoint:compressed-tensors-w4a16-g128", "checkpoint:compressed-tensors-w8a16-g128",
                "checkpoint:compressed-tensors-w8a16-channel-asym"):
        assert not int8_weights(fmt)
        assert "int8" not in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc", fmt)["linear"]


@pytest.mark.parametrize("name, arch, cap, amx", [
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", None, True),
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", "avx512_bf16", False),  # the cap rules AMX out
    ("intel-xeon-skylake-avx512.txt", "x86_64", None, False),
    ("amd-epyc-zen3-avx2.txt", "x86_64", None, False),
    ("nvidia-grace-neoverse-v2.txt", "aarch64", None, False),
])
def test_doctor_plans_decode_sized_bf16_products_on_the_amx_kernel_where_amx_runs(name, arch, cap, amx):
    from tierlm.platforms.cpu_features import cpu_kernel_plan

    cpu = apply_cap(recorded(name, arch), cap)
    kernel = "AMX kernel over the packed weight"
    assert (kernel in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc")["linear"]) == amx
    assert kernel not in cpu_kernel_plan(cpu, "float32", "float32", "cc")["linear"]
    assert kernel not in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", None)["linear"]  # no compiler
    for env in ({"TIERLM_CPU_AMX_LINEAR": "0"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}):
        assert kernel not in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc", env=env)["linear"]
    if amx:  # oneDNN capped at an AMX level still runs tiles
        env = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}
        assert kernel in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc", env=env)["linear"]


@pytest.mark.parametrize("name, cap, avx512", [
    ("amd-epyc-zen4-avx512bf16.txt", None, True),
    ("intel-xeon-sapphire-rapids-amx.txt", None, False),  # oneDNN packs for AMX tiles: the AMX kernel's
    ("intel-xeon-sapphire-rapids-amx.txt", "avx512_bf16", True),  # the cap rules AMX out
    ("intel-xeon-skylake-avx512.txt", None, False),  # no AVX512-BF16
    ("amd-epyc-zen3-avx2.txt", None, False),
])
def test_doctor_plans_decode_sized_bf16_products_on_the_avx512_bf16_kernel_where_it_runs(name, cap, avx512):
    from tierlm.platforms.cpu_features import cpu_kernel_plan

    cpu = apply_cap(recorded(name, "x86_64"), cap)
    assert cpu.level == (cap or cpu.level)
    kernel = "AVX512-BF16 kernel over the packed weight"
    assert (kernel in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc")["linear"]) == avx512
    assert kernel not in cpu_kernel_plan(cpu, "float32", "float32", "cc")["linear"]
    assert kernel not in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", None)["linear"]  # no compiler
    for env in ({"TIERLM_CPU_AVX512_LINEAR": "0"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}):
        assert kernel not in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc", env=env)["linear"]


@pytest.mark.parametrize("name, arch, cap, expected", [
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", None, "sdpa"),  # torch's flash kernel runs on AMX tiles
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", "avx512_bf16", "blocked"),  # the cap rules AMX out
    ("intel-xeon-skylake-avx512.txt", "x86_64", None, "blocked"),
    ("amd-epyc-zen3-avx2.txt", "x86_64", None, "blocked"),
    ("nvidia-grace-neoverse-v2.txt", "aarch64", None, "blocked"),
])
def test_bf16_prefill_attention_is_torch_sdpa_on_amx_and_the_blocked_path_elsewhere(name, arch, cap, expected):
    from tierlm.platforms.cpu_features import bf16_prefill_attention, cpu_kernel_plan

    cpu = apply_cap(recorded(name, arch), cap)
    assert bf16_prefill_attention(cpu, {})[0] == expected
    plan = cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc")["prefill_attention"]
    assert plan.startswith("torch SDPA" if expected == "sdpa" else "blocked bf16 GEMMs"), plan
    f32 = cpu_kernel_plan(cpu, "float32", "float32", "cc")["prefill_attention"]
    assert f32.startswith("torch SDPA") and ("C float32 paged extend kernel" in f32) == (arch == "x86_64"), f32
    assert cpu_kernel_plan(cpu, "float32", "float32", None)["prefill_attention"] == "torch SDPA"
    assert cpu_kernel_plan(cpu, "float32", "float32", "cc", env={"TIERLM_CPU_PAGED_DECODE": "0"})[
        "prefill_attention"] == "torch SDPA"
    assert cpu_kernel_plan(cpu, "bfloat16", "bfloat16", None)["prefill_attention"].startswith("torch SDPA")
    off = cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc", env={"TIERLM_CPU_PAGED_DECODE": "0"})
    assert off["prefill_attention"].startswith("torch SDPA") and "TIERLM_CPU_PAGED_DECODE=0" in off["decode_attention"]
    for forced in ("blocked", "sdpa"):  # the switch wins over the CPU, and the plan says why
        env = {"TIERLM_CPU_PREFILL_ATTENTION": forced.upper()}
        assert bf16_prefill_attention(cpu, env) == (forced, f"TIERLM_CPU_PREFILL_ATTENTION={forced}")
        assert f"TIERLM_CPU_PREFILL_ATTENTION={forced}" in cpu_kernel_plan(cpu, "bfloat16", "bfloat16", "cc",
                                                                         env=env)["prefill_attention"]


def test_a_misspelt_prefill_attention_switch_stops_startup_with_the_choices():
    from tierlm.platforms.cpu_features import bf16_prefill_attention

    cpu = recorded("intel-xeon-sapphire-rapids-amx.txt", "x86_64")
    with pytest.raises(ValueError, match="auto, blocked, sdpa"):
        bf16_prefill_attention(cpu, {"TIERLM_CPU_PREFILL_ATTENTION": "flash"})
    facts = _facts(cpu_flags=tuple(sorted(cpu.flags & known_flags("x86_64"))))
    assert choose_backend(facts, {}).backend == "torch"
    with pytest.raises(BackendChoiceError, match="TIERLM_CPU_PREFILL_ATTENTION='flash'"):
        choose_backend(facts, {"TIERLM_CPU_PREFILL_ATTENTION": "flash"})
