"""The builder: wires an engine together from ServerArgs by executing the load plan (runtime/load_plan.py).

    model source -> platform facts -> load plan (backend, attention, architecture, dtype, sizes, kernels,
    compiled decode, context length, tier sizes) -> tokenizer + chat format -> backend as planned
    -> pools at the planned sizes -> compiled decode if planned
    -> KV cache manager (radix, HiCache) -> output processor -> scheduler

Only this file and the plan name concrete backends (imported once chosen: torch or mlx may not be installed), the
model sources and the platform layer; the rest of runtime/ talks to a backend through ``backends/base.py``
(tests/test_layering.py holds it to that). Every decision is logged with its reason (backend, dtype, pool
sizes per tier) so a user can see why the server looks the way it does, and every failure a user can fix is a
StartupError that says how.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from tierlm.backends.base import Choice, GrammarBackend, HostStatePool, KVCacheDtypeError, ModelBackend, ModelInfo
from tierlm.backends.dtypes import DTYPE_BYTES
from tierlm.backends.model_source import ModelSourceError, resolve_model_path
from tierlm.backends.model_source.builtin_model import BUILTIN_MODEL_NOTICE
from tierlm.backends.model_source.chat_templates import resolve_chat_template
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.model_source.tokenizer import load_tokenizer
from tierlm.backends.verified_architectures import UnverifiedArchitectureError
from tierlm.backends.weight_format import WeightFormatError, WeightQuant
from tierlm.platforms import Decision, Facts, TierPlan, detect, this_cpu
from tierlm.platforms.memory_limits import bounded_by_cgroup, cgroup_memory
from tierlm.runtime.cache.hicache_manager import LAYOUTS, WRITE_POLICIES, HiCacheManager
from tierlm.runtime.cache.hiradix_cache import HiRadixCache
from tierlm.runtime.cache.kv_cache_manager import KVCacheManager
from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.radix_cache import RadixCache
from tierlm.runtime.cache.state_slots import StateSlots
from tierlm.runtime.cache.state_tiers import state_namespace_fields
from tierlm.runtime.cache.storage import registry as storage_registry
from tierlm.runtime.cache.storage.base import KVStorage
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.cache.storage.storage_io import DEFAULT_IO_TIMEOUT_S, DEFAULT_MAX_PENDING_WRITE_BYTES, StorageIO
from tierlm.runtime.cache.storage_prefetch import (PREFETCH_POLICIES, PREFETCH_TIMEOUT_BASE_S,
                                                   PREFETCH_TIMEOUT_PER_PAGE_S)
from tierlm.runtime.chat_format import ChatFormat
from tierlm.runtime.errors import StartupError
from tierlm.runtime.load_plan import (LoadPlan, chat_format_for, check_context_length, choose_dtype, compile_for_loaded,
                                      plan_load, resolve_attention_backend, size_tiers, weight_quant_for)
from tierlm.runtime.grammar.manager import GrammarManager
from tierlm.runtime.io_struct import GenerateOutput
from tierlm.runtime.metrics import EngineMetrics
from tierlm.runtime.output_processor import OutputProcessor
from tierlm.runtime.request import Req
from tierlm.runtime.scheduler import Scheduler
from tierlm.runtime.server_args import ServerArgs
from tierlm.runtime.speculative.speculator import NgramSpeculator
from tierlm.runtime.tokenizer_protocol import Tokenizer
from tierlm.runtime.warm_up import warm_up

IO_BACKEND_MEANING = {"kernel": "pages move as one batched gather and one copy per direction",
                      "direct": "pages move one copy per page and layer, no staging"}
DEFAULT_DECODE_GRAPH_MAX_BS = 32  # --cuda-graph-max-bs unset: the buckets cover up to this many running requests

log = logging.getLogger(__name__)

Emit = Callable[[Req, GenerateOutput], None]


@dataclass
class TierSizes:
    device_pages: int  # L1
    host_pages: int  # L2; 0 without --enable-hierarchical-cache
    state_slots: int = 0  # hybrid models: recurrent-state slots, one per running request
    host_state_slots: int = 0  # hybrid models with HiCache: host (L2) snapshot slots


@dataclass
class EngineParts:
    args: ServerArgs
    folder: ModelFolder
    tokenizer: Tokenizer
    backend: ModelBackend
    cache: KVCacheManager
    scheduler: Scheduler
    metrics: EngineMetrics
    context_length: int
    decision: Decision
    architecture_verified: bool = True  # False: loaded only because of --trust-unverified-architecture
    warnings: list[str] = field(default_factory=list)  # shown in /server_info (and logged at startup)
    chat_format: ChatFormat = field(default_factory=ChatFormat)  # template, parsers and why: choose_chat_format
    attention: tuple[str, str] = ("", "")  # (attention implementation, why): the load plan's
    dtype_reason: str = ""  # why the model computes in its dtype: the load plan's (its backend's part)
    decode_graphs: dict[str, Any] | None = None  # the static decode path (buckets, captured sizes, why): setup_decode_graphs
    torch_compile: dict[str, Any] | None = None  # compiled decode as set up (or why not): run_compile_plan

    @property
    def grammar(self) -> GrammarManager:
        return self.scheduler.grammar

    @property
    def model_info(self) -> ModelInfo:
        return self.backend.info

    def describe(self) -> dict[str, Any]:
        acc = self.cache.accounting()
        kv_tok = self.backend.kv_bytes_per_token()
        return {
            "model_path": str(self.folder.path),
            "backend": self.backend.name,
            "device": self.backend.device,
            "dtype": self.model_info.dtype,
            "dtype_chosen_by": self.dtype_reason,
            "weight_format": self.model_info.weight_format,  # backends/weight_format.py; also in the L3 namespace
            "weight_bytes": self.backend.weight_bytes(),  # resident: quantized tensors at their packed size
            "weight_bytes_per_token": self.backend.weight_bytes_per_token(),  # what one decode stream reads
            "backend_decision": self.decision.to_dict(),
            "context_length": self.context_length,
            "architecture": self.model_info.architecture,
            "architecture_verified": self.architecture_verified,
            "warnings": list(self.warnings),
            "kv_pool": {**acc, "kv_dtype": self.model_info.kv_dtype,
                        "total_tokens": acc["total_pages"] * acc["page_size"],
                        "bytes_per_token": kv_tok, "total_bytes": kv_tok * acc["total_pages"] * acc["page_size"]},
            "tiers": self.cache.tiers_info(),
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
            "max_running_requests": self.scheduler.max_running,
            "chunked_prefill_size": self.scheduler.chunk,
            "prefill_budget_tokens": self.scheduler.prefill_budget,
            "radix_cache": self.cache.tree is not None,
            "pins": self.cache.pins_info(),  # prompt-caching pins: pinned pages and the bound per tier
            "state_pool": self.cache.state_accounting(),  # hybrids: free + cached + in_use == total; else None
            "grammar_backend": self.grammar.backend.name if self.grammar.backend else None,
            "grammar_cache": self.grammar.cache_info(),
            "chat_template": self.chat_format.chat_template_source,
            "reasoning_parser": {"name": self.chat_format.reasoning_parser,
                                 "chosen_by": self.chat_format.reasoning_parser_source},
            "tool_call_parser": {"name": self.chat_format.tool_call_parser,
                                 "chosen_by": self.chat_format.tool_call_parser_source},
            "speculative": self.scheduler.spec.info() if self.scheduler.spec is not None else None,
            "attention_backend": {"name": self.attention[0], "chosen_by": self.attention[1]},
            "decode_graphs": self.decode_graphs_info(),
            "torch_compile": {**self.torch_compile, **(self.backend.torch_compile_stats() or {})}
            if self.torch_compile else None,
            "kernels": self.backend.kernels(),
            "cpu": this_cpu().to_dict() if self.backend.device == "cpu" else None,
        }

    def decode_graphs_info(self) -> dict[str, Any] | None:
        """The static decode path as set up, with its live step counts."""
        stats = self.backend.decode_graph_stats()
        if self.decode_graphs is None or stats is None:
            return self.decode_graphs
        return {**self.decode_graphs, **stats}

    def close(self) -> None:
        self.cache.close()
        self.grammar.close()


def build_engine_parts(args: ServerArgs, emit: Emit) -> EngineParts:
    """Plan the launch (runtime/load_plan.py), then build it as planned: the tokenizer, the backend with the
    plan's dtype and attention, the pools at the plan's tier sizes, the compiled decode step if planned, the
    cache manager, the scheduler."""
    try:
        args.check()  # the CLI checked already; settings built in code are checked here
    except ValueError as e:
        raise StartupError(str(e)) from e
    folder = resolve_model(args)  # config.json and the rest read here, once
    facts = ram_bound(detect())  # before the weights load, so the memory plan counts them once
    plan = plan_load(args, facts, folder, os.environ)  # every refusal here: before the tokenizer and weights
    decision = plan.decision
    log.info("backend: %s on %s (%s)", decision.backend, decision.device, "; ".join(decision.reasons))
    log_attention(args, plan.attention)
    log_accepted_flags(args, decision)
    tokenizer, template_source = tokenizer_for(args, folder.path)
    chat_format = choose_chat_format(args, folder, tokenizer, template_source)
    plan = replace(plan, chat_format=chat_format)
    log.info("dtype: %s (%s)", plan.dtype, plan.backend.dtype.why)
    backend = load_backend(decision, folder, args, plan.attention.value, plan.dtype, plan.quant)
    info = backend.info
    log.info("model: %s (%s), %d layers, %d KV heads x %d dims, dtype %s, %.1f MiB of weights", folder.path,
             info.architecture, info.num_layers, info.num_kv_heads, info.head_dim, info.dtype,
             backend.weight_bytes() / 2**20)
    context_length, tier_plan = loaded_tiers(plan, args, facts, backend)
    tiers = log_tiers(args, facts, backend, context_length, tier_plan)
    backend.init_kv_pool(tiers.device_pages, args.page_size)
    backend.init_state_pool(tiers.state_slots)
    decode_graphs = setup_decode_graphs(args, backend, decision, context_length)
    torch_compile = run_compile_plan(compile_for_loaded(plan, backend.weight_bytes(), info.weight_format), args,
                                     backend)
    metrics = EngineMetrics(args.model_name)
    if args.enable_hierarchical_cache:
        backend.set_host_io_backend(args.hicache_io_backend)
    cache = make_cache_manager(args, backend, tiers)
    cache.set_pin_fraction(args.cache_pin_fraction)
    cache.register_gauges(metrics)
    commit_host_pool(cache)
    stop_ids = stop_token_ids(info, tokenizer, chat_format.extra_stop_tokens)
    outputs = OutputProcessor(tokenizer, stop_ids, metrics)
    grammar = GrammarManager(make_grammar_backend(args, tokenizer, info, stop_ids),
                             cache_bytes=args.grammar_cache_mb * 2**20, compile_timeout_s=args.grammar_compile_timeout)
    grammar.register_gauges(metrics)
    scheduler = Scheduler(backend, cache, max_running_requests=args.max_running_requests,
                          chunked_prefill_size=args.chunked_prefill_size, metrics=metrics, outputs=outputs, emit=emit,
                          grammar=grammar, max_prefill_tokens=args.max_prefill_tokens,
                          stream_interval=args.stream_interval, schedule_policy=args.schedule_policy,
                          random_seed=args.random_seed, speculator=NgramSpeculator.create(args, metrics))
    scheduler.register_gauges(metrics)
    arch = plan.architecture
    parts = EngineParts(args, folder, tokenizer, backend, cache, scheduler, metrics, context_length, decision,
                        architecture_verified=arch.verified, warnings=[arch.warning] if arch.warning else [],
                        chat_format=chat_format, attention=(plan.attention.value, plan.attention.why),
                        dtype_reason=plan.backend.dtype.why, decode_graphs=decode_graphs, torch_compile=torch_compile)
    if args.warmup:
        warm_up(backend, cache.page_size, cache.num_pages)
        if scheduler.spec is not None:
            scheduler.spec.measure_cost(backend, cache.page_size, cache.num_pages)
    return parts


def loaded_tiers(plan: LoadPlan, args: ServerArgs, facts: Facts, backend: ModelBackend) -> tuple[int, TierPlan]:
    """The plan's context length and tier sizes, as planned where the loaded model is the one the folder
    described; sized again from the loaded model (logged) where it is not: a config.json that leaves
    max_position_embeddings to the model class's default, or a format the folder count does not know."""
    info, sizes = backend.info, plan.backend.sizes
    measured = (backend.weight_bytes(), backend.kv_bytes_per_token(),
                backend.info.state.slot_bytes if backend.info.state else 0)
    context_length = plan.context_length.value
    if info.max_position_embeddings != plan.model_max:  # the model class's default where config.json names none
        context_length = check_context_length(args.context_length, info.max_position_embeddings, os.environ)
        log.info("context length: %d (the loaded model's max_position_embeddings is %d; config.json names %s)",
                 context_length, info.max_position_embeddings, plan.model_max or "none")
    planned = None if sizes is None else (sizes.weight_bytes, sizes.kv_bytes_per_token, sizes.state_slot_bytes)
    if plan.tiers is not None and planned == measured and context_length == plan.context_length.value:
        return context_length, plan.tiers
    if planned is not None and planned != measured:
        log.info("memory plan: sized from the loaded model (%d weight bytes, %d KV bytes/token, %d state bytes/slot) "
                 "where the folder counted %d, %d, %d", *measured, *planned)
    return context_length, size_tiers(args, facts, plan.decision, measured[0], measured[1], context_length,
                                      measured[2])


