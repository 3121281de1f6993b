"""runtime/torch_compile_setup.default_compile: where the CPU compiles its decode step without the flag."""
from __future__ import annotations

import pytest

from tierlm.runtime.errors import StartupError
from tierlm.runtime.torch_compile_setup import MIN_WEIGHT_BYTES, default_compile

BIG = 2 * MIN_WEIGHT_BYTES
SMALL = MIN_WEIGHT_BYTES // 64


def decide(env=None, backend="torch", device="cpu", arch="LlamaForCausalLM", fmt="none", size=BIG, static=False,
           cxx="/usr/bin/g++"):
    return default_compile(backend, device, arch, fmt, size, static, env or {}, cxx)


def test_a_dense_model_of_a_tested_family_compiles_on_cpu_by_default():
    on, why = decide()
    assert on and "CPU default" in why and "TIERLM_CPU_COMPILE=0" in why
    assert decide(arch="Qwen2ForCausalLM")[0] and decide(arch="Qwen3ForCausalLM")[0]
    assert decide(arch="MistralForCausalLM")[0]


def test_small_models_stay_eager_unless_the_variable_asks():
    on, why = decide(size=SMALL)
    assert not on and "MiB of weights" in why and "TIERLM_CPU_COMPILE=1" in why
    assert decide({"TIERLM_CPU_COMPILE": "1"}, size=SMALL) == (True, "TIERLM_CPU_COMPILE=1")


def test_the_variable_turns_the_default_off():
    assert decide({"TIERLM_CPU_COMPILE": "0"}) == (False, "TIERLM_CPU_COMPILE=0")


@pytest.mark.parametrize("kw, reason", [
    ({"backend": "mlx"}, "not mlx on cpu"),
    ({"device": "cuda"}, "not torch on cuda"),
    ({"static": True}, "--cuda-graph-max-bs"),
    ({"arch": "GptOssForCausalLM"}, "not among the families"),
    ({"fmt": "torchao:int8wo+embedding"}, "torchao:int8wo+embedding weights"),
    ({"cxx": None}, "no C++ compiler for torch.compile (g++ not found"),
])
def test_other_backends_devices_families_and_weight_formats_stay_eager_even_when_asked(kw, reason):
    for env in ({}, {"TIERLM_CPU_COMPILE": "1"}):
        on, why = decide(env, **kw)
        assert not on and reason in why


def test_the_compiler_inductor_uses_is_looked_up_as_inductor_does(tmp_path):
    from tierlm.runtime.torch_compile_setup import cxx_compiler

    fake = tmp_path / "my-g++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert cxx_compiler({"CXX": "my-g++", "PATH": str(tmp_path)}) == str(fake)
    assert cxx_compiler({"PATH": str(tmp_path)}) is None  # no g++ there
    assert "my-g++ not found" in decide({"CXX": "my-g++"}, cxx=None)[1]


def test_an_unknown_value_stops_startup_with_the_choices():
    with pytest.raises(StartupError, match="TIERLM_CPU_COMPILE=yes: use 0 .* or 1"):
        decide({"TIERLM_CPU_COMPILE": "yes"})


def test_doctor_says_whether_serve_will_compile_the_decode_step(tiny_llama):
    """doctor applies serve's rule to the model folder: the tiny model stays eager by its size, the variable
    compiles it, and a bad value is an error there as at startup."""
    from tierlm.platforms import detect
    from tierlm.server import doctor_cmd

    def plan(env, *flags):
        report = doctor_cmd.diagnose(detect(), {"TIERLM_BACKEND": "torch", **env},
                                     ["--json", "--model-path", str(tiny_llama), "--device", "cpu", *flags])
        return report, (report["cpu_kernels"] or {}).get("decode_step", "")

    report, step = plan({})
    assert step.startswith("eager (") and "MiB of weights" in step
    assert plan({"TIERLM_CPU_COMPILE": "1"})[1] == "compiled by torch.compile (TIERLM_CPU_COMPILE=1)"
    assert plan({}, "--enable-torch-compile")[1] == "compiled by torch.compile (--enable-torch-compile)"
    report, _ = plan({"TIERLM_CPU_COMPILE": "yes"})
    assert any("TIERLM_CPU_COMPILE=yes" in e for e in report["errors"])
    assert "decode step" in doctor_cmd.render_text(plan({})[0])
