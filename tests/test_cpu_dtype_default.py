"""--dtype auto on CPU: bfloat16 where the CPU has native bf16 matmuls (AVX512-BF16 / AMX-BF16) and the backend
is torch, float32 elsewhere; the fact comes from /proc/cpuinfo (platforms/facts.py) through the backend decision
to the composition root, which logs the dtype with its reason (/server_info: dtype_chosen_by)."""
from __future__ import annotations

import pytest

from tierlm.backends.dtypes import dtype_decision, serving_dtype
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.platforms import Facts, choose_backend
from tierlm.platforms.cpu_features import parse_cpuinfo
from tierlm.runtime import load_plan
from tierlm.runtime.server_args import ServerArgs

GiB = 2**30


def box(cpu_bf16: str | None, **kw) -> Facts:
    return Facts(os_name="Linux", arch="x86_64", cpu_count=2, ram_total_bytes=16 * GiB,
                 ram_available_bytes=12 * GiB, python_version="3.11.9", torch_version="2.13.0",
                 cpu_flags=(cpu_bf16,) if cpu_bf16 else (), **kw)


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16", None])
def test_auto_on_a_cpu_with_native_bf16_is_bfloat16_whatever_the_checkpoint(stored):
    dtype, why = dtype_decision("auto", "cpu", stored, cpu_bf16=True)
    assert dtype == "bfloat16" and "native bf16" in why and "--dtype float32" in why


@pytest.mark.parametrize("stored", ["float32", "bfloat16", None])
def test_auto_on_a_cpu_without_native_bf16_stays_float32(stored):
    assert serving_dtype("auto", "cpu", stored) == "float32"
    assert dtype_decision("auto", "cpu", stored, cpu_bf16=False)[0] == "float32"


def test_an_explicit_dtype_always_wins_and_other_devices_keep_their_rule():
    assert dtype_decision("float32", "cpu", "bfloat16", cpu_bf16=True) == ("float32", "--dtype")
    assert serving_dtype("auto", "cuda", "float32", cpu_bf16=True) == "bfloat16"
    assert serving_dtype("auto", "mps", "float16", cpu_bf16=True) == "float16"
    assert serving_dtype("auto", "metal", "float32", cpu_bf16=True) == "float32"


@pytest.mark.parametrize("flags, expected", [
    ("fpu sse avx512f avx512_bf16 amx_bf16 amx_tile", "amx_bf16"),
    ("fpu sse avx512f avx512_bf16", "avx512_bf16"),
    ("fpu sse avx2 avx512f", None),
])
def test_native_bf16_is_read_from_the_cpuinfo_flags(flags, expected):
    text = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert parse_cpuinfo(text, "x86_64").native_bf16 == expected


def test_no_flags_line_means_no_native_bf16():
    assert parse_cpuinfo("", "x86_64").native_bf16 is None
    assert parse_cpuinfo("Features\t: fp asimd bf16\n", "x86_64").native_bf16 is None  # an Arm line on x86
    assert parse_cpuinfo("Features\t: fp asimd bf16\n", "aarch64").native_bf16 == "bf16"


def test_the_decision_carries_the_fact_for_torch_on_cpu_only():
    d = choose_backend(box("avx512_bf16"), {}, "cpu")
    assert d.native_bf16 and any("native bf16" in r and "avx512_bf16" in r for r in d.reasons)
    assert d.to_dict()["native_bf16"] is True
    plain = choose_backend(box(None), {}, "cpu")
    assert not plain.native_bf16 and any("serves float32" in r for r in plain.reasons)
    mlx = box("avx512_bf16", mlx_version="0.32.4", mlx_lm_version="0.31.0")
    assert not choose_backend(mlx, {"TIERLM_BACKEND": "mlx"}, "cpu").native_bf16  # MLX's CPU kernels gain nothing


def test_facts_without_the_new_field_still_load():
    recorded = box(None).to_dict()
    for key in ("cpu_flags", "cpu_model", "cpu_physical_cores", "cpu_isa_cap", "cpu_isa_dropped", "cpu_isa_error"):
        del recorded[key]
    assert Facts.from_dict(recorded).cpu_bf16 is None


def test_the_composition_root_resolves_auto_with_the_fact(tmp_path):
    (tmp_path / "config.json").write_text('{"torch_dtype": "float32"}')
    native, folder = choose_backend(box("amx_bf16"), {}, "cpu"), ModelFolder.read(tmp_path)
    dtype, why = load_plan.choose_dtype(ServerArgs(dtype="auto"), native, folder)
    assert dtype == "bfloat16" and "float32 served in bfloat16" in why
    assert load_plan.choose_dtype(ServerArgs(dtype="float32"), native, folder) == ("float32", "--dtype")
    assert load_plan.choose_dtype(ServerArgs(), choose_backend(box(None), {}, "cpu"), folder)[0] == "float32"


@pytest.mark.parametrize("isa, expected", [("avx512_bf16", "bfloat16"), (None, "float32")])
def test_doctor_and_bench_resolve_auto_as_serve_does(isa, expected, tiny_llama, monkeypatch):
    """doctor's KV tier sizes and a benchmark's servers and in-process baselines use serve's dtype for auto."""
    from tierlm.server.commands import doctor as doctor_cmd
    from tierlm.server.commands.bench import command as bench_cmd

    facts = box(isa)
    monkeypatch.setattr("tierlm.platforms.detect", lambda: facts)
    monkeypatch.setenv("TIERLM_BACKEND", "torch")
    monkeypatch.delenv("SGLANG_USE_MLX", raising=False)
    assert bench_cmd.resolve_dtype("auto", tiny_llama) == expected
    assert bench_cmd.resolve_dtype("float32", tiny_llama) == "float32"
    report = doctor_cmd.diagnose(facts, {"TIERLM_BACKEND": "torch"}, ["--json", "--model-path", str(tiny_llama)])
    assert report["model"]["dtype"] == expected
    per_token_f32 = doctor_cmd.diagnose(facts, {"TIERLM_BACKEND": "torch"},
                                        ["--json", "--model-path", str(tiny_llama), "--dtype", "float32"])
    assert per_token_f32["model"]["kv_bytes_per_token"] == report["model"]["kv_bytes_per_token"] * (
        2 if expected == "bfloat16" else 1)
