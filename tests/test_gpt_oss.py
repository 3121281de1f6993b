"""gpt-oss on both backends: alternating sliding-window (8) / full attention, attention sinks, 4 experts top-2,
YaRN RoPE, MXFP4 expert weights. Greedy output equals transformers' float32 eager reference token for token,
and prefix reuse is deep and exact: KV pages hold every layer (sliding ones included) and cached prefixes keep
their pages whole in every tier, so a match at any page boundary leaves each sliding layer its window.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from backend_driver import GreedyDriver, run_greedy
from backends_under_test import make_backend
from engine_harness import greedy, pool_is_clean, run, start_engine
from model_factory import GPT_OSS_TINY, build_tiny_gpt_oss, quantize_mxfp4, reference_greedy

WINDOW = GPT_OSS_TINY["sliding_window"]
PS = 4  # page size of the cache tests


@pytest.fixture(scope="module")
def gpt_oss(tiny_models_root) -> Path:
    return build_tiny_gpt_oss(tiny_models_root / "gpt_oss")


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tiny_models_root) -> Path:
    return build_tiny_gpt_oss(tiny_models_root / "gpt_oss_mxfp4", mxfp4=True)


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, GPT_OSS_TINY["vocab_size"], n).tolist() for n in lengths]


# ---------------------------------------------------------------- the model and its attention

def test_tiny_config_is_gpt_oss_shaped(gpt_oss, backend_name):
    backend = make_backend(backend_name, gpt_oss)
    info = backend.info
    assert info.architecture == "GptOssForCausalLM" and info.num_layers == 4 and info.sliding_window == WINDOW
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(gpt_oss)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (4, 2)


def test_sink_attention_equals_the_eager_formula():
    """tierlm's one-SDPA sink trick against transformers' eager gpt-oss math, with GQA, a window and padding."""
    import torch

    from tierlm.backends.torch.paged_attention import attend

    torch.manual_seed(0)
    G, H, Hkv, Q, L, D = 2, 4, 2, 5, 11, 16
    q, k, v = torch.randn(G, H, Q, D), torch.randn(G, Hkv, L, D), torch.randn(G, Hkv, L, D)
    sinks = torch.randn(H) * 2
    q_pos = torch.tensor([[6, 7, 8, 9, 10], [0, 1, 2, 3, 3]])  # second request: 4 real rows + 1 padded
    mask = (torch.arange(L)[None, None, :] <= q_pos[:, :, None]) & (torch.arange(L) > q_pos[:, :, None] - 3)
    mask = mask[:, None]
    out = attend(q, k, v, mask, 0.25, sinks)

    kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    logits = (q @ kr.transpose(-1, -2)) * 0.25 + torch.where(mask, 0.0, float("-inf"))
    logits = torch.cat([logits, sinks.reshape(1, H, 1, 1).expand(G, H, Q, 1)], dim=-1)
    expected = torch.softmax(logits, dim=-1)[..., :-1] @ vr
    assert torch.allclose(out, expected, atol=1e-5)
    plain = attend(q, k, v, mask, 0.25, None)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the sinks really change the result


@pytest.mark.mlx
def test_mlx_yarn_frequencies_are_transformers_ones(gpt_oss):
    """gpt-oss's YaRN has truncate=false; mlx-lm rounds the correction range, tierlm's MLX model does not."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(gpt_oss), "cpu")
    rope = make_backend("mlx", gpt_oss).model.layers[0].self_attn.inner.rope
    np.testing.assert_allclose(1 / np.array(rope._freqs), inv_freq.numpy(), rtol=1e-6)


