"""When the torch backend compiles its decode step on CPU: the default that compiles where it pays (SGLang's
``--enable-torch-compile`` always compiles). Pure: the torch backend's load plan (backends/torch/load_plan.py) asks it;
nothing here imports torch.

SGLang keeps torch.compile opt-in; vLLM CPU compiles its model at every start. tierlm's torch backend on a CPU
compiles the decode step by default (backends/torch/compile/compiled_decode.py) for the dense families that step is tested
on, when the weights are big enough for a step's eager glue to be worth the startup. Measured server to server on
llama-small bf16 (AMX Xeon, 2 cores, `tierlm bench peers`, medians of three runs): 1.06x decode at one stream,
1.08x at 8 streams, 1.13x at 3.9k tokens of context (in process 1.15-1.19x at one stream), for ~15 s more
startup from inductor's disk cache and one to two minutes the first time on a new model. Under
``MIN_WEIGHT_BYTES`` a step takes a few ms eagerly (stories260K: 3.4 -> 2.5 ms), which is not worth ~40 s at a
first start. Quantized weights and other families stay eager unless the flag asks, and so does a machine without
the C++ compiler inductor builds with (it would trace for seconds before failing).

The CPU plan's override ``compile=no`` (``TIERLM_CPU_PLAN``, platforms/cpu_plan.py; ``TIERLM_CPU_COMPILE=0`` is read as
it) never compiles by default; ``compile=yes`` (``TIERLM_CPU_COMPILE=1``) compiles whatever the weights' size (still
only where the default may). A default compile that fails (no C++ compiler, ...) leaves the server serving eagerly with a
warning; the flag's failure stops startup with the reason (runtime/engine_setup.run_compile_plan).
"""
from __future__ import annotations

import shutil
from typing import Mapping

SKIP = "TIERLM_CPU_PLAN=compile=no"
MIN_WEIGHT_BYTES = 64 * 2**20
# transformers' classes whose compiled decode tests/test_compiled_decode.py checks against the eager step, bit for bit
# (qwen2's q/k/v biases, qwen3's q/k norms and head size, mistral's sliding window included).
DEFAULT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def default_compile(backend_name: str, device: str, architecture: str, weight_format: str, weight_bytes: int,
                    static_decode: bool, asked: tuple[str, str] | None, cxx: str | None,
                    cxx_name: str = "g++") -> tuple[bool, str]:
    """(compile, why) when the flag is not given; ``asked``: the CPU plan's ``compile`` override as (value, the
    setting that asked), or None (platforms/cpu_plan.override reads it; the composition root hands it in);
    ``cxx``: the C++ compiler inductor would use (``cxx_compiler``), None without one; ``cxx_name``: the one it looked
    for ($CXX, else g++). Pure: the same inputs give the same answer."""
    forced, source = asked if asked is not None else ("", "")
    if forced == "no":
        return False, source
    if backend_name != "torch" or device != "cpu":
        return False, f"compiled decode is the torch backend's CPU path, not {backend_name} on {device}"
    if static_decode:
        return False, "--cuda-graph-max-bs runs decode steps on the static bucketed path instead"
    if architecture not in DEFAULT_ARCHITECTURES:
        return False, (f"{architecture} is not among the families compiled by default "
                       f"({', '.join(DEFAULT_ARCHITECTURES)}); --enable-torch-compile tries it")
    if weight_format != "none":
        return False, f"{weight_format} weights are not compiled by default; --enable-torch-compile tries it"
    if cxx is None:
        return False, (f"no C++ compiler for torch.compile ({cxx_name} not found; install g++ or set CXX for the "
                       "compiled decode step)")
    mib = weight_bytes / 2**20
    if forced == "yes":
        return True, source
    if weight_bytes < MIN_WEIGHT_BYTES:
        return False, (f"{mib:.1f} MiB of weights (< {MIN_WEIGHT_BYTES >> 20} MiB): an eager step takes a few ms, "
                       f"not worth ~40 s of compiling at a first start; TIERLM_CPU_PLAN=compile=yes compiles anyway")
    return True, (f"CPU default for {architecture} with {mib:.0f} MiB of weights: ~1.05-1.15x decode for ~15 s of "
                  f"startup from the compile cache, 1-2 min the first time; {SKIP} skips it")


def cxx_name(env: Mapping[str, str]) -> str:
    """The C++ compiler inductor builds with on Linux, by its rule: $CXX, else g++."""
    return env.get("CXX") or "g++"


def cxx_compiler(env: Mapping[str, str]) -> str | None:
    """``cxx_name``'s path where it is on PATH, else None."""
    return shutil.which(cxx_name(env), path=env.get("PATH"))

