"""bf16 linear layers on CPU with oneDNN-prepacked weights (what inductor's CPU "freezing" emits).

Eager ``F.linear`` in bf16 reorders the weight into oneDNN's blocked layout on every call; for the one-row
matmuls of decode that reorder costs more than the product itself (measured on AVX512-BF16: 1.5-2.4x faster
per decode GEMV when packed once, prefill-sized products unchanged or faster). ``pack_linears`` swaps each
``nn.Linear`` of a loaded bf16 model for a ``PackedLinear`` holding the packed weight instead of the plain one
(same memory, same module names and shapes); oneDNN computes the same product either way, so the outputs are
bit-identical to ``F.linear`` (tests/test_cpu_linear.py).

Packed only where oneDNN's bf16 reorder runs (platforms/cpu_features.py: AVX-512 BW/VL/DQ or AVX-NE-CONVERT on
x86); elsewhere (AVX2-only x86, aarch64) torch's plain bf16 ``F.linear`` serves, as transformers' own model does.

Decode-sized products (at most 32 rows) run on tierlm's own kernel over the same packed weight where oneDNN packed
it in the layout that kernel reads, with the same bits: cpu_amx_linear.py's tile kernel on AMX CPUs (the weights
streamed ~1.7x faster), cpu_avx512_linear.py's dot products on AVX512-BF16 CPUs without AMX (~1.7x at one row).

Not packed: float32 (the reference dtype, which must stay exact against transformers). A tied lm_head (its weight
shared with the embedding, which still needs the plain rows) is packed as a second copy of the largest matrix:
eager bf16 ``F.linear`` reorders the whole weight on every call, which for a tied Qwen2.5-0.5B lm_head
(151936 x 896) took 19.4 ms of a 52 ms one-stream step where the packed copy takes 9.0 ms (AVX512-BF16 EPYC, one
thread; 32000 x 512: 1.98 vs 0.69 ms). vLLM CPU keeps the same packed copy next to its embedding. The copy is
counted in the weight bytes the KV pool is sized from; TIERLM_CPU_PACK_TIED_LM_HEAD=0 gives the memory back.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn

from tierlm.backends.torch import cpu_amx_linear, cpu_avx512_linear
from tierlm.platforms.cpu_features import CpuFeatures, this_cpu

log = logging.getLogger(__name__)

# The batch size oneDNN is told to expect when choosing the packed layout (vLLM CPU tells it 32 too). 1, 8 and 32
# measured the same on AVX512-BF16; on an AMX Xeon the layout chosen for 1 streamed slower even at one row (weights
# from DRAM, one core: 32000x512 7.2 vs 4.3 ms, 2816x512 0.75 vs 0.57; Qwen2.5-0.5B-shape decode step 1.10-1.13x),
# and 8 to 2016 rows ran as fast or faster. The products are the same bits either way.
PACK_BATCH_HINT = 32
PACK_TIED_ENV = "TIERLM_CPU_PACK_TIED_LM_HEAD"


def packing_available(cpu: CpuFeatures | None = None) -> tuple[bool, str]:
    """(whether bf16 weights can be prepacked here, why): this torch has the mkldnn linear ops and this CPU
    (after any TIERLM_CPU_ISA cap) runs oneDNN's bf16 reorder, which torch refuses without AVX-512 BW/VL/DQ."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False, "torch's plain bf16 linear: this torch build has no mkldnn linear ops"
    ok, why = (cpu or this_cpu()).onednn_bf16_prepack
    if ok and cpu is None:  # this process: torch has the last word (ONEDNN_MAX_CPU_ISA can rule the reorder out)
        refusal = _torch_refuses_the_reorder()
        if refusal:
            return False, f"torch's plain bf16 linear: torch refuses the oneDNN bf16 reorder here ({refusal})"
    return ok, why


