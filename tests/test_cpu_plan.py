"""The CPU execution plan (platforms/cpu_plan.py): every CPU decision of the torch backend in one frozen record,
decided from facts alone (recorded cpuinfo texts of real machines, a model's dtype and heads, the kernels each
level's library was built with), with its overrides; and the record a backend builds and reports."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_cpu_features import level_kernels, recorded

from tierlm.platforms import cpu_plan
from tierlm.platforms.cpu_features import apply_cap
from tierlm.platforms.cpu_plan import CpuPlanError, LibraryFacts, ModelFacts, decide


def _cpu(name: str, cap: str | None = None):
    return apply_cap(recorded(name, "x86_64"), cap)


def _library(level: str) -> LibraryFacts:
    """A server's facts for the x86 library of ``level``: the kernels its build has (test_cpu_features' table, which
    a test there holds to the install's manifest)."""
    return LibraryFacts(level, level_kernels("x86_64", level), f"the installed {level} library",
                        amx_granted=level == "amx")


BF16 = ModelFacts("bfloat16", "bfloat16", 8, 4, 64)
F32 = ModelFacts("float32", "float32", 8, 4, 64)


@pytest.mark.parametrize("name, level, products, prefill, extend", [
    ("intel-xeon-sapphire-rapids-amx.txt", "amx", "amx", "sdpa", "amx"),
    ("amd-epyc-zen4-avx512bf16.txt", "avx512_bf16", "avx512_bf16", "one_pass", "avx512"),
    ("intel-xeon-skylake-avx512.txt", "avx512", "onednn", "blocked", "avx512"),
])
def test_bf16_models_plan_the_kernels_of_their_cpu_class(name, level, products, prefill, extend):
    plan = decide(_cpu(name), BF16, _library(level), {})
    assert (plan.cpu.value, plan.kernels.value) == (level, level)
    assert plan.bf16_linear.value == "packed" and plan.decode_products.value == products, plan.decode_products
    assert plan.prefill_attention.value == prefill, plan.prefill_attention
    assert (plan.extend_attention.value, plan.extend_kernel.value) == ("paged", extend), plan.extend_attention
    assert plan.decode_attention.value == "paged" and plan.compiled_ops.value == "native"
    assert plan.f32_products.value == "n/a" and plan.int8_products.value == "n/a"
    for field in ("decode_products", "prefill_attention", "extend_attention"):
        assert getattr(plan, field).why  # every decision says why


def test_an_avx2_cpu_serves_bf16_on_torch_linears_and_float32_on_the_kernels():
    cpu, lib = _cpu("amd-epyc-zen3-avx2.txt"), _library("avx2")
    bf16 = decide(cpu, BF16, lib, {})
    assert bf16.bf16_linear.value == "torch" and "AVX-512 BW/VL/DQ" in bf16.bf16_linear.why
    assert bf16.decode_products.value == "n/a" and bf16.extend_attention.value == "torch"
    assert bf16.prefill_attention.value == "blocked"  # no AVX512-BF16 block kernel in the avx2 library
    f32 = decide(cpu, F32, lib, {})
    assert (f32.f32_products.value, f32.f32_16bit_weights.value) == ("gemv", "yes")
    assert (f32.extend_attention.value, f32.extend_kernel.value) == ("paged", "f32")
    assert f32.prefill_attention.value == "sdpa" and f32.decode_attention.value == "paged"


def test_the_baseline_library_has_no_vector_products_and_the_plan_says_so():
    plan = decide(_cpu("amd-epyc-zen3-avx2.txt", "x86-64"), F32, _library("x86-64"), {})
    assert plan.f32_products.value == "mkl" and "x86-64 library has no AVX2/AVX-512" in plan.f32_products.why
    assert plan.extend_attention.value == "torch" and plan.decode_attention.value == "paged"


def test_int8_weights_take_the_streaming_kernel_where_the_library_has_it():
    fmt = "torchao:int8wo+embedding"
    for name, level in (("amd-epyc-zen3-avx2.txt", "avx2"), ("amd-epyc-zen4-avx512bf16.txt", "avx512_bf16")):
        for dtype in ("bfloat16", "float32"):
            plan = decide(_cpu(name), ModelFacts(dtype, dtype, 8, 4, 64, fmt), _library(level), {})
            assert plan.int8_products.value == "gemv", plan.int8_products
            assert plan.bf16_linear.value == "n/a" and plan.f32_products.value == "n/a"
    baseline = decide(_cpu("amd-epyc-zen3-avx2.txt", "x86-64"), ModelFacts("bfloat16", "bfloat16", weight_format=fmt),
                      _library("x86-64"), {})
    assert baseline.int8_products.value == "torch" and "x86-64" in baseline.int8_products.why
    half = decide(_cpu("amd-epyc-zen3-avx2.txt"), ModelFacts("float16", "float16", weight_format=fmt), _library("avx2"),
                  {})
    assert half.int8_products.value == "torch" and "not float16" in half.int8_products.why
    assert not cpu_plan.int8_weights("torchao:int8wo")  # torchao's own path: not tierlm's layers


