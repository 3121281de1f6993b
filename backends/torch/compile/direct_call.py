"""The compiled decoder stack called straight, without dynamo's frame hook (compiled_decode.py uses it).

A compiled call through torch.compile enters dynamo's frame hook, looks up the entry's graph, runs its guards, then
the transformed bytecode gathers ~50 inputs (the step's tensors and every weight, attribute by attribute) before it
calls the function the backend compiled (aot_autograd's wrapper around inductor's code). For the stack of a decode
step the part before that call is ~0.3-0.5 ms: 7 % of a llama-small step at one stream and at 8 (4.75 -> 4.41 ms,
6.98 -> 6.42, in process, alternated). vLLM calls its compiled graphs the same way, without guards.

``plan`` reads the graph dynamo handed to the backend: each input is the step's ``input_ids`` or ``position_ids``,
a symbolic size (the step's token count), or a tensor of the model itself (a weight, a rotary buffer) that the
call binds once. Anything else, or more than one output, and the stack keeps going through dynamo.
``DirectCall`` then takes the decoder stack's keyword arguments as transformers' causal LM passes them and
returns its output; a call with other arguments (embeddings instead of ids, a cache, a mask) goes through dynamo.
CompiledDecode checks the direct call against dynamo's on its compile steps, bit for bit, before it serves.

Not used where the model changes its own tensors during a forward: RoPE types that rescale their frequencies as
the context grows ("dynamic", "longrope") assign new buffers, which a bound input would miss.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from tierlm.platforms.cpu_plan import override

STEP_INPUTS = {"l_kwargs_input_ids_": "input_ids", "l_kwargs_position_ids_": "position_ids"}
MODEL_TENSOR_PREFIX = "l_fn_self_"  # dynamo's name for a tensor read from the stack module (the entry's ``fn``)
# keyword arguments the stack may get as long as they are unset (transformers' causal LM passes them through)
UNSET_ARGUMENTS = ("attention_mask", "cache", "past_key_values", "inputs_embeds", "cache_position")
RUNTIME_ROPE_TYPES = ("dynamic", "longrope")


@dataclasses.dataclass
class DirectCall:
    compiled: Callable  # what the backend compiled (aot_autograd over inductor): the graph's inputs, its outputs
    inputs: list  # the graph's inputs, the model's tensors bound; the step's slots are filled per call
    ids_at: int
    positions_at: int
    tokens_at: tuple[int, ...]
    output: Callable[[torch.Tensor], Any]  # the stack's return value around the hidden states

    def takes(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether a call with these keyword arguments is the one the graph was traced for: ids and positions as
        contiguous [1, T] int64 CPU tensors (inductor's code reads them without checks), nothing else set."""
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        return _step_tensor(ids) and _step_tensor(positions) and ids.shape == positions.shape and \
            not kwargs.get("use_cache") and all(kwargs.get(k) is None for k in UNSET_ARGUMENTS) and \
            set(kwargs) <= {"input_ids", "position_ids", "use_cache", *UNSET_ARGUMENTS}

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> Any:
        args = self.inputs.copy()
        args[self.ids_at], args[self.positions_at] = input_ids, position_ids
        for i in self.tokens_at:
            args[i] = input_ids.shape[1]
        return self.output(self.compiled(*args)[0])


def _step_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 2 and t.shape[0] == 1 and \
        t.device.type == "cpu" and t.is_contiguous()


def plan(gm: torch.fx.GraphModule, example_inputs: list, compiled: Callable,
         output: Callable[[torch.Tensor], Any]) -> tuple[DirectCall | None, str]:
    """(the direct call of this graph, "") or (None, why it cannot be called straight)."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if len(names) != len(example_inputs):
        return None, f"{len(names)} graph inputs for {len(example_inputs)} example inputs"
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 1:
        return None, "the graph returns more than the hidden states (a side effect dynamo replays)"
    at = {STEP_INPUTS[name]: i for i, name in enumerate(names) if name in STEP_INPUTS}
    if len(at) != 2:
        return None, f"the graph's inputs do not include {' and '.join(sorted(set(STEP_INPUTS.values()) - set(at)))}"
    tokens = example_inputs[at["input_ids"]].shape[1]
    inputs: list = []
    tokens_at = []
    for i, (name, value) in enumerate(zip(names, example_inputs)):
        if name in STEP_INPUTS:
            inputs.append(None)
        elif isinstance(value, torch.SymInt):
            if value.node.hint != tokens:  # a size that is not the step's token count
                return None, f"the graph's symbolic input {name} is not the token count"
            tokens_at.append(i)
            inputs.append(None)
        elif isinstance(value, torch.Tensor) and name.startswith(MODEL_TENSOR_PREFIX):
            inputs.append(value)
        else:
            return None, f"the graph's input {name} is neither the step's nor the model's own tensor"
    return DirectCall(compiled, inputs, at["input_ids"], at["position_ids"], tuple(tokens_at), output), ""


def choice(env: Mapping[str, str], config) -> tuple[bool, str]:
    """(whether ready steps call the compiled stack straight, why not)."""
    asked = override(env, "compile_call")
    if asked is not None and asked[0] == "dynamo":
        return False, asked[1]
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = {rope.get("rope_type") or rope.get("type")} if "rope_type" in rope or "type" in rope else \
        {(v or {}).get("rope_type") for v in rope.values() if isinstance(v, dict)}
    runtime = sorted(k for k in kinds if k in RUNTIME_ROPE_TYPES)
    if runtime:
        return False, f"RoPE type {runtime[0]} updates its frequencies during a forward"
    return True, "the stack's graph called straight (compile_call=dynamo goes through dynamo)"
