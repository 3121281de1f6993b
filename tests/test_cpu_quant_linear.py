"""CPU weight-only int8 / int4 linears (backends/torch/cpu_quant_linear.py): outputs equal a dequantized reference
(the value conventions of ``from_quantized`` as documented), ``from_linear`` holds exactly the weights torchao's
int8wo / int4wo recipes make, and greedy output through the backend equals transformers' model running the same
dequantized weights, token for token."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from backend_driver import run_greedy
from tierlm.backends.torch.cpu_quant_linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear, quantize_linears
from tierlm.backends.weight_format import parse_weight_quant

# Float32 activations: the kernels accumulate in float32, so only the summation order differs from the reference.
F32_TOL = dict(rtol=1e-5, atol=1e-5)


def _bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bfloat16 output: within a few output roundings (8 mantissa bits) of the float32 reference."""
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs().max().item()
    assert err <= 4 * 2.0 ** -8 * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64), (0, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_from_quantized_equals_the_dequantized_product(dtype, shape, bias):
    torch.manual_seed(0)
    q = torch.randint(-128, 128, (40, 64), dtype=torch.int8)
    scales = torch.rand(40, 1) * 0.01 + 1e-3  # [N, 1] as compressed-tensors stores channel scales
    b = torch.randn(40) if bias else None
    layer = Int8WeightOnlyLinear.from_quantized(q, scales, b, dtype=dtype)
    x = torch.randn(*shape).to(dtype)
    w = q.float() * scales.to(dtype).float()  # scales held in the activation dtype, as documented
    ref = x.float() @ w.t() + (b.to(dtype).float() if bias else 0)
    out = layer(x)
    assert out.shape == (*shape[:-1], 40) and out.dtype == dtype
    if out.numel():
        torch.testing.assert_close(out, ref, **F32_TOL) if dtype == torch.float32 else _bf16_close(out, ref)
    assert torch.equal(layer.dequantized(), w)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("with_zeros", [True, False])
@pytest.mark.parametrize("n,k,group", [(48, 128, 32), (40, 256, 128), (17, 64, 64)])
def test_int4_from_quantized_equals_the_dequantized_product(signed, with_zeros, n, k, group):
    """(w_int4 - zeros) * scales per group, signed (int8 in -8..7) or unsigned (uint8 in 0..15); N not a multiple
    of 16 (padded) included."""
    torch.manual_seed(1)
    lo, hi, dt = (-8, 8, torch.int8) if signed else (0, 16, torch.uint8)
    q = torch.randint(lo, hi, (n, k), dtype=dt)
    scales = torch.rand(n, k // group) * 0.05 + 1e-3
    zeros = torch.randint(lo, hi, (n, k // group)).float() if with_zeros else None
    b = torch.randn(n)
    layer = Int4WeightOnlyLinear.from_quantized(q, scales, zeros, b)
    z = zeros if zeros is not None else torch.zeros_like(scales)
    w = (q.float() - z.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    x = torch.randn(3, k)
    torch.testing.assert_close(layer(x), x @ w.t() + b, **F32_TOL)
    torch.testing.assert_close(layer.dequantized(), w, **F32_TOL)
    bf = Int4WeightOnlyLinear.from_quantized(q, scales, zeros, b, dtype=torch.bfloat16)
    xb = x.to(torch.bfloat16)
    # bfloat16 scales and tinygemm zero points (-z * s) hold the dequantized weight to bf16 precision
    wb = bf.dequantized()
    torch.testing.assert_close(wb, w, rtol=2 ** -7, atol=2 ** -7 * w.abs().max().item())
    _bf16_close(bf(xb), xb.float() @ wb.t() + b.to(torch.bfloat16).float())


def test_from_quantized_refuses_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="-8..7"):
        Int4WeightOnlyLinear.from_quantized(torch.full((16, 64), 9, dtype=torch.int8), torch.ones(16, 2), None)
    with pytest.raises(ValueError, match="group size 48"):
        Int4WeightOnlyLinear.from_quantized(torch.zeros(16, 96, dtype=torch.uint8), torch.ones(16, 2), None)
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8WeightOnlyLinear.from_quantized(torch.zeros(8, 40, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="one value per output channel"):
        Int8WeightOnlyLinear.from_quantized(torch.zeros(8, 64, dtype=torch.int8), torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_linear_holds_torchaos_int8wo_weights(dtype):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(128, 48, bias=True)).to(dtype)
    ours = Int8WeightOnlyLinear.from_linear(model[0])
    quantize_(model, Int8WeightOnlyConfig())
    theirs = model[0].weight
    assert torch.equal(ours.qweight, theirs.qdata)
    assert torch.equal(ours.scales, theirs.scale.reshape(-1).to(dtype))
    x = torch.randn(4, 128).to(dtype)
    ref = model(x).float()
    out = ours(x)
    torch.testing.assert_close(out, ref, **F32_TOL) if dtype == torch.float32 else _bf16_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
def test_from_linear_holds_torchaos_int4wo_weights(dtype, group):
    """torchao's CPU int4 tensor (its prototype Int4OpaqueTensor, same tinygemm recipe and kernel) packs the same
    bytes, scales and zero points."""
    pytest.importorskip("torchao")
    from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor

    torch.manual_seed(3)
    lin = nn.Linear(256, 48).to(dtype)
    ours = Int4WeightOnlyLinear.from_linear(lin, group)
    theirs = Int4OpaqueTensor.from_hp(lin.weight.detach(), [1, group])
    assert torch.equal(ours.qweight, theirs.qdata) and torch.equal(ours.scales_and_zeros, theirs.scale_and_zero)


def test_quantize_linears_keeps_shapes_the_kernel_cannot_take_dense():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 40), nn.Linear(40, 16))
    swapped, kept = quantize_linears(model, 4, 32)
    assert swapped == 2 and isinstance(model[0], Int4WeightOnlyLinear) and type(model[2]) is nn.Linear
    assert kept == ["2: in_features 40 is not a multiple of the group size 32"]


# ------------------------------------------------------------------------------------------------ backend
def _dequantized_reference(model_dir, backend, prompt: list[int], new: int) -> list[int]:
    """transformers' float32 eager model with every linear weight replaced by the backend's dequantized one."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ref.config.tie_word_embeddings = False
    layers = dict(backend.model.named_modules())
    for name, m in list(ref.named_modules()):
        q = layers.get(name)
        if isinstance(q, (Int8WeightOnlyLinear, Int4WeightOnlyLinear)):
            m.weight = nn.Parameter(q.dequantized(), requires_grad=False)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("value", ["int8wo", "int4wo-32"])
def test_backend_greedy_equals_transformers_on_the_dequantized_weights(tiny_llama, value):
    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(tiny_llama, dtype="float32", device="cpu",
                           weight_quant=parse_weight_quant(None, value))
    assert backend.info.weight_format == f"torchao:{value}"
    kinds = {type(m) for m in backend.model.modules()}
    assert (Int8WeightOnlyLinear if value == "int8wo" else Int4WeightOnlyLinear) in kinds
    assert "weight-only" in backend.kernels()["linear"]
    prompts = [[1, 17, 42, 99, 7, 250, 31], [1, 5, 6, 200, 201, 202, 12, 13, 14]]
    got = run_greedy(backend, prompts, 12)
    assert got == [_dequantized_reference(tiny_llama, backend, p, 12) for p in prompts]


def test_int8_weight_at_an_unaligned_address_and_activations_in_another_dtype():
    """A weight mapped straight from a safetensors file can sit at any byte offset, and a caller may pass float32
    activations to a bf16 layer: torch's kernel crashes on both, so the layer copies the weight to an aligned
    address and casts the activations."""
    torch.manual_seed(0)
    q = torch.randint(-128, 128, (40, 64), dtype=torch.int8)
    raw = torch.empty(q.numel() + 1, dtype=torch.int8)
    unaligned = raw[1:].view(40, 64)
    unaligned.copy_(q)
    assert unaligned.data_ptr() % 16 != 0
    scales = torch.rand(40) * 0.01 + 1e-3
    layer = Int8WeightOnlyLinear.from_quantized(unaligned, scales, None, dtype=torch.bfloat16)
    x = torch.randn(3, 64)  # float32 into a bf16 layer
    out = layer(x)
    assert out.dtype == torch.float32
    _bf16_close(out.to(torch.bfloat16), x.to(torch.bfloat16).float() @ (q.float() * scales.to(torch.bfloat16).float()[:, None]).t())
