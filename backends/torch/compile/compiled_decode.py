"""Compiled decode on CPU: decode steps through the model compiled by torch.compile (inductor).

``--enable-torch-compile``, or the CPU default that backends/torch/compile/policy.py decides.

A decode step of a small model spends a third of its time outside the matmuls, in the ~30 small eager ops per
layer of transformers' modeling code (norms, rotary, residual adds, activation: docs/performance.md, "Where the
time goes"). Compiling the decoder stack fuses them into a few generated loops per layer. What inductor cannot
trace stays opaque through tierlm's ops (backends/torch/ops.py): the paged attention (it writes the pool and reads
pages through the step's index tensors, which live outside the graph), the oneDNN-prepacked bf16 linear
(cpu/linear.py), the float32 and int8 weight-only linears' C kernels, so the matmuls and attention are exactly the
eager ones.

- Steps of at most ``--torch-compile-max-bs`` requests run compiled when they are decode-only (SGLang's rule) or
  at most ``SHORT_STEP_TOKENS`` tokens long: a warm request's short suffix over its cached prefix, a mixed step of a
  few decodes and a short extend, a short prompt. The graph has no notion of requests (attention is the opaque
  op), so one graph with a symbolic token count serves all of them, and one specialized graph the single token
  (torch's rule for size 1, and its fastest code); ``CompiledDecode.compile_now`` compiles both before serving
  (a one-token and a two-token step), so no request waits. Longer steps run eagerly: compiled, a 2016-token
  prefill was no faster (its matmuls and attention dominate), and above ~56 tokens the logits stopped matching
  eager's bit for bit here (AMX Xeon).
  A 16-token extend over 2000 cached tokens: 44.7 -> 41.4 ms; 5 tokens: 41.3 -> 34.6 ms (llama-small bf16).
- Outputs equal the eager model's bit for bit: inductor is told to round every intermediate to the model dtype
  where eager does (``emulate_precision_casts``), so bf16 keeps transformers' bf16 rounding points
  (tests/test_compiled_decode.py).
- inductor writes the step's wrapper in C++ (``cpp_wrapper``): the ~400 Python statements a step of its Python
  wrapper (kernel calls, buffer allocations, ~95 size asserts on 8 layers) become one C++ function that calls the
  custom ops through the dispatcher; the asserts are off (dynamo's guards check the inputs, and the ops' outputs
  are new contiguous tensors, as their shape rules say). llama-small, in process, alternated: 8 streams 8.2-8.4 ->
  7.7-7.9 ms a step, one stream 5.9 -> 5.7. The C++ wrapper is a Python extension and needs Python's headers
  (Python.h): without them, or if its compile fails, the Python wrapper serves (logged); the CPU plan's override
  ``compile_wrapper=python`` keeps the Python wrapper.
- Guards: each size class compiles through an entry function with a code object of its own (dynamo keys graphs by
  code object; transformers' forward wrapper is one for every model), so each entry holds exactly one graph of one
  model. Once ``compile_now`` built them, steps of the families tests check bit for bit run with
  ``skip_guard_eval_unsafe``: dynamo runs only the tensor guards of what is not a parameter (the step's inputs and
  the model's buffers: dtype, device, shape) instead of all ~1,200 on the model's modules, parameters and config,
  which nothing changes while serving (``set_stance`` is process-wide: one thread runs the steps). llama-small, in
  process, alternated: one stream 4.88 -> 4.61 ms a step, 8 streams 7.26 -> 6.70.
  ``TIERLM_CPU_PLAN=compile_guards=all`` runs every guard (and turns the direct call off). Beyond that, ready steps
  call each class's compiled function straight, past dynamo's frame hook, guards and input gathering
  (direct_call.py: 4.92 -> 4.53 ms, 7.5 -> 6.7), once compile_now found the direct call equal to
  dynamo's on its own steps.
- Where the CPU plan has them (``compiled_ops``), the kernel calls are the kernel library's C++ ops
  (cpu/native_ops.py), so the C++ wrapper reaches the kernels without entering Python (~9 us a product before).
  llama-small, in process, alternated: one stream 4.24 -> 4.0 ms a step, 8 streams 6.69 -> 6.23; the
  Qwen2.5-0.5B shape at 8 streams 57.5 -> 55.5. Their per-step state is the step record (cpu/step_record.py),
  written by ``step`` before each compiled step. Elsewhere the Python ops serve.
- inductor's compiled code is cached on disk (``TORCHINDUCTOR_CACHE_DIR``, under tierlm's cache folder unless
  set), so a restart on the same model and torch loads it in seconds instead of compiling again. tierlm's folder
  has one subfolder per machine kind (``inductor_cache_key``): inductor compiles with -march=native and picks its
  vector ISA from ATEN_CPU_CAPABILITY, but its cache keys hold neither, so a graph cached by an AVX-512 run was
  loaded by an AVX2-capped one and gave all-zero tokens (and the reverse crashed); a home folder shared between
  machines would do the same.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import types
from typing import Callable, Iterator

import numpy as np
import torch

from tierlm.backends.base import ForwardBatch
from tierlm.backends.torch.compile import direct_call
from tierlm.backends.torch.cpu import decode_step, native_ops
from tierlm.platforms.cpu_features import CpuFeatures, this_cpu
from tierlm.platforms.cpu_plan import override

log = logging.getLogger(__name__)

# Steps of at most this many tokens run compiled whatever their mix (see the module doc): bit-identical to eager
# up to ~56 tokens here, so 32 keeps a margin; longer steps gain nothing from compiling.
SHORT_STEP_TOKENS = 32


def inductor_cache_key(cpu: CpuFeatures, aten_capability: str | None) -> str:
    """The subfolder of tierlm's inductor cache for code built on this kind of machine: the CPU level (after a
    TIERLM_CPU_ISA cap), then a hash of the CPU model, its flags (after the cap) and ATen's capability, which
    together decide the code inductor writes."""
    key = "\0".join((cpu.arch, cpu.model_name, " ".join(sorted(cpu.flags)), aten_capability or ""))
    return f"{cpu.level}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _cache_dir() -> None:
    """inductor's on-disk cache under tierlm's cache folder (/tmp, inductor's default, is emptied on reboot), one
    subfolder per machine kind, unless the user chose one. inductor writes its default into the environment on
    first use, so that value counts as unset. What inductor keeps under its *default* folder whatever the variable
    says (its precompiled headers, the on-disk caches of its memoizer: a shared name in $TMPDIR,
    /tmp/torchinductor_<user>, that another user can create first) goes under the same folder too."""
    from platformdirs import user_cache_dir
    from torch._inductor.runtime import runtime_utils

    default = runtime_utils.default_cache_dir
    own = getattr(default, "tierlm_folder", None)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(own or default())):
        key = inductor_cache_key(this_cpu(), os.environ.get("ATEN_CPU_CAPABILITY"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(user_cache_dir("tierlm"), "inductor", key)
    _inductor_defaults_under(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def _inductor_defaults_under(folder: str) -> None:
    """Point the places inductor derives from its default cache folder at ``folder``: its ``default_cache_dir``
    (read at each use by its on-disk caches) and the precompiled-header folders codecache computed at import."""
    import torch._inductor.codecache as codecache
    from torch._inductor.runtime import runtime_utils

    def default_cache_dir() -> str:
        return folder

    default_cache_dir.tierlm_folder = folder  # a later call (another model, a test's folder) replaces it
    runtime_utils.default_cache_dir = default_cache_dir
    if hasattr(codecache, "_HEADER_DIR"):
        codecache._HEADER_DIR = os.path.join(folder, "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")


class CompiledDecode:
    """The decoder stack compiled for decode steps and short steps; the model's own eager forward serves every
    other step.

    Those steps go through the compiled stack once ``compile_now`` has compiled both size classes, before the
    server is ready. Not on a thread beside a serving one: dynamo's "compiling" flag is process-wide, and
    transformers and tierlm's attention take other branches while it is set (measured: a background compile sent
    the serving thread's eager attention into the compiled op, which recursed)."""

    def __init__(self, model: torch.nn.Module, max_bs: int, kernels) -> None:
        _cache_dir()
        import torch._inductor.config as inductor_config

        # bf16/fp16: round where eager rounds, so compiled outputs equal transformers' own (not "more precise").
        inductor_config.emulate_precision_casts = True
        import torch._dynamo.config as dynamo_config

        # A model that breaks the graph (another architecture under --enable-torch-compile) compiles the rest in
        # functions of transformers' code objects, shared by every model of the process: several backends (tests,
        # in-process benchmarks) would reach dynamo's default limit of 8 and silently run those parts eagerly.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        self.inner = model.model  # the decoder stack; the lm_head (and logits_to_keep) stays eager
        self.max_bs = max_bs
        self._eager = self.inner.forward
        self.graphs = 0  # graphs inductor compiled: one per size class (1 request, several)
        self.recompiles = 0  # graphs compiled for a size class that had one already: 0 unless a shape forced one
        self._compiled_for: set[str] = set()
        self._seen_class = False
        self.cpp_wrapper, self.wrapper_why = cpp_wrapper_choice(os.environ)
        self.wrappers: set[str] = set()  # the wrappers the graphs were built with ("C++", "Python")
        log.info("torch.compile: inductor's %s wrapper (%s)", "C++" if self.cpp_wrapper else "Python",
                 self.wrapper_why)
        # before any trace: the layers that call a kernel from C++ learn it now (ops.py records what they carry)
        self.kernels = kernels
        self.record, self.products_why = native_ops.prepare(model, kernels)
        self.native_products = self.record is not None
        log.info("torch.compile: kernel calls through the %s ops (%s)",
                 "C++" if self.native_products else "Python", self.products_why)
        # One entry per size class, each with a code object of its own: dynamo keys its graphs by code object, so
        # each entry holds the one graph of its class and of this instance (transformers' forward wrapper is one
        # code object for every model), and nothing is left for guards to choose between (see ``run``).
        self._entries: dict[str, Callable] = {
            size_class: torch.compile(own_code_object(self._eager), dynamic=True, backend=self._inductor)
            for size_class in SIZE_CLASSES}
        self.skip_guards, self.guards_why = skip_guards_choice(os.environ, (model.config.architectures or [""])[0])
        # Ready steps call each class's graph straight (direct_call.py), where nothing but the step's
        # inputs varies (as for the guards) and compile_now found it equal to dynamo's call.
        self.direct, self.direct_why = direct_call.choice(os.environ, model.config) if self.skip_guards \
            else (False, self.guards_why)
        self._direct: dict[str, direct_call.DirectCall] = {}
        self._forwards = {size_class: self._forward_for(size_class) for size_class in SIZE_CLASSES}
        self._class_now: str | None = None  # the size class of the step running (the graph being built is its)
        self._verifying = False
        self._verified: set[str] = set()  # classes whose direct call compile_now found equal to dynamo's
        self._compiling = False  # compile_now's own steps run compiled before ready
        self.ready = False  # decode and short steps run compiled
        self.state = "not compiled"  # -> "compiling" -> "ready" | "failed: <reason>"
        self.steps = 0  # steps run compiled after compile_now's own (warm-up's one included; /server_info)
        self.compile_s = 0.0  # seconds the first steps took to compile (or load from the cache)

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        compiled, wrapper = None, "Python"
        if self.cpp_wrapper:
            from torch._dynamo.exc import RestartAnalysis, SkipFrame

            try:
                compiled, wrapper = compile_fx(gm, example_inputs, config_patches=CPP_WRAPPER_PATCHES), "C++"
            except (RestartAnalysis, SkipFrame):  # dynamo's own control flow (it traces again), not a failed build
                raise
            except Exception as e:  # noqa: BLE001 - the Python wrapper below serves the same kernels
                self.cpp_wrapper, self.wrapper_why = False, f"the C++ wrapper failed to build ({_first_line(e)})"
                log.warning("torch.compile: %s; inductor's Python wrapper serves the step", self.wrapper_why)
        if compiled is None:
            compiled = compile_fx(gm, example_inputs)
        # counted once built: a restart of dynamo's analysis raised above is not a graph
        self.graphs += 1
        self.recompiles += self._seen_class
        self.wrappers.add(wrapper)
        if self.direct and self._class_now is not None:
            try:  # an optional speed-up: whatever goes wrong planning it leaves the step to dynamo
                call, why = direct_call.plan(gm, example_inputs, compiled, _stack_output) \
                    if not self._seen_class else (None, f"the step for {self._class_now} compiled a second graph")
            except Exception as e:  # noqa: BLE001
                call, why = None, f"planning the direct call failed ({type(e).__name__}: {_first_line(e)})"
            if call is None:
                self._direct.pop(self._class_now, None)
                self.direct_why = why
                log.info("torch.compile: the step for %s goes through dynamo: %s", self._class_now, why)
            else:
                self._direct[self._class_now] = call
        return compiled

    def _forward_for(self, size_class: str) -> Callable:
        """The decoder stack's forward for steps of ``size_class``: the direct call where it was planned and
        verified and the call is the one traced, else the dynamo entry."""
        entry = self._entries[size_class]

        def forward(*args, **kwargs):
            call = self._direct.get(size_class)
            if call is None or args or not call.takes(kwargs):
                return entry(*args, **kwargs)
            if self._verifying:
                return self._verify(size_class, call, entry(**kwargs), kwargs)
            return call(kwargs["input_ids"], kwargs["position_ids"])

        return forward

    def _verify(self, size_class: str, call, through_dynamo, kwargs):
        """compile_now's second pass: the direct call must give dynamo's hidden states bit for bit."""
        try:
            direct = call(kwargs["input_ids"], kwargs["position_ids"])
            same, why = torch.equal(direct.last_hidden_state, through_dynamo.last_hidden_state), \
                f"the direct call differed from dynamo's on the step for {size_class}"
        except Exception as e:  # noqa: BLE001 - the step has dynamo's result; the direct call is dropped
            same, why = False, f"the direct call failed on the step for {size_class} ({type(e).__name__}: " \
                               f"{_first_line(e)})"
        if same:
            self._verified.add(size_class)
        else:
            self._direct.pop(size_class, None)
            self.direct_why = why
            log.warning("torch.compile: %s; the step goes through dynamo", why)
        return through_dynamo

    @contextlib.contextmanager
    def step(self, meta, pool, heads: int, head_dim: int, dtype: torch.dtype) -> Iterator[None]:
        """While a compiled step runs, the step record (cpu/step_record.py) holds what its C++ ops read: whether it
        is a decode-only step, and its DecodeStep (cpu/decode_step.py, planned here before the first layer), with
        which each layer's attention runs ``paged_decode_step`` with no Python in between (~25 us a layer through
        the Python op: ~3 % of a llama-small one-stream step). Cleared after."""
        if self.record is None:
            yield
            return
        attention = None
        if self.record.attention and meta.decode_rows is not None:
            if meta.decode_step is False:
                meta.decode_step = decode_step.plan_for(meta, pool, heads, head_dim, dtype, "cpu",
                                                        self.kernels.decode)
            attention = meta.decode_step
        with self.record.step(meta.decode_rows is not None, attention):
            yield

    def accepts(self, batch: ForwardBatch) -> bool:
        n, tokens = len(batch.q_lens), len(batch.input_ids)
        return (self.ready or self._compiling) and 0 < n <= self.max_bs and \
            (tokens <= SHORT_STEP_TOKENS or bool((np.asarray(batch.q_lens) == 1).all()))

    def compile_now(self, steps: Callable[[], None]) -> None:
        """Run ``steps`` (decode steps of one request and of several, through the backend) on this thread with the
        compiled stack: they compile both graphs (or load them from inductor's cache). Raises what inductor
        raises (a missing C++ compiler, ...)."""
        self.state = "compiling"
        self._compiling = True
        try:
            steps()
            if self._direct:  # the same steps again, each class called both ways (they rewrite the same K/V)
                self._verified.clear()
                self._verifying = True
                steps()
                for size_class in set(self._direct) - self._verified:
                    del self._direct[size_class]
        except Exception as e:
            self.state = f"failed: {type(e).__name__}: {_first_line(e)}"
            raise
        finally:
            self._compiling = self._verifying = False
        if self.graphs == 0:  # dynamo fell back to eager without saying so to the caller
            self.state = "failed: torch.compile built no graph (dynamo fell back to eager; see its warnings)"
            raise RuntimeError(self.state[len("failed: "):])
        self.ready, self.state = True, "ready"

    def run(self, batch: ForwardBatch, run_step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run_step`` with the compiled decoder stack in place of the eager one. The first step of one token and
        the first of several each compile (or load from the cache) their graph: torch specializes a size of 1,
        which is also the fastest code for one stream; ``compile_now`` runs both before they serve."""
        size_class = SIZE_CLASSES[0] if len(batch.input_ids) == 1 else SIZE_CLASSES[1]
        self._seen_class = size_class in self._compiled_for
        if not self._seen_class:
            log.info("torch.compile: compiling the step for %s (once per model and torch version; cached in "
                     "%s)", size_class, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
            t0 = time.perf_counter()
        self.inner.forward = self._forwards[size_class]
        self._class_now = size_class
        try:
            if self.ready and self.skip_guards:
                # The entry holds one graph, built by compile_now: dynamo runs only the tensor guards of the step's
                # inputs and the model's buffers instead of all ~1,200 (every module, parameter and config value the
                # stack reads: 0.3-0.5 ms a step on llama-small).
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out = run_step()
            else:
                out = run_step()
        finally:
            self.inner.forward = self._eager
            self._class_now = None
        if not self._seen_class:
            self._compiled_for.add(size_class)
            dt = time.perf_counter() - t0
            self.compile_s += dt
            log.info("torch.compile: step for %s ready in %.1f s", size_class, dt)
        if not self._compiling:
            self.steps += 1
        return out

    def graphs_per_entry(self) -> dict[str, int]:
        """How many graphs dynamo holds on each size class's entry: 1 each once compiled (what skipping the guards
        rests on)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return {size_class: len(_debug_get_cache_entry_list(entry._torchdynamo_orig_callable.__code__))
                for size_class, entry in self._entries.items()}

    def info(self) -> dict:
        return {"state": self.state, "max_bs": self.max_bs, "compiled_steps": self.steps, "graphs": self.graphs,
                "wrapper": _wrapper_name(self.wrappers, self.cpp_wrapper), "wrapper_why": self.wrapper_why,
                "guards": "inputs only" if self.skip_guards else "all", "guards_why": self.guards_why,
                "call": _call_name(self._direct, self.ready), "call_why": self.direct_why,
                "products": "C++ op" if self.native_products else "Python op", "products_why": self.products_why,
                "recompiles": self.recompiles, "compile_s": round(self.compile_s, 1),
                "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}


# The size classes, each compiled through its own entry (one token: torch specializes a size of 1)
SIZE_CLASSES = ("one token", "several tokens")


def own_code_object(fn: Callable) -> Callable:
    """A function that calls ``fn``, with a code object no other function has: what torch.compile keys its
    graphs (and their limits) by."""
    def entry(*args, **kwargs):
        return fn(*args, **kwargs)

    return types.FunctionType(entry.__code__.replace(), entry.__globals__, entry.__name__, entry.__defaults__,
                              entry.__closure__)


# The families whose compiled step tests/test_compiled_decode.py checks bit for bit with the guards skipped: what
# varies between their steps is the input tensors, which stay checked. Other models (--enable-torch-compile on any
# architecture) may keep state a guard watches, so they keep every guard.
GUARD_FREE_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def skip_guards_choice(env, architecture: str) -> tuple[bool, str]:
    """(whether steps after compile_now run only the guards on the input tensors, why)."""
    asked = override(env, "compile_guards")
    if asked is not None and asked[0] == "all":
        return False, f"{asked[1]}: dynamo checks every guard on every step"
    if architecture not in GUARD_FREE_FAMILIES:
        return False, f"{architecture or 'this model'} is not among the families tested with the guards skipped"
    import inspect

    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None or "skip_guard_eval_unsafe" not in inspect.signature(stance).parameters:
        return False, f"torch {torch.__version__} cannot skip guards (torch.compiler.set_stance, torch 2.6+)"
    return True, "each entry holds one graph: only its input tensors' guards run (compile_guards=all runs them all)"


# inductor's settings for the C++ wrapper: no size asserts (see the module doc)
CPP_WRAPPER_PATCHES = {"cpp_wrapper": True, "size_asserts": False}


def cpp_wrapper_choice(env, include_dir: str | None = None) -> tuple[bool, str]:
    """(whether inductor writes the step's wrapper in C++, why). It builds as a Python extension, so it needs
    Python.h where ``sysconfig`` says the headers are (``include_dir``: that folder, for tests)."""
    asked = override(env, "compile_wrapper")
    if asked is not None and asked[0] == "python":
        return False, asked[1]
    if include_dir is None:
        import sysconfig

        include_dir = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include_dir, "Python.h")):
        return False, (f"no Python.h in {include_dir or 'the interpreter include folder'}: the C++ wrapper builds as a "
                       "Python extension (install the Python development headers, e.g. python3-dev)")
    return True, "the step in one C++ function (compile_wrapper=python keeps the Python wrapper)"


def _wrapper_name(built: set[str], cpp_wrapper: bool) -> str:
    """What the graphs run through: "C++", "Python", or "mixed" when one size class fell back and the other not;
    before any graph, the wrapper the next one will be built with."""
    if not built:
        return "C++" if cpp_wrapper else "Python"
    return next(iter(built)) if len(built) == 1 else "mixed"


def _stack_output(hidden_states: torch.Tensor):
    """What the decoder stack returns around its hidden states (no cache: the pool is tierlm's)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return BaseModelOutputWithPast(last_hidden_state=hidden_states)


def _call_name(direct: dict, ready: bool) -> str:
    """How ready steps reach the graphs: "direct" for both size classes, "dynamo" for none, else "mixed"."""
    if not ready:
        return "not compiled"
    return "direct" if len(direct) == len(SIZE_CLASSES) else "mixed" if direct else "dynamo"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)
