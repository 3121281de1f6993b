"""--attention-backend triton: the Triton kernels (backends/torch/triton_attention.py) against torch_native.

On a CPU the kernels run in Triton's interpreter. TRITON_INTERPRET=1 must be set when triton is first imported
(triton.jit decides then, for triton.language's own helpers too) and while the kernels run, so this file imports
triton with the variable set, puts it back, and sets it again around each test; the rest of the session is
unaffected. When triton was already imported without it (another test module got there first), the kernel tests
run in a child pytest process that has it from the start. With TIERLM_TEST_DEVICE=cuda on a GPU the same cases
run compiled. Each case runs ``paged_attention`` twice on one random pool and step, once per backend, and
compares; on a CPU with the CPU plan the backend would run (backends/torch/cpu/plan.py: torch_native reads pages
with tierlm's C kernels where the plan has them), on a GPU with none.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from tierlm.backends.torch import paged_attention as pa  # noqa: E402
from tierlm.backends.torch.kv_pool import TorchKVPool  # noqa: E402

DEVICE = torch.device("cuda" if os.environ.get("TIERLM_TEST_DEVICE") == "cuda" and torch.cuda.is_available()
                      else "cpu")
_KERNELS = "tierlm.backends.torch.triton_attention"


def _import_kernels():
    """(module, whether its kernels can run in this process)."""
    if DEVICE.type == "cuda":
        return importlib.import_module(_KERNELS), True
    if _KERNELS in sys.modules:
        return sys.modules[_KERNELS], sys.modules[_KERNELS].INTERPRETED
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return None, False  # triton.language's helpers are compiled-mode functions now: the interpreter fails
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(_KERNELS), True
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


ta, IN_PROCESS = _import_kernels()
in_process = pytest.mark.skipif(not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET=1 earlier in "
                                "this process: test_kernels_in_a_fresh_process runs these")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter checks it at every launch


def test_kernels_in_a_fresh_process():
    if IN_PROCESS:
        pytest.skip("the kernel tests run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


class _Layer:
    layer_idx = 1  # not the first layer of the pool: strides of a per-layer view


def _kernels(dtype, kv_dtype, H, Hkv, D):
    """What the backend sets as paged_attention.CURRENT.kernels: on CPU the model's plan with the process's kernel
    library, on a GPU none."""
    if DEVICE.type != "cpu":
        return None
    from tierlm.backends.torch.cpu import plan as cpu_plan

    return cpu_plan.for_model(dtype, kv_dtype, H, Hkv, D)


def _attention(meta, pool, kernels, *args, **kw):
    """paged_attention of ``_Layer`` in a step of ``meta`` over ``pool`` with ``kernels``; CURRENT put back after."""
    saved = pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels
    pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels = meta, pool, kernels
    try:
        return pa.paged_attention(_Layer, *args, **kw)
    finally:
        pa.CURRENT.meta, pa.CURRENT.pool, pa.CURRENT.kernels = saved


def _step(q_lens, cached, page_size=4, heads=(4, 2), D=16, dtype=torch.float32, kv_dtype=None, window=None,
          sinks=False, seed=0):
    """Attention outputs [T, H, D] of both backends for one random step: requests with ``q_lens`` new tokens
    after ``cached`` tokens already in the pool, pages scattered at random through a pool of random K/V."""
    H, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    q_lens = np.asarray(q_lens, dtype=np.int64)
    kv_lens = np.asarray(cached, dtype=np.int64) + q_lens
    R, P = len(q_lens), -(-int(kv_lens.max()) // page_size) + 1  # one spare column: tables are wider than needed
    num_pages = R * P + 5
    page_table = rng.permutation(num_pages)[: R * P].reshape(R, P).astype(np.int32)
    pool = TorchKVPool(2, num_pages, page_size, Hkv, D, kv_dtype or dtype, DEVICE)
    pool.buffer.copy_(pool.quantize(torch.randn(pool.buffer.shape, generator=g).to(DEVICE)))
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(cached, q_lens)])
    T = len(positions)
    # [1, H, T, D] as transformers passes it: a transposed view of [1, T, H, D]
    q = torch.randn(1, T, H, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    k = torch.randn(1, Hkv, T, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(1, Hkv, T, D, generator=g).to(dtype).to(DEVICE)
    s_aux = (torch.randn(H, generator=g) + 0.5).to(dtype).to(DEVICE) if sinks else None
    outs = []
    kernels = _kernels(dtype, kv_dtype or dtype, H, Hkv, D)
    for backend in (pa.TORCH_NATIVE, pa.TRITON):
        meta = pa.StepMeta(q_lens, kv_lens, positions, page_table, page_size, DEVICE, backend)
        out, _ = _attention(meta, pool, kernels, q, k, v, None, scaling=D ** -0.5, sliding_window=window,
                            s_aux=s_aux)
        assert out.shape == (1, T, H, D) and out.dtype == dtype
        outs.append(out[0].float().cpu())
    return outs


def _assert_close(outs, dtype):
    ref, got = outs
    assert torch.isfinite(got).all()
    err = (ref - got).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), f"max abs error {err}"


CASES = {
    # name: (q_lens, cached prefix lengths, keyword arguments of _step)
    "decode-page1-mha": ([1, 1, 1], [0, 6, 13], dict(page_size=1, heads=(4, 4))),
    "decode-page4-gqa2": ([1, 1, 1, 1], [3, 4, 17, 30], dict(page_size=4, heads=(4, 2))),
    "decode-page16-gqa4": ([1, 1], [15, 40], dict(page_size=16, heads=(8, 2))),
    "extend-fresh-page4": ([7, 20], [0, 0], dict(page_size=4)),
    "extend-cached-prefix-page16": ([5, 18, 2], [16, 9, 33], dict(page_size=16, heads=(6, 2))),
    "extend-page1-gqa4": ([3, 9], [11, 0], dict(page_size=1, heads=(4, 1))),
    "mixed-page4": ([1, 6, 1, 19, 2], [9, 0, 22, 5, 40], dict(page_size=4)),
    "single-fresh-prefill-window": ([21], [0], dict(page_size=4, window=5)),
    "window-mixed-page1": ([1, 7, 1, 3], [12, 10, 2, 30], dict(page_size=1, window=4)),
    "window-mixed-page16": ([1, 17, 1], [40, 20, 3], dict(page_size=16, window=9, heads=(8, 2))),
    "sinks-mixed": ([1, 5, 1, 12], [7, 3, 0, 19], dict(page_size=4, sinks=True)),
    "sinks-window-gpt-oss": ([1, 9, 1], [25, 14, 3], dict(page_size=16, window=8, sinks=True)),
    "head-dim-24": ([1, 4], [10, 7], dict(page_size=4, D=24)),
    "head-dim-64": ([1, 20], [33, 0], dict(page_size=16, D=64, heads=(2, 1))),
    "bf16-mixed": ([1, 6, 1], [21, 9, 0], dict(page_size=4, dtype=torch.bfloat16)),
    "bf16-window-sinks": ([1, 10], [30, 5], dict(page_size=16, dtype=torch.bfloat16, window=6, sinks=True)),
    "fp16-mixed": ([1, 8], [12, 4], dict(page_size=4, dtype=torch.float16)),
    "bf16-pages-fp32-queries": ([1, 5], [9, 2], dict(page_size=4, kv_dtype=torch.bfloat16)),
    "fp8-e4m3-pages": ([1, 6, 1], [14, 3, 20], dict(page_size=4, kv_dtype=torch.float8_e4m3fn)),
    "fp8-e5m2-pages-bf16": ([1, 6], [14, 3], dict(page_size=16, dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2,
                                                 window=7)),
}


@in_process
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_torch_native(name):
    q_lens, cached, kw = CASES[name]
    _assert_close(_step(q_lens, cached, **kw), kw.get("dtype", torch.float32))


@in_process
@pytest.mark.parametrize("window,sinks", [(None, False), (10, True), (3, False)])
def test_decode_split_over_kv_blocks(monkeypatch, window, sinks):
    """Several KV splits per request, some of them empty (short requests, windows): the merge is exact."""
    monkeypatch.setattr(ta, "decode_splits", lambda max_kv_len, n: 5)
    _assert_close(_step([1, 1, 1], [2, 70, 150], page_size=4, heads=(4, 2), window=window, sinks=sinks),
                  torch.float32)


@in_process
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_static_decode_buffers_with_padding_match_torch_native(page_size):
    """What a captured CUDA graph runs (decode_graphs.py): 3 decode requests in bucket 4's static buffers, the
    padded row in the scratch page, Triton reading the static page table; the real rows equal torch_native's."""
    from tierlm.backends.base import ForwardBatch
    from tierlm.backends.torch.decode_graphs import DecodeGraphs

    H, Hkv, D = 4, 2, 16
    g = torch.Generator().manual_seed(3)
    cached = np.array([3, 17, 30])
    kv_lens = cached + 1
    R, P = 3, -(-int(kv_lens.max()) // page_size)
    num_pages = R * P
    page_table = np.random.default_rng(3).permutation(num_pages).reshape(R, P).astype(np.int32)
    pool = TorchKVPool(2, num_pages + 1, page_size, Hkv, D, torch.float32, DEVICE)  # + the scratch page
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(DEVICE))
    start = pool.buffer.clone()
    q = torch.randn(1, 4, H, D, generator=g).to(DEVICE).transpose(1, 2)  # bucket 4: row 3 is padding
    k = torch.randn(1, Hkv, 4, D, generator=g).to(DEVICE)
    v = torch.randn(1, Hkv, 4, D, generator=g).to(DEVICE)

    def run_model(input_ids, positions, keep):  # stands for the model: one attention layer over the step's rows
        b = input_ids.shape[1]
        out, _ = pa.paged_attention(_Layer, q[:, :, :b], k[:, :, :b], v[:, :, :b], None, scaling=D ** -0.5)
        return out[0].reshape(b, -1)

    graphs = DecodeGraphs(pool, num_pages, max_bs=4, max_context_len=64, vocab_size=0, device=DEVICE,
                          attention_backend=pa.TRITON, run_model=run_model, capture=False)
    batch = ForwardBatch(input_ids=np.array([7, 8, 9]), positions=cached.astype(np.int64),
                         q_lens=np.ones(3, np.int32), kv_lens=kv_lens.astype(np.int32), page_table=page_table,
                         sample_indices=np.arange(3), sampling=None, page_size=page_size)
    assert graphs.accepts(batch) and graphs.bucket(3) == 4
    got = graphs.run(batch).cpu()
    static_pool = pool.buffer.clone()
    pool.buffer.copy_(start)
    meta = pa.StepMeta(np.ones(3, np.int64), kv_lens, cached, page_table, page_size, DEVICE, pa.TORCH_NATIVE)
    ref, _ = _attention(meta, pool, _kernels(torch.float32, torch.float32, H, Hkv, D), q[:, :, :3], k[:, :, :3],
                        v[:, :, :3], None, scaling=D ** -0.5)
    assert got.shape == (3, H * D)
    assert (got - ref[0].reshape(3, -1).cpu()).abs().max().item() <= TOL[torch.float32] * 10
    real_slots = num_pages * page_size  # the padded row wrote the scratch page only
    assert torch.equal(static_pool[:, :, :real_slots], pool.buffer[:, :, :real_slots])