def run_compile_plan(choice: Choice[bool], args: ServerArgs, backend: ModelBackend) -> dict[str, Any]:
    """Compile the decode step now if the plan says so, before ready (minutes on a first start, seconds from
    inductor's disk cache after). The flag's failure stops startup with the reason; the default's leaves the
    server serving eagerly with a warning. /server_info adds the backend's live numbers (torch_compile_stats)."""
    chosen_by = "--enable-torch-compile" if args.enable_torch_compile else "default"
    if args.enable_torch_compile:
        try:
            backend.init_torch_compile(args.torch_compile_max_bs)
        except ValueError as e:
            raise StartupError(str(e)) from e
        except Exception as e:  # inductor needs a C++ compiler and a working toolchain: say so, not a traceback
            raise StartupError(f"--enable-torch-compile: compiling the decode step failed ({_first_line(e)}); "
                               "check that a C++ compiler (g++) is installed, or drop the flag") from e
        return {"enabled": True, "chosen_by": chosen_by, "why": choice.why}
    if not choice.value:
        log.info("torch.compile: decode steps run eagerly (%s)", choice.why)
        return {"enabled": False, "chosen_by": chosen_by, "why": choice.why}
    log.info("torch.compile: compiling the decode step before serving (%s)", choice.why)
    try:
        backend.init_torch_compile(args.torch_compile_max_bs)
    except Exception as e:  # the eager path serves as well; only slower
        log.warning("torch.compile: compiling the decode step failed (%s); decode steps run eagerly. Install a C++ "
                    "compiler (g++) for the compiled step, or set TIERLM_CPU_PLAN=compile=no to skip the attempt",
                    _first_line(e))
        return {"enabled": False, "chosen_by": chosen_by, "why": f"compiling failed: {_first_line(e)}"}
    return {"enabled": True, "chosen_by": chosen_by, "why": choice.why}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else repr(e)}"


