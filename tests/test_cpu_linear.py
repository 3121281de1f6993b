"""CPU bf16: oneDNN-prepacked linear weights (backends/torch/cpu/linear.py) give bit-identical products where the
CPU plan packs them (oneDNN's bf16 reorder runs here), the plain path serves (same greedy output) where it does not
(AVX2-only x86, aarch64, or TIERLM_CPU_ISA capped below AVX-512), the decode attention path (eager math for
one-query bf16 rows) agrees with transformers' bf16 eager model, and float32 is never touched."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend_driver import run_greedy
from model_factory import build_tiny_model
from packed_kernels import bf16_kernels, packing_refusal
from tierlm.backends.base import ForwardBatch, SamplingBatch
from tierlm.backends.torch import paged_attention
from tierlm.backends.torch.backend import TorchBackend
from tierlm.backends.torch.cpu import library, linear
from tierlm.backends.torch.cpu.linear import PackedLinear, pack_linears
from tierlm.backends.torch.cpu.plan import CpuKernels
from tierlm.platforms import cpu_features, cpu_plan
from tierlm.platforms.cpu_features import apply_cap, this_cpu

PACK_REFUSAL = packing_refusal()
needs_packing = pytest.mark.skipif(PACK_REFUSAL is not None, reason=PACK_REFUSAL or "")


@pytest.fixture
def cpu_without_avx512(monkeypatch):
    """The process's CPU view capped at AVX2 (TIERLM_CPU_ISA), as on an AVX2-only machine, with the kernel library
    such a machine loads (the avx2 level's); both restored after."""
    if this_cpu().arch != "x86_64":
        pytest.skip(f"TIERLM_CPU_ISA=avx2 is an x86_64 level; this CPU is {this_cpu().arch}")
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    this_cpu.cache_clear()
    library.reset_for_tests()
    try:
        yield this_cpu()
    finally:
        monkeypatch.undo()
        this_cpu.cache_clear()
        library.reset_for_tests()


@needs_packing
@pytest.mark.parametrize("kernel", ["onednn", "planned"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (1, 7, 48), (70, 48)])
def test_packed_linear_is_bit_identical_to_f_linear(bias, shape, kernel):
    """oneDNN's product at every row count (no kernel), and with the decode-product kernel this CPU's plan runs
    (where it takes this weight: AVX512-BF16 needs whole blocks of 64 columns, AMX inputs in 32s)."""
    kernels = bf16_kernels()
    decode = linear.KERNELS.get(kernels.plan.decode_products.value) if kernel == "planned" else None
    if kernel == "planned" and decode is None:
        pytest.skip(f"no decode-product kernel in this CPU's plan: {kernels.plan.decode_products}")
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape).to(torch.bfloat16)
    expected = F.linear(x, lin.weight, lin.bias)
    packed = PackedLinear(lin, decode, kernels.lib if decode is not None else None)
    out = packed(x)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16 and torch.equal(out, expected)


def _tiny(family: str, tiny_models_root, dtype):
    from transformers import AutoModelForCausalLM

    folder = tiny_models_root / family
    if not (folder / "config.json").exists():
        build_tiny_model(family, folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()


@needs_packing
def test_a_tied_lm_head_is_packed_as_a_copy_by_default(tiny_models_root, monkeypatch):
    """By default (the plan's pack_tied_lm_head=yes) the tied lm_head gets its own packed copy, the embedding keeps
    the plain rows, the logits stay bit-identical and the copy counts in the packed bytes."""
    from tierlm.backends.torch.cpu.linear import packed_bytes

    qwen = _tiny("qwen2", tiny_models_root, torch.bfloat16)
    n_linear = sum(type(m) is nn.Linear for m in qwen.modules())
    embedding = qwen.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 9, 77, 3]])
    monkeypatch.delenv(cpu_plan.PLAN_ENV, raising=False)
    monkeypatch.delenv("TIERLM_CPU_PACK_TIED_LM_HEAD", raising=False)  # its earlier switch (cpu_plan.RENAMED)
    kernels = bf16_kernels()
    assert kernels.plan.pack_tied_lm_head.value == "yes", kernels.plan.pack_tied_lm_head
    with torch.inference_mode():
        before = qwen(ids).logits
        assert pack_linears(qwen, kernels) == n_linear
        after = qwen(ids).logits
    assert isinstance(qwen.lm_head, PackedLinear) and qwen.model.embed_tokens.weight is embedding
    assert packed_bytes(qwen) >= embedding.numel() * embedding.element_size()
    assert torch.equal(before, after)


