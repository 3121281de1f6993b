"""runtime/torch_compile_setup.default_compile: where the CPU compiles its decode step without the flag."""
from __future__ import annotations

import pytest

from tierlm.runtime.errors import StartupError
from tierlm.runtime.torch_compile_setup import MIN_WEIGHT_BYTES, default_compile

BIG = 2 * MIN_WEIGHT_BYTES
SMALL = MIN_WEIGHT_BYTES // 64


def decide(env=None, backend="torch", device="cpu", arch="LlamaForCausalLM", fmt="none", size=BIG, static=False):
    return default_compile(backend, device, arch, fmt, size, static, env or {})


def test_a_dense_model_of_a_tested_family_compiles_on_cpu_by_default():
    on, why = decide()
    assert on and "CPU default" in why and "TIERLM_CPU_COMPILE=0" in why
    assert decide(arch="Qwen2ForCausalLM")[0] and decide(arch="Qwen3ForCausalLM")[0]


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
])
def test_other_backends_devices_families_and_weight_formats_stay_eager_even_when_asked(kw, reason):
    for env in ({}, {"TIERLM_CPU_COMPILE": "1"}):
        on, why = decide(env, **kw)
        assert not on and reason in why


def test_an_unknown_value_stops_startup_with_the_choices():
    with pytest.raises(StartupError, match="TIERLM_CPU_COMPILE=yes: use 0 .* or 1"):
        decide({"TIERLM_CPU_COMPILE": "yes"})
