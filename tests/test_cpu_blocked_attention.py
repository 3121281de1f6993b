"""bf16 prefill / extend attention on CPU (backends/torch/cpu_blocked_attention.py): the blocked matmuls + C row
softmax against transformers' bf16 eager attention, through paged_attention for a fresh prefill and for an extend
step over cached pages (requests of different lengths, padded rows), its fallback to SDPA without the C library,
and greedy output through the backend (a prefix-cache hit included) against transformers' bf16 eager model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_paged_decode import run_step, skip_unless_this_cpu_runs

from tierlm.backends.torch import cpu_blocked_attention as cba
from tierlm.backends.torch import cpu_blocked_scores
from tierlm.backends.torch import cpu_paged_decode
from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.kv_pool import TorchKVPool
from tierlm.platforms.cpu_features import PREFILL_ATTENTION_ENV

lib = cpu_paged_decode.load()
needs_kernel = pytest.mark.skipif(lib is None, reason="no C compiler here: the C library is not built (SDPA path)")


def choose(monkeypatch, kernel: str) -> None:
    """TIERLM_CPU_PREFILL_ATTENTION for this test (the choice is made once per process, so it is made again)."""
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, kernel)
    cba.choice.cache_clear()


@pytest.fixture(autouse=True)
def _blocked_unless_a_test_chooses(monkeypatch):
    """The blocked path whatever the CPU (AMX CPUs choose torch's SDPA by default); the process's choice after."""
    choose(monkeypatch, "blocked")
    yield
    cba.choice.cache_clear()


def eager_reference(q, k, v, limits, scale):
    """transformers' bf16 eager attention: bf16 scores * scale, additive mask, float32 softmax, bf16 probabilities."""
    n = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    s = torch.matmul(q, kk.transpose(-1, -2)) * scale
    seen = torch.arange(k.shape[2])[None, None, :] < torch.as_tensor(limits)[:, :, None].long()
    s = s.masked_fill(~seen[:, None], torch.finfo(s.dtype).min)
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), vv)


def assert_bf16_equal(out, ref):
    """Equal but for rare one-ulp roundings (glibc's vector expf, oneDNN's summation order)."""
    diff = (out.float() - ref.float()).abs()
    assert (diff > 0).float().mean().item() < 0.01
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -8)


@needs_kernel
@pytest.mark.parametrize("G,H,Hkv,Q,L,D", [
    (1, 8, 4, 200, 200, 64),   # a fresh causal prefill, 3 full blocks and a partial one, GQA 2:1
    (3, 14, 2, 37, 300, 64),   # three extends over cached prefixes, GQA 7:1
    (2, 4, 4, 130, 180, 32),   # MHA, an odd block split
])
def test_blocked_attention_equals_transformers_bf16_eager(G, H, Hkv, Q, L, D):
    g = torch.Generator().manual_seed(G * 100 + Q)
    q, k, v = (torch.randn(G, h, n, D, generator=g).bfloat16() for h, n in ((H, Q), (Hkv, L), (Hkv, L)))
    limits = np.stack([np.clip(np.arange(Q) + (L - Q) + 1 - 7 * r, 1, L) for r in range(G)]).astype(np.int32)
    assert_bf16_equal(cba.blocked_attention(lib, q, k, v, limits, D ** -0.5), eager_reference(q, k, v, limits,
                                                                                              D ** -0.5))


def _step(q_lens, cached, use_lib, monkeypatch, H=8, Hkv=4, D=64, page_size=16, expect_blocked=None):
    """paged_attention over one step whose requests bring q_lens new tokens after ``cached`` pool tokens; the blocked
    path ran once if ``expect_blocked`` (by default: with the library, where the blocked path is chosen)."""
    g = torch.Generator().manual_seed(sum(q_lens))
    q_lens, cached = np.asarray(q_lens, np.int64), np.asarray(cached, np.int64)
    kv_lens = cached + q_lens
    R, P = len(q_lens), -(-int(kv_lens.max()) // page_size)
    table = np.random.default_rng(0).permutation(R * P + 2)[: R * P].reshape(R, P).astype(np.int32)
    pool = TorchKVPool(2, R * P + 2, page_size, Hkv, D, torch.bfloat16, torch.device("cpu"))  # layer 1 runs
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).bfloat16())
    T = int(q_lens.sum())
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, q_lens)])
    q = torch.randn(1, T, H, D, generator=g).bfloat16().transpose(1, 2)
    k, v = (torch.randn(1, T, Hkv, D, generator=g).bfloat16().transpose(1, 2) for _ in range(2))
    calls = []
    if use_lib:
        real = cba.blocked_attention
        monkeypatch.setattr(cba, "blocked_attention", lambda *a: calls.append(1) or real(*a))
    else:
        monkeypatch.setattr(cpu_paged_decode, "load", lambda: None)
    out = run_step(pa.StepMeta(q_lens, kv_lens, positions, table, page_size, torch.device("cpu")), pool, q, k, v,
                   D ** -0.5, monkeypatch)
    if expect_blocked is None:
        expect_blocked = use_lib and cba.choice()[0] == "blocked"
    assert len(calls) == (1 if expect_blocked else 0)
    return out[0], q[0], pool, table, kv_lens, positions