@pytest.mark.mlx
def test_mlx_refuses_a_half_dtype_for_float_experts_on_cpu(gpt_oss, gpt_oss_mxfp4):
    """MLX's CPU gather_mm is float32-only: refused at load with the fix, not at the first request. Packed
    MXFP4 experts (gather_qmm) are fine in bfloat16."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("the float32-only gather_mm is a CPU limit")
    from tierlm.backends.mlx.backend import MLXBackend

    with pytest.raises(ValueError, match="--dtype float32"):
        MLXBackend(gpt_oss, dtype="bfloat16")
    backend = MLXBackend(gpt_oss_mxfp4, dtype="bfloat16")
    assert len(run_greedy(backend, prompts([12]), 4)[0]) == 4


@pytest.mark.parametrize("page_size,chunk_size", [(4, 5), (16, None), (1, 3)])
def test_greedy_matches_reference(gpt_oss, backend_name, page_size, chunk_size):
    """Prompts of 1..61 tokens (most longer than the window), joining a step apart, prefilled in chunks that
    straddle pages next to other requests' decode tokens."""
    backend = make_backend(backend_name, gpt_oss)
    ps = prompts([1, 7, 33, 20, 61])  # same prompts for every layout: one reference each
    drivers: list[GreedyDriver] = []
    outputs = run_greedy(backend, ps, 32, page_size=page_size, chunk_size=chunk_size, driver_out=drivers)
    if chunk_size:
        assert any(1 in shape and max(shape) > 1 for shape in drivers[0].batch_shapes)
    for prompt, out in zip(ps, outputs):
        assert out == reference_greedy(gpt_oss, prompt, 32), f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("depth", [4, 8, 12, 20, 40])