def ram_bound(facts: Facts) -> Facts:
    """The RAM facts narrowed to this process's memory cgroup (a container's limit), logged when it applies: the
    memory plan must size the pools from the memory this process may use, not from the machine's."""
    facts, why = bounded_by_cgroup(facts, cgroup_memory())
    if why:
        log.info("memory: %s", why)
    return facts


def commit_host_pool(cache: KVCacheManager) -> None:
    """Wait until the host (L2) pool's pages are faulted in, before the server reports ready: memory promised to
    a pool but not yet touched does not show as used, so another instance started after this one said "ready"
    would size itself from RAM this one is about to take (issue 33: the OOM killer then took the first)."""
    if not isinstance(cache, HiCacheManager):
        return
    pools = [cache.host] + ([cache.states.host] if cache.states is not None else [])  # hybrids: the state pool too
    if all(p.faulted_in.is_set() for p in pools):
        return
    t0 = time.monotonic()
    for pool in pools:
        pool.faulted_in.wait()  # set by the prefault thread however it ends (backends/host_memory.py)
    log.info("host KV pool committed (%.0f MiB faulted in) in %.2f s, before reporting ready",
             sum(p.total_bytes for p in pools) / 2**20, time.monotonic() - t0)


def log_attention(args: ServerArgs, choice: Choice[str]) -> None:
    name = choice.value
    log.info("attention: %s (%s)", name if args.attention_backend in (None, name) else
             f"{args.attention_backend} = {name}", choice.why)


