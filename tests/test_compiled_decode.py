"""--enable-torch-compile (backends/torch/compile/compiled_decode.py): decode steps and short steps through the model
compiled by torch.compile, with the paged attention and prepacked linears as opaque ops.

What must hold: the compiled step gives the eager step's logits bit for bit (float32 and bf16: inductor rounds
where eager rounds), greedy output equals transformers' reference, only steps of at most --torch-compile-max-bs
requests that are decode-only or at most SHORT_STEP_TOKENS long run compiled, and backends or models that cannot
compile stop startup with the reason. Compiling takes tens of seconds on 2 cores, so the graphs are compiled once
per dtype for the module and shared by its tests (inductor's disk cache makes a second compile of the same graph a
load).
"""
from __future__ import annotations

import contextlib
import os

import pytest

from backend_driver import run_greedy
from engine_harness import greedy, pool_is_clean, run, start_engine
from model_factory import reference_greedy

pytestmark = pytest.mark.slow

# Five requests joining two steps apart: prefill, mixed and decode-only steps of 1 to 5 requests.
PROMPTS = [[5, 9, 13, 2, 7], [11, 4], list(range(20, 43)), [8], [30, 31, 32, 33, 34, 35, 36]]
NEW_TOKENS = 12
PAGE_SIZE = 4


