"""bf16 prefill / extend attention on CPU (backends/torch/cpu/blocked_attention.py): the blocked matmuls + C row
softmax, and the one-pass kernel of AVX512-BF16 libraries (cpu/blocked_one_pass.py), against transformers' bf16
eager attention, through paged_attention for a fresh prefill and for an extend step over cached pages (requests of
different lengths, padded rows) as the CPU plan (cpu/plan.py: ``prefill_attention`` blocked | one_pass | sdpa)
sends them, torch's SDPA without the C library or where the plan chooses it, the report of the plan's choice, and
greedy output through the backend (a prefix-cache hit included) against transformers' bf16 eager model."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from conftest import torch_threads as threads
from test_cpu_paged_decode import kernels_for, lib, library_at, needs_kernel, run_step

from tierlm.backends.torch import paged_attention as pa
from tierlm.backends.torch.cpu import blocked_attention as cba
from tierlm.backends.torch.cpu import blocked_one_pass
from tierlm.backends.torch.cpu import plan as cpu_plan
from tierlm.backends.torch.kv_pool import TorchKVPool
from tierlm.platforms.cpu_plan import PLAN_ENV, CpuPlanError


def prefill_kernels(prefill: str, lib=True, dtype=torch.bfloat16, kv_dtype=None, heads=(8, 4), D: int = 64,
                    plan: str = "") -> cpu_plan.CpuKernels:
    """The CPU plan with ``prefill_attention=<prefill>`` (and ``plan``'s other overrides), or a skip where the plan
    cannot run that choice here (``one_pass`` needs the AVX512-BF16 levels' block kernel)."""
    try:
        kernels = kernels_for(dtype, kv_dtype, heads, D, lib, f"prefill_attention={prefill}" + (f",{plan}" if plan
                                                                                                  else ""))
    except CpuPlanError as e:
        pytest.skip(str(e))
    assert kernels.plan.prefill_attention.value == prefill
    return kernels


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
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("G,H,Hkv,Q,L,D", [
    (1, 8, 4, 200, 200, 64),   # a fresh causal prefill, 3 full blocks and a partial one, GQA 2:1
    (3, 14, 2, 37, 300, 64),   # three extends over cached prefixes, GQA 7:1
    (2, 4, 4, 130, 180, 32),   # MHA, an odd block split
])
def test_blocked_attention_equals_transformers_bf16_eager(G, H, Hkv, Q, L, D, one_pass, monkeypatch):
    """The GEMMs and the C softmax, and (on libraries with it) the one-pass kernel."""
    if one_pass and not lib.has("blocked_attention"):
        pytest.skip(f"the {lib.level} library has no one-pass block kernel (AVX512-BF16 levels)")
    g = torch.Generator().manual_seed(G * 100 + Q)
    q, k, v = (torch.randn(G, h, n, D, generator=g).bfloat16() for h, n in ((H, Q), (Hkv, L), (Hkv, L)))
    limits = np.stack([np.clip(np.arange(Q) + (L - Q) + 1 - 7 * r, 1, L) for r in range(G)]).astype(np.int32)
    ran = []
    real = blocked_one_pass.attend
    monkeypatch.setattr(blocked_one_pass, "attend", lambda *a: ran.append(1) or real(*a))
    out = cba.blocked_attention(lib, q, k, v, limits, D ** -0.5, one_pass)
    assert bool(ran) == (one_pass and D % 16 == 0 and blocked_one_pass.runs(lib))  # the path asked for
    assert_bf16_equal(out, eager_reference(q, k, v, limits, D ** -0.5))


def _step(q_lens, cached, kernels, monkeypatch, H=8, Hkv=4, D=64, page_size=16, expect_blocked=None):
    """paged_attention over one step whose requests bring q_lens new tokens after ``cached`` pool tokens, with
    ``kernels`` (a CPU plan and its library; None: torch's paths); the blocked path ran once if ``expect_blocked``
    (by default: where the plan has it), one pass a block exactly where the plan says ``one_pass``."""
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
    real = cba.blocked_attention
    monkeypatch.setattr(cba, "blocked_attention", lambda *a: calls.append((a[0], a[6])) or real(*a))
    out = run_step(pa.StepMeta(q_lens, kv_lens, positions, table, page_size, torch.device("cpu")), pool, q, k, v,
                   D ** -0.5, monkeypatch, kernels)
    if expect_blocked is None:
        expect_blocked = kernels is not None and kernels.blocked is not None
    assert len(calls) == (1 if expect_blocked else 0)
    for called_lib, one_pass in calls:  # the plan's library, one pass where the plan says so
        assert called_lib is kernels.blocked and one_pass == (kernels.plan.prefill_attention.value == "one_pass")
    return out[0], q[0], pool, table, kv_lens, positions


@needs_kernel
@pytest.mark.parametrize("prefill", ["blocked", "one_pass"])
@pytest.mark.parametrize("q_lens,cached", [([150], [0]), ([20, 5, 70], [33, 200, 0])])
def test_paged_prefill_and_extend_take_the_blocked_path_with_eager_numerics(q_lens, cached, prefill, monkeypatch):
    out, q, pool, table, kv_lens, positions = _step(q_lens, cached, prefill_kernels(prefill), monkeypatch)
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
@pytest.mark.parametrize("prefill", ["blocked", "one_pass"])
def test_without_the_c_library_sdpa_serves_the_same_attention_within_bf16_rounding(prefill, monkeypatch):
    blocked = _step([20, 5, 70], [33, 200, 0], prefill_kernels(prefill), monkeypatch)[0].float()
    none = kernels_for(torch.bfloat16, lib=None)  # no library loaded: the plan has torch's SDPA
    assert none.plan.prefill_attention.value == "sdpa" and none.blocked is None
    for kernels in (none, None):
        sdpa = _step([20, 5, 70], [33, 200, 0], kernels, monkeypatch)[0].float()
        assert (blocked - sdpa).abs().max().item() < 0.05 * sdpa.abs().max().item()


@needs_kernel
def test_the_sdpa_choice_serves_prefill_and_extend_without_the_blocked_path(monkeypatch):
    """prefill_attention=sdpa (the default on AMX CPUs): the same step through torch's SDPA, the library loaded and
    not called for it, within bf16 rounding of the blocked path's eager numerics."""
    blocked = _step([20, 5, 70], [33, 200, 0], prefill_kernels("blocked"), monkeypatch)[0].float()
    kernels = prefill_kernels("sdpa")
    assert kernels.lib is lib and kernels.blocked is None
    assert not cba.usable(kernels.blocked, torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))
    sdpa = _step([20, 5, 70], [33, 200, 0], kernels, monkeypatch)[0].float()
    assert (blocked - sdpa).abs().max().item() < 0.05 * sdpa.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("prefill", ["one_pass", "blocked", "sdpa"])
def test_bf16_greedy_with_chunked_prefill_equals_transformers_bf16(tiny_llama, monkeypatch, prefill):
    """Prompts prefilled in 8-token chunks (the first chunk a fresh prefill, the rest extends over the pages the
    earlier chunks wrote, two requests in one step), the backend's plan set by TIERLM_CPU_PLAN: greedy output is
    transformers' bf16 eager output, and the prefill rows went through the blocked path (extends of a few rows:
    cpu/paged_extend.py's kernel where the plan has it), or none of them where torch's SDPA is chosen."""
    from backend_driver import run_greedy
    from transformers import AutoModelForCausalLM

    from tierlm.backends.torch.backend import TorchBackend
    from tierlm.backends.torch.cpu import paged_extend

    prefill_kernels(prefill)  # skips where the plan cannot run it here
    monkeypatch.setenv(PLAN_ENV, f"prefill_attention={prefill}")
    blocked, extends = [], []
    real = cba.blocked_attention
    monkeypatch.setattr(cba, "blocked_attention", lambda *a: blocked.append(a[1].shape[0]) or real(*a))
    real_extend = paged_extend.paged_extend  # 8-row extends take it where the plan has it (AVX-512, AMX)
    monkeypatch.setattr(paged_extend, "paged_extend", lambda *a: extends.append(len(a[8])) or real_extend(*a))
    backend = TorchBackend(tiny_llama, dtype="bfloat16")
    assert backend.cpu_kernels.plan.prefill_attention.value == prefill
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16, attn_implementation="eager").eval()
    prompts = [[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 72, 105, 32, 116, 104, 101, 114],
               [1, 84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116, 32, 111, 110]]
    ours = run_greedy(backend, prompts, 8, chunk_size=8, stagger=0)
    for ids, out in zip(prompts, ours):
        with torch.inference_mode():
            assert out == hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    if prefill != "sdpa":
        assert max(blocked + extends) == 2  # an extend step of both requests took the blocked path or the extend kernel
    else:
        assert not blocked
        assert bool(extends) == (backend.cpu_kernels.extend is not None)  # AMX tiles take extends whatever prefill


