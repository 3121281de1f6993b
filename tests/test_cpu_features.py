"""Every CPU-class decision (platforms/cpu_features.py, and the kernel choices of the CPU plan that doctor reports,
platforms/cpu_plan.py) from recorded /proc/cpuinfo texts of real machines (tests/data/cpuinfo/), so the AVX2,
AVX-512, AMX and aarch64 paths are all decided and checked on any machine; the TIERLM_CPU_ISA cap; and Facts
carrying the CPU through a recording."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierlm.backends.dtypes import dtype_decision
from tierlm.platforms.backend_choice import BackendChoiceError, choose_backend
from tierlm.platforms.cpu_features import CpuFeatures, CpuIsaError, apply_cap, detect_cpu, known_flags, parse_cpuinfo
from tierlm.platforms.cpu_plan import Choice, CpuPlanError, LibraryFacts, ModelFacts, decide, int8_weights
from tierlm.platforms.facts import Facts

RECORDED = Path(__file__).parent / "data" / "cpuinfo"
GiB = 1 << 30


def recorded(name: str, arch: str):
    return parse_cpuinfo((RECORDED / name).read_text(), arch)


# file, arch, level, native bf16, oneDNN bf16 prepacking, physical cores
MACHINES = [
    ("amd-epyc-zen3-avx2.txt", "x86_64", "avx2", None, False, 1),
    ("intel-xeon-skylake-avx512.txt", "x86_64", "avx512", None, True, 2),
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", "amx", "amx_bf16", True, 2),
    ("aws-graviton3-neoverse-v1.txt", "aarch64", "sve", "bf16", False, 0),
    ("nvidia-grace-neoverse-v2.txt", "aarch64", "sve2", "bf16", False, 0),
    ("ampere-altra-neoverse-n1.txt", "aarch64", "dotprod", None, False, 0),
]


@pytest.mark.parametrize("name, arch, level, bf16, prepack, cores", MACHINES)
def test_each_recorded_machine_gets_its_decisions(name, arch, level, bf16, prepack, cores):
    cpu = recorded(name, arch)
    assert cpu.level == level
    assert cpu.native_bf16 == bf16
    assert cpu.onednn_bf16_prepack[0] is prepack and cpu.onednn_bf16_prepack[1]
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
    assert cpu.level == "unknown" and cpu.native_bf16 is None
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
    import torch
    from engine_harness import start_engine

    from tierlm.backends.torch.cpu import plan as cpu_kernels
    from tierlm.backends.torch.cpu.linear import KERNELS
    from tierlm.platforms.cpu_features import this_cpu

    engine = start_engine(tiny_llama, dtype="bfloat16", device="cpu")
    try:
        info = engine.server_info()
    finally:
        engine.shutdown()
    cpu, kernels = info["cpu"], info["kernels"]
    assert cpu["level"] == this_cpu().level and cpu["features"] and "onednn_bf16_prepack_why" in cpu
    assert set(kernels) == {"linear", "prefill_attention", "decode_attention", "weight_pages", "last_layer", "plan",
                            "library"}
    assert kernels["last_layer"] == "read rows only"  # last_layer_rows.py: llama is covered
    # the plan this CPU and the process's library give the model, decided here apart from the server
    config = json.loads((tiny_llama / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    plan = cpu_kernels.for_model(torch.bfloat16, torch.bfloat16, heads, kv_heads, head_dim, env={}).plan
    assert {k: v["value"] for k, v in kernels["plan"].items() if k in plan.to_dict()} == \
        {k: v["value"] for k, v in plan.to_dict().items()}
    # the linear kernel named is the one the CPU decision allows
    assert ("oneDNN-prepacked" in kernels["linear"]) == (cpu["onednn_bf16_prepack"] and
                                                         plan.bf16_linear.value == "packed")
    # tiny_llama's projections are whole blocks of 64 columns: they take the decode-product kernel where it runs
    kernel = KERNELS.get(plan.decode_products.value) if "oneDNN-prepacked" in kernels["linear"] else None
    assert ("kernel over the packed weight" in kernels["linear"]) == (kernel is not None)
    if kernel is not None:
        assert f"rows on tierlm's {kernel.NAME} kernel" in kernels["linear"]
    layers = config["num_hidden_layers"]
    assert f"q/k/v fused in {layers} layers, gate/up in {layers}" in kernels["linear"]  # fused_projections.py
    prefill, choice = kernels["prefill_attention"], plan.prefill_attention
    assert ("blocked bf16" in prefill) == (choice.value in ("blocked", "one_pass"))
    assert ("blocked bf16 GEMMs" in prefill) == (choice.value == "blocked")
    assert ("in one AVX512-BF16 C pass" in prefill) == (choice.value == "one_pass")
    assert (choice.why in prefill) == (choice.value == "sdpa")  # SDPA says why it runs
    assert kernels["library"]["loaded"] == (plan.kernels.value != "none")


# The kernels each level's library has (backends/torch/cpu/csrc/registry.c), as LibraryFacts for recorded CPUs.
_BASE = {"paged_decode", "softmax_rows", "torch_ops"}
_X86 = {"x86-64": set(), "avx2": {"paged_extend_f32", "f32_gemv", "int8_gemv"},
        "avx512": {"paged_decode_avx512", "paged_extend_bf16"},
        "avx512_bf16": {"paged_decode_dp", "blocked_attention", "avx512_linear"},
        "amx": {"paged_extend_amx", "amx_linear"}}


def level_kernels(arch: str, level: str) -> frozenset[str]:
    """The kernels of ``level``'s library: x86 levels add to the one below; aarch64 libraries hold the plain-C
    kernels only."""
    if arch != "x86_64":
        return frozenset(_BASE)
    names = list(_X86)
    return frozenset(_BASE.union(*(_X86[lv] for lv in names[:names.index(level) + 1])))


def library(cpu: CpuFeatures) -> LibraryFacts:
    """What a server on ``cpu`` loads: its level's library (after any cap), AMX tile state granted where it has AMX."""
    return LibraryFacts(cpu.level, level_kernels(cpu.arch, cpu.level), f"the {cpu.level} library",
                        amx_granted=cpu.has("amx_bf16", "amx_tile"))


