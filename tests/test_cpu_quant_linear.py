"""CPU weight-only int8 / int4 linears (backends/torch/weights/quant_linear.py) and the quantized input embedding
(weights/quant_embedding.py): outputs equal a dequantized reference (the value conventions of ``from_quantized`` as
documented), ``from_linear`` holds exactly the weights torchao's int8wo / int4wo recipes make, an embedding lookup
gives the rows the lm_head kernel multiplies by (one table when tied), and greedy output through the backend
equals transformers' model running the same dequantized weights (embedding included), token for token."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from backend_driver import run_greedy
from tierlm.backends.torch.cpu import library
from tierlm.backends.torch.weights.quant_embedding import QuantizedEmbedding
from tierlm.backends.torch.weights.quant_linear import (QUANT_LINEARS, Int4WeightOnlyLinear, Int8WeightOnlyLinear,
                                                        int4_tinygemm_recipe, quantize_linears)
from tierlm.backends.weight_format import parse_weight_quant

# Float32 activations: the kernels accumulate in float32, so only the summation order differs from the reference.
F32_TOL = dict(rtol=1e-5, atol=1e-5)


def _int8_kernel_library():
    """The process's kernel library where it has the int8 streaming kernel (x86 AVX2 / AVX-512 code), else skip."""
    lib = library.load()
    if lib is None or not lib.has("int8_gemv"):
        pytest.skip(f"no kernel library with the int8 streaming kernel here ({library.status()['why']})")
    return lib


