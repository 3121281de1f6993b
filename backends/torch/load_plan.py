"""The torch backend's part of the load plan (runtime/load_plan.py): the dtype it computes in, the model as it will
hold it (weight format, weight and KV bytes), the CPU execution plan and whether it compiles the decode step, each
with its reason, from the model folder and the machine alone. Imports no torch: `tierlm doctor` asks it too."""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from tierlm.backends.base import BackendPlan, Choice, PlanFacts, ServedSizes
from tierlm.backends.dtypes import DTYPE_BYTES, dtype_decision
from tierlm.backends.model_source.builtin_model import BUILTIN_DTYPE_WHY, is_builtin_model
from tierlm.backends.model_source.folder_facts import weight_bytes
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.model_source.served_sizes import served_sizes
from tierlm.backends.torch.compile.policy import cxx_compiler, cxx_name, default_compile
from tierlm.backends.weight_format import (FP8_MATMUL_CAPABILITY, checkpoint_method, input_embedding_shape,
                                           mxfp4_experts_mode, safetensors_shapes)
from tierlm.platforms import cpu_plan
from tierlm.platforms.cpu_features import CpuFeatures, this_cpu


def plan_load(facts: PlanFacts) -> BackendPlan:
    dtype = plan_dtype(facts)
    try:
        sizes = held_sizes(facts, dtype.value)
    except (KeyError, TypeError, ValueError) as e:  # a config without the usual fields (e.g. Nemotron-H's layers)
        sizes, sizes_why = None, f"no usable {e}"
    else:
        sizes_why = ""
    kernels, refusal = None, ""
    if facts.device == "cpu" and sizes is not None:
        try:
            kernels = cpu_kernels(facts, sizes)
        except cpu_plan.CpuPlanError as e:  # an override this CPU or model cannot run: the message says which
            refusal = str(e)
    compile = plan_compile(facts, sizes.weight_bytes if sizes else 0, sizes.weight_format if sizes else "none")
    return BackendPlan(dtype, sizes, compile, kernels, sizes_why, refusal)


def plan_dtype(facts: PlanFacts) -> Choice[str]:
    """--dtype, or for auto the device's rule (backends/dtypes.py) with the platform's native-bf16 fact; the
    built-in model computes in float32 (its reference's dtype)."""
    cfg = facts.folder.config
    stored = cfg.get("torch_dtype") or cfg.get("dtype")
    if facts.dtype == "auto" and is_builtin_model(facts.folder.path):
        return Choice("float32", BUILTIN_DTYPE_WHY)
    dtype, why = dtype_decision(facts.dtype, facts.device, stored if isinstance(stored, str) else None,
                                cpu_bf16=facts.native_bf16)
    return Choice(dtype, why)


def held_sizes(facts: PlanFacts, dtype: str) -> ServedSizes:
    """The folder's sizes as this backend holds the weights: gpt-oss's MXFP4 experts packed or dequantized, fp8
    compressed-tensors dequantized where there is no fp8 matmul, a load-time quantization at its packed bytes, a
    bf16 tied lm_head's packed copy on CPU."""
    folder, device = facts.folder, facts.device
    sizes = served_sizes(folder, dtype, device, facts.kv_cache_dtype, facts.quant, facts.env)
    method = checkpoint_method(folder.config)
    if facts.quant is not None:
        return sizes
    if method == "mxfp4":
        # gpt-oss experts: packed (4.25 bits per weight) or dequantized while loading (the mlx backend keeps them
        # packed; folder_facts counts the stored bytes, which are the packed ones)
        mode, why = mxfp4_experts_mode(device, facts.env)
        held = weight_bytes(folder, dtype, mxfp4_dequantized=True) if mode == "dequantized" else sizes.weight_bytes
        return replace(sizes, weight_bytes=held, notes={**sizes.notes, "mxfp4_experts": {"mode": mode, "why": why}})
    if method == "compressed-tensors" and not (device == "cuda" and facts.compute_capability is not None
                                               and facts.compute_capability >= FP8_MATMUL_CAPABILITY):
        # fp8 weights are dequantized to the model dtype where there is no fp8 matmul (compressed_tensors.py: the
        # CPU, CUDA before Ada); a CUDA device of unknown capability counts as one without
        sizes = replace(sizes, weight_bytes=weight_bytes(folder, dtype, fp8_dequantized=True))
    return replace(sizes, weight_bytes=sizes.weight_bytes + tied_lm_head_copy_bytes(
        folder, dtype, sizes.weight_format, device, facts.env, facts.cpu))


def tied_lm_head_copy_bytes(folder: ModelFolder, dtype: str, weight_format: str, device: str,
                            env: Mapping[str, str], cpu: CpuFeatures | None = None) -> int:
    """bf16 on a CPU whose oneDNN prepacks: the backend packs a tied lm_head as a copy next to the embedding
    (backends/torch/cpu/linear.py) where the CPU plan says so (platforms/cpu_plan.packs_tied_lm_head)."""
    if device != "cpu" or dtype != "bfloat16":
        return 0
    if checkpoint_method(folder.config) not in (None, "compressed-tensors"):
        return 0  # MXFP4 / mlx checkpoints: no plain bf16 lm_head to pack (compressed-tensors leaves it float)
    model = cpu_plan.ModelFacts(dtype, dtype, weight_format=weight_format)
    if not cpu_plan.packs_tied_lm_head(cpu or this_cpu(), model, env):
        return 0
    shapes = safetensors_shapes(list(folder.weight_files))
    tied = folder.text_config.get("tie_word_embeddings")
    if tied is None:  # not stated: tied when no lm_head tensor is stored
        tied = not any("lm_head" in name for name, _ in shapes)
    if not tied:
        return 0
    table = input_embedding_shape(shapes)
    return table[0] * table[1] * DTYPE_BYTES["bfloat16"] if table else 0


def cpu_kernels(facts: PlanFacts, sizes: ServedSizes) -> dict[str, Choice[str]] | None:
    """The CPU execution plan the backend builds for this model (platforms/cpu_plan.py), with the kernel library
    the install built (read from its manifest: nothing loaded); raises cpu_plan.CpuPlanError on a bad override."""
    from tierlm.backends.torch.cpu import library  # no torch: the manifest alone

    cpu = facts.cpu or this_cpu()
    heads, kv_heads, head_dim = sizes.attention_heads
    model = cpu_plan.ModelFacts(sizes.dtype, sizes.kv_dtype, heads, kv_heads, head_dim, sizes.weight_format)
    lib = library.installed_facts(cpu, facts.env)
    plan = cpu_plan.decide(cpu, model, lib, facts.env)
    kernels = {"kernel_library": Choice(lib.level or "none", lib.why)}
    for name, c in plan.to_dict().items():
        if name not in ("cpu", "kernels"):
            kernels[name] = Choice(str(c["value"]), str(c["why"]))
    return kernels


def plan_compile(facts: PlanFacts, weight_bytes: int, weight_format: str) -> Choice[bool]:
    """--enable-torch-compile, or the CPU default for weights of that size and format
    (backends/torch/compile/policy.py)."""
    if facts.enable_torch_compile:
        return Choice(True, "--enable-torch-compile")
    on, why = default_compile("torch", facts.device, facts.architecture, weight_format, weight_bytes,
                              facts.static_decode, cpu_plan.override(facts.env, "compile"), cxx_compiler(facts.env),
                              cxx_name(facts.env))
    return Choice(on, why)
