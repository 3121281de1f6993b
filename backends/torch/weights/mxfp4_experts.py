"""gpt-oss MXFP4 experts kept packed: the checkpoint's 4-bit blocks + E8M0 scales stay resident (4.25 bits per
weight instead of 16 or 32), and each forward dequantizes only the experts its router picked, a few at a time.

transformers' own packed path needs the ``kernels`` package, which downloads triton_kernels from the Hub; this is
plain torch (any device, offline). The values are transformers' ``Mxfp4Config(dequantize=True)`` ones bit for bit
(``dequantize`` = its ``convert_moe_packed_tensors``: the same lookup table and ``ldexp``), laid out [experts, in,
out] like ``GptOssExperts``' parameters, and the forward is transformers' default ``grouped_mm`` experts forward op
for op with each grouped matmul run over a compact stack of the selected experts (per-group products do not
depend on the other groups), so outputs equal the dequantized model's (tests/test_mxfp4_experts.py).

Loading (``packed_gpt_oss_class``): the model class builds these modules in place of ``GptOssExperts`` while
transformers creates the model on the meta device, and the config loses its ``quantization_config`` so
transformers' MXFP4 quantizer never runs: the checkpoint's ``*_blocks`` / ``*_scales`` tensors then load by name
straight into these uint8 parameters, tensor by tensor, and no dense copy of all experts ever exists.
"""
from __future__ import annotations

import copy
import functools
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

MXFP4_BLOCK = 32  # values per E8M0 scale; 16 bytes of two E2M1 codes each
# Bound on one chunk's dense copy of expert weights (the dequantize's index and the matmul come on top: the
# transient peak is about 3x this). gpt-oss-20b in bf16: 33 MB per expert's gate_up, so 2 experts a chunk.
CHUNK_BYTES = 64 << 20