def _bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bfloat16 output: within a few output roundings (8 mantissa bits) of the float32 reference."""
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs().max().item()
    assert err <= 4 * 2.0 ** -8 * ref.abs().max().item(), err


@pytest.mark.parametrize("kernel", ["torch", "library"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64), (0, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_from_quantized_equals_the_dequantized_product(dtype, shape, bias, kernel):
    """On torch's kernels (a layer without a library) and on tierlm's streaming kernel (``lib`` set, as the plan
    sets it where int8_products=gemv): the same dequantized product."""
    torch.manual_seed(0)
    q = torch.randint(-128, 128, (40, 64), dtype=torch.int8)
    scales = torch.rand(40, 1) * 0.01 + 1e-3  # [N, 1] as compressed-tensors stores channel scales
    b = torch.randn(40) if bias else None
    layer = Int8WeightOnlyLinear.from_quantized(q, scales, b, dtype=dtype)
    assert layer.lib is None  # torch's kernel until the plan gives the layer the library
    if kernel == "library":
        layer.lib = _int8_kernel_library()
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


# ------------------------------------------------------------------------------------------------ embedding
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,n,k,group", [(8, 40, 64, None), (4, 285, 64, 32), (4, 208, 128, 64),
                                            (4, 48, 256, 128)])
def test_embedding_rows_are_the_rows_the_lm_head_kernel_multiplies_by(dtype, bits, n, k, group):
    """A lookup reads the quantized table (int8 per row; int4 from tinygemm's packed layout, full 64-row blocks and
    a short last block, N padded to 16 included) and gives, in the model dtype, the weight rows the lm_head kernel
    computes with (read back through the kernel: x = identity)."""
    torch.manual_seed(4)
    lin = nn.Linear(k, n, bias=False).to(dtype)
    table = Int8WeightOnlyLinear.from_linear(lin) if bits == 8 else Int4WeightOnlyLinear.from_linear(lin, group)
    emb = QuantizedEmbedding(table, dtype)
    w = table(torch.eye(k, dtype=dtype)).t().float()  # [N, K] as the kernel multiplies, rounded to dtype
    ids = torch.tensor([[0, n - 1, 3], [n // 2, 1, 0]])
    out = emb(ids)
    assert out.shape == (2, 3, k) and out.dtype == dtype
    # bfloat16: exact ((q - 8) * scale is exact in float32); float32: the kernel's fused multiply-add, 1 ulp
    torch.testing.assert_close(out.float(), w[ids], rtol=1e-6 if dtype == torch.float32 else 0, atol=0)
    if bits == 8:
        assert torch.equal(emb.dequantized(), table.dequantized().to(dtype).float())


def test_int4_rows_read_the_packed_layout_of_this_torch_build_or_an_unpacked_copy(monkeypatch):
    """The probe finds how this torch build packs int4 (AVX512: 64-row blocks, AVX2: 32); where no known layout
    reads it, the embedding reads an unpacked copy of the same values: same rows."""
    from tierlm.backends.torch.weights import quant_embedding

    assert quant_embedding._packed_int4_layout() is not None
    torch.manual_seed(5)
    lin = nn.Linear(64, 285, bias=False)
    table = Int4WeightOnlyLinear.from_linear(lin, 32)
    packed_rows = QuantizedEmbedding(table, torch.float32).dequantized()
    monkeypatch.setattr(quant_embedding, "_packed_int4_layout", lambda: None)
    with pytest.raises(ValueError, match="unpacked values"):
        QuantizedEmbedding(table, torch.float32)
    q = int4_tinygemm_recipe(lin.weight.detach(), 32)[0]
    assert torch.equal(QuantizedEmbedding(table, torch.float32, unpacked=q).dequantized(), packed_rows)


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_models_root):
    """Tied embeddings: lm_head shares the embedding matrix in the checkpoint."""
    from model_factory import build_tiny_model

    return build_tiny_model("qwen2", tiny_models_root / "qwen2")


@pytest.mark.parametrize("value", ["int8wo", "int4wo-32"])
def test_tied_embedding_and_lm_head_hold_one_quantized_table(tiny_qwen2, value):
    """One table [V, H] serves the embedding lookup and the tied lm_head: no float embedding and no second copy
    left, so the weights are the quantized linears + norms, nothing more."""
    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(tiny_qwen2, dtype="bfloat16", device="cpu", weight_quant=parse_weight_quant(None, value))
    model = backend.model
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, QuantizedEmbedding) and emb.table is head
    quant_bytes = sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, QUANT_LINEARS)
                      for p in m.parameters(recurse=False))  # q, scales (and zero points), biases
    norms = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "norm" in name)
    assert backend.weight_bytes() == quant_bytes + norms


# ------------------------------------------------------------------------------------------------ backend
def _dequantized_reference(model_dir, backend, prompt: list[int], new: int) -> list[int]:
    """transformers' float32 eager model with every linear weight, and the input embedding, replaced by the
    backend's dequantized one."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ref.config.tie_word_embeddings = False
    ref_layers = dict(ref.named_modules())
    emb = backend.model.get_input_embeddings()
    assert isinstance(emb, QuantizedEmbedding)
    for name, q in backend.model.named_modules():
        if not isinstance(q, QUANT_LINEARS) or name.startswith("model.embed_tokens."):
            continue  # an untied embedding's own table: set below
        # fused_projections.py: one qkv_proj / gate_up_proj, rows in the order of transformers' layers
        parent, _, attr = name.rpartition(".")
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(attr)
        targets = [ref_layers[f"{parent}.{p}"] for p in parts] if parts else [ref_layers[name]]
        for m, w in zip(targets, q.dequantized().split([m.out_features for m in targets])):
            m.weight = nn.Parameter(w, requires_grad=False)
    ref.get_input_embeddings().weight = nn.Parameter(emb.dequantized(), requires_grad=False)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("value", ["int8wo", "int4wo-32"])