@needs_packing
def test_pack_linears_keeps_float32_weights_and_when_asked_tied_ones_plain(tiny_models_root):
    """The plan's pack_tied_lm_head=no (TIERLM_CPU_PLAN) keeps the tied lm_head plain (no second copy); float32 is
    never packed."""
    kernels = bf16_kernels("pack_tied_lm_head=no")
    assert kernels.plan.pack_tied_lm_head.value == "no" and "pack_tied_lm_head=no" in kernels.plan.pack_tied_lm_head.why
    qwen = _tiny("qwen2", tiny_models_root, torch.bfloat16)  # tie_word_embeddings: lm_head shares the embedding
    n_linear = sum(type(m) is nn.Linear for m in qwen.modules())
    ids = torch.tensor([[1, 5, 9, 77, 3]])
    with torch.inference_mode():
        before = qwen(ids).logits
        assert pack_linears(qwen, kernels) == n_linear - 1
        after = qwen(ids).logits
    assert type(qwen.lm_head) is nn.Linear and qwen.lm_head.weight is qwen.model.embed_tokens.weight
    assert isinstance(qwen.model.layers[0].self_attn.q_proj, PackedLinear)
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None  # qwen2's q/k/v biases are kept
    assert torch.equal(before, after)
    # a float32 model: its plan packs nothing, and even a bf16 model's plan leaves float32 weights alone
    from tierlm.backends.torch.cpu import plan

    f32 = plan.for_model(torch.float32, env={})
    assert f32.plan.bf16_linear.value == "n/a"
    for k in (f32, bf16_kernels()):
        llama = _tiny("llama", tiny_models_root, torch.float32)
        assert pack_linears(llama, k) == 0 and not any(isinstance(m, PackedLinear) for m in llama.modules())