NO_LIBRARY = LibraryFacts(None, why="no kernel library for the test")


def plan_for(cpu: CpuFeatures, dtype: str = "bfloat16", lib: LibraryFacts | None = None, fmt: str = "none",
             env: dict[str, str] | None = None, head_dim: int = 64):
    return decide(cpu, ModelFacts(dtype, dtype, 8, 2, head_dim, fmt), library(cpu) if lib is None else lib, env or {})


def test_the_recorded_levels_kernels_are_the_installed_builds():
    """The table above says what each installed x86 library says it has (where the install built it)."""
    from tierlm.backends.torch.cpu import library as kernel_library
    from tierlm.platforms.cpu_features import this_cpu

    if this_cpu().arch != "x86_64":
        pytest.skip("the install holds this architecture's libraries only")
    try:
        manifest = kernel_library.read_manifest(kernel_library.INSTALLED, own=False)
    except kernel_library.LibraryRefused as e:
        pytest.skip(f"no installed build to compare with: {e}")
    built = manifest["libraries"]
    assert built
    for level, entry in built.items():
        assert frozenset(entry["kernels"]) == level_kernels("x86_64", level), level


@pytest.mark.parametrize("name, arch, streams", [("amd-epyc-zen3-avx2.txt", "x86_64", True),
                                                 ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", True),
                                                 ("nvidia-grace-neoverse-v2.txt", "aarch64", False)])