def setup_decode_graphs(args: ServerArgs, backend: ModelBackend, decision: Decision, context_length: int
                        ) -> dict[str, Any] | None:
    """The static, bucketed decode path (backends/torch/decode_graphs.py), decided and logged with the reason:
    on CUDA captured as CUDA graphs (--attention-backend triton) unless --disable-cuda-graph; on CPU only when
    --cuda-graph-max-bs asks for it (no capture there, so it saves nothing: it is how the CPU tests run the path)."""
    if args.disable_cuda_graph:
        log.info("decode graphs: off (--disable-cuda-graph)")
        return {"enabled": False, "why": "--disable-cuda-graph"}
    if decision.device != "cuda" and args.cuda_graph_max_bs is None:
        return None  # the plain path: nothing to log on CPU and MLX
    max_bs = args.cuda_graph_max_bs or min(DEFAULT_DECODE_GRAPH_MAX_BS, args.max_running_requests)
    capture = decision.device == "cuda"
    info = backend.init_decode_graphs(max_bs, context_length, capture)
    if info is None:
        log.info("decode graphs: not available on the %s backend for this model", backend.name)
        return {"enabled": False, "why": f"not available on the {backend.name} backend for this model"}
    why = ("captured as CUDA graphs" if info["captured"] else
           "on static buffers without capture (--attention-backend triton is what CUDA graphs capture)"
           if capture else f"on static buffers without capture: --cuda-graph-max-bs on {decision.device}")
    log.info("decode graphs: decode steps of up to %d requests padded to buckets %s, %s", max_bs, info["buckets"], why)
    return {"enabled": True, "why": why, "max_bs": max_bs}