class PackedMxfp4Experts(nn.Module):
    """``GptOssExperts`` (transformers) with ``gate_up_proj`` / ``down_proj`` as MXFP4 ``*_blocks`` uint8
    [E, out, in/32, 16] and ``*_scales`` uint8 [E, out, in/32] (the checkpoint's tensors and names); biases float."""

    def __init__(self, config, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__()
        E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size
        if H % MXFP4_BLOCK or I % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size divisible by {MXFP4_BLOCK}; "
                             f"got {H} and {I}")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.chunk_bytes = chunk_bytes

        def packed(rows: int, cols: int) -> tuple[nn.Parameter, nn.Parameter]:
            blocks = torch.empty(E, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2, dtype=torch.uint8)
            scales = torch.empty(E, rows, cols // MXFP4_BLOCK, dtype=torch.uint8)
            return nn.Parameter(blocks, requires_grad=False), nn.Parameter(scales, requires_grad=False)

        # Parameters (not buffers): weight counts (TorchBackend.weight_bytes) and .to(device) see them.
        self.gate_up_proj_blocks, self.gate_up_proj_scales = packed(2 * I, H)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I), requires_grad=False)
        self.down_proj_blocks, self.down_proj_scales = packed(H, I)
        self.down_proj_bias = nn.Parameter(torch.empty(E, H), requires_grad=False)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        return GptOssExperts._apply_gate(self, gate_up)  # the clamp / alpha / (up + 1) of the float model

    def experts_per_chunk(self, dtype: torch.dtype) -> int:
        per_expert = 2 * self.intermediate_size * self.hidden_size * torch.empty(0, dtype=dtype).element_size()
        return max(1, self.chunk_bytes // per_expert)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        # transformers' grouped_mm_experts_forward (integrations/moe.py), the dense path's default, step for step.
        dtype = self.gate_up_proj_bias.dtype
        num_top_k, num_tokens, hidden = router_indices.size(-1), hidden_states.size(0), hidden_states.size(-1)
        expert_ids = router_indices.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        x_g = hidden_states[perm // num_top_k]
        weights_g = routing_weights.reshape(-1)[perm]
        # One host sync: which experts this call needs, and where their rows start in sorted order.
        counts = torch.bincount(expert_ids_g, minlength=self.num_experts).tolist()
        groups = _chunks([e for e, n in enumerate(counts) if n], counts, self.experts_per_chunk(dtype))

        proj = self._grouped(x_g, groups, self.gate_up_proj_blocks, self.gate_up_proj_scales, dtype, x_g.device)
        proj.add_(self.gate_up_proj_bias[expert_ids_g])
        proj = self._apply_gate(proj)
        proj = self._grouped(proj, groups, self.down_proj_blocks, self.down_proj_scales, dtype, x_g.device)
        proj.add_(self.down_proj_bias[expert_ids_g])

        weighted = proj * weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
        out = weighted[inv_perm].view(num_tokens, num_top_k, hidden).sum(dim=1)
        return out.to(hidden_states.dtype)

    @staticmethod
    def _grouped(rows: torch.Tensor, groups: list[tuple[list[int], int, int, list[int]]], blocks: torch.Tensor,
                 scales: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``rows`` (sorted by expert) times each row's expert weight, the experts dequantized chunk by chunk."""
        from transformers.integrations.moe import _grouped_mm  # the dense path's dispatch (CPU, CUDA sm80+, ...)

        out = rows.new_empty(rows.size(0), blocks.size(1), dtype=dtype)
        for experts, start, end, sizes in groups:
            weight = dequantize(blocks, scales, experts, dtype)
            offsets = torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
            out[start:end] = _grouped_mm(rows[start:end], weight, offs=offsets)
            del weight  # before the next chunk's copy exists
        return out


def _chunks(experts: list[int], counts: list[int], per_chunk: int) -> list[tuple[list[int], int, int, list[int]]]:
    """The hit experts in chunks of ``per_chunk``: (experts, first row, end row, rows per expert) in sorted order."""
    starts, row = {}, 0
    for e, n in enumerate(counts):
        starts[e] = row
        row += n
    out = []
    for i in range(0, len(experts), per_chunk):
        chunk = experts[i:i + per_chunk]
        sizes = [counts[e] for e in chunk]
        out.append((chunk, starts[chunk[0]], starts[chunk[0]] + sum(sizes), sizes))
    return out


@functools.lru_cache(maxsize=16)
def _nibble_tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """byte -> the E2M1 value of its low nibble, and of its high nibble (transformers' FP4_VALUES, in ``dtype``)."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=device)
    byte = torch.arange(256, device=device)
    return lut[byte & 0x0F], lut[byte >> 4]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, experts: list[int] | None, dtype: torch.dtype
               ) -> torch.Tensor:
    """Experts ``experts`` (all: None) of MXFP4 ``blocks`` [E, out, G, 16] / ``scales`` [E, out, G] as dense
    [len(experts), G*32, out] in ``dtype``: ``convert_moe_packed_tensors``' values and layout, bit for bit.

    Decoded straight into the [in, out] layout from the bytes transposed first (uint8: a quarter of the bytes a
    float transpose would move), element 2j of a block from byte j's low nibble, 2j+1 from its high one."""
    if experts is not None:
        index = torch.tensor(experts, device=blocks.device)
        blocks, scales = blocks.index_select(0, index), scales.index_select(0, index)
    k, rows, groups, half = blocks.shape
    codes = blocks.permute(0, 2, 3, 1).int()  # [k, G, 16, out]: int32 indexes the tables
    lo, hi = _nibble_tables(dtype, blocks.device)
    out = torch.empty(k, groups, half, 2, rows, dtype=dtype, device=blocks.device)
    out[:, :, :, 0] = lo[codes]
    out[:, :, :, 1] = hi[codes]
    del codes
    exponent = (scales.to(torch.int32) - 127).permute(0, 2, 1)[:, :, None, None, :]  # [k, G, 1, 1, out]
    torch.ldexp(out, exponent, out=out)  # as transformers scales: exact unless the result under/overflows
    return out.view(k, groups * half * 2, rows)


def packed_model_class(config) -> tuple[object, type]:
    """(the config without its quantization_config, the model class with packed experts) for from_pretrained."""
    from transformers import GptOssForCausalLM

    if getattr(config, "model_type", None) != "gpt_oss":
        raise ValueError(f"packed MXFP4 experts are gpt-oss's; this checkpoint is {config.model_type!r}: set "
                         "TIERLM_MXFP4_EXPERTS=dequantized")
    config = copy.deepcopy(config)
    del config.quantization_config  # transformers' MXFP4 quantizer (dequantize or Hub kernels) stays out
    return config, packed_gpt_oss_class(GptOssForCausalLM)


def packed_gpt_oss_class(base: type, chunk_bytes: int = CHUNK_BYTES) -> type:
    """``base`` (transformers' GptOssForCausalLM) building ``PackedMxfp4Experts`` in every layer (see the module
    docstring); from_pretrained on it with a config without quantization_config loads the packed tensors."""

    class PackedMxfp4GptOss(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)  # on the meta device inside from_pretrained: no bytes
            for layer in self.model.layers:
                layer.mlp.experts = PackedMxfp4Experts(config, chunk_bytes)

    PackedMxfp4GptOss.__name__ = PackedMxfp4GptOss.__qualname__ = base.__name__  # logs and reports read as usual
    return PackedMxfp4GptOss


def packed_bytes(model: nn.Module) -> int:
    """Resident bytes of every packed expert module's tensors (blocks + scales + biases)."""
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, PackedMxfp4Experts)
               for p in m.parameters())
