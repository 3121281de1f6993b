"""backends/torch/compile/policy.default_compile: where the CPU compiles its decode step without the flag. The
override it takes is the CPU plan's ``compile`` (``TIERLM_CPU_PLAN=compile=yes|no``; the old TIERLM_CPU_COMPILE=1|0
is read as it), as the composition root reads it (platforms/cpu_plan.override)."""
from __future__ import annotations

import pytest

from tierlm.platforms.cpu_plan import CpuPlanError, override
from tierlm.backends.torch.compile.policy import MIN_WEIGHT_BYTES, default_compile

BIG = 2 * MIN_WEIGHT_BYTES
SMALL = MIN_WEIGHT_BYTES // 64
ON, OFF = {"TIERLM_CPU_PLAN": "compile=yes"}, {"TIERLM_CPU_PLAN": "compile=no"}
OLD_ON, OLD_OFF = {"TIERLM_CPU_COMPILE": "1"}, {"TIERLM_CPU_COMPILE": "0"}


def decide(env=None, backend="torch", device="cpu", arch="LlamaForCausalLM", fmt="none", size=BIG, static=False,
           cxx="/usr/bin/g++"):
    return default_compile(backend, device, arch, fmt, size, static, override(env or {}, "compile"), cxx)


def test_a_dense_model_of_a_tested_family_compiles_on_cpu_by_default():
    on, why = decide()
    assert on and "CPU default" in why and "TIERLM_CPU_PLAN=compile=no" in why
    assert decide(arch="Qwen2ForCausalLM")[0] and decide(arch="Qwen3ForCausalLM")[0]
    assert decide(arch="MistralForCausalLM")[0]


def test_small_models_stay_eager_unless_the_variable_asks():
    on, why = decide(size=SMALL)
    assert not on and "MiB of weights" in why and "TIERLM_CPU_PLAN=compile=yes" in why
    assert decide(ON, size=SMALL) == (True, "TIERLM_CPU_PLAN compile=yes")
    assert decide(OLD_ON, size=SMALL) == (True, "TIERLM_CPU_COMPILE=1")


def test_the_variable_turns_the_default_off():
    assert decide(OFF) == (False, "TIERLM_CPU_PLAN compile=no")
    assert decide(OLD_OFF) == (False, "TIERLM_CPU_COMPILE=0")


@pytest.mark.parametrize("kw, reason", [
    ({"backend": "mlx"}, "not mlx on cpu"),
    ({"device": "cuda"}, "not torch on cuda"),
    ({"static": True}, "--cuda-graph-max-bs"),
    ({"arch": "GptOssForCausalLM"}, "not among the families"),
    ({"fmt": "torchao:int8wo+embedding"}, "torchao:int8wo+embedding weights"),
    ({"cxx": None}, "no C++ compiler for torch.compile ("),
])
def test_other_backends_devices_families_and_weight_formats_stay_eager_even_when_asked(kw, reason):
    for env in ({}, ON, OLD_ON):
        on, why = decide(env, **kw)
        assert not on and reason in why
        if "cxx" in kw:  # what to install or set
            assert "g++" in why and "not found" in why and "CXX" in why


def test_the_compiler_inductor_uses_is_looked_up_as_inductor_does(tmp_path):
    from tierlm.backends.torch.compile.policy import cxx_compiler

    fake = tmp_path / "my-g++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert cxx_compiler({"CXX": "my-g++", "PATH": str(tmp_path)}) == str(fake)
    assert cxx_compiler({"PATH": str(tmp_path)}) is None  # no g++ there


def test_the_reason_names_the_compiler_it_looked_for(tmp_path):
    """Without a C++ compiler the reason serve logs and reports names the one looked for ($CXX, else g++)."""
    from tierlm.backends.base import PlanFacts
    from tierlm.backends.torch.load_plan import plan_compile

    facts = PlanFacts(None, "cpu", "auto", "auto", False, None,  # type: ignore[arg-type]  # no folder needed
                      {"CXX": "my-g++", "PATH": str(tmp_path)}, architecture="LlamaForCausalLM")
    out = plan_compile(facts, BIG, "none")
    assert not out.value and "no C++ compiler for torch.compile" in out.why
    assert "my-g++ not found" in out.why


def test_an_unknown_value_stops_startup_with_the_choices():
    from tierlm.platforms.backend_choice import BackendChoiceError, choose_backend
    from tierlm.platforms.facts import detect

    for env, choices in (({"TIERLM_CPU_COMPILE": "yes"}, "TIERLM_CPU_COMPILE=yes: use one of 0, 1"),
                         ({"TIERLM_CPU_PLAN": "compile=maybe"}, "compile takes yes, no, not 'maybe'")):
        with pytest.raises(CpuPlanError, match=choices):
            decide(env)
        with pytest.raises(BackendChoiceError, match=choices):  # serve's first decision stops startup with it
            choose_backend(detect(), {"TIERLM_BACKEND": "torch", **env}, "cpu")


def test_doctor_says_whether_serve_will_compile_the_decode_step(tiny_llama):
    """doctor applies serve's rule to the model folder: the tiny model stays eager by its size, the override
    compiles it, and a bad value is an error there as at startup."""
    from tierlm.platforms import detect
    from tierlm.server.commands import doctor as doctor_cmd

    def plan(env, *flags):
        report = doctor_cmd.diagnose(detect(), {"TIERLM_BACKEND": "torch", **env},
                                     ["--json", "--model-path", str(tiny_llama), "--device", "cpu", *flags])
        return report, (report["cpu_kernels"] or {}).get("decode_step", "")

    report, step = plan({})
    assert step.startswith("eager (") and "MiB of weights" in step
    assert plan(ON)[1] == "compiled by torch.compile (TIERLM_CPU_PLAN compile=yes)"
    assert plan(OLD_ON)[1] == "compiled by torch.compile (TIERLM_CPU_COMPILE=1)"
    assert plan(OFF)[1] == "eager (TIERLM_CPU_PLAN compile=no)"
    assert plan({}, "--enable-torch-compile")[1] == "compiled by torch.compile (--enable-torch-compile)"
    for env, named in (({"TIERLM_CPU_COMPILE": "yes"}, "TIERLM_CPU_COMPILE=yes"),
                       ({"TIERLM_CPU_PLAN": "compile=maybe"}, "compile takes yes, no")):
        report, _ = plan(env)
        assert any(named in e for e in report["errors"]), report["errors"]
    assert "decode step" in doctor_cmd.render_text(plan({})[0])