@needs_kernel
@pytest.mark.parametrize("q_lens,cached", [([150], [0]), ([20, 5, 70], [33, 200, 0])])
def test_paged_prefill_and_extend_take_the_blocked_path_with_eager_numerics(q_lens, cached, monkeypatch):
    out, q, pool, table, kv_lens, positions = _step(q_lens, cached, True, monkeypatch)
    start = 0
    for r, n in enumerate(q_lens):  # each request against the reference over its own pages, as the pool holds them
        L = int(kv_lens[r])
        slots = torch.from_numpy(table[r, np.arange(L) // pool.page_size].astype(np.int64) * pool.page_size +
                                 np.arange(L) % pool.page_size)
        k, v = (pool.k[1].index_select(0, slots).transpose(0, 1)[None], pool.v[1].index_select(0, slots)
                .transpose(0, 1)[None])
        limits = (positions[start:start + n] + 1)[None].astype(np.int32)
        ref = eager_reference(q[:, start:start + n][None], k, v, limits, 64 ** -0.5)[0].transpose(0, 1)
        assert_bf16_equal(out[start:start + n], ref)
        start += n


@needs_kernel
def test_without_the_c_library_sdpa_serves_the_same_attention_within_bf16_rounding(monkeypatch):
    blocked = _step([20, 5, 70], [33, 200, 0], True, monkeypatch)[0].float()
    sdpa = _step([20, 5, 70], [33, 200, 0], False, monkeypatch)[0].float()
    assert (blocked - sdpa).abs().max().item() < 0.05 * sdpa.abs().max().item()


@needs_kernel
def test_the_sdpa_choice_serves_prefill_and_extend_without_the_blocked_path(monkeypatch):
    """TIERLM_CPU_PREFILL_ATTENTION=sdpa (the default on AMX CPUs): the same step through torch's SDPA, within bf16
    rounding of the blocked path's eager numerics."""
    blocked = _step([20, 5, 70], [33, 200, 0], True, monkeypatch)[0].float()
    choose(monkeypatch, "sdpa")
    assert not cba.usable(lib, torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))
    sdpa = _step([20, 5, 70], [33, 200, 0], True, monkeypatch)[0].float()  # the C library loaded, not called
    assert (blocked - sdpa).abs().max().item() < 0.05 * sdpa.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("kernel", ["blocked", "sdpa"])
