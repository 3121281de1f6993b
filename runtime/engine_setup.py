"""Build an engine's parts from ServerArgs: model files, tokenizer, backend, KV pool sizing, caches, scheduler.

Every decision is logged with its reason (backend, dtype, pool sizes per tier) so a user can see why the
server looks the way it does.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tierlm.backends.base import ModelBackend, ModelInfo
from tierlm.runtime.errors import StartupError
from tierlm.runtime.kv_cache_manager import KVCacheManager
from tierlm.runtime.metrics import EngineMetrics
from tierlm.runtime.output_processor import OutputProcessor
from tierlm.runtime.scheduler import Scheduler
from tierlm.runtime.server_args import ServerArgs

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    args: ServerArgs
    model_dir: Path
    tokenizer: Any
    backend: ModelBackend
    cache: KVCacheManager
    scheduler: Scheduler
    metrics: EngineMetrics
    context_length: int
    decision: dict[str, Any] = field(default_factory=dict)

    @property
    def model_info(self) -> ModelInfo:
        return self.backend.info

    def describe(self) -> dict[str, Any]:
        acc = self.cache.accounting()
        kv_tok = self.backend.kv_bytes_per_token()
        return {
            "model_path": str(self.model_dir),
            "backend": self.backend.name,
            "device": self.backend.device,
            "dtype": self.model_info.dtype,
            "backend_decision": self.decision,
            "context_length": self.context_length,
            "architecture": self.model_info.architecture,
            "kv_pool": {**acc, "total_tokens": acc["total_pages"] * acc["page_size"],
                        "bytes_per_token": kv_tok, "total_bytes": kv_tok * acc["total_pages"] * acc["page_size"]},
            "tiers": self.cache.tiers_info(),
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
            "max_running_requests": self.scheduler.max_running,
            "chunked_prefill_size": self.scheduler.chunk,
            "radix_cache": self.cache.tree is not None,
        }

    def close(self) -> None:
        self.cache.close()


def choose_backend(args: ServerArgs, facts: Any) -> Any:
    """Backend + device with the reasons; the platform layer decides from the machine's facts."""
    from tierlm.platforms import choose_backend as decide

    try:
        return decide(facts, os.environ, args.device)
    except ValueError as e:  # BackendChoiceError says what to install or which flag to change
        raise StartupError(str(e)) from e


def load_backend(decision: Any, model_dir: Path, args: ServerArgs) -> ModelBackend:
    if decision.backend == "mlx":
        from tierlm.backends.mlx.backend import MLXBackend

        return MLXBackend(model_dir, dtype=args.dtype, seed=args.random_seed, device=decision.device)
    from tierlm.backends.torch.backend import TorchBackend

    return TorchBackend(model_dir, dtype=args.dtype, device=decision.device,
                        trust_remote_code=args.trust_remote_code, seed=args.random_seed)


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise StartupError(f"could not load a tokenizer from {path}: {e}. Pass --tokenizer-path to a folder "
                           "with tokenizer.json / tokenizer_config.json.") from e