def test_doctor_plans_int8_weights_on_the_streaming_kernel_where_x86_vector_code_runs(name, arch, streams):
    cpu = recorded(name, arch)
    for fmt in ("torchao:int8wo+embedding", "checkpoint:compressed-tensors-w8a8-int8",
                "checkpoint:compressed-tensors-w8a16-channel"):
        assert int8_weights(fmt)
        plan = plan_for(cpu, fmt=fmt)
        assert plan.int8_products.value == ("gemv" if streams else "torch"), plan.int8_products
        # torchao replaces every linear; an int8 checkpoint's unquantized ones (its lm_head) are packed as bf16
        packs = "packed" if cpu.onednn_bf16_prepack[0] else "torch"
        assert plan.bf16_linear.value == ("n/a" if fmt.startswith("torchao:") else packs), (fmt, plan.bf16_linear)
    fmt = "torchao:int8wo+embedding"
    no_lib = plan_for(cpu, "float32", NO_LIBRARY, fmt).int8_products  # no kernel library
    assert no_lib.value == "torch" and "(none)" in no_lib.why, no_lib
    for env, why in (({"TIERLM_CPU_INT8_GEMV": "0"}, "TIERLM_CPU_INT8_GEMV=0"),
                     ({"TIERLM_CPU_PLAN": "int8_products=torch"}, "TIERLM_CPU_PLAN int8_products=torch")):
        assert plan_for(cpu, fmt=fmt, env=env).int8_products == Choice("torch", why)
    half = plan_for(cpu, "float16", fmt=fmt).int8_products
    assert half.value == "torch" and "not float16" in half.why
    if not streams:  # the override names a kernel this CPU's library lacks: refused with the reason
        with pytest.raises(CpuPlanError, match="int8_products=gemv cannot run here"):
            plan_for(cpu, fmt=fmt, env={"TIERLM_CPU_PLAN": "int8_products=gemv"})
    # torchao's own int8wo path (TIERLM_CPU_QUANT_LINEAR=0 drops "+embedding"), and int8 loaded dequantized
    for fmt in ("none", "torchao:int8wo", "torchao:int8dq", "torchao:int4wo-128+embedding",
                "checkpoint:compressed-tensors-w4a16-g128", "checkpoint:compressed-tensors-w8a16-g128",
                "checkpoint:compressed-tensors-w8a16-channel-asym"):
        assert not int8_weights(fmt)
        assert plan_for(cpu, fmt=fmt).int8_products.value == "n/a"


@pytest.mark.parametrize("name, arch, cap, amx", [
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", None, True),
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", "avx512_bf16", False),  # the cap rules AMX out
    ("intel-xeon-skylake-avx512.txt", "x86_64", None, False),
    ("amd-epyc-zen3-avx2.txt", "x86_64", None, False),
    ("nvidia-grace-neoverse-v2.txt", "aarch64", None, False),
])
def test_doctor_plans_decode_sized_bf16_products_on_the_amx_kernel_where_amx_runs(name, arch, cap, amx):
    cpu = apply_cap(recorded(name, arch), cap)
    assert (plan_for(cpu).decode_products.value == "amx") == amx
    assert plan_for(cpu, "float32").decode_products.value == "n/a"
    assert plan_for(cpu, lib=NO_LIBRARY).decode_products.value != "amx"  # no kernel library
    refused = LibraryFacts(cpu.level, library(cpu).kernels, "Linux refused the tile state", amx_granted=False)
    assert plan_for(cpu, lib=refused).decode_products.value != "amx"
    for env in ({"TIERLM_CPU_PLAN": "decode_products=onednn"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}):
        assert plan_for(cpu, env=env).decode_products.value != "amx"
    if amx:  # oneDNN capped at an AMX level still runs tiles
        env = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}
        assert plan_for(cpu, env=env).decode_products.value == "amx"
    elif plan_for(cpu).bf16_linear.value == "packed":  # an override cannot ask for tiles the plan cannot run
        with pytest.raises(CpuPlanError, match="decode_products=amx cannot run here"):
            plan_for(cpu, env={"TIERLM_CPU_PLAN": "decode_products=amx"})


