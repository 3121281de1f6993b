"""float32 serving with exactly-bf16 or exactly-fp16 weights held in their 16 bits
(backends/torch/weights/stored_16bit.py, where the CPU plan says f32_16bit_weights=yes): half the bytes, and not one
bit of any output changes against holding them as float32."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_levels import library_at_level
from torch import nn

from tierlm.backends.torch.cpu import f32_gemv as cpu_f32_gemv
from tierlm.backends.torch.cpu import library, plan
from tierlm.backends.torch.cpu.f32_gemv import F32GemvLinear
from tierlm.backends.torch.weights import stored_16bit as stored
from tierlm.platforms.cpu_plan import PLAN_ENV

F32_PRODUCTS = plan.for_model(torch.float32).plan.f32_products  # this CPU's plan for a float32 model
needs_kernel = pytest.mark.skipif(F32_PRODUCTS.value != "gemv", reason=f"the float32 kernel does not run here: "
                                  f"{F32_PRODUCTS}")

# Partial weight tiles, columns past the last full vector (K % 16 = 8, 7, 11) and a shape of a real layer.
SHAPES = [(37, 72), (38, 23), (39, 27), (96, 896)]


HELD = [torch.bfloat16, torch.float16]


@pytest.fixture
def as_served():
    """torch as a server on this machine computes: at its thread count (cpu/threads.configure_cpu_threads; MKL
    splits a product between threads its own way, so the bits compared are the ones serving gives, whatever count an
    earlier test left) and in inference mode (the reused scratch may have been made in it: see
    test_the_scratch_serves_products_in_and_out_of_inference_mode)."""
    from tierlm.backends.torch.cpu.threads import configure_cpu_threads

    configure_cpu_threads()
    with torch.inference_mode():
        yield


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if dtype == torch.float16:  # fp16's whole range: subnormals (below 2^-14) and large values among the normals
        w = w * torch.exp2(torch.randint(-20, 12, (n, k), generator=g).float())
    x = torch.randn(m, k, generator=g)
    return x, w.to(dtype), (torch.randn(n, generator=g) if bias else None)


@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("n,k", [(100, 24), (257, 72), (1001, 24), (37, 72), (16, 8)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", HELD)
def test_other_products_widen_the_weight_in_slices_with_f_linears_bits(rows, n, k, bias, dtype, monkeypatch,
                                                                      as_served):
    # slices of 64 or 96 output rows here (the whole weight where it is narrower; a short last slice joins the one
    # before it: N = 100, 257 and 1001 leave 36, 1 and 41 rows), as the real sizes give on real layers
    monkeypatch.setattr(stored, "SHORT_SLICE", 64 * k)
    monkeypatch.setattr(stored, "LONG_SLICE", 96 * k)
    monkeypatch.setattr(stored, "LONG_ROWS", 9)
    x, w, b = _case(rows, n, k, bias, dtype=dtype)
    ref = F.linear(x, w.float(), b)
    assert torch.equal(stored.widened_product(x, w, b), ref)
    assert torch.equal(stored.widened_product(x.view(1, rows, k), w, b), ref.view(1, rows, n))  # [B, T, K]
    assert torch.equal(cpu_f32_gemv.product(x, w, b), ref)  # not a decode step: the widened weight


def test_real_layer_shapes_keep_f_linears_bits_in_slices(as_served):
    """MKL's output column does not depend on the columns beside it: the slices of the sizes served (short steps'
    narrow slices, long steps' wide ones) give the whole product's bits on this machine's MKL."""
    for n, k in [(1536, 512), (2816, 512), (512, 1408), (9728, 896), (896, 4864)]:
        for rows in (1, 16, stored.LONG_ROWS + 1):
            x, w, b = _case(rows, n, k, rows == 16)
            assert torch.equal(stored.widened_product(x, w, b), F.linear(x, w.float(), b)), (n, k, rows)