def log_accepted_flags(args: ServerArgs, decision: Decision) -> None:
    """SGLang flags that are accepted because tierlm already behaves that way, or has nothing to tune yet."""
    if args.enable_metrics:
        log.info("--enable-metrics: accepted; /metrics is always on")
    if args.enable_cache_report:
        log.info("--enable-cache-report: accepted; usage always reports cached_tokens")
    for flag, what in args.accepted_sglang_flags.items():
        log.info("%s: accepted; %s", flag, what)
    if args.enable_hierarchical_cache:
        if decision.backend == "mlx":
            log.info("--hicache-io-backend %s: on MLX kernel and direct are the same copy (the device and host pools "
                     "are both in host memory)", args.hicache_io_backend)
        elif decision.device == "cpu":
            log.info("--hicache-io-backend %s: %s; on CPU both are memory copies", args.hicache_io_backend,
                     IO_BACKEND_MEANING[args.hicache_io_backend])
        else:
            log.info("--hicache-io-backend %s: %s, between the GPU and the host pool registered as pinned memory, "
                     "loads on a copy stream", args.hicache_io_backend, IO_BACKEND_MEANING[args.hicache_io_backend])


def resolve_model(args: ServerArgs) -> ModelFolder:
    """--model-path as a local folder, read once (config.json, generation_config.json, the weight files)."""
    try:
        model_dir = resolve_model_path(args.model_path, revision=args.revision,
                                       cache_dir=Path(args.download_dir).expanduser() if args.download_dir else None)
    except ModelSourceError as e:  # the message says what to do
        raise StartupError(str(e)) from e
    if args.model_path is None:
        log.info(BUILTIN_MODEL_NOTICE)
    return ModelFolder.read(model_dir)


def tokenizer_for(args: ServerArgs, model_dir: Path) -> tuple[Tokenizer, str | None]:
    """The tokenizer, with --chat-template (checked first: a missing file or a jinja syntax error stops startup
    with the reason) replacing the model's template; and where the template comes from (None: nowhere)."""
    try:
        template, source = resolve_chat_template(args.chat_template) if args.chat_template else (None, None)
        tokenizer = load_tokenizer(Path(args.tokenizer_path) if args.tokenizer_path else model_dir,
                                   args.trust_remote_code, chat_template=template)
    except ModelSourceError as e:
        raise StartupError(str(e)) from e
    if source is not None:
        log.info("chat template: %s (--chat-template)", source)
    elif getattr(tokenizer, "chat_template", None):
        source = "the model's tokenizer"
    else:
        log.info("chat template: none (the model has none; /v1/chat/completions needs --chat-template)")
    return tokenizer, source


def choose_chat_format(args: ServerArgs, folder: ModelFolder, tokenizer: Tokenizer, template_source: str | None
                       ) -> ChatFormat:
    """The chat format from the loaded tokenizer's template (runtime/load_plan.chat_format_for), each parser logged
    with why (/server_info shows it)."""
    template = getattr(tokenizer, "chat_template", None)  # a transformers tokenizer may have none
    fmt = chat_format_for(args, folder, str(template) if template else None, template_source)
    log.info("reasoning parser: %s (%s)", fmt.reasoning_parser or "none", fmt.reasoning_parser_source)
    log.info("tool-call parser: %s (%s)", fmt.tool_call_parser or "none", fmt.tool_call_parser_source)
    return fmt