def plan_tiers(args: ServerArgs, facts: Any, decision: Any, backend: ModelBackend, context_length: int
               ) -> tuple[int, int]:
    """Device (L1) and host (L2) pages from the platform's memory plan; logs the sizes and the reasons."""
    from tierlm.platforms.memory_plan import plan_memory_for_args

    try:
        plan = plan_memory_for_args(facts, decision, args, weight_bytes=backend.weight_bytes(),
                                    kv_bytes_per_token=backend.kv_bytes_per_token())
    except ValueError as e:  # MemoryPlanError carries the numbers and the flag to change
        raise StartupError(str(e)) from e
    for w in plan.warnings:
        log.warning(w)
    ps = args.page_size
    tokens, why = plan.device_kv_tokens, "; ".join(plan.reasons)
    if not args.max_total_tokens:
        # More than every running request at full context (x4 for cached prefixes) can never be used.
        cap = context_length * args.max_running_requests * 4
        if tokens > cap:
            tokens, why = cap, f"{why}; capped at 4 x context length x max running requests = {cap} tokens"
    pages = max(tokens // ps, 2)
    if pages * ps < context_length // 4:
        log.warning("the device KV pool holds only %d tokens (context length %d): long prompts will be refused",
                    pages * ps, context_length)
    kv = backend.kv_bytes_per_token()
    log.info("device KV pool (L1): %d pages x %d tokens = %d tokens, %.1f MiB (%s)", pages, ps, pages * ps,
             pages * ps * kv / 2**20, why)
    host_pages = 0
    if args.enable_hierarchical_cache:
        host_pages = plan.host_kv_tokens // ps
        if not args.hicache_size:  # the ratio follows the device pool actually allocated
            host_pages = min(host_pages, int(pages * args.hicache_ratio))
        if host_pages < 1:
            raise StartupError("the host KV pool would hold no pages; raise --hicache-ratio or --hicache-size")
    return pages, host_pages


def build_engine_parts(args: ServerArgs, emit: Callable) -> EngineParts:
    from tierlm.backends.model_files import resolve_model_path

    args.check()
    model_dir = resolve_model_path(args.model_path)
    if args.model_path is None:
        from tierlm.backends.demo_model import DEMO_MODEL_NOTICE

        log.warning(DEMO_MODEL_NOTICE)
    from tierlm.platforms import detect

    facts = detect()  # before the weights load, so the memory plan counts them once
    decision = choose_backend(args, facts)
    log.info("backend: %s on %s (%s)", decision.backend, decision.device, "; ".join(decision.reasons))
    tokenizer = load_tokenizer(Path(args.tokenizer_path) if args.tokenizer_path else model_dir,
                               args.trust_remote_code)
    backend = load_backend(decision, model_dir, args)
    info = backend.info
    log.info("model: %s (%s), %d layers, %d KV heads x %d dims, dtype %s, %.1f MiB of weights", model_dir,
             info.architecture, info.num_layers, info.num_kv_heads, info.head_dim, info.dtype,
             backend.weight_bytes() / 2**20)
    context_length = args.context_length or info.max_position_embeddings
    if args.context_length and args.context_length > info.max_position_embeddings:
        log.warning("--context-length %d exceeds the model's max_position_embeddings %d",
                    args.context_length, info.max_position_embeddings)
    num_pages, host_pages = plan_tiers(args, facts, decision, backend, context_length)
    backend.init_kv_pool(num_pages, args.page_size)
    metrics = EngineMetrics(args.model_name)
    eos = list(info.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    cache = make_cache_manager(args, backend, num_pages, host_pages, metrics)
    outputs = OutputProcessor(tokenizer, eos, metrics)
    scheduler = Scheduler(backend, cache, max_running_requests=args.max_running_requests,
                          chunked_prefill_size=args.chunked_prefill_size, metrics=metrics, outputs=outputs, emit=emit)
    parts = EngineParts(args, model_dir, tokenizer, backend, cache, scheduler, metrics, context_length,
                        decision.to_dict())
    _register_gauges(parts)
    if args.warmup:
        warm_up(parts)
    return parts


def make_cache_manager(args: ServerArgs, backend: ModelBackend, num_pages: int, host_pages: int,
                       metrics: EngineMetrics):
    if args.enable_hierarchical_cache:
        from tierlm.runtime.hicache.controller import HiCacheManager

        return HiCacheManager.create(args, backend, num_pages, host_pages, metrics)
    if args.hicache_storage_backend:
        raise StartupError("--hicache-storage-backend needs --enable-hierarchical-cache")
    return KVCacheManager(num_pages, args.page_size, enable_radix=not args.disable_radix_cache)


def _register_gauges(parts: EngineParts) -> None:
    m, c, s = parts.metrics, parts.cache, parts.scheduler
    m.gauge("tierlm_kv_pages_total", "Device KV pages", lambda: c.num_pages)
    m.gauge("tierlm_kv_pages_free", "Free device KV pages", lambda: c.allocator.num_free)
    m.gauge("tierlm_kv_pages_cached", "Device KV pages held by the radix cache",
            lambda: c.tree.device_pages_cached if c.tree else 0)
    m.gauge("tierlm_kv_pages_in_use", "Device KV pages held only by running requests", lambda: c.in_use_pages)
    m.gauge("tierlm_kv_pool_usage", "Share of device KV pages not free",
            lambda: 1.0 - c.allocator.num_free / max(c.num_pages, 1))
    tiers = {"device": lambda: c.evicted_device_pages}
    if hasattr(c.tree, "evicted_host_pages"):
        tiers["host"] = lambda: c.tree.evicted_host_pages
    if getattr(c, "storage", None) is not None:
        tiers["storage"] = lambda: c.storage.stats()["evictions"]
    m.tier_gauge("tierlm_cache_evicted_pages", "Pages evicted from each cache tier since start (device pages "
                 "demoted to host count here too)", tiers)
    m.gauge("tierlm_num_running_requests", "Running requests", lambda: len(s.running))
    m.gauge("tierlm_num_waiting_requests", "Waiting requests", lambda: len(s.waiting))


def warm_up(parts: EngineParts) -> None:
    """A few forwards straight through the backend (allocations, first-call overheads) before serving.

    It bypasses the scheduler so no request, cache entry or metric is left behind.
    """
    import numpy as np
    from tqdm import tqdm

    from tierlm.backends.base import ForwardBatch, SamplingBatch

    ps = parts.cache.page_size
    n = min(2 * ps, parts.cache.num_pages * ps - 1, 32)
    pages = np.arange(-(-(n + 1) // ps), dtype=np.int32)[None]
    steps = [(np.arange(n), n), (np.array([n]), n + 1)]  # one prefill, one decode
    for ids, kv in tqdm(steps, desc="warm-up", disable=os.environ.get("TIERLM_NO_PROGRESS") == "1"):
        q = len(ids)
        batch = ForwardBatch(input_ids=(ids % parts.model_info.vocab_size).astype(np.int64),
                             positions=np.arange(kv - q, kv, dtype=np.int64), q_lens=np.array([q], np.int32),
                             kv_lens=np.array([kv], np.int32), page_table=pages,
                             sample_indices=np.array([q - 1], np.int64), sampling=SamplingBatch.greedy(1),
                             page_size=ps)
        parts.backend.forward(batch)