def test_continuing_from_a_cached_prefix_at_any_depth(gpt_oss, backend_name, depth):
    """A second request reads the first one's pages for positions < depth (depth below, at and far beyond the
    8-token window) and computes only the rest: its output is the reference's, because every layer's KV
    (the sliding layers' last window before ``depth`` included) is still in those pages."""
    backend = make_backend(backend_name, gpt_oss)
    shared, = prompts([44], seed=depth)
    first = shared[:depth] + [7, 8, 9]
    second = shared
    driver = GreedyDriver(backend, PS, num_pages=40)
    n1 = driver.pages_needed(len(first), 4)
    a = driver.add(first, 4, list(range(n1)))
    driver.run()
    n2 = driver.pages_needed(len(second), 16)
    b = driver.add(second, 16, list(range(depth // PS)) + list(range(n1, n1 + n2 - depth // PS)))
    b.kv_len = depth  # positions < depth come from the first request's pages, never recomputed
    driver.run()
    assert a.output == reference_greedy(gpt_oss, first, 4)
    assert b.output == reference_greedy(gpt_oss, second, 16)


@pytest.mark.mlx
@pytest.mark.parametrize("writer_name,reader_name", [("torch", "mlx"), ("mlx", "torch")])
def test_pages_written_by_one_backend_continue_on_the_other(gpt_oss, writer_name, reader_name):
    """Both backends declare the same page bytes (post-RoPE K, YaRN's scale included, and V of every layer), so
    they share an L3 namespace: a prefix one wrote must continue on the other with the reference output."""
    from tierlm.backends.base import HostKVPool

    writer, reader = make_backend(writer_name, gpt_oss), make_backend(reader_name, gpt_oss)
    assert writer.kv_byte_layout() == reader.kv_byte_layout()
    prompt, = prompts([30], seed=21)
    first = GreedyDriver(writer, PS, num_pages=24)
    req = first.add(prompt, 24, list(range(first.pages_needed(len(prompt), 24))))
    while len(req.output) < 5:
        first.step()
    used = -(-req.kv_len // PS)
    host = HostKVPool(num_pages=used, page_bytes=writer.kv_bytes_per_token() * PS,
                      num_layers=writer.info.num_layers, layout="page_first")
    writer.copy_pages_to_host(np.arange(used), host, np.arange(used))
    second = GreedyDriver(reader, PS, num_pages=24)
    reader.copy_pages_from_host(host, np.arange(used), np.arange(used))
    second.requests.append(req)  # same request state: prompt, outputs so far, kv_len
    second.run()
    assert req.output == reference_greedy(gpt_oss, prompt, 24)


# ---------------------------------------------------------------- through the engine (scheduler + radix cache)

def _prefilled(engine) -> int:
    m = re.search(r"^tierlm_prefill_tokens_total\{[^}]*\} ([0-9.e+]+)$", engine.metrics_text().decode(), re.M)
    return int(float(m.group(1)))


def test_engine_batched_greedy_matches_reference(gpt_oss, backend_name):
    engine = start_engine(gpt_oss, backend_name, page_size=PS, chunked_prefill_size=16, max_total_tokens=2048)
    try:
        ps = prompts([5, 30, 61], seed=3)
        results = run(engine, ps, greedy(24))
        for prompt, res in zip(ps, results):
            assert res.token_ids == reference_greedy(gpt_oss, prompt, 24), f"prompt of {len(prompt)} tokens"
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_shared_system_prompt_is_reused_to_its_last_whole_page(gpt_oss, backend_name):
    """System prompt of 42 tokens (5x the window), then different user turns: the second request reuses
    40 of its 47 prompt tokens (the system prompt's whole pages), not just a window-sized prefix."""
    system, user_a, user_b = prompts([42, 5, 5], seed=11)
    engine = start_engine(gpt_oss, backend_name, page_size=PS, max_total_tokens=2048)
    try:
        cold = run(engine, [system + user_a], greedy(16))[0]
        before = _prefilled(engine)
        hot = run(engine, [system + user_b], greedy(16))[0]
        assert (hot.last.cached.device, len(system + user_b)) == (40, 47)  # matched depth vs prompt length
        assert _prefilled(engine) - before == 47 - 40  # statistics: exactly the reused tokens were skipped
        assert cold.last.cached.total == 0
        assert cold.token_ids == reference_greedy(gpt_oss, system + user_a, 16)
        assert hot.token_ids == reference_greedy(gpt_oss, system + user_b, 16)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_multi_turn_continuation_reuses_the_whole_conversation(gpt_oss, backend_name):
    """Turn 2 = turn 1's prompt + its answer + a new user message: everything turn 1 computed (its prompt and
    all but the last generated token, cut to whole pages) is reused: 56 of 63 prompt tokens."""
    turn1, new_text = prompts([42, 6], seed=12)
    engine = start_engine(gpt_oss, backend_name, page_size=PS, max_total_tokens=2048)
    try:
        first = run(engine, [turn1], greedy(15))[0]
        turn2 = turn1 + first.token_ids + new_text
        computed = len(turn1) + len(first.token_ids) - 1  # the last sampled token's KV is never written
        before = _prefilled(engine)
        second = run(engine, [turn2], greedy(16))[0]
        assert (second.last.cached.device, len(turn2)) == (computed // PS * PS, 63) == (56, 63)
        assert _prefilled(engine) - before == 63 - 56
        assert first.token_ids == reference_greedy(gpt_oss, turn1, 15)
        assert second.token_ids == reference_greedy(gpt_oss, turn2, 16)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- host (L2) and storage (L3) tiers

def _hicache_engine(model: Path, backend: str, storage: bool):
    kw = dict(page_size=PS, max_total_tokens=96, enable_hierarchical_cache=True, hicache_ratio=4.0)
    if storage:
        kw.update(hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete")
    return start_engine(model, backend, **kw)


def _doc(seed: int, n: int = 60) -> list[int]:
    return [(seed * 31 + j * 7) % 270 + 5 for j in range(n)]


def test_host_tier_hit_gives_the_cold_output(gpt_oss, backend_name, store):
    """The 60-token prefix is pushed out of the 24-page device pool into host memory and comes back whole
    (every layer's pages, sliding ones included): 60 tokens reused, same tokens as cold."""
    prompt = _doc(1) + [9, 9]
    engine = _hicache_engine(gpt_oss, backend_name, storage=False)
    try:
        cold, = run(engine, [prompt], greedy(12))
        for i in range(3):
            run(engine, [_doc(100 + i)], greedy(4))
        before = _prefilled(engine)
        hot, = run(engine, [prompt], greedy(12))
        assert (hot.last.cached.host, hot.last.cached.device) == (60, 0)
        assert _prefilled(engine) - before == len(prompt) - 60
        assert hot.token_ids == cold.token_ids == reference_greedy(gpt_oss, prompt, 12)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_storage_tier_hit_after_restart_gives_the_cold_output(gpt_oss, backend_name, store):
    prompt = _doc(2) + [7]
    engine = _hicache_engine(gpt_oss, backend_name, storage=True)
    try:
        cold, = run(engine, [prompt], greedy(12))
    finally:
        engine.shutdown()  # flushes queued L3 writes
    engine = _hicache_engine(gpt_oss, backend_name, storage=True)
    try:
        hot, = run(engine, [prompt], greedy(12))
        assert (hot.last.cached.storage, hot.last.cached.total) == (60, 60)
        assert _prefilled(engine) == len(prompt) - 60  # a fresh engine: only this request's last token
        assert hot.token_ids == cold.token_ids == reference_greedy(gpt_oss, prompt, 12)
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- MXFP4 checkpoints

def test_mxfp4_writer_matches_transformers_decoder():
    """Values that MXFP4 represents exactly survive our writer + transformers' decoder bit for bit, so the
    tiny checkpoint uses the released layout (nibble order, block axis, E8M0 bias)."""
    import torch
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    E, rows, cols = 2, 6, 64
    codes = torch.randint(0, 16, (E, rows, cols), generator=gen)
    codes[..., ::32] = 7  # each block's absmax is 6 * 2**e (the writer's scale choice is then exact)
    exponents = torch.randint(-8, 4, (E, rows, cols // 32), generator=gen).float()
    w = torch.tensor(FP4_VALUES)[codes] * torch.exp2(exponents).repeat_interleave(32, -1)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (E, rows, cols // 32, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (E, rows, cols // 32) and scales.dtype == torch.uint8
    decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows], like the params
    assert torch.equal(decoded.transpose(1, 2), w)


_MXFP4_REF: dict = {}


def mxfp4_reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy on the same MXFP4 folder, dequantized by transformers itself (float32, eager)."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    if str(model_dir) not in _MXFP4_REF:
        _MXFP4_REF[str(model_dir)] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager",
            quantization_config=Mxfp4Config(dequantize=True)).eval()
    model = _MXFP4_REF[str(model_dir)]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_mxfp4_checkpoint_matches_reference(gpt_oss_mxfp4, gpt_oss, backend_name):
    """torch dequantizes the experts while loading on a CPU and keeps them packed elsewhere (the device's default,
    weight_format.mxfp4_experts_mode; both modes: test_mxfp4_experts.py); MLX keeps them packed (mlx-lm's native
    mxfp4 mode)."""
    backend = make_backend(backend_name, gpt_oss_mxfp4)
    experts = backend.model.model.layers[0].mlp.experts
    if backend_name == "torch":
        import torch
        from safetensors import safe_open
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        from tierlm.backends.torch.weights.mxfp4_experts import PackedMxfp4Experts
        from tierlm.backends.weight_format import mxfp4_experts_mode

        with safe_open(str(gpt_oss_mxfp4 / "model.safetensors"), "pt") as f:
            prefix = "model.layers.0.mlp.experts.gate_up_proj"
            blocks, scales = f.get_tensor(prefix + "_blocks"), f.get_tensor(prefix + "_scales")
        packed = isinstance(experts, PackedMxfp4Experts)
        assert packed == (mxfp4_experts_mode(backend.device, os.environ)[0] == "packed")
        if packed:
            assert torch.equal(experts.gate_up_proj_blocks.cpu(), blocks)
        else:
            expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert experts.gate_up_proj.dtype == torch.float32 and torch.equal(experts.gate_up_proj.cpu(), expected)
    else:
        assert type(experts.gate_proj).__name__ == "QuantizedSwitchLinear" and experts.gate_proj.mode == "mxfp4"
    ps = prompts([7, 33, 61], seed=4)
    outputs = run_greedy(backend, ps, 32, page_size=PS, chunk_size=9)
    for prompt, out in zip(ps, outputs):
        assert out == mxfp4_reference(gpt_oss_mxfp4, prompt, 32), f"prompt of {len(prompt)} tokens"
    # Same seed as the float model before quantization: the references differ, so the MXFP4 values are used.
    assert outputs[1] != reference_greedy(gpt_oss, ps[1], 32)