# ------------------------------------------------------------------ selection at startup (the load plan)
def test_attention_backend_choice():
    from tierlm.platforms import Decision
    from tierlm.runtime.load_plan import resolve_attention_backend
    from tierlm.runtime.errors import StartupError
    from tierlm.runtime.server_args import ServerArgs

    cpu, cuda = Decision("torch", "cpu"), Decision("torch", "cuda")
    assert resolve_attention_backend(ServerArgs(), cpu, {})[0] == "torch_native"
    assert resolve_attention_backend(ServerArgs(), cuda, {})[0] == "triton"  # triton is installed here
    assert resolve_attention_backend(ServerArgs(attention_backend="torch_native"), cuda, {})[0] == "torch_native"
    assert resolve_attention_backend(ServerArgs(attention_backend="tierlm_paged"), cpu, {})[0] == "torch_native"
    assert resolve_attention_backend(ServerArgs(), Decision("mlx", "mps"), {})[0] == "mlx_paged"
    with pytest.raises(StartupError, match="needs a CUDA device"):
        resolve_attention_backend(ServerArgs(attention_backend="triton"), cpu, {})
    assert resolve_attention_backend(ServerArgs(attention_backend="triton"), cpu,
                                     {"TRITON_INTERPRET": "1"})[0] == "triton"
    with pytest.raises(StartupError, match="use --attention-backend mlx_paged"):
        resolve_attention_backend(ServerArgs(attention_backend="triton"), Decision("mlx", "mps"), {})
    with pytest.raises(ValueError, match="flashinfer: not implemented"):
        ServerArgs(attention_backend="flashinfer").check()