def load_backend(decision: Decision, folder: ModelFolder, args: ServerArgs, attention_backend: str | None = None,
                 dtype: str | None = None, quant: WeightQuant | None = None) -> ModelBackend:
    """The chosen backend with the model's weights loaded. ``attention_backend``, ``dtype``, ``quant``: the load
    plan's (planned here from the flags when not given)."""
    if attention_backend is None:
        attention_backend = resolve_attention_backend(args, decision, os.environ)[0]
    if dtype is None:
        dtype = choose_dtype(args, decision, folder, os.environ)[0]
    if quant is None:
        quant = weight_quant_for(args, decision.backend)
    try:
        if decision.backend == "mlx":
            from tierlm.backends.mlx.backend import MLXBackend

            return MLXBackend(folder, dtype=args.dtype, seed=args.random_seed, device=decision.device,
                              trust_unverified_architecture=args.trust_unverified_architecture,
                              kv_cache_dtype=args.kv_cache_dtype, weight_quant=quant)
        from tierlm.backends.torch.backend import TorchBackend

        return TorchBackend(folder, dtype=dtype, device=decision.device,
                            trust_remote_code=args.trust_remote_code, seed=args.random_seed,
                            trust_unverified_architecture=args.trust_unverified_architecture,
                            kv_cache_dtype=args.kv_cache_dtype, attention_backend=attention_backend,
                            weight_quant=quant)
    except (UnverifiedArchitectureError, KVCacheDtypeError, WeightFormatError) as e:  # the message names the fix
        raise StartupError(str(e)) from e


def log_tiers(args: ServerArgs, facts: Facts, backend: ModelBackend, context_length: int, plan: TierPlan
              ) -> TierSizes:
    """The tier sizes as the pools will be allocated, with the budget's inputs and the reasons."""
    for w in plan.warnings:
        log.warning(w)
    log.info("KV budget inputs: RAM %.2f GB total, %.2f GB available at sizing time (memory other instances have "
             "committed counts as used), weights %.1f MiB, %d KV bytes/token, context length %d, max running requests "
             "%d, page size %d; --mem-fraction-static %s, --max-total-tokens %s, HiCache %s -> device KV %.1f MiB, "
             "host KV %.1f MiB", facts.ram_total_bytes / 1e9, facts.ram_available_bytes / 1e9,
             backend.weight_bytes() / 2**20, backend.kv_bytes_per_token(), context_length, args.max_running_requests,
             args.page_size, args.mem_fraction_static, args.max_total_tokens,
             (f"ratio {args.hicache_ratio:g}" if not args.hicache_size else f"size {args.hicache_size:g} GB")
             if args.enable_hierarchical_cache else "off", plan.device_bytes / 2**20, plan.host_bytes / 2**20)
    log.info("device KV pool (L1): %d pages x %d tokens = %d tokens, %.1f MiB, KV %s (%s)", plan.device_pages,
             plan.page_size, plan.device_tokens, plan.device_bytes / 2**20, kv_dtype_note(backend.info),
             "; ".join(plan.reasons))
    if plan.state_slots:
        log.info("state pool: %d recurrent-state slots (live + snapshots), %.1f MiB", plan.state_slots,
                 plan.state_bytes / 2**20)
    # make_hicache_manager logs the host pools
    assert plan.device_pages is not None and plan.host_pages is not None  # sized in tokens: KV bytes/token known
    return TierSizes(plan.device_pages, plan.host_pages, plan.state_slots, plan.host_state_slots)


def kv_dtype_note(info: ModelInfo) -> str:
    """The KV storage dtype and how it compares, e.g. "fp8_e4m3 (half the bytes of bfloat16; ...)"."""
    kv = info.kv_dtype
    if kv == info.dtype:
        return f"{kv} (the model's dtype)"
    ratio = DTYPE_BYTES[kv] / DTYPE_BYTES["bfloat16"]
    vs = {0.5: "half the bytes of bfloat16", 1.0: "the bytes of bfloat16"}.get(ratio, f"{ratio:g}x bfloat16's bytes")
    return f"{kv} ({vs}; the model computes in {info.dtype})"


