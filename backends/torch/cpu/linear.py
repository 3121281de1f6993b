"""bf16 linear layers on CPU with oneDNN-prepacked weights (what inductor's CPU "freezing" emits).

Eager ``F.linear`` in bf16 reorders the weight into oneDNN's blocked layout on every call; for the one-row
matmuls of decode that reorder costs more than the product itself (measured on AVX512-BF16: 1.5-2.4x faster
per decode GEMV when packed once, prefill-sized products unchanged or faster). ``pack_linears`` swaps each
``nn.Linear`` of a loaded bf16 model for a ``PackedLinear`` holding the packed weight instead of the plain one
(same memory, same module names and shapes); oneDNN computes the same product either way, so the outputs are
bit-identical to ``F.linear`` (tests/test_cpu_linear.py).

Packed where the CPU plan says (``bf16_linear``: oneDNN's bf16 reorder runs on AVX-512 BW/VL/DQ or AVX-NE-CONVERT
x86); elsewhere (AVX2-only x86, aarch64) torch's plain bf16 ``F.linear`` serves, as transformers' own model does.

Decode-sized products (at most 32 rows) run on tierlm's own kernel over the same packed weight where oneDNN packed
it in the layout that kernel reads, with the same bits (the plan's ``decode_products``): amx_linear.py's tile kernel
on AMX CPUs (the weights streamed ~1.7x faster), avx512_linear.py's dot products on AVX512-BF16 CPUs without AMX
(~1.7x at one row).

Not packed: float32 (the reference dtype, which must stay exact against transformers). A tied lm_head (its weight
shared with the embedding, which still needs the plain rows) is packed as a second copy of the largest matrix:
eager bf16 ``F.linear`` reorders the whole weight on every call, which for a tied Qwen2.5-0.5B lm_head
(151936 x 896) took 19.4 ms of a 52 ms one-stream step where the packed copy takes 9.0 ms (AVX512-BF16 EPYC, one
thread; 32000 x 512: 1.98 vs 0.69 ms). vLLM CPU keeps the same packed copy next to its embedding. The copy is
counted in the weight bytes the KV pool is sized from; the plan's ``pack_tied_lm_head=no`` gives the memory back.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from tierlm.backends.torch import ops
from tierlm.backends.torch.cpu import amx_linear, avx512_linear, library
from tierlm.backends.torch.cpu.library import KernelLibrary

log = logging.getLogger(__name__)

# The batch size oneDNN is told to expect when choosing the packed layout (vLLM CPU tells it 32 too). 1, 8 and 32
# measured the same on AVX512-BF16; on an AMX Xeon the layout chosen for 1 streamed slower even at one row (weights
# from DRAM, one core: 32000x512 7.2 vs 4.3 ms, 2816x512 0.75 vs 0.57; Qwen2.5-0.5B-shape decode step 1.10-1.13x),
# and 8 to 2016 rows ran as fast or faster. The products are the same bits either way.
PACK_BATCH_HINT = 32
# The decode-product kernel of each plan value (platforms/cpu_plan.py ``decode_products``)
KERNELS = {"amx": amx_linear, "avx512_bf16": avx512_linear}
BY_BLOCK = {k.BLOCK: k for k in KERNELS.values()}


def torch_refusal() -> str | None:
    """Why this torch will not prepack bf16 weights in this process where the plan says the CPU can (no mkldnn
    linear ops; or its own refusal, e.g. under ONEDNN_MAX_CPU_ISA), else None."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch build has no mkldnn linear ops"
    return _torch_refuses_the_reorder()