def test_the_scratch_serves_products_in_and_out_of_inference_mode(monkeypatch):
    """The float32 scratch the widened slices reuse (one per thread) is made by whichever product comes first:
    a product in inference mode (every served step) must leave it usable by one outside it (an eager caller, a
    benchmark, a test) on the same thread, and the other way round."""
    monkeypatch.setattr(stored._SCRATCH, "buf", None)  # this test's own scratch; the thread's is given back after
    x, w, b = _case(3, 100, 24, True)
    ref = F.linear(x, w.float(), b)
    with torch.inference_mode():
        assert torch.equal(stored.widened_product(x, w, b), ref)
    assert torch.equal(stored.widened_product(x, w, b), ref)
    monkeypatch.setattr(stored._SCRATCH, "buf", None)
    assert torch.equal(stored.widened_product(x, w, b), ref)
    with torch.inference_mode():
        assert torch.equal(stored.widened_product(x, w, b), ref)


@needs_kernel
@pytest.mark.parametrize("level", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", HELD)
def test_decode_rows_read_the_16bit_weight_with_the_float32_weights_bits(level, dtype, monkeypatch):
    lib = library_at_level(level)
    assert lib.has("f32_gemv")
    calls = []
    entry = "f32_linear_bf16w" if dtype == torch.bfloat16 else "f32_linear_f16w"

    class Spy:  # that level's library, as the process's, with the 16-bit entry's calls counted
        has = staticmethod(lib.has)
        f32_linear = lib.f32_linear
        f32_linear_bf16w = f32_linear_f16w = None  # the other 16-bit entry: never called

    setattr(Spy, entry, staticmethod(lambda *args: calls.append(args[1]) or getattr(lib, entry)(*args)))
    monkeypatch.setattr(library, "load", lambda cpu=None: Spy)
    with cpu_f32_gemv.decode_step():
        for m in range(1, cpu_f32_gemv.MAX_ROWS + 1):
            for n, k in SHAPES:
                x, w, b = _case(m, n, k, m % 2 == 0, dtype=dtype)
                y = cpu_f32_gemv.product(x, w, b)
                assert torch.equal(y, cpu_f32_gemv.product(x, w.float(), b)), (m, n, k)
                scale = float((x.abs() @ w.float().abs().T).max())  # float32 rounding of the sums' terms
                torch.testing.assert_close(y, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-6 * scale + 1e-6)
    assert calls == [m for m in range(1, cpu_f32_gemv.MAX_ROWS + 1) for _ in SHAPES]


def test_the_exact_16bit_dtype_is_bf16_first_then_fp16_else_none():
    w = torch.randint(-256, 257, (64, 32)).float() / 64  # 8 significant bits at most: bf16 and fp16 values
    assert stored.exact_16bit_dtype(w) == torch.bfloat16
    w[5, 7] = 1 + 2.0 ** -9  # 10 significant bits: off the bf16 grid, on the fp16 one
    assert stored.exact_16bit_dtype(w) == torch.float16
    w[5, 7] = 1 + 2.0 ** -12  # off both grids
    assert stored.exact_16bit_dtype(w) is None
    h = torch.randn(64, 32).to(torch.float16).float()
    assert stored.exact_16bit_dtype(h) == torch.float16
    h[0, 0] = 70000.0  # past fp16's largest finite value (65504): not held as fp16
    assert stored.exact_16bit_dtype(h) is None
    h[0, 0] = 2.0 ** -24  # fp16's smallest subnormal
    assert stored.exact_16bit_dtype(h) == torch.float16
    h[0, 0] = 2.0 ** -25  # below it
    assert stored.exact_16bit_dtype(h) is None


def _checkpoint_in_16bit(src: Path, dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``src`` saved as a bf16 (or fp16) checkpoint (as Hugging Face models ship), tokenizer and all."""
    from transformers import AutoModelForCausalLM

    if not (dst / "config.json").exists():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        AutoModelForCausalLM.from_pretrained(src, dtype=dtype).save_pretrained(dst)
        assert json.loads((dst / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    return dst


def _served(path: Path, monkeypatch, on: bool):
    """A float32 TorchBackend of ``path`` with 16-bit holding on or off, and its greedy tokens and every logits row
    it computed on two prompts (a batch, chunks, decode steps)."""
    from backend_driver import run_greedy

    from tierlm.backends.torch.backend import TorchBackend

    monkeypatch.setenv(PLAN_ENV, f"f32_16bit_weights={'yes' if on else 'no'}")
    backend = TorchBackend(path, dtype="float32")
    assert backend.cpu_kernels.plan.f32_16bit_weights.value == ("yes" if on else "no")
    logits = []
    backend.model.lm_head.register_forward_hook(lambda m, i, out: logits.append(out.detach().clone()))
    prompts = [[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], [1, 84, 104, 101, 32, 99]]
    tokens = run_greedy(backend, prompts, 8, chunk_size=5)
    return backend, tokens, logits


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the lm_head tied to the input embedding
@pytest.mark.parametrize("dtype", HELD)
def test_a_16bit_checkpoint_served_in_float32_holds_16bit_weights_and_changes_no_bit(family, dtype, tiny_models_root,
                                                                                     tmp_path_factory, monkeypatch):
    from model_factory import build_tiny_model, reference_greedy

    src = build_tiny_model(family, tiny_models_root / family)
    name = str(dtype).removeprefix("torch.")
    path = _checkpoint_in_16bit(src, tmp_path_factory.mktemp(name) / family, dtype)
    wide, wide_tokens, wide_logits = _served(path, monkeypatch, on=False)
    held, tokens, logits = _served(path, monkeypatch, on=True)
    linears = [m for m in held.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is F32GemvLinear and m.weight.dtype == dtype for m in linears)
    assert all(m.weight.dtype == torch.float32 for m in wide.model.modules() if isinstance(m, nn.Linear))
    embedding = held.model.get_input_embeddings()
    assert embedding.weight.dtype == torch.float32 and held.model.dtype == torch.float32
    if family == "qwen2":  # untied: the lm_head's own 16-bit copy of the embedding's values
        assert wide.model.lm_head.weight is wide.model.get_input_embeddings().weight
        assert torch.equal(held.model.lm_head.weight.float(), embedding.weight)
    halved = sum(m.weight.numel() * 2 for m in linears if m is not held.model.lm_head)
    lm_head = held.model.lm_head.weight.numel() * 2  # tied: a 16-bit copy more; untied: its float32 halved
    assert held.weight_bytes() == wide.weight_bytes() - halved + (lm_head if family == "qwen2" else -lm_head)
    # the bench's bound: one row of the embedding is read, unless it is the lm_head (tied, as served float32)
    assert held.weight_bytes_per_token() == held.weight_bytes() - embedding.weight.numel() * 4
    assert wide.weight_bytes_per_token() == wide.weight_bytes() - (0 if family == "qwen2" else
                                                                   embedding.weight.numel() * 4)
    assert f"weights held as {name}" in held.kernels()["linear"] and "held as" not in wide.kernels()["linear"]
    assert tokens == wide_tokens
    assert len(logits) == len(wide_logits) > 8 and all(torch.equal(a, b) for a, b in zip(logits, wide_logits))
    prompts = [[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], [1, 84, 104, 101, 32, 99]]
    assert tokens == [reference_greedy(path, p, 8) for p in prompts]  # transformers' float32 greedy


@needs_kernel
def test_float32_values_stay_float32(tiny_llama, monkeypatch):
    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(tiny_llama, dtype="float32")  # a float32 checkpoint of random float32 values
    linears = [m for m in backend.model.modules() if isinstance(m, F32GemvLinear)]
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    assert "held as" not in backend.kernels()["linear"]
    # held where exact, by default; the plan's f32_16bit_weights=no keeps float32 weights, saying so
    assert backend.cpu_kernels.plan.f32_16bit_weights.value == "yes"
    off = plan.for_model(torch.float32, env={**os.environ, PLAN_ENV: "f32_16bit_weights=no"}).plan.f32_16bit_weights
    assert off.value == "no" and "f32_16bit_weights=no" in off.why


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("dtype", HELD)
def test_compiled_steps_read_the_16bit_weights_and_keep_the_reference_output(dtype, tiny_models_root,
                                                                             tmp_path_factory):
    from model_factory import build_tiny_model, reference_greedy
    from test_compiled_decode import NEW_TOKENS, PROMPTS, _greedy_outputs

    path = _checkpoint_in_16bit(build_tiny_model("llama", tiny_models_root / "llama"),
                            tmp_path_factory.mktemp(f"{dtype}c".removeprefix("torch.")) / "llama", dtype)
    outs, _, steps = _greedy_outputs(path, "float32", compile_max_bs=4)  # the op tierlm::f32_linear, 16-bit weights
    assert steps > 0
    assert outs == [reference_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