def make_cache_manager(args: ServerArgs, backend: ModelBackend, tiers: TierSizes) -> KVCacheManager:
    """The device pool and the radix tree over it (built here and handed to the manager), plus HiCache's host
    pool and L3 store when the flags ask for them."""
    allocator = PageAllocator(tiers.device_pages)
    if args.enable_hierarchical_cache:
        return make_hicache_manager(args, backend, tiers, allocator)
    ps = args.page_size
    tree = None if args.disable_radix_cache else RadixCache(ps, allocator.free, args.radix_eviction_policy)
    if tiers.state_slots:  # a hybrid model: prefix reuse up to state snapshots (runtime/cache/state_snapshots.py)
        cache = KVCacheManager(allocator, ps, tree, state_slots=StateSlots(tiers.state_slots),
                               copy_state_slots=backend.copy_state_slots)
        log.info("radix cache for this hybrid model: %s", "prefixes reused up to the deepest page-aligned state "
                 "snapshot" if tree is not None else "off (--disable-radix-cache): every prompt is prefilled")
    else:
        cache = KVCacheManager(allocator, ps, tree)
    if tree is not None:
        log.info("radix cache: eviction policy %s (--radix-eviction-policy)", args.radix_eviction_policy)
    return cache


def make_hicache_manager(args: ServerArgs, backend: ModelBackend, tiers: TierSizes, allocator: PageAllocator
                         ) -> HiCacheManager:
    """HiCache from the flags: a HiRadixCache over ``allocator``, ``tiers.host_pages`` host pages (and for a
    hybrid model ``tiers.state_slots``, ``tiers.host_state_slots``) from the memory plan, the L3 store if set."""
    check_hicache_flags(args)
    ps = args.page_size
    hybrid = backend.info.state is not None and tiers.state_slots > 0
    storage = storage_io = state_storage = None
    timeout = (PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_PAGE_S)
    if args.hicache_storage_backend:
        storage, storage_io, timeout, state_storage = open_storage_tier(args, backend, hybrid)
    mgr = HiCacheManager(backend, allocator, ps, HiRadixCache(ps, allocator.free, args.radix_eviction_policy),
                         tiers.host_pages, write_policy=args.hicache_write_policy, layout=args.hicache_mem_layout,
                         storage=storage, storage_io=storage_io, prefetch_policy=args.hicache_storage_prefetch_policy,
                         prefetch_timeout=timeout, state_slots=StateSlots(tiers.state_slots) if hybrid else None,
                         host_state_slots=tiers.host_state_slots, state_storage=state_storage)
    log_hicache(args, mgr)
    return mgr


def check_hicache_flags(args: ServerArgs) -> None:
    """StartupError naming the flag unless each HiCache choice is one tierlm has."""
    for name, value, allowed in (("--hicache-write-policy", args.hicache_write_policy, WRITE_POLICIES),
                                 ("--hicache-storage-prefetch-policy", args.hicache_storage_prefetch_policy,
                                  PREFETCH_POLICIES),
                                 ("--hicache-mem-layout", args.hicache_mem_layout, LAYOUTS),
                                 ("--hicache-io-backend", args.hicache_io_backend, ("kernel", "direct"))):
        if value not in allowed:
            raise StartupError(f"{name} {value!r} is not one of {', '.join(allowed)}")


def log_hicache(args: ServerArgs, mgr: HiCacheManager) -> None:
    """The host pools and the L3 store, as sized and opened."""
    ps = args.page_size
    if mgr.states is not None:
        hs = mgr.states.host
        log.info("HiCache host state pool (L2): %d snapshot slots x %.2f MiB = %.1f MiB%s", hs.num_slots,
                 hs.slot_bytes / 2**20, hs.total_bytes / 2**20,
                 "; snapshots also stored in L3 beside the pages" if mgr.states.storage is not None else "")
    log.info("HiCache host pool (L2): %d pages x %d tokens = %d tokens, %.1f MiB, layout %s, write policy %s, "
             "eviction policy %s (--radix-eviction-policy, device and host tiers)", mgr.host.num_pages, ps,
             mgr.host.num_pages * ps, mgr.host.total_bytes / 2**20, mgr.host.layout, args.hicache_write_policy,
             args.radix_eviction_policy)
    if mgr.storage is not None:
        assert mgr.storage_io is not None  # a store always comes with its I/O threads
        st = mgr.storage.stats()
        log.info("HiCache storage (L3): %s backend at %s, %d pages already stored (%.1f MiB), "
                 "prefetch policy %s, I/O time limit %g s", args.hicache_storage_backend, mgr.storage.location,
                 st.get("files", 0), st.get("bytes", 0) / 2**20, args.hicache_storage_prefetch_policy,
                 mgr.storage_io.io_timeout_s)