# cpu_plan.RENAMED reads TIERLM_CPU_AMX_LINEAR=0 as decode_products=avx512_bf16, which the plan refuses (CpuPlanError,
# startup stops) where that kernel cannot run: on an AMX CPU (oneDNN packs for tiles) and on one without AVX512-BF16
@pytest.mark.parametrize("name, arch, cap", [
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", None),
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", "avx512_bf16"),
    ("amd-epyc-zen4-avx512bf16.txt", "x86_64", None),
    ("intel-xeon-skylake-avx512.txt", "x86_64", None),
    ("amd-epyc-zen3-avx2.txt", "x86_64", None),
    ("nvidia-grace-neoverse-v2.txt", "aarch64", None),
])
def test_the_old_amx_switch_still_keeps_the_amx_kernel_out(name, arch, cap):
    """TIERLM_CPU_AMX_LINEAR=0 (the old doctor-plan cases) ruled the AMX kernel out and nothing else: read as an
    override of the plan, the plan must still be made wherever it was set, without the AMX kernel, and whatever the
    CPU ran without it (the AVX512-BF16 kernel, or oneDNN) it still runs."""
    cpu = apply_cap(recorded(name, arch), cap)
    plan = plan_for(cpu, env={"TIERLM_CPU_AMX_LINEAR": "0"})
    assert plan.decode_products.value != "amx"
    if not cpu.has("amx_bf16"):
        assert plan.decode_products.value == plan_for(cpu).decode_products.value


@pytest.mark.parametrize("name, cap, avx512", [
    ("amd-epyc-zen4-avx512bf16.txt", None, True),
    ("intel-xeon-sapphire-rapids-amx.txt", None, False),  # oneDNN packs for AMX tiles: the AMX kernel's
    ("intel-xeon-sapphire-rapids-amx.txt", "avx512_bf16", True),  # the cap rules AMX out
    ("intel-xeon-skylake-avx512.txt", None, False),  # no AVX512-BF16
    ("amd-epyc-zen3-avx2.txt", None, False),
])
def test_doctor_plans_decode_sized_bf16_products_on_the_avx512_bf16_kernel_where_it_runs(name, cap, avx512):
    cpu = apply_cap(recorded(name, "x86_64"), cap)
    assert cpu.level == (cap or cpu.level)
    assert (plan_for(cpu).decode_products.value == "avx512_bf16") == avx512
    assert plan_for(cpu, "float32").decode_products.value == "n/a"
    assert plan_for(cpu, lib=NO_LIBRARY).decode_products.value != "avx512_bf16"  # no kernel library
    for env in ({"TIERLM_CPU_AVX512_LINEAR": "0"}, {"TIERLM_CPU_PLAN": "decode_products=onednn"},
                {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}):
        assert plan_for(cpu, env=env).decode_products.value != "avx512_bf16"


