"""The compiled step's kernel calls as C++ operators (csrc/torch_ops.cpp), compiled into the kernel library itself.

Why: compiled, every product is a call of an op (ops.py) whose kernel is a Python function: ~3.4 us from the
dispatcher into Python and ~5.7 us of Python (shapes, the chunk table, ctypes) around a kernel that runs 10-300 us. A
decode step makes one per linear layer: 33 in llama-small, 97 in Qwen2.5-0.5B. inductor's C++ wrapper calls the
``tierlm_native::`` ops through the dispatcher and they call the kernels linked beside them, with no Python between:

- ``packed_linear``: bf16 rows over oneDNN's packed weight on the AVX512-BF16 kernel (the weight's K chunks for each
  row count, probed at packing: avx512_linear.chunk_sizes) or the AMX kernel, one thread's share of work;
- ``f32_linear``: 1..8 float32 rows of a decode step (the step record says which steps are) on the float32 kernel;
- ``paged_attention``: a decode-only step's layer on ``paged_decode_step`` with the step's DecodeStep (decode_step.py)
  from the step record: llama-small bf16 one stream 4.41 -> 4.18 ms a step, the Qwen2.5-0.5B shape at 8 streams
  49.3 -> 48.1 ms;
- ``blocked_attention``: the one-pass blocked prefill attention split between torch's own OpenMP threads (Python
  helper threads lost their cores to the OpenMP workers that spin between torch's parallel ops): a 2016-token
  llama-small layer's attention on two threads 27.1 -> 15.9 ms.

Every case an op does not serve goes to the ``tierlm::`` Python op of the same name, so outputs are the Python path's
bit for bit. What a call needs arrives as its arguments: a packed linear's kernel block and K chunks (per weight),
the step record (per step, step_record.py). The plan (``compiled_ops``, ``compiled_attention``) says whether the C++
ops serve a model; they exist once the process's library registered them (``registered``).
"""
from __future__ import annotations

import logging
import threading

import torch

from tierlm.backends.torch.cpu import library
from tierlm.backends.torch.cpu.library import KernelLibrary
from tierlm.backends.torch.cpu.step_record import StepRecord

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
# The library whose ops torch's dispatcher holds (one per process); kept when the module is reloaded (autoreload), as
# the dispatcher keeps the ops.
if "_REGISTERED" not in globals():
    _REGISTERED: list[KernelLibrary] = []


def registered(lib: KernelLibrary | None = None) -> KernelLibrary | None:
    """The library whose ``tierlm_native`` ops are registered: the process's library (registered now if not yet),
    when ``lib`` is None or that library; None where no library loaded or it has no torch ops, or for another library
    (a test's level: the ops call the process library's kernels, not ``lib``'s)."""
    process = library.load()
    if process is None or (lib is not None and lib is not process) or not process.has("torch_ops"):
        return None
    if not _REGISTERED:
        with _LOCK:
            if not _REGISTERED:
                code = process.tierlm_register_torch_ops()
                if code != 0:
                    raise RuntimeError("the tierlm_native ops could not be registered (" + (
                        "another library of this process registered them" if code == -1 else
                        "torch refused them: its message is on stderr") + ")")
                _register_fakes()
                _REGISTERED.append(process)
                log.info("CPU kernels: the torch ops of the %s library are registered", process.level)
    return _REGISTERED[0] if _REGISTERED[0] is process else None


def _register_fakes() -> None:
    """The C++ ops' shape rules, for tracing."""
    torch.library.register_fake("tierlm_native::packed_linear")(
        lambda x, packed_weight, bias, out_features, fast_rows, block, k_chunks:
        x.new_empty((*x.shape[:-1], out_features)))
    torch.library.register_fake("tierlm_native::f32_linear")(
        lambda x, weight, bias, step: x.new_empty((*x.shape[:-1], weight.shape[0])))
    torch.library.register_fake("tierlm_native::paged_attention")(
        lambda query, key, value, layer, scaling, sliding_window, s_aux, step:
        query.new_empty((1, query.shape[2], query.shape[1], query.shape[3])))


def served() -> dict[str, int]:
    """Calls the C++ ops ran themselves in this process (not handed to the Python op)."""
    if not _REGISTERED:
        return {"packed_linear": 0, "f32_linear": 0, "paged_attention": 0}
    packed, f32, attention = torch.ops.tierlm_native.served()
    return {"packed_linear": int(packed), "f32_linear": int(f32), "paged_attention": int(attention)}


def prepare(model: torch.nn.Module, kernels) -> tuple[StepRecord | None, str]:
    """Before the first trace: where the plan has the C++ ops, register them, give the packed linears their native
    call, and the float32 linears and (for ``compiled_attention``) the attention modules the step record. Returns
    (the record the backend writes each compiled step, or None, why)."""
    from tierlm.backends.torch.cpu.f32_gemv import F32GemvLinear
    from tierlm.backends.torch.cpu.linear import PackedLinear

    plan = kernels.plan
    if plan.compiled_ops.value != "native":
        return None, plan.compiled_ops.why
    lib = registered(kernels.lib)
    if lib is None:
        return None, "the kernel library's ops are not registered in this process"
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m.fast_rows]
    f32 = [m for m in model.modules() if isinstance(m, F32GemvLinear)]
    for m in packed:
        m.use_native_call()
    attention = plan.compiled_attention.value == "native" and plan.decode_attention.value == "paged"
    record = StepRecord(lib, attention)
    for m in f32:
        record.attach(m)
    if attention:
        for m in model.modules():
            if hasattr(m, "layer_idx") and hasattr(m, "o_proj"):  # transformers' attention modules
                record.attach(m)
    parts = [f"{len(packed)} packed products" if packed else "", f"{len(f32)} float32 products" if f32 else "",
             "the decode-only steps' attention" if attention else ""]
    return record, f"{', '.join(p for p in parts if p) or 'no kernel call'} from C++ ({lib.level} library)"