def test_backend_greedy_equals_transformers_on_the_dequantized_weights(tiny_llama, tiny_qwen2, family, value):
    """Untied (llama: the embedding has a table of its own) and tied (qwen2: the lm_head's table) embeddings."""
    from tierlm.backends.torch.backend import TorchBackend

    model_dir = tiny_llama if family == "llama" else tiny_qwen2
    backend = TorchBackend(model_dir, dtype="float32", device="cpu", weight_quant=parse_weight_quant(None, value))
    assert backend.info.weight_format == f"torchao:{value}+embedding"
    kinds = {type(m) for m in backend.model.modules()}
    assert (Int8WeightOnlyLinear if value == "int8wo" else Int4WeightOnlyLinear) in kinds
    linear = backend.kernels()["linear"]
    assert "weight-only" in linear
    lib = library.load()
    streams = value == "int8wo" and lib is not None and lib.has("int8_gemv")
    assert ("streaming kernel for all rows" in linear) == streams
    assert (backend.cpu_kernels.plan.int8_products.value == "gemv") == streams
    assert all(m.lib is (lib if streams else None) for m in backend.model.modules()
               if isinstance(m, Int8WeightOnlyLinear))
    prompts = [[1, 17, 42, 99, 7, 250, 31], [1, 5, 6, 200, 201, 202, 12, 13, 14]]
    got = run_greedy(backend, prompts, 12)
    assert got == [_dequantized_reference(model_dir, backend, p, 12) for p in prompts]


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


def test_an_embedding_left_in_the_model_dtype_is_not_labelled_quantized(tiny_llama, monkeypatch):
    """quantize_embedding declines (a scaled embedding subclass, rows the kernel cannot take): the weights keep the
    plain int8wo label, so their L3 pages are never read under "+embedding" (which computes other numbers)."""
    from tierlm.backends.torch.backend import TorchBackend
    from tierlm.backends.torch.weights import weight_quant

    monkeypatch.setattr(weight_quant, "quantize_embedding", lambda *a: "declined for the test")
    backend = TorchBackend(tiny_llama, dtype="float32", device="cpu", weight_quant=parse_weight_quant(None, "int8wo"))
    assert not any(isinstance(m, QuantizedEmbedding) for m in backend.model.modules())
    assert backend.info.weight_format == "torchao:int8wo"


@pytest.mark.parametrize("value", ["int8wo", "int4wo-32"])
def test_a_long_lookup_in_slices_gives_the_rows_of_a_short_one(tiny_qwen2, value, monkeypatch):
    """Lookups longer than LOOKUP_CHUNK go in slices (bounded temporaries): the same rows as one lookup."""
    from tierlm.backends.torch.backend import TorchBackend
    from tierlm.backends.torch.weights import quant_embedding

    backend = TorchBackend(tiny_qwen2, dtype="float32", device="cpu", weight_quant=parse_weight_quant(None, value))
    emb = next(m for m in backend.model.modules() if isinstance(m, QuantizedEmbedding))
    ids = torch.randint(0, emb.num_embeddings, (3, 50))
    whole = emb(ids)
    monkeypatch.setattr(quant_embedding, "LOOKUP_CHUNK", 7)
    assert torch.equal(emb(ids), whole) and whole.shape == (3, 50, emb.embedding_dim)


def test_int8_bf16_prefill_goes_through_the_widened_weight_in_slices(monkeypatch):
    from tierlm.backends.torch.weights import quant_linear as cpu_quant_linear

    g = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (70, 96), generator=g, dtype=torch.int8)
    scales = (torch.rand(70, generator=g) / 50 + 1e-3).to(torch.bfloat16)
    b = torch.randn(70, generator=g).to(torch.bfloat16)
    layer = Int8WeightOnlyLinear.from_quantized(q, scales, b, dtype=torch.bfloat16)
    x = torch.randn(cpu_quant_linear.DENSE_PREFILL_ROWS + 3, 96, generator=g).to(torch.bfloat16)
    calls = []
    real = cpu_quant_linear._dense_prefill
    monkeypatch.setattr(cpu_quant_linear, "_dense_prefill", lambda *a: calls.append(1) or real(*a))
    whole = layer(x)
    assert calls, "prefill rows must take the widened-weight path"
    _bf16_close(whole, x.float() @ layer.dequantized().t() + b.float())
    monkeypatch.setattr(cpu_quant_linear, "DENSE_SLICE_WEIGHTS", 96 * 16)  # 16 output rows per slice, a short last
    assert torch.equal(layer(x), whole)
    no_bias = Int8WeightOnlyLinear.from_quantized(q, scales, None, dtype=torch.bfloat16)
    _bf16_close(no_bias(x), x.float() @ layer.dequantized().t())