def _greedy_outputs(model_dir, dtype: str, compile_max_bs: int, stats_out: dict | None = None):
    """Greedy outputs of PROMPTS through a fresh compiled backend, its step shapes and its compiled-step count."""
    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(model_dir, dtype=dtype)
    num_pages = sum(-(-(len(p) + NEW_TOKENS) // PAGE_SIZE) for p in PROMPTS)
    backend.init_kv_pool(num_pages, PAGE_SIZE)
    real_init, backend.init_kv_pool = backend.init_kv_pool, lambda n, ps: None  # keep the pool set up here
    backend.init_torch_compile(compile_max_bs)
    drivers: list = []
    try:
        outs = run_greedy(backend, PROMPTS, NEW_TOKENS, page_size=PAGE_SIZE, num_pages=num_pages, stagger=2,
                          driver_out=drivers)
    finally:
        backend.init_kv_pool = real_init
    stats = backend.torch_compile_stats()
    assert stats["recompiles"] == 0  # the graphs of the first step serve every batch size
    if stats_out is not None:
        stats_out.update(stats)
    return outs, drivers[0].batch_shapes, stats["compiled_steps"]


def test_compiled_decode_gives_the_reference_output_and_only_decode_and_short_steps_compile(tiny_llama):
    compiled, shapes, steps = _greedy_outputs(tiny_llama, "float32", compile_max_bs=4)
    for prompt, out in zip(PROMPTS, compiled):
        assert out == reference_greedy(tiny_llama, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    # exactly the steps of at most 4 requests that are decode-only or short ran compiled: prefills and mixed steps
    # of at most SHORT_STEP_TOKENS tokens too, 5-request steps not
    from tierlm.backends.torch.compile.compiled_decode import SHORT_STEP_TOKENS

    compiled_shapes = [s for s in shapes if len(s) <= 4 and (all(q == 1 for q in s) or sum(s) <= SHORT_STEP_TOKENS)]
    assert any(len(s) == 5 and all(q == 1 for q in s) for s in shapes)  # a decode step over the max: eager
    assert any(any(q > 1 for q in s) for s in compiled_shapes)  # a prefill or mixed step ran compiled
    assert steps == len(compiled_shapes) > 0


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral-window"])
def compiled_family(request, tiny_models_root):
    """Each family the CPU compiles by default: qwen2's q/k/v biases, qwen3's q/k norms and head size, and mistral
    with a sliding window (4) shorter than the prompts."""
    from model_factory import build_tiny_model

    if request.param == "mistral-window":
        return build_tiny_model("mistral", tiny_models_root / "mistral-window4", sliding_window=4)
    return build_tiny_model(request.param, tiny_models_root / request.param)


def test_compiled_logits_equal_eager_logits_bit_for_bit(compiled_family):
    """A bf16 decode step of three requests, a short mixed step (one decode, two extends over cached prefixes) and a
    fresh prompt of SHORT_STEP_TOKENS tokens (the longest step that compiles), each run eagerly and compiled on the
    same pool: the same logits (inductor rounds where eager rounds: emulate_precision_casts), for every family the
    CPU compiles by default."""
    import numpy as np
    import torch

    from tierlm.backends.base import ForwardBatch, SamplingBatch
    from tierlm.backends.torch.backend import TorchBackend

    from tierlm.backends.torch.compile.compiled_decode import SHORT_STEP_TOKENS, cpp_wrapper_choice
    from tierlm.backends.torch.cpu import native_ops

    backend = TorchBackend(compiled_family, dtype="bfloat16")
    backend.init_kv_pool(6 + SHORT_STEP_TOKENS // PAGE_SIZE, PAGE_SIZE)
    prompts = [[5, 9, 13, 2, 7], [11, 4, 6], [8, 1]]
    ids = np.concatenate([np.asarray(p, np.int64) for p in prompts])
    q = np.asarray([len(p) for p in prompts], np.int32)
    table = np.asarray([[0, 1], [2, 3], [4, 5]], np.int32)
    positions = np.concatenate([np.arange(len(p)) for p in prompts]).astype(np.int64)
    backend.forward(ForwardBatch(ids, positions, q, q, table, np.cumsum(q).astype(np.int64) - 1,
                                 SamplingBatch.greedy(3), PAGE_SIZE))  # prefill (eager)
    step = ForwardBatch(np.asarray([3, 3, 3], np.int64), q.astype(np.int64), np.ones(3, np.int32), q + 1, table,
                        np.arange(3, dtype=np.int64), SamplingBatch.greedy(3), PAGE_SIZE)
    # request 0 decodes; 1 and 2 extend their cached 3 and 2 tokens by 4 and 3: every row's logits
    mixed = ForwardBatch(np.asarray([3, 14, 15, 16, 17, 18, 19, 20], np.int64),
                         np.asarray([5, 3, 4, 5, 6, 2, 3, 4], np.int64), np.asarray([1, 4, 3], np.int32),
                         np.asarray([6, 7, 5], np.int32), table, np.arange(8, dtype=np.int64), SamplingBatch.greedy(8),
                         PAGE_SIZE)
    n = SHORT_STEP_TOKENS  # a fourth request's whole prompt, on pages 6..
    longest = ForwardBatch(np.arange(7, 7 + n, dtype=np.int64), np.arange(n, dtype=np.int64),
                           np.asarray([n], np.int32), np.asarray([n], np.int32),
                           np.arange(6, 6 + n // PAGE_SIZE, dtype=np.int32)[None], np.arange(n, dtype=np.int64),
                           SamplingBatch.greedy(n), PAGE_SIZE)
    steps = (step, mixed, longest)
    eager = [backend.forward_logits(b).clone() for b in steps]
    backend.init_torch_compile(max_bs=4)
    before = native_ops.served()
    compiled = [backend.forward_logits(b) for b in steps]  # rewrite the same K/V into the same slots
    stats = backend.torch_compile_stats()
    served = {k: v - before[k] for k, v in native_ops.served().items()}
    # the products ran in the C++ op where the plan has it (this machine's kernel library has the torch ops)
    plan = backend.cpu_kernels.plan
    fast = any(getattr(m, "fast_rows", 0) for m in backend.model.modules())
    if plan.compiled_ops.value == "native":
        assert stats["products"] == "C++ op", stats["products_why"]
        assert (served["packed_linear"] > 0) == fast, served
    else:
        assert stats["products"] == "Python op" and not any(served.values()), stats["products_why"]
    # the decode-only step's layers ran in the C++ attention op where the plan has it (not the mixed and the long
    # step, nor any step of a sliding-window model: the Python op), with the Python path's bits (compared below)
    windowed = getattr(backend.model.config, "sliding_window", None) is not None
    native_attention = plan.compiled_ops.value == plan.compiled_attention.value == "native" and \
        plan.decode_attention.value == "paged"
    expected = 0 if windowed or not native_attention else backend.model.config.num_hidden_layers
    assert served["paged_attention"] == expected, (served, plan.compiled_attention)
    assert stats["compiled_steps"] == 3 and stats["graphs"] >= 1
    # the C++ wrapper where Python's headers are (this machine's interpreter has them: the step ran through it)
    assert stats["wrapper"] == ("C++" if cpp_wrapper_choice(os.environ)[0] else "Python"), stats["wrapper_why"]
    assert stats["guards"] == "inputs only", stats["guards_why"]  # the steps after compile_now skipped the rest
    assert stats["call"] == "direct", stats["call_why"]  # and called the graphs without dynamo
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("call", ["direct", "dynamo"])
def test_two_models_of_one_class_run_their_own_graphs_with_the_guards_skipped(tiny_llama, tiny_models_root,
                                                                             monkeypatch, call):
    """Dynamo keys graphs by code object, and transformers' forward wrapper is one code object for every model: each
    compiled stack compiles through entries of its own, so with the guards skipped after compile_now, interleaved
    one- and two-token steps of two llama models of different shapes (a graph of one would fail the other's
    weights) each give their own eager logits, bit for bit: called straight, and through dynamo."""
    import numpy as np
    import torch

    from model_factory import build_tiny_model
    from tierlm.backends.base import ForwardBatch, SamplingBatch
    from tierlm.backends.torch.backend import TorchBackend

    if call == "dynamo":
        monkeypatch.setenv("TIERLM_CPU_PLAN", "compile_call=dynamo")

    other = build_tiny_model("llama", tiny_models_root / "llama-3-layers-wide", num_hidden_layers=3,
                             intermediate_size=96)
    backends = [TorchBackend(d, dtype="bfloat16") for d in (tiny_llama, other)]
    prompt = [5, 9, 13, 2, 7]
    n = len(prompt)
    prefill = ForwardBatch(np.asarray(prompt, np.int64), np.arange(n, dtype=np.int64), np.asarray([n], np.int32),
                           np.asarray([n], np.int32), np.asarray([[0, 1]], np.int32), np.asarray([n - 1], np.int64),
                           SamplingBatch.greedy(1), PAGE_SIZE)
    steps = [ForwardBatch(np.asarray([t], np.int64), np.asarray([n], np.int64), np.ones(1, np.int32),
                          np.asarray([n + 1], np.int32), np.asarray([[0, 1]], np.int32), np.zeros(1, np.int64),
                          SamplingBatch.greedy(1), PAGE_SIZE) for t in (3, 4)]
    steps.append(ForwardBatch(np.asarray([6, 8], np.int64), np.asarray([n, n + 1], np.int64),
                              np.asarray([2], np.int32), np.asarray([n + 2], np.int32), np.asarray([[0, 1]], np.int32),
                              np.arange(2, dtype=np.int64), SamplingBatch.greedy(2), PAGE_SIZE))
    eager = []
    for b in backends:
        b.init_kv_pool(2, PAGE_SIZE)
        b.forward(prefill)
        eager.append([b.forward_logits(s).clone() for s in steps])
    for b in backends:
        b.init_torch_compile(max_bs=2)
        stats = b.torch_compile_stats()
        assert stats["guards"] == "inputs only" and stats["call"] == call, stats["call_why"]
    for i in range(len(steps)):  # A, B, A, B: each call after the other model's
        for b, want in zip(backends, eager):
            assert torch.equal(b.forward_logits(steps[i]), want[i])
    for b in backends:
        stats = b.torch_compile_stats()
        assert stats["graphs"] == 2 and stats["recompiles"] == 0
        assert b.compiled.graphs_per_entry() == {"one token": 1, "several tokens": 1}


def test_a_direct_call_that_differs_from_dynamos_is_dropped_before_serving(tiny_llama, monkeypatch):
    """compile_now runs its steps a second time, each through the direct call and through dynamo: a direct call
    whose hidden states differ (here: shifted by one) is dropped, and the steps serve through dynamo with the
    reference output."""
    from tierlm.backends.torch.compile import direct_call

    real_plan = direct_call.plan

    def off_by_one(gm, example_inputs, compiled, output):
        call, why = real_plan(gm, example_inputs, compiled, output)
        if call is not None:
            call.compiled = lambda *args: (compiled(*args)[0] + 1,)
        return call, why

    monkeypatch.setattr(direct_call, "plan", off_by_one)
    outs, _, steps = _greedy_outputs(tiny_llama, "float32", compile_max_bs=4, stats_out=(stats := {}))
    for prompt, out in zip(PROMPTS, outs):
        assert out == reference_greedy(tiny_llama, prompt, NEW_TOKENS)
    assert steps > 0 and stats["call"] == "dynamo" and "differed" in stats["call_why"]


def test_the_direct_call_takes_only_the_traced_arguments_and_only_graphs_of_the_steps_inputs():
    import torch

    from tierlm.backends.torch.compile.direct_call import plan

    def stack(l_kwargs_input_ids_, s27, l_kwargs_position_ids_, l_fn_self_weight):
        return ((l_kwargs_input_ids_ + l_kwargs_position_ids_).float() * l_fn_self_weight,)

    gm = torch.fx.symbolic_trace(stack)
    weight = torch.tensor(3.0)
    ids, pos = torch.tensor([[1, 2]]), torch.tensor([[0, 1]])
    call, why = plan(gm, [ids, 2, pos, weight], gm, lambda h: h)
    assert call is None and "s27" in why  # a plain int where a symbolic size belongs: not this graph's input

    def stack_without_size(l_kwargs_input_ids_, l_kwargs_position_ids_, l_fn_self_weight):
        return ((l_kwargs_input_ids_ + l_kwargs_position_ids_).float() * l_fn_self_weight,)

    gm = torch.fx.symbolic_trace(stack_without_size)
    call, why = plan(gm, [ids, pos, weight], gm, lambda h: h)
    assert why == "" and torch.equal(call(torch.tensor([[5]]), torch.tensor([[7]])), torch.tensor([[36.0]]))
    assert call.takes({"input_ids": ids, "position_ids": pos, "use_cache": False, "cache": None})
    assert not call.takes({"input_ids": ids, "position_ids": pos, "inputs_embeds": torch.ones(1)})
    assert not call.takes({"input_ids": ids, "position_ids": pos, "use_cache": True})
    assert not call.takes({"input_ids": ids, "position_ids": pos, "output_hidden_states": True})
    assert not call.takes({"input_ids": ids.int(), "position_ids": pos})  # inductor's code reads int64 unchecked
    assert not call.takes({"input_ids": torch.tensor([[1, 2, 3, 4]])[:, ::2], "position_ids": pos})  # strided
    assert not call.takes({"input_ids": ids, "position_ids": pos[:, :1]})  # ids and positions of other lengths

    def two_outputs(l_kwargs_input_ids_, l_kwargs_position_ids_, l_fn_self_weight):
        return (l_kwargs_input_ids_ * 1, l_fn_self_weight * 2)

    assert "more than the hidden states" in plan(torch.fx.symbolic_trace(two_outputs), [ids, pos, weight], None,
                                                 lambda h: h)[1]

    def foreign(l_kwargs_input_ids_, l_kwargs_position_ids_, l_g_something):
        return (l_kwargs_input_ids_ * l_g_something,)

    assert "l_g_something" in plan(torch.fx.symbolic_trace(foreign), [ids, pos, weight], None, lambda h: h)[1]


def test_the_direct_call_is_off_when_switched_off_or_where_rope_changes_during_a_forward():
    from types import SimpleNamespace

    from tierlm.backends.torch.compile.direct_call import choice

    assert choice({}, SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))[0]
    assert choice({}, SimpleNamespace(rope_parameters={"rope_type": "llama3", "factor": 8.0}))[0]
    off, why = choice({"TIERLM_CPU_PLAN": "compile_call=dynamo"}, SimpleNamespace(rope_parameters=None))
    assert not off and "compile_call=dynamo" in why
    off, why = choice({"TIERLM_CPU_COMPILE_DIRECT_CALL": "0"}, SimpleNamespace(rope_parameters=None))  # its old name
    assert not off and "TIERLM_CPU_COMPILE_DIRECT_CALL=0" in why
    dynamic, why = choice({}, SimpleNamespace(rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    assert not dynamic and "dynamic" in why
    per_layer = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "longrope"},
                                                 "sliding_attention": {"rope_type": "default"}})
    assert not choice({}, per_layer)[0]


def test_the_guards_are_skipped_only_for_tested_families_and_not_when_switched_off():
    from tierlm.backends.torch.compile.compiled_decode import skip_guards_choice

    assert skip_guards_choice({}, "Qwen2ForCausalLM")[0]
    off, why = skip_guards_choice({"TIERLM_CPU_PLAN": "compile_guards=all"}, "LlamaForCausalLM")
    assert not off and "compile_guards=all" in why
    other, why = skip_guards_choice({}, "Qwen3NextForCausalLM")
    assert not other and "Qwen3NextForCausalLM" in why


def test_the_wrapper_choice_follows_the_switch_and_pythons_headers(tmp_path):
    from tierlm.backends.torch.compile.compiled_decode import cpp_wrapper_choice

    (tmp_path / "Python.h").write_text("")
    assert cpp_wrapper_choice({}, str(tmp_path))[0]
    off, why = cpp_wrapper_choice({"TIERLM_CPU_PLAN": "compile_wrapper=python"}, str(tmp_path))
    assert not off and "compile_wrapper=python" in why
    empty = tmp_path / "no-headers"
    empty.mkdir()
    missing, why = cpp_wrapper_choice({}, str(empty))
    assert not missing and "Python.h" in why and "python3-dev" in why


def test_inductors_cache_has_a_folder_per_machine_kind(monkeypatch, tmp_path):
    """inductor compiles with -march=native and picks its vector ISA from ATEN_CPU_CAPABILITY, and its cache keys
    hold neither: tierlm's folder for it is split by CPU level, model, flags and ATen's capability (a graph cached by
    an AVX-512 run gave an AVX2-capped one all-zero tokens); a folder the user chose is kept as it is."""
    from test_cpu_features import recorded

    from tierlm.backends.torch.compile import compiled_decode
    from tierlm.platforms.cpu_features import apply_cap

    avx2, skylake = recorded("amd-epyc-zen3-avx2.txt", "x86_64"), recorded("intel-xeon-skylake-avx512.txt", "x86_64")
    keys = {compiled_decode.inductor_cache_key(cpu, cap) for cpu in (avx2, skylake, apply_cap(skylake, "avx2"))
            for cap in (None, "avx2", "avx512")}
    assert len(keys) == 9
    assert compiled_decode.inductor_cache_key(avx2, None).startswith("avx2-")
    assert compiled_decode.inductor_cache_key(apply_cap(skylake, "avx2"), "avx2").startswith("avx2-")
    assert compiled_decode.inductor_cache_key(skylake, None) == compiled_decode.inductor_cache_key(skylake, None)

    import torch._inductor.codecache as codecache
    from torch._inductor.runtime import runtime_utils

    monkeypatch.setattr(compiled_decode, "this_cpu", lambda: skylake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):  # restored after the test, with inductor's default folder
        monkeypatch.setattr(codecache, name, getattr(codecache, name))
    monkeypatch.setattr(runtime_utils, "default_cache_dir", runtime_utils.default_cache_dir)
    compiled_decode._cache_dir()
    ours = tmp_path / "tierlm" / "inductor" / compiled_decode.inductor_cache_key(skylake, "avx2")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ours)
    # what inductor keeps under its default folder (precompiled headers, its on-disk caches) is in ours too, not in
    # a shared /tmp/torchinductor_<user>
    assert codecache._HEADER_DIR == str(ours / "precompiled_headers")
    assert runtime_utils.default_cache_dir() == str(ours)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compiled_decode._cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert codecache._HEADER_DIR == str(tmp_path / "mine" / "precompiled_headers")


@pytest.mark.parametrize("how", ["switched off", "fails to build"])
def test_the_python_wrapper_serves_where_the_cpp_wrapper_does_not(tiny_llama, monkeypatch, how):
    """The plan's override compile_wrapper=python, or a C++ wrapper whose build fails: the compiled step still
    serves, through inductor's Python wrapper, with the reference output, and the stats say which wrapper and why."""
    from tierlm.backends.torch.compile import compiled_decode

    no_cache = contextlib.nullcontext()
    if how == "switched off":
        monkeypatch.setenv("TIERLM_CPU_PLAN", "compile_wrapper=python")
    else:
        if not compiled_decode.cpp_wrapper_choice(os.environ)[0]:
            pytest.skip("no C++ wrapper here to fail (no Python.h)")
        import torch._inductor.codecache as codecache
        import torch._inductor.config as inductor_config

        def no_build(*args, **kwargs):  # what a C++ wrapper that does not compile raises, mid-build
            raise RuntimeError("CppCompileError: simulated: Python.h: No such file or directory")

        # build now, not load an earlier build. torch's own patch, not monkeypatch.setattr: an inductor option is no
        # entry of its module's __dict__, so pytest (9.2+) undoes that setattr with delattr, which hides the option
        # ("fx_graph_cache does not exist") from every later compile of the process.
        no_cache = inductor_config.patch(fx_graph_cache=False)
        monkeypatch.setattr(codecache.CppWrapperCodeCache, "load_pybinding_async", no_build)
    with no_cache:  # inductor's options are per thread: the backend compiles on this one
        outs, _, steps = _greedy_outputs(tiny_llama, "float32", compile_max_bs=4, stats_out=(stats := {}))
    for prompt, out in zip(PROMPTS, outs):
        assert out == reference_greedy(tiny_llama, prompt, NEW_TOKENS)
    assert steps > 0 and stats["wrapper"] == "Python"
    assert ("compile_wrapper=python" if how == "switched off" else "failed to build") in stats["wrapper_why"]
    assert stats["graphs"] == 2  # one token, several tokens: a failed C++ build is not counted as a graph


def test_one_request_limit_still_compiles_the_graph_of_short_steps_before_serving(tiny_llama):
    """--torch-compile-max-bs 1 admits no two-request decode step, yet short prompts run compiled: compile_now builds
    the several-token graph from a two-token step, so no request compiles on the serving thread."""
    import numpy as np

    from tierlm.backends.base import ForwardBatch, SamplingBatch
    from tierlm.backends.torch.backend import TorchBackend

    backend = TorchBackend(tiny_llama, dtype="float32")
    backend.init_kv_pool(4, PAGE_SIZE)
    info = backend.init_torch_compile(max_bs=1)
    assert info["graphs"] >= 2  # one token, several tokens
    n = 6
    backend.forward(ForwardBatch(np.arange(3, 3 + n, dtype=np.int64), np.arange(n, dtype=np.int64),
                                 np.asarray([n], np.int32), np.asarray([n], np.int32), np.asarray([[0, 1]], np.int32),
                                 np.asarray([n - 1], np.int64), SamplingBatch.greedy(1), PAGE_SIZE))
    after = backend.torch_compile_stats()
    assert after["compiled_steps"] == 1 and after["graphs"] == info["graphs"] and after["recompiles"] == 0


def test_engine_serves_compiled_and_reports_it(tiny_llama):
    """Compiled at startup (before ready), reported in /server_info, reference output, no page leaks."""
    engine = start_engine(tiny_llama, "torch", dtype="float32", page_size=PAGE_SIZE, enable_torch_compile=True,
                          torch_compile_max_bs=8)
    try:
        info = engine.server_info()["torch_compile"]
        assert info["enabled"] and info["chosen_by"] == "--enable-torch-compile" and info["state"] == "ready"
        assert info["max_bs"] == 8 and info["graphs"] >= 1
        assert info["compiled_steps"] == 0  # the startup steps of 1 and 2 requests compiled it; none served yet
        prompts = [[5, 9, 13, 2, 7], [11, 4, 6], [8, 8, 9]]
        outs = run(engine, prompts, greedy(10))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(tiny_llama, prompt, 10)
        after = engine.server_info()["torch_compile"]
        assert after["compiled_steps"] > 0 and after["graphs"] == info["graphs"] and after["recompiles"] == 0
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_backends_and_models_that_cannot_compile_stop_startup_with_the_reason(tiny_llama, tmp_path):
    from model_factory import HYBRIDS, build_tiny_hybrid, hybrid_available
    from tierlm.runtime.errors import StartupError
    from tierlm.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="--torch-compile-max-bs must be >= 1"):
        ServerArgs(model_path=str(tiny_llama), torch_compile_max_bs=0).check()
    with pytest.raises(StartupError, match="torch.compile applies to the torch backend, not mlx"):
        start_engine(tiny_llama, "mlx", enable_torch_compile=True)
    with pytest.raises(StartupError, match="--cuda-graph-max-bs"):  # both want the same decode steps
        start_engine(tiny_llama, "torch", enable_torch_compile=True, cuda_graph_max_bs=4)
    arch = next((a for a in HYBRIDS if hybrid_available(a)), None)
    if arch is None:
        pytest.skip("this transformers has none of the hybrid architectures")
    with pytest.raises(StartupError, match="not available for hybrid models"):
        start_engine(build_tiny_hybrid(arch, tmp_path / "hybrid"), "torch", enable_torch_compile=True)


def test_the_cpu_default_compiles_where_it_may_and_serves_eagerly_where_compiling_fails(tiny_llama, monkeypatch):
    """The plan's override compile=yes lifts the default's size floor: the engine compiles without the flag and serves the
    reference output compiled; a compile that fails leaves it serving eagerly, the reason in /server_info; and
    below the floor (the tiny model, no variable) it does not compile."""
    from tierlm.backends.torch.backend import TorchBackend

    prompts = [[5, 9, 13, 2, 7], [11, 4, 6]]
    monkeypatch.setenv("TIERLM_CPU_PLAN", "compile=yes")
    engine = start_engine(tiny_llama, "torch", dtype="float32", page_size=PAGE_SIZE, torch_compile_max_bs=4)
    try:
        info = engine.server_info()["torch_compile"]
        assert (info["enabled"], info["chosen_by"], info["state"]) == (True, "default", "ready")
        assert info["graphs"] >= 1
        for prompt, out in zip(prompts, run(engine, prompts, greedy(8))):
            assert out.token_ids == reference_greedy(tiny_llama, prompt, 8)
        assert engine.server_info()["torch_compile"]["compiled_steps"] > 0
        assert pool_is_clean(engine)
    finally:
        engine.shutdown()

    def no_compiler(self):  # what inductor raises at code generation, after the backend set up its graphs
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(TorchBackend, "_compile_steps", no_compiler)
    engine = start_engine(tiny_llama, "torch", dtype="float32", page_size=PAGE_SIZE)
    try:
        info = engine.server_info()["torch_compile"]
        assert info["enabled"] is False and "compiling failed: RuntimeError: InvalidCxxCompiler" in info["why"]
        assert info["state"].startswith("failed: RuntimeError") and info["compiled_steps"] == 0
        for prompt, out in zip(prompts, run(engine, prompts, greedy(8))):
            assert out.token_ids == reference_greedy(tiny_llama, prompt, 8)
        assert engine.server_info()["torch_compile"]["compiled_steps"] == 0  # every step ran eagerly
    finally:
        engine.shutdown()

    monkeypatch.delenv("TIERLM_CPU_PLAN")
    engine = start_engine(tiny_llama, "torch", dtype="float32", page_size=PAGE_SIZE)
    try:
        info = engine.server_info()["torch_compile"]
        assert info["enabled"] is False and "MiB of weights" in info["why"]
        assert "state" not in info  # nothing was compiled
    finally:
        engine.shutdown()