@functools.lru_cache(maxsize=1)
def _torch_refuses_the_reorder() -> str | None:
    """torch's own message when it will not prepack a bf16 weight in this process, else None (one tiny try)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PACK_BATCH_HINT)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed bf16 weight; ``weight`` is gone, ``packed_weight`` holds it.
    ``kernel``: the decode-product kernel module of the plan (amx_linear, avx512_linear) and ``lib`` its library,
    or None (oneDNN's product at every row count)."""

    def __init__(self, linear: nn.Linear, kernel=None, lib: KernelLibrary | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT),
                             persistent=False)
        self.bias = linear.bias
        # rows up to this many take tierlm's decode-product kernel (0: oneDNN's product at every count)
        usable = kernel is not None and lib is not None and (self.bias is None or self.bias.dtype == torch.bfloat16)
        self.fast_rows = kernel.fast_rows(lib, w, self.packed_weight) if usable else 0
        self.kernel, self.lib = (kernel, lib) if self.fast_rows else (None, None)
        # the kernel's column block (names it in a compiled step's op: 0, oneDNN) and, once compiled steps call it
        # from C++ (native_ops.prepare), what that op takes: for the AVX512-BF16 kernel [the thread count probed at,
        # the K chunk for 1 row, ..., for 32]
        self.block = self.kernel.BLOCK if self.kernel is not None else 0
        self.native, self.k_chunks = False, []

    def use_native_call(self) -> None:
        """Compiled steps call this layer's kernel from C++ (native_ops.prepare)."""
        if self.kernel is not None:
            self.native, self.k_chunks = True, self.kernel.native_chunks(self.lib, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled step: an op with a shape rule (ops.py)
            return ops.packed_linear(x, self.packed_weight, self.bias, self.out_features, self.fast_rows,
                                     self.block, self.k_chunks, self.native)
        return packed_product(x, self.packed_weight, self.bias, self.out_features, self.fast_rows, self.kernel,
                              self.lib)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               "packed=oneDNN" + (f", {self.kernel.NAME} kernel up to {self.fast_rows} rows" if self.fast_rows else "")


def packed_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                   fast_rows: int, kernel=None, lib: KernelLibrary | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) over a packed weight: ``kernel`` (its library ``lib``) for at most ``fast_rows`` rows, else
    (or where that kernel declines a row count) oneDNN."""
    if fast_rows and kernel is not None and 0 < x.numel() <= fast_rows * x.shape[-1] and x.dtype == torch.bfloat16:
        y = kernel.product(lib, x, packed_weight, bias, out_features)
        if y is not None:
            return y
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def _python_op(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
               fast_rows: int, block: int) -> torch.Tensor:
    """``tierlm::packed_linear``: ``packed_product`` with the kernel ``block`` names (the process's library)."""
    kernel = BY_BLOCK.get(block)
    lib = library.load() if kernel is not None else None
    return packed_product(x, packed_weight, bias, out_features, fast_rows if lib is not None else 0, kernel, lib)


ops.implement("packed_linear", _python_op,
              lambda x, packed_weight, bias, out_features, fast_rows, block:
              x.new_empty((*x.shape[:-1], out_features)))


def pack_linears(model: nn.Module, kernels) -> int:
    """Swap every unshared bf16 CPU ``nn.Linear`` of ``model`` for a ``PackedLinear`` where ``kernels`` (the model's
    CpuKernels, plan.py) says ``bf16_linear=packed``; returns how many (0 otherwise, or where this torch refuses the
    reorder: the plain linears stay, with the reason logged). With ``pack_tied_lm_head=yes`` also a linear whose
    weight only non-linear modules share (a tied lm_head), as a packed copy next to the shared plain weight."""
    plan = kernels.plan
    if plan.bf16_linear.value != "packed":
        log.info("CPU bf16 linear layers: torch's plain bf16 linear (%s)", plan.bf16_linear.why)
        return 0
    refusal = torch_refusal()
    if refusal:
        log.info("CPU bf16 linear layers: torch's plain bf16 linear (torch refuses the oneDNN bf16 reorder here: %s)",
                 refusal)
        return 0
    pack_tied = plan.pack_tied_lm_head.value == "yes"
    kernel = KERNELS.get(plan.decode_products.value)
    lib = kernels.lib if kernel is not None else None
    uses: dict[int, int] = {}
    linear_uses: dict[int, int] = {}
    for m in model.modules():  # a weight held by two modules (tied embeddings) stays plain unless pack_tied
        for p in m.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
            linear_uses[id(p)] = linear_uses.get(id(p), 0) + (type(m) is nn.Linear)
    swaps, copies = [], 0
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:  # subclasses (quantized, LoRA) have their own forward
            continue
        w = m.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16:
            continue
        if uses[id(w)] > 1:
            if not pack_tied or linear_uses[id(w)] > 1:
                continue
            copies += w.numel() * w.element_size()
        swaps.append((name, m))
    for name, m in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(m, kernel, lib))
    if swaps:
        fast = sum(bool(model.get_submodule(name).fast_rows) for name, _m in swaps)
        log.info("CPU bf16: %d linear layers use oneDNN-prepacked weights; %d of them run decode-sized products on "
                 "%s (%s)", len(swaps), fast, f"tierlm's {kernel.NAME} kernel" if kernel else "oneDNN",
                 plan.decode_products.why)
    if copies:
        log.info("CPU bf16: tied lm_head packed as a copy next to the embedding (+%.0f MiB; TIERLM_CPU_PLAN="
                 "pack_tied_lm_head=no keeps it plain)", copies / 2**20)
    return len(swaps)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights (buffers, not parameters: weight counts add this)."""
    return sum(m.packed_weight.numel() * m.packed_weight.element_size()
               for m in model.modules() if isinstance(m, PackedLinear))