@pytest.mark.parametrize("name, arch, cap, expected", [
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", None, "sdpa"),  # torch's flash kernel runs on AMX tiles
    ("intel-xeon-sapphire-rapids-amx.txt", "x86_64", "avx512_bf16", "one_pass"),  # the cap rules AMX out
    ("amd-epyc-zen4-avx512bf16.txt", "x86_64", None, "one_pass"),
    ("intel-xeon-skylake-avx512.txt", "x86_64", None, "blocked"),  # no AVX512-BF16: no one-pass kernel
    ("amd-epyc-zen3-avx2.txt", "x86_64", None, "blocked"),
    ("nvidia-grace-neoverse-v2.txt", "aarch64", None, "blocked"),
])
def test_bf16_prefill_attention_is_torch_sdpa_on_amx_and_the_blocked_path_elsewhere(name, arch, cap, expected):
    cpu = apply_cap(recorded(name, arch), cap)
    assert plan_for(cpu).prefill_attention.value == expected
    if expected == "one_pass":  # the one-pass kernel takes head sizes of a multiple of 16
        assert plan_for(cpu, head_dim=72).prefill_attention.value == "blocked"
    f32 = plan_for(cpu, "float32")
    assert f32.prefill_attention.value == "sdpa"
    assert (f32.extend_attention.value, f32.extend_kernel.value) == (("paged", "f32") if arch == "x86_64" else
                                                                    ("torch", "none")), f32.extend_attention
    no_lib = plan_for(cpu, "float32", NO_LIBRARY)
    assert (no_lib.prefill_attention.value, no_lib.extend_attention.value) == ("sdpa", "torch")
    off = plan_for(cpu, "float32", env={"TIERLM_CPU_PLAN": "extend_attention=torch"})
    assert (off.prefill_attention.value, off.extend_attention.value) == ("sdpa", "torch")
    assert plan_for(cpu, lib=NO_LIBRARY).prefill_attention.value == "sdpa"
    for env, why in (({"TIERLM_CPU_PAGED_DECODE": "0"}, "TIERLM_CPU_PAGED_DECODE=0"),
                     ({"TIERLM_CPU_PLAN": "decode_attention=torch,extend_attention=torch,prefill_attention=sdpa"},
                      "TIERLM_CPU_PLAN decode_attention=torch")):
        off = plan_for(cpu, env=env)
        assert off.prefill_attention.value == "sdpa" and off.extend_attention.value == "torch"
        assert off.decode_attention.value == "torch" and why in off.decode_attention.why
        assert plan_for(cpu, "float32", env=env).extend_attention.value == "torch"
    for forced in ("blocked", "sdpa"):  # the switch wins over the CPU, and the plan says why
        for env, why in (({"TIERLM_CPU_PREFILL_ATTENTION": forced.upper()}, f"TIERLM_CPU_PREFILL_ATTENTION={forced}"),
                         ({"TIERLM_CPU_PLAN": f"prefill_attention={forced}"},
                          f"TIERLM_CPU_PLAN prefill_attention={forced}")):
            assert plan_for(cpu, env=env).prefill_attention == Choice(forced, why)
    # the one-pass kernel where the library has it (AVX512-BF16), refused with the reason elsewhere
    one_pass = {"TIERLM_CPU_PLAN": "prefill_attention=one_pass"}
    if library(cpu).has("blocked_attention"):
        assert plan_for(cpu, env=one_pass).prefill_attention.value == "one_pass"
    else:
        with pytest.raises(CpuPlanError, match="no AVX512-BF16 block kernel"):
            plan_for(cpu, env=one_pass)
    with pytest.raises(CpuPlanError, match="no kernel library"):  # the blocked path needs the library's softmax
        plan_for(cpu, lib=NO_LIBRARY, env={"TIERLM_CPU_PLAN": "prefill_attention=blocked"})


def test_a_misspelt_prefill_attention_switch_stops_startup_with_the_choices():
    cpu = recorded("intel-xeon-sapphire-rapids-amx.txt", "x86_64")
    with pytest.raises(CpuPlanError, match="blocked, sdpa"):
        plan_for(cpu, env={"TIERLM_CPU_PREFILL_ATTENTION": "flash"})
    with pytest.raises(CpuPlanError, match="prefill_attention takes one_pass, blocked, sdpa, not 'flash'"):
        plan_for(cpu, env={"TIERLM_CPU_PLAN": "prefill_attention=flash"})
    facts = _facts(cpu_flags=tuple(sorted(cpu.flags & known_flags("x86_64"))))
    assert choose_backend(facts, {}).backend == "torch"
    with pytest.raises(BackendChoiceError, match="TIERLM_CPU_PREFILL_ATTENTION=flash"):
        choose_backend(facts, {"TIERLM_CPU_PREFILL_ATTENTION": "flash"})
    with pytest.raises(BackendChoiceError, match="prefill_attention takes one_pass, blocked, sdpa"):
        choose_backend(facts, {"TIERLM_CPU_PLAN": "prefill_attention=flash"})
    with pytest.raises(BackendChoiceError, match="fields: decode_attention"):
        choose_backend(facts, {"TIERLM_CPU_PLAN": "prefil_attention=sdpa"})