@needs_kernel
def test_softmax_split_between_threads_gives_the_same_bits(monkeypatch):
    """Rows are independent: the softmax split between torch's intra-op threads (helper threads running slices of
    rows while the caller runs one) writes exactly what one thread writes."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 64, generator=g).bfloat16() for h, n in ((8, 90), (4, 150), (4, 150)))
    limits = np.stack([np.arange(61, 151), np.clip(np.arange(90) + 20, 1, 150)]).astype(np.int32)
    one_pass = False  # the GEMM and the separate softmax (their split)
    one = cba.blocked_attention(lib, q, k, v, limits, 0.125, one_pass)
    calls = []
    real = cba.helper_threads
    monkeypatch.setattr(cba, "helper_threads", lambda n: calls.append(n) or real(n))
    monkeypatch.setattr(cba, "MIN_SCORES_PER_THREAD", 1)
    with threads(3):
        split = cba.blocked_attention(lib, q, k, v, limits, 0.125, one_pass)
    assert calls and calls[0] == 2  # two helper threads next to the caller
    assert torch.equal(one, split)


def test_kernel_report_names_the_blocked_path_for_bf16_models_whatever_the_kv_dtype():
    """fp8 KV pages are dequantized to bf16 before attention, so a bf16 model with fp8 pages takes the blocked path
    (GEMMs or one pass) too, and /server_info says so; without a library, or for a float32 model, SDPA."""
    from tierlm.backends.torch.kernel_report import kernel_report

    def prefill(dtype, kv_dtype, kernels):
        return kernel_report(torch.nn.Linear(2, 2), "cpu", dtype, kv_dtype, pa.TORCH_NATIVE, 8, 4, 64,
                             kernels)["prefill_attention"]

    names = {"blocked": "blocked bf16 GEMMs", "one_pass": "one AVX512-BF16 C pass"}
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        default = kernels_for(torch.bfloat16, kv)
        assert default.plan.prefill_attention == kernels_for(torch.bfloat16).plan.prefill_attention
        if lib is not None:
            for choice, name in names.items():
                try:
                    kernels = kernels_for(torch.bfloat16, kv, plan=f"prefill_attention={choice}")
                except CpuPlanError:
                    assert choice == "one_pass" and not lib.has("blocked_attention")
                    continue
                assert name in prefill(torch.bfloat16, kv, kernels)
        chosen = default.plan.prefill_attention.value
        assert ("blocked bf16" in prefill(torch.bfloat16, kv, default)) == (chosen in names)
        assert (chosen in names) == (lib is not None and default.blocked is not None)
        none = kernels_for(torch.bfloat16, kv, lib=None)
        assert "SDPA" in prefill(torch.bfloat16, kv, none) and "blocked bf16" not in prefill(torch.bfloat16, kv, none)
    # (the plan's reason may name the blocked path: "the blocked path is for bf16"; the path itself is not named)
    f32 = prefill(torch.float32, torch.float32, kernels_for(torch.float32))
    assert f32.startswith("torch SDPA") and "blocked bf16" not in f32


@needs_kernel
@pytest.mark.parametrize("level", ["x86-64", "avx2", "avx512", "avx512_bf16", "amx"])
def test_the_row_softmax_of_each_x86_build_is_transformers_bf16_softmax(level):
    """The softmax's AVX-512 code (with and without AVX512-BF16's rounding instruction) and the plain loop the AVX2
    and baseline libraries vectorize (or not): transformers' bf16 eager softmax (scale, round, float32 softmax,
    round) but for rare one-ulp roundings, the masked tail zeroed; rows shorter than one vector and rows whose last
    vector is partial included (limits 1..37 of E = 37)."""
    built = library_at(level)
    assert built.has("softmax_rows")
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
