"""The MLX backend's part of the load plan (runtime/load_plan.py), from the model folder alone (imports no mlx):
--dtype as given (the backend resolves auto itself: its CPU kernels gain nothing from bf16), the weights as stored
or at a load-time quantization's packed size, and no compiled decode step (torch.compile is the torch backend's)."""
from __future__ import annotations

from tierlm.backends.base import BackendPlan, Choice, PlanFacts
from tierlm.backends.model_source.served_sizes import served_sizes
from tierlm.platforms import cpu_plan


def plan_load(facts: PlanFacts) -> BackendPlan:
    dtype = plan_dtype(facts)
    try:
        sizes, sizes_why = served_sizes(facts.folder, facts.dtype, facts.device, facts.kv_cache_dtype, facts.quant,
                                        facts.env), ""
    except (KeyError, TypeError, ValueError) as e:
        sizes, sizes_why = None, f"no usable {e}"
    forced = cpu_plan.override(facts.env, "compile")  # ("no", the setting that asked) as on the torch backend
    compile = Choice(False, forced[1] if forced is not None and forced[0] == "no" else
                     f"compiled decode is the torch backend's CPU path, not mlx on {facts.device}")
    if facts.enable_torch_compile:  # refused by the builder (ModelBackend.init_torch_compile says why)
        compile = Choice(True, "--enable-torch-compile")
    return BackendPlan(dtype, sizes, compile, None, sizes_why)


def plan_dtype(facts: PlanFacts) -> Choice[str]:
    """--dtype as given: the MLX backend resolves auto itself when it loads."""
    return Choice(facts.dtype, "--dtype" if facts.dtype != "auto" else "--dtype auto, resolved by the MLX backend")