def test_without_a_kernel_library_everything_is_torch_with_the_reason():
    none = LibraryFacts(None, why="TIERLM_CPU_KERNELS=0")
    plan = decide(_cpu("amd-epyc-zen4-avx512bf16.txt"), BF16, none, {})
    assert plan.kernels.value == "none" and plan.decode_attention.value == "torch"
    assert plan.decode_products.value == "onednn" and plan.prefill_attention.value == "sdpa"
    assert plan.extend_attention.value == "torch" and plan.compiled_ops.value == "python"
    assert all("TIERLM_CPU_KERNELS=0" in c.why for c in (plan.decode_attention, plan.prefill_attention,
                                                        plan.compiled_ops))


def test_onednn_capped_below_a_kernels_instructions_rules_that_kernel_out():
    cpu = _cpu("intel-xeon-sapphire-rapids-amx.txt")
    capped = decide(cpu, BF16, _library("amx"), {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert capped.decode_products.value == "avx512_bf16", capped.decode_products  # oneDNN packs for it again
    assert "rules AMX out" in capped.decode_products.why
    lower = decide(_cpu("amd-epyc-zen4-avx512bf16.txt"), BF16, _library("avx512_bf16"),
                   {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert lower.decode_products.value == "onednn" and "rules AVX512-BF16 out" in lower.decode_products.why
    no_tiles = decide(cpu, BF16, LibraryFacts("amx", _library("amx").kernels, "installed", amx_granted=False), {})
    assert no_tiles.decode_products.value == "onednn" and "refused the AMX tile state" in no_tiles.decode_products.why


def test_overrides_set_fields_the_plan_can_run_and_refuse_the_rest():
    cpu, lib = _cpu("amd-epyc-zen4-avx512bf16.txt"), _library("avx512_bf16")
    env = {cpu_plan.PLAN_ENV: "prefill_attention=blocked, decode_attention=torch,compiled_attention=python"}
    plan = decide(cpu, BF16, lib, env)
    assert (plan.prefill_attention.value, plan.decode_attention.value, plan.compiled_attention.value) == \
        ("blocked", "torch", "python")
    assert plan.prefill_attention.why == f"{cpu_plan.PLAN_ENV} prefill_attention=blocked"
    with pytest.raises(CpuPlanError, match="cannot run here.*no AMX-BF16"):
        decide(cpu, BF16, lib, {cpu_plan.PLAN_ENV: "decode_products=amx"})
    with pytest.raises(CpuPlanError, match="fields: decode_attention"):
        decide(cpu, BF16, lib, {cpu_plan.PLAN_ENV: "decode=torch"})
    with pytest.raises(CpuPlanError, match="takes paged, torch"):
        decide(cpu, BF16, lib, {cpu_plan.PLAN_ENV: "decode_attention=c"})
    with pytest.raises(CpuPlanError, match="TIERLM_CPU_KERNELS"):
        cpu_plan.kernels_override({cpu_plan.KERNELS_ENV: "no"})
    # a field that does not apply to the model takes its off value, never a kernel
    assert decide(cpu, F32, lib, {cpu_plan.PLAN_ENV: "decode_products=onednn"}).decode_products.value == "n/a"
    with pytest.raises(CpuPlanError, match="decode_products=amx does not apply to this model"):
        decide(cpu, F32, lib, {cpu_plan.PLAN_ENV: "decode_products=amx"})
    with pytest.raises(CpuPlanError, match="prefill_attention=one_pass cannot run here.*for bf16"):
        decide(cpu, F32, lib, {cpu_plan.PLAN_ENV: "prefill_attention=one_pass"})


def test_the_switches_of_earlier_versions_are_read_as_the_fields_they_set(caplog, monkeypatch):
    monkeypatch.setattr(cpu_plan, "_WARNED", set())  # each switch is warned about once a process
    cpu, lib = _cpu("amd-epyc-zen4-avx512bf16.txt"), _library("avx512_bf16")
    with caplog.at_level(logging.WARNING, logger="tierlm.platforms.cpu_plan"):
        plan = decide(cpu, BF16, lib, {"TIERLM_CPU_PAGED_DECODE": "0", "TIERLM_CPU_AVX512_LINEAR": "0"})
    assert (plan.decode_attention.value, plan.extend_attention.value, plan.prefill_attention.value,
            plan.decode_products.value) == ("torch", "torch", "sdpa", "onednn")
    assert plan.decode_attention.why == "TIERLM_CPU_PAGED_DECODE=0 rules paged out"
    assert "TIERLM_CPU_PAGED_DECODE=0 is read as decode_attention not paged" in caplog.text
    # a switch that turned one kernel off rules just that one out: the next choice the CPU runs serves
    amx = decide(_cpu("intel-xeon-sapphire-rapids-amx.txt"), BF16, _library("amx"), {"TIERLM_CPU_AMX_LINEAR": "0"})
    assert amx.decode_products.value == "onednn"  # oneDNN packs for tiles there: the AVX512-BF16 kernel cannot run
    assert decide(cpu, BF16, lib, {"TIERLM_CPU_AMX_LINEAR": "0"}).decode_products.value == "avx512_bf16"
    assert decide(cpu, BF16, lib, {"TIERLM_CPU_BLOCKED_SCORES": "0"}).prefill_attention.value == "blocked"
    none = LibraryFacts(None, why="TIERLM_CPU_KERNELS=0")
    assert decide(cpu, BF16, none, {"TIERLM_CPU_BLOCKED_SCORES": "0"}).prefill_attention.value == "sdpa"
    # switches of one field together: what each ruled out stays out, as when each turned its kernel off
    both = decide(_cpu("intel-xeon-sapphire-rapids-amx.txt"), BF16, _library("amx"),
                  {"TIERLM_CPU_AMX_LINEAR": "0", "TIERLM_CPU_AVX512_LINEAR": "0"})
    assert both.decode_products.value == "onednn"
    for second in ({"TIERLM_CPU_BLOCKED_SCORES": "0"}, {"TIERLM_CPU_PREFILL_ATTENTION": "blocked"}):
        off = decide(cpu, BF16, lib, {"TIERLM_CPU_PAGED_DECODE": "0", **second})
        assert off.prefill_attention.value == "sdpa", second
    assert cpu_plan.override({"TIERLM_CPU_COMPILE": "1"}, "compile") == ("yes", "TIERLM_CPU_COMPILE=1")
    assert cpu_plan.override({}, "compile") is None
    with pytest.raises(CpuPlanError, match="TIERLM_CPU_PREFILL_ATTENTION=flash"):
        cpu_plan.read_overrides({"TIERLM_CPU_PREFILL_ATTENTION": "flash"})


def test_the_plan_needs_no_weights_and_prints_every_field_with_its_reason():
    plan = decide(_cpu("intel-xeon-skylake-avx512.txt"), BF16, _library("avx512"), {})
    plan = plan.with_decision("threads", cpu_plan.Choice("1", "test"))
    shown = plan.to_dict()
    assert shown["threads"] == {"value": "1", "why": "test"}
    assert set(shown) >= set(cpu_plan.OVERRIDES) | {"cpu", "kernels", "extend_kernel"}
    assert all(set(v) == {"value", "why"} and v["why"] for v in shown.values())


def test_a_backend_builds_its_plan_at_load_and_reports_it(tiny_llama):
    """The torch backend on CPU decides the plan from the model's config before its weights load, every CPU call
    site reads it, and /server_info's kernels show it with the library."""
    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(tiny_llama, dtype="bfloat16")
    plan = backend.cpu_kernels.plan
    report = backend.kernels()
    assert report["plan"] == plan.to_dict() and report["plan"]["threads"]["value"].isdigit()
    assert report["library"]["loaded"] == (backend.cpu_kernels.lib is not None)
    if plan.decode_attention.value == "paged":
        assert report["decode_attention"].startswith("C paged kernel over the pool in place, built for "
                                                     f"{backend.cpu_kernels.lib.level}")
    else:
        assert plan.decode_attention.why in report["decode_attention"]


def test_docs_list_every_override_and_every_renamed_switch():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cpu-plan.md").read_text()
    for field, values in cpu_plan.FIELDS.items():
        assert f"| `{field}` |" in doc and all(f"`{value}`:" in doc for value in values), field
    for name, meanings in cpu_plan.RENAMED.items():
        assert all(f"`{name}={value}`" in doc for value in meanings), name