def _decode_batch(vocab: int, kv_lens: list[int], page_size: int) -> ForwardBatch:
    q = np.ones(len(kv_lens), np.int32)
    kv = np.asarray(kv_lens, np.int32)
    pages = [-(-k // page_size) for k in kv_lens]
    table = np.zeros((len(kv_lens), max(pages)), np.int32)
    first = 0
    for r, n in enumerate(pages):
        table[r, :n] = np.arange(first, first + n)
        first += n
    return ForwardBatch(input_ids=np.arange(len(kv_lens), dtype=np.int64) % vocab, positions=(kv - 1).astype(np.int64),
                        q_lens=q, kv_lens=kv, page_table=table, sample_indices=np.arange(len(kv_lens), dtype=np.int64),
                        sampling=SamplingBatch.greedy(len(kv_lens)), page_size=page_size)


def test_bf16_decode_eager_path_matches_sdpa_within_bf16_rounding(tiny_llama, monkeypatch):
    """The torch path of decode attention (the plan's decode_attention=torch: where no C kernel reads the pages):
    its eager math for one-query bf16 rows against torch's SDPA."""
    monkeypatch.setenv(cpu_plan.PLAN_ENV, "decode_attention=torch")
    backend = TorchBackend(tiny_llama, dtype="bfloat16")
    assert backend.cpu_kernels.decode is None
    backend.init_kv_pool(64, 4)
    backend.pool.buffer.normal_()  # cached K/V of every request: random, as any earlier step could leave them
    batch = _decode_batch(backend.info.vocab_size, [5, 17, 33], 4)
    calls = []
    real = paged_attention.attend_decode_eager
    monkeypatch.setattr(paged_attention, "attend_decode_eager", lambda *a: calls.append(1) or real(*a))
    eager = backend.forward_logits(batch)
    assert len(calls) == backend.model.config.num_hidden_layers  # every layer took the eager path
    monkeypatch.setattr(paged_attention, "_EAGER_DECODE_DTYPES", ())
    sdpa = backend.forward_logits(batch)
    assert len(calls) == backend.model.config.num_hidden_layers  # and none now
    assert (eager - sdpa).abs().max().item() < 0.05 * sdpa.abs().max().item()


def _greedy_against_transformers_bf16(tiny_llama) -> TorchBackend:
    backend = TorchBackend(tiny_llama, dtype="bfloat16")
    prompt = [1, 72, 101, 108, 108, 111, 44, 32, 119]
    ours = run_greedy(backend, [prompt], 8)[0]
    hf = _tiny("llama", tiny_llama.parent, torch.bfloat16)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert ours == ref
    return backend


@needs_packing
def test_bf16_greedy_agrees_with_transformers_bf16(tiny_llama):
    """The whole bf16 path (packed linears, SDPA prefill, eager decode) against transformers' bf16 eager model."""
    backend = _greedy_against_transformers_bf16(tiny_llama)
    assert any(isinstance(m, PackedLinear) for m in backend.model.modules())


def test_without_avx512_bf16_serves_through_plain_linears_with_the_same_greedy_output(tiny_llama, cpu_without_avx512):
    """What an AVX2-only CPU runs (torch refuses oneDNN's bf16 reorder there): nothing is packed, the reason is
    the CPU's, and the greedy output is still transformers' bf16 output."""
    backend = _greedy_against_transformers_bf16(tiny_llama)
    plan = backend.cpu_kernels.plan
    assert plan.bf16_linear == cpu_plan.Choice("torch", cpu_without_avx512.onednn_bf16_prepack[1])
    assert not cpu_without_avx512.onednn_bf16_prepack[0] and "AVX-512 BW/VL/DQ" in plan.bf16_linear.why
    assert backend.cpu_kernels.lib is None or backend.cpu_kernels.lib.level == "avx2"  # the library it would load
    assert plan.bf16_linear.why in backend.kernels()["linear"]
    assert not any(isinstance(m, PackedLinear) for m in backend.model.modules())
    assert sum(type(m) is nn.Linear for m in backend.model.modules()) > 0


def test_pack_linears_leaves_a_cpu_without_the_reorder_alone(tiny_models_root):
    """Decided by the plan of the CPU described, whatever this machine has: an AVX2 level, an aarch64 CPU."""
    avx2 = apply_cap(cpu_features.CpuFeatures("x86_64", frozenset({"avx2", "fma", "avx512f", "avx512bw",
                                                                    "avx512vl", "avx512dq"})), "avx2")
    arm = cpu_features.CpuFeatures("aarch64", frozenset({"asimd", "bf16", "sve"}))
    facts = cpu_plan.ModelFacts("bfloat16", "bfloat16", 8, 4, 64)
    for cpu, lib in ((avx2, cpu_plan.LibraryFacts("avx2", frozenset({"paged_decode", "softmax_rows", "torch_ops",
                                                                       "paged_extend_f32", "f32_gemv", "int8_gemv"}))),
                     (arm, cpu_plan.LibraryFacts("sve", frozenset({"paged_decode", "softmax_rows", "torch_ops"})))):
        decided = cpu_plan.decide(cpu, facts, lib, {})
        assert decided.bf16_linear == cpu_plan.Choice("torch", cpu.onednn_bf16_prepack[1])
        assert decided.decode_products.value == "n/a"
        model = _tiny("llama", tiny_models_root, torch.bfloat16)
        assert pack_linears(model, CpuKernels(decided, None)) == 0
        assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_cpu_threads_leave_one_core_to_the_server_unless_omp_num_threads_says():
    from tierlm.platforms.thread_count import cpu_thread_count

    assert cpu_thread_count({}, 2)[0] == 1 and cpu_thread_count({}, 1)[0] == 1
    assert cpu_thread_count({}, 16)[0] == 15
    n, why = cpu_thread_count({"OMP_NUM_THREADS": "2"}, 2)
    assert n is None and why == "OMP_NUM_THREADS=2"


@needs_packing
def test_doctor_counts_the_packed_copy_of_a_tied_lm_head(tiny_models_root, monkeypatch):
    """bf16 on this CPU: serve holds the tied lm_head's packed copy next to the embedding, and doctor's estimate
    (what it sizes the KV tiers from before anything loads) counts it; the plan's pack_tied_lm_head=no
    (TIERLM_CPU_PLAN) drops it from both."""
    from tierlm.backends.torch.backend import TorchBackend
    from tierlm.platforms import detect
    from tierlm.server.commands import doctor as doctor_cmd

    _tiny("qwen2", tiny_models_root, torch.bfloat16)  # builds the folder (tie_word_embeddings)
    folder = tiny_models_root / "qwen2"
    for value in ("yes", "no"):
        override = f"pack_tied_lm_head={value}"
        monkeypatch.setenv(cpu_plan.PLAN_ENV, override)
        report = doctor_cmd.diagnose(detect(), {"TIERLM_BACKEND": "torch", cpu_plan.PLAN_ENV: override},
                                     ["--json", "--model-path", str(folder), "--dtype", "bfloat16", "--device", "cpu"])
        assert not report["errors"], report["errors"]
        backend = TorchBackend(folder, dtype="bfloat16", device="cpu")
        assert backend.cpu_kernels.plan.pack_tied_lm_head.value == value
        loaded = backend.weight_bytes()
        assert abs(report["model"]["weight_bytes"] - loaded) <= 0.02 * loaded, value
        if value == "yes":
            packed = loaded
    assert packed > 1.1 * loaded  # the copy is a real share of this tiny model