def open_storage_tier(args: ServerArgs, backend: ModelBackend, hybrid: bool = False
                      ) -> tuple[KVStorage, StorageIO, tuple[float, float], tuple[KVStorage, StorageIO] | None]:
    """--hicache-storage-backend's store and its I/O threads, the prefetch timeout (base, per page) from the
    extra-config, and for a hybrid model the store of its state snapshots."""
    try:
        cfg = storage_registry.parse_extra_config(args.hicache_storage_backend_extra_config)
    except ValueError as e:
        raise StartupError(f"--hicache-storage-backend-extra-config: {e}") from e
    # the manager's own keys; the rest goes to the store
    timeout = (float(cfg.pop("prefetch_timeout_base", PREFETCH_TIMEOUT_BASE_S)),
               float(cfg.pop("prefetch_timeout_per_page", PREFETCH_TIMEOUT_PER_PAGE_S)))
    io_timeout = cfg.setdefault("io_timeout", DEFAULT_IO_TIMEOUT_S)  # stays: a store opens under it too
    if isinstance(io_timeout, bool) or not isinstance(io_timeout, (int, float)) or not io_timeout > 0:
        raise StartupError("--hicache-storage-backend-extra-config: io_timeout (time limit of one L3 read or write) "
                           f"must be a positive number of seconds, got {io_timeout!r}")
    name, page_bytes = args.hicache_storage_backend, backend.kv_bytes_per_token() * args.page_size
    assert name is not None  # called only with --hicache-storage-backend
    # Host pages are always written to L3 in page-first byte order, whatever the host layout.
    ns = StorageNamespace.from_fields({**backend.kv_namespace(), "page_size": args.page_size, "layout": "page_first"})
    state_cfg = dict(cfg)  # as the page store gets it
    storage = storage_registry.open_storage(name, ns, page_bytes, cfg)
    io = StorageIO(storage, num_threads=1, max_pending_write_bytes=write_backlog(page_bytes), io_timeout_s=io_timeout)
    state_storage = None
    if hybrid:  # snapshots: a second store of the same backend, in a namespace of their own (state_tiers.py)
        assert backend.info.state is not None  # hybrid: the model has a recurrent state
        slot_bytes = HostStatePool(0, backend.info.state).slot_bytes
        state_ns = StorageNamespace.from_fields(state_namespace_fields(backend, args.page_size))
        st = storage_registry.open_storage(name, state_ns, slot_bytes, state_cfg)
        state_storage = (st, StorageIO(st, num_threads=1, max_pending_write_bytes=write_backlog(slot_bytes),
                                       io_timeout_s=io_timeout))
    return storage, io, timeout, state_storage


def write_backlog(entry_bytes: int) -> int:
    """The L3 write backlog holds page copies: 256 MiB, or 16 entries where entries are larger than 16 MiB."""
    return max(DEFAULT_MAX_PENDING_WRITE_BYTES, 16 * entry_bytes)


def make_grammar_backend(args: ServerArgs, tokenizer: Tokenizer, info: ModelInfo, stop_ids: list[int]
                         ) -> GrammarBackend | None:
    """xgrammar over the model's tokenizer and the logits' width (ModelInfo.vocab_size), ending at ``stop_ids``
    (stop_token_ids); None for --grammar-backend none (every grammar is then refused with a 400)."""
    if args.grammar_backend == "none":
        log.info("structured output: off (--grammar-backend none)")
        return None
    try:
        from tierlm.backends.grammar.xgrammar_backend import XGrammarBackend
    except ImportError as e:
        raise StartupError(f"--grammar-backend xgrammar needs the xgrammar package ({e}); install it with "
                           "`pip install xgrammar`, or start with --grammar-backend none") from e
    # the loaded tokenizer is a transformers one; Tokenizer is the protocol the runtime sees of it
    backend = XGrammarBackend(tokenizer, info.vocab_size, stop_ids)  # type: ignore[arg-type]
    log.info("structured output: xgrammar (%d-token vocabulary)", info.vocab_size)
    return backend


def stop_token_ids(info: ModelInfo, tokenizer: Tokenizer, extra_stop_tokens: tuple[str, ...] = ()) -> list[int]:
    """The model's EOS ids (generation_config, config), plus the tokenizer's eos token when it names another, plus
    the chat format's extra stop tokens (gpt-oss's <|return|> and <|call|>: the released generation_config lists
    them; a copy that does not still stops there)."""
    eos = list(info.eos_token_ids)
    extra = [getattr(tokenizer, "eos_token_id", None)]
    if extra_stop_tokens:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        extra += [vocab.get(t) for t in extra_stop_tokens]
    for tok in extra:
        if tok is not None and tok not in eos:
            eos.append(tok)
    return eos