def test_bf16_greedy_with_chunked_prefill_equals_transformers_bf16(tiny_llama, monkeypatch, kernel):
    """Prompts prefilled in 8-token chunks (the first chunk a fresh prefill, the rest extends over the pages the
    earlier chunks wrote, two requests in one step): greedy output is transformers' bf16 eager output, and the
    prefill rows went through the blocked path (extends of a few rows: cpu_paged_extend's kernel where the build has
    it), or none of them where torch's SDPA is chosen."""
    from backend_driver import run_greedy
    from test_cpu_linear import _tiny

    from tierlm.backends.torch.backend import TorchBackend

    from tierlm.backends.torch import cpu_paged_extend

    choose(monkeypatch, kernel)
    calls = []
    real = cba.blocked_attention
    monkeypatch.setattr(cba, "blocked_attention", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    real_extend = cpu_paged_extend.paged_extend  # 8-row extends take it where the build has it (AVX-512)
    monkeypatch.setattr(cpu_paged_extend, "paged_extend", lambda *a: calls.append(len(a[7])) or real_extend(*a))
    backend = TorchBackend(tiny_llama, dtype="bfloat16")
    hf = _tiny("llama", tiny_llama.parent, torch.bfloat16)
    prompts = [[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 72, 105, 32, 116, 104, 101, 114],
               [1, 84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116, 32, 111, 110]]
    ours = run_greedy(backend, prompts, 8, chunk_size=8, stagger=0)
    for ids, out in zip(prompts, ours):
        with torch.inference_mode():
            assert out == hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    if kernel == "blocked":
        assert max(calls) == 2  # an extend step of both requests took the blocked path or the extend kernel
    else:
        assert not calls


@needs_kernel
def test_softmax_split_between_threads_gives_the_same_bits(monkeypatch):
    """Rows are independent: the softmax split between torch's intra-op threads (helper threads running slices of
    rows while the caller runs one) writes exactly what one thread writes."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 64, generator=g).bfloat16() for h, n in ((8, 90), (4, 150), (4, 150)))
    limits = np.stack([np.arange(61, 151), np.clip(np.arange(90) + 20, 1, 150)]).astype(np.int32)
    monkeypatch.setenv(cpu_blocked_scores.SWITCH_ENV, "0")  # the GEMM and the separate softmax (their split)
    one = cba.blocked_attention(lib, q, k, v, limits, 0.125)
    calls = []
    real = cba.helper_threads
    monkeypatch.setattr(cba, "helper_threads", lambda n: calls.append(n) or real(n))
    monkeypatch.setattr(cba, "MIN_SCORES_PER_THREAD", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        split = cba.blocked_attention(lib, q, k, v, limits, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert calls and calls[0] == 2  # two helper threads next to the caller
    assert torch.equal(one, split)


def test_kernel_report_names_the_blocked_path_for_bf16_models_whatever_the_kv_dtype():
    """fp8 KV pages are dequantized to bf16 before attention, so a bf16 model with fp8 pages takes the blocked path
    too, and /server_info says so; a float32 model keeps SDPA."""
    from tierlm.backends.torch import paged_attention as pa_mod
    from tierlm.backends.torch.kernel_report import kernel_report

    def prefill(dtype, kv_dtype):
        return kernel_report(torch.nn.Linear(2, 2), "cpu", dtype, kv_dtype, pa_mod.TORCH_NATIVE, 8, 4,
                             64)["prefill_attention"]

    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        assert ("blocked bf16 GEMMs" in prefill(torch.bfloat16, kv)) == (lib is not None)
    assert "SDPA" in prefill(torch.float32, torch.float32) and "blocked" not in prefill(torch.float32, torch.float32)


@needs_kernel
@pytest.mark.parametrize("level", ["avx2", "avx512", "avx512_bf16"])
def test_the_row_softmax_of_each_x86_build_is_transformers_bf16_softmax(level, tmp_path):
    """The softmax's AVX-512 code (with and without AVX512-BF16's rounding instruction) and the plain loop the AVX2
    build vectorizes: transformers' bf16 eager softmax (scale, round, float32 softmax, round) but for rare one-ulp
    roundings, the masked tail zeroed; rows shorter than one vector and rows whose last vector is partial included
    (limits 1..37 of E = 37)."""
    import ctypes

    from tierlm.backends.torch import c_kernel_build
    from tierlm.platforms.cpu_features import COMPILE_FLAGS, find_c_compiler

    skip_unless_this_cpu_runs(level)
    cc = find_c_compiler({})
    path = c_kernel_build.build_library("softmax_test", cpu_paged_decode._SOURCE, cpu_paged_decode.CFLAGS, cc,
                                        c_kernel_build.compiler_identity(cc), level, COMPILE_FLAGS[level], tmp_path)
    built = ctypes.CDLL(str(path))
    cpu_paged_decode._bind(built)
    g = torch.Generator().manual_seed(7)
    for E, b, H, spread in ((37, 37, 3, 4.0), (2000, 64, 2, 30.0), (1, 1, 1, 1.0)):
        R = H * b
        scores = (torch.randn(R, E, generator=g) * spread).bfloat16()
        limits = np.clip(np.arange(b) + E - b + 1 - (np.arange(b) % 3), 1, E).astype(np.int32)  # E=37: 1..37
        out = scores.clone()
        work = torch.empty(E)
        built.softmax_rows_bf16(out.data_ptr(), 0, R, E, limits.ctypes.data, R, b, 0.125, work.data_ptr())
        seen = torch.arange(E)[None, :] < torch.from_numpy(np.tile(limits, H)).long()[:, None]
        ref = (scores * 0.125).float().masked_fill(~seen, float("-inf")).softmax(-1).bfloat16()
        assert torch.all(out[~seen] == 0)
        ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
        assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 1e-3, (E, level)