@functools.lru_cache(maxsize=1)
def _torch_refuses_the_reorder() -> str | None:
    """torch's own message when it will not prepack a bf16 weight in this process, else None (one tiny try)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PACK_BATCH_HINT)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed bf16 weight; ``weight`` is gone, ``packed_weight`` holds it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT),
                             persistent=False)
        self.bias = linear.bias
        # rows up to this many take tierlm's decode-product kernel (0: oneDNN's product at every count)
        kernel = decode_kernel()
        self.fast_rows = kernel.fast_rows(w, self.packed_weight) \
            if kernel is not None and (self.bias is None or self.bias.dtype == torch.bfloat16) else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # --enable-torch-compile: an op with a shape rule (compiled_decode.py)
            from tierlm.backends.torch.compiled_decode import packed_linear_op

            return packed_linear_op(x, self.packed_weight, self.bias, self.out_features, self.fast_rows)
        return packed_product(x, self.packed_weight, self.bias, self.out_features, self.fast_rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               "packed=oneDNN" + \
            (f", {decode_kernel().NAME} kernel up to {self.fast_rows} rows" if self.fast_rows else "")


_decode_kernel: list = []  # [the module or None] once decided


def decode_kernel():
    """The module of tierlm's decode-product kernel that runs in this process (cpu_amx_linear where the CPU has AMX,
    cpu_avx512_linear where it has AVX512-BF16 and oneDNN does not use AMX), or None: oneDNN serves every product.
    Decided on the first call (each kernel's load is once per process too)."""
    if not _decode_kernel:
        _decode_kernel.append(next((k for k in (cpu_amx_linear, cpu_avx512_linear) if k.load() is not None), None))
    return _decode_kernel[0]


def packed_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                   fast_rows: int) -> torch.Tensor:
    """x @ W.T (+ bias) over a packed weight: tierlm's decode-product kernel for at most ``fast_rows`` rows, else
    (or where that kernel declines a row count) oneDNN."""
    if fast_rows and 0 < x.numel() <= fast_rows * x.shape[-1] and x.dtype == torch.bfloat16:
        kernel = decode_kernel()
        y = None if kernel is None else kernel.product(x, packed_weight, bias, out_features)
        if y is not None:
            return y
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def pack_linears(model: nn.Module, cpu: CpuFeatures | None = None, pack_tied: bool | None = None) -> int:
    """Swap every unshared bf16 CPU ``nn.Linear`` of ``model`` for a ``PackedLinear``; returns how many (0 where
    the CPU cannot run oneDNN's bf16 reorder: the plain linears stay, with the reason logged). ``pack_tied``
    (default: on unless TIERLM_CPU_PACK_TIED_LM_HEAD=0): also a linear whose weight only non-linear modules share
    (a tied lm_head), as a packed copy next to the shared plain weight."""
    ok, why = packing_available(cpu)
    if not ok:
        log.info("CPU bf16 linear layers: %s", why)
        return 0
    if pack_tied is None:
        pack_tied = os.environ.get(PACK_TIED_ENV, "1") != "0"
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
        setattr(parent, attr, PackedLinear(m))
    if swaps:
        fast = sum(bool(model.get_submodule(name).fast_rows) for name, _m in swaps)
        kernel = decode_kernel()
        why = kernel.describe()["why"] if kernel else \
            "; ".join(f"{k.NAME}: {k.describe()['why']}" for k in (cpu_amx_linear, cpu_avx512_linear))
        log.info("CPU bf16: %d linear layers use oneDNN-prepacked weights; %d of them run decode-sized products on "
                 "tierlm's %s kernel (%s)", len(swaps), fast, kernel.NAME if kernel else "own", why)
    if copies:
        log.info("CPU bf16: tied lm_head packed as a copy next to the embedding (+%.0f MiB; %s=0 keeps it plain)",
                 copies / 2**20, PACK_TIED_ENV)
    return len(swaps)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights (buffers, not parameters: weight counts add this)."""
    return sum(m.packed_weight.numel() * m.packed_weight.element_size()
               for m in model.modules() if isinstance(m, PackedLinear))