def test_cuda_without_triton_falls_back(monkeypatch):
    import importlib.util as iu

    from tierlm.platforms import Decision
    from tierlm.runtime.load_plan import resolve_attention_backend
    from tierlm.runtime.errors import StartupError
    from tierlm.runtime.server_args import ServerArgs

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    name, why = resolve_attention_backend(ServerArgs(), Decision("torch", "cuda"), {})
    assert name == "torch_native" and "without Triton" in why
    with pytest.raises(StartupError, match="needs the triton package"):
        resolve_attention_backend(ServerArgs(attention_backend="triton"), Decision("torch", "cuda"), {})


# ------------------------------------------------------------------ one engine, end to end
def _count_launches(monkeypatch) -> dict:
    calls = {"decode": 0, "extend": 0}
    for kind in calls:
        real = getattr(ta, kind)

        def counted(*a, _real=real, _kind=kind, **kw):
            calls[_kind] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(ta, kind, counted)
    return calls


def _engine_matches_reference(model_dir, prompts, new_tokens, monkeypatch, **kw):
    from engine_harness import greedy, run, start_engine
    from model_factory import reference_greedy

    calls = _count_launches(monkeypatch)
    device = "cuda" if DEVICE.type == "cuda" else "cpu"
    engine = start_engine(model_dir, attention_backend="triton", dtype="float32", device=device, **kw)
    try:
        assert engine.parts.backend.attention_backend == "triton"
        assert engine.parts.describe()["attention_backend"]["name"] == "triton"
        results = run(engine, prompts, greedy(new_tokens))
    finally:
        engine.shutdown()
    assert calls["decode"] > 0 and calls["extend"] > 0, calls
    for prompt, res in zip(prompts, results):
        assert res.token_ids == reference_greedy(model_dir, prompt, new_tokens), f"prompt of {len(prompt)} tokens"


@in_process
def test_engine_greedy_matches_reference(tiny_llama, monkeypatch):
    """Greedy output with --attention-backend triton equals transformers' on a tiny model: prompts admitted
    together (an extend group of several requests), then decode steps (the decode kernel), pages of 4."""
    prompts = [[5, 9, 14, 3, 7], [11, 4, 8, 20, 6, 2, 9, 13, 17], [30, 31, 32]]
    _engine_matches_reference(tiny_llama, prompts, 5, monkeypatch, page_size=4, max_total_tokens=256)


@in_process
def test_engine_gpt_oss_sinks_and_sliding_window(tiny_models_root, monkeypatch):
    """gpt-oss in miniature (attention sinks; sliding layers with a window of 8, shorter than the prompts),
    prefilled in chunks of 8 so later chunks extend over a cached prefix."""
    from model_factory import build_tiny_gpt_oss

    model = build_tiny_gpt_oss(tiny_models_root / "gpt_oss")
    prompts = [[(7 * i) % 200 + 3 for i in range(13)], [(11 * i) % 150 + 5 for i in range(10)]]
    _engine_matches_reference(model, prompts, 4, monkeypatch, page_size=4, chunked_prefill_size=8,
                              max_total_tokens=256, context_length=256)
