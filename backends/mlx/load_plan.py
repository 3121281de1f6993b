"""The MLX backend's part of the load plan (runtime/load_plan.py), from the model folder alone (imports no mlx):
--dtype as given (the backend resolves auto itself: its CPU kernels gain nothing from bf16), the weights as stored
or at a load-time quantization's packed size, and no compiled decode step (torch.compile is the torch backend's)."""
from __future__ import annotations

from tierlm.backends.base import BackendPlan, Choice, PlanFacts
from tierlm.backends.model_source.served_sizes import served_sizes


def plan_load(facts: PlanFacts) -> BackendPlan:
    dtype = Choice(facts.dtype, "--dtype" if facts.dtype != "auto" else "--dtype auto, resolved by the MLX backend")
    try:
        sizes, sizes_why = served_sizes(facts.folder, facts.dtype, facts.device, facts.kv_cache_dtype, facts.quant,
                                        facts.env), ""
    except (KeyError, TypeError, ValueError) as e:
        sizes, sizes_why = None, f"cannot size the model from its config.json (no usable {e})"
    compile = Choice(False, "torch.compile is the torch backend's; the MLX backend runs its own step")
    if facts.enable_torch_compile:  # refused by the builder (ModelBackend.init_torch_compile says why)
        compile = Choice(True, "--enable-torch-compile")
    return BackendPlan(dtype, sizes, compile, None, sizes_why)
