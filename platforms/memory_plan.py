"""Size the device (L1) and host (L2) KV tiers for the memory this machine really has.

Three cases, decided by the backend's device and the facts:
- discrete GPU (torch on CUDA, own memory): as SGLang. L1 = free GPU memory - weights - (1 - f) x total GPU
  memory, f = --mem-fraction-static; L2 = --hicache-ratio x L1 (or --hicache-size GB) from host RAM, which
  must fit the RAM available minus a headroom, else an error with the numbers.
- unified memory (Apple Silicon, DGX Spark GB10, Jetson): L1 and L2 share one physical pool, so one budget:
  weights + L1 + L2 + headroom <= the OS's available memory. On GB10 CUDA's free figure excludes the page
  cache and NVML reports no memory, so the OS figure is the only honest one. A --hicache-ratio (or size)
  that would overcommit is reduced, with a warning showing the numbers.
- CPU: L1 and L2 both live in RAM, sized from the same budget; explicit settings that do not fit are an
  error with the numbers and the fix. The default leaves room for what else runs (another tierlm instance,
  a Mooncake store): L1 + L2 at most DEFAULT_CPU_KV_SHARE of total RAM, and L1 at most context length x max
  running requests (what running requests can ever use; the prefix cache beyond that is L2's job). The
  available figure it starts from must count other pools already promised: serve commits its pools before it
  reports ready, so an instance started after it sees them as used.

Facts must be detected *before* the weights are loaded: the weights are subtracted here.
Pure: no probing, no allocation. Sizes in messages are GB = 1e9 bytes, as SGLang prints them.

`size_kv_tiers` is the one function that turns facts, decision, launch flags and the model's sizes into the
pages a launch allocates: `tierlm serve` (runtime/load_plan.size_tiers) allocates what it returns and
`tierlm doctor` reports what it returns, so the two never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tierlm.platforms.backend_choice import Decision
from tierlm.platforms.facts import ACCELERATOR_APPLE, Facts

GiB = 1024**3
GB = 1e9
HEADROOM_SHARE = 0.10  # of total RAM kept free for the OS, activations and everything else...
HEADROOM_MIN = 1 * GiB  # ...at least this much...
HEADROOM_MAX = 10 * GiB  # ...and at most SGLang's fixed 10 GiB host reserve.
DEFAULT_UNIFIED_FRACTION = 0.80  # weights + L1 share of available memory on unified machines
DEFAULT_CPU_FRACTION = 0.40  # CPU decode is slow; a larger pool mostly pins RAM the rest of the box needs
DEFAULT_CPU_KV_SHARE = 0.25  # CPU default: device + host KV together at most this share of total RAM
GPU_RESERVE_FIXED = 1 * GiB  # CUDA context, cuBLAS workspace...
GPU_RESERVE_SHARE = 0.10  # ...plus activations and graphs, as a share of GPU memory
CONTEXT_CAP_FACTOR = 4  # without --max-total-tokens: device KV <= 4 x context length x max running requests
CPU_CONTEXT_CAP_FACTOR = 1  # ...on CPU by default: no more than the running requests can ever use
MIN_DEVICE_PAGES = 2  # the smallest device pool a launch allocates

KIND_DISCRETE = "discrete"
KIND_UNIFIED = "unified"
KIND_CPU = "cpu"


class MemoryPlanError(ValueError):
    """The tiers cannot be sized as configured; the message carries the numbers and the flag to change."""


@dataclass(frozen=True)
class MemoryPlan:
    memory_kind: str  # "discrete" | "unified" | "cpu"
    device_kv_tokens: int  # L1, a multiple of page_size
    host_kv_tokens: int  # L2, a multiple of page_size; 0 when HiCache is off
    kv_bytes_per_token: int
    weight_bytes: int
    available_bytes: int  # where sizing started: free GPU memory (discrete) or the OS's available memory
    headroom_bytes: int  # RAM left untouched for everything else
    mem_fraction_static: float  # the fraction used (given or default)
    hicache_ratio: float | None  # effective host/device ratio; None when HiCache is off
    warnings: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def device_kv_bytes(self) -> int:
        return self.device_kv_tokens * self.kv_bytes_per_token

    @property
    def host_kv_bytes(self) -> int:
        return self.host_kv_tokens * self.kv_bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_kind": self.memory_kind,
            "device_kv_tokens": self.device_kv_tokens,
            "host_kv_tokens": self.host_kv_tokens,
            "device_kv_bytes": self.device_kv_bytes,
            "host_kv_bytes": self.host_kv_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weight_bytes": self.weight_bytes,
            "available_bytes": self.available_bytes,
            "headroom_bytes": self.headroom_bytes,
            "mem_fraction_static": self.mem_fraction_static,
            "hicache_ratio": self.hicache_ratio,
            "warnings": list(self.warnings),
            "reasons": list(self.reasons),
        }


def headroom_for(ram_total_bytes: int) -> int:
    """RAM kept free: 10% of total, within [1 GiB, 10 GiB]."""
    return int(min(HEADROOM_MAX, max(HEADROOM_MIN, ram_total_bytes * HEADROOM_SHARE)))


def default_gpu_fraction(total_bytes: int) -> float:
    """SGLang-like default --mem-fraction-static for a discrete GPU: ~0.78 at 8 GB, ~0.89 at 80 GB."""
    reserve = GPU_RESERVE_FIXED + GPU_RESERVE_SHARE * total_bytes
    return round(max(0.5, (total_bytes - reserve) / total_bytes), 3)


def memory_kind(facts: Facts, decision: Decision) -> str:
    if decision.device == "cpu":
        return KIND_CPU
    if decision.device == "mps" or facts.unified_memory:
        return KIND_UNIFIED
    return KIND_DISCRETE


def plan_memory(
    facts: Facts,
    decision: Decision,
    *,
    weight_bytes: int,
    kv_bytes_per_token: int,
    page_size: int = 1,
    max_total_tokens: int | None = None,
    mem_fraction_static: float | None = None,
    enable_hierarchical_cache: bool = False,
    hicache_ratio: float = 2.0,
    hicache_size_gb: float = 0.0,
    context_length: int | None = None,
    max_running_requests: int | None = None,
) -> MemoryPlan:
    """Size L1 (device KV) and, with HiCache, L2 (host KV). Raises MemoryPlanError when nothing sensible fits.

    Without ``max_total_tokens``, given ``context_length`` and ``max_running_requests``, device KV is capped at
    CONTEXT_CAP_FACTOR x context length x max running requests: more than every running request at full context
    (x4 for cached prefixes) can never be used. The host tier is then sized from the capped device tier."""
    if kv_bytes_per_token < 1 or page_size < 1 or weight_bytes < 0:
        raise ValueError(
            f"need kv_bytes_per_token >= 1, page_size >= 1, weight_bytes >= 0; got {kv_bytes_per_token}, "
            f"{page_size}, {weight_bytes}"
        )
    if enable_hierarchical_cache and hicache_size_gb <= 0 and hicache_ratio <= 0:
        raise MemoryPlanError(f"--hicache-ratio must be > 0 (got {hicache_ratio}), or set --hicache-size in GB")
    context_cap = None
    if not max_total_tokens and context_length and max_running_requests:
        context_cap = (context_length, max_running_requests)
    kind = memory_kind(facts, decision)
    req = _Request(
        facts, decision, weight_bytes, kv_bytes_per_token, page_size, max_total_tokens, mem_fraction_static,
        enable_hierarchical_cache, hicache_ratio, int(hicache_size_gb * GB) if hicache_size_gb > 0 else 0,
        context_cap,
        CPU_CONTEXT_CAP_FACTOR if kind == KIND_CPU and mem_fraction_static is None else CONTEXT_CAP_FACTOR,
    )
    if kind == KIND_DISCRETE:
        return _plan_discrete(req)
    return _plan_shared(req, kind)


class TierFlags(Protocol):
    """The launch flags that size the tiers (ServerArgs has them; platforms/ does not import the runtime); read
    only here."""

    @property
    def page_size(self) -> int: ...

    @property
    def max_total_tokens(self) -> int | None: ...

    @property
    def mem_fraction_static(self) -> float | None: ...

    @property
    def enable_hierarchical_cache(self) -> bool: ...

    @property
    def hicache_ratio(self) -> float: ...

    @property
    def hicache_size(self) -> float: ...

    @property
    def max_running_requests(self) -> int: ...

    @property
    def disable_radix_cache(self) -> bool: ...


def plan_memory_for_args(
    facts: Facts, decision: Decision, args: TierFlags, *, weight_bytes: int, kv_bytes_per_token: int,
    context_length: int | None = None,
) -> MemoryPlan:
    """plan_memory reading the flags from ServerArgs (or anything with the same attributes); with
    ``context_length`` also the cap by context length x max running requests. Launches size their tiers with
    size_kv_tiers, which builds on this."""
    return plan_memory(
        facts,
        decision,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_ratio=args.hicache_ratio,
        hicache_size_gb=args.hicache_size,
        context_length=context_length,
        max_running_requests=args.max_running_requests if context_length else None,
    )


@dataclass(frozen=True)
class TierPlan:
    """The KV tiers a launch allocates: what `tierlm serve` builds and `tierlm doctor` reports.

    In pages of ``page_size`` tokens when the model's KV bytes per token are known; otherwise (a hub id that is
    not downloaded) only byte budgets: ``device_pages``/``host_pages`` are None and no size is named in tokens.
    """

    memory: MemoryPlan  # the memory plan the pages come from
    page_size: int
    device_pages: int | None  # L1; None when sized in bytes only
    host_pages: int | None  # L2; 0 without HiCache; None when sized in bytes only
    context_length: int | None  # the context length the cap used (None: bytes only)
    warnings: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    # Hybrid models: recurrent-state slots (one live slot per running request, and with a radix cache
    # SNAPSHOT_SLOTS_PER_RUNNING_REQUEST more per request for prefix-reuse snapshots), taken from the L1 budget
    # before the KV pages
    state_slots: int = 0
    state_bytes: int = 0
    # ...and with HiCache host (L2) snapshot slots, hicache_ratio x the device snapshot slots, taken from the host
    # KV budget (runtime/cache/state_tiers.py)
    host_state_slots: int = 0
    host_state_bytes: int = 0

    @property
    def in_tokens(self) -> bool:
        return self.device_pages is not None

    @property
    def kv_bytes_per_token(self) -> int | None:
        return self.memory.kv_bytes_per_token if self.in_tokens else None

    @property
    def device_tokens(self) -> int | None:
        return self.device_pages * self.page_size if self.device_pages is not None else None

    @property
    def host_tokens(self) -> int | None:
        return self.host_pages * self.page_size if self.host_pages is not None else None

    @property
    def device_bytes(self) -> int:
        tokens = self.device_tokens
        return self.memory.device_kv_bytes if tokens is None else tokens * self.memory.kv_bytes_per_token

    @property
    def host_bytes(self) -> int:
        tokens = self.host_tokens
        return self.memory.host_kv_bytes if tokens is None else tokens * self.memory.kv_bytes_per_token

    @property
    def hicache_ratio(self) -> float | None:
        """Host / device size as allocated; None when HiCache is off."""
        if self.memory.hicache_ratio is None:
            return None
        return round(self.host_bytes / self.device_bytes, 3) if self.device_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON view; sized in bytes only, it has no *_tokens, *_pages, per-token or weight keys (all unknown)."""
        m = self.memory
        out: dict[str, Any] = {"memory_kind": m.memory_kind, "sized_in": "tokens" if self.in_tokens else "bytes"}
        if self.in_tokens:
            out.update(page_size=self.page_size, device_pages=self.device_pages, host_pages=self.host_pages,
                       device_kv_tokens=self.device_tokens, host_kv_tokens=self.host_tokens,
                       kv_bytes_per_token=m.kv_bytes_per_token, context_length=self.context_length,
                       weight_bytes=m.weight_bytes - self.state_bytes)
            if self.state_slots:
                out.update(state_slots=self.state_slots, state_bytes=self.state_bytes)
            if self.host_state_slots:
                out.update(host_state_slots=self.host_state_slots, host_state_bytes=self.host_state_bytes)
        out.update(device_kv_bytes=self.device_bytes, host_kv_bytes=self.host_bytes, available_bytes=m.available_bytes, headroom_bytes=m.headroom_bytes,
                   mem_fraction_static=m.mem_fraction_static, hicache_ratio=self.hicache_ratio,
                   warnings=list(self.warnings), reasons=list(self.reasons))
        return out


# Hybrid models with a radix cache: snapshot slots per --max-running-requests (SGLang sizes its mamba pool at 3x the
# running requests; here 1x live + 2x snapshots). The snapshots a request has not published yet come from them too.
SNAPSHOT_SLOTS_PER_RUNNING_REQUEST = 2


def size_kv_tiers(
    facts: Facts, decision: Decision, args: TierFlags, *, weight_bytes: int, kv_bytes_per_token: int | None,
    context_length: int | None, state_slot_bytes: int = 0,
) -> TierPlan:
    """The device (L1) and host (L2) pages a launch with ``args`` allocates for a model of ``weight_bytes`` and
    ``kv_bytes_per_token`` served at ``context_length`` (--context-length or max_position_embeddings).

    The one sizing rule shared by `tierlm serve` and `tierlm doctor`: the memory plan (with the cap by
    --max-total-tokens, else by context length x max running requests), whole pages, at least MIN_DEVICE_PAGES
    device pages, a host tier of at least one page. ``kv_bytes_per_token`` None (the model is not at hand):
    byte budgets only, before the weights and the token caps. Raises MemoryPlanError with the numbers and the fix.

    ``state_slot_bytes`` (hybrid models: one request's recurrent state, backends/base.StateGeometry.slot_bytes):
    one live slot per --max-running-requests, plus SNAPSHOT_SLOTS_PER_RUNNING_REQUEST snapshot slots per request
    when the radix cache is on (runtime/cache/state_snapshots.py), are set aside like the weights before the KV pages
    are sized.
    """
    ps = args.page_size
    if kv_bytes_per_token is None:
        plan = plan_memory(facts, decision, weight_bytes=weight_bytes, kv_bytes_per_token=1, page_size=1,
                           mem_fraction_static=args.mem_fraction_static,
                           enable_hierarchical_cache=args.enable_hierarchical_cache,
                           hicache_ratio=args.hicache_ratio, hicache_size_gb=args.hicache_size)
        warnings = list(plan.warnings)
        if args.max_total_tokens:
            warnings.append(f"--max-total-tokens {args.max_total_tokens} is not applied to the byte budgets: "
                            "converting tokens to bytes needs the model's config.json")
        reasons = plan.reasons + [
            "byte budgets only: without the model's config.json the weights, KV bytes per token and the token caps "
            "(--max-total-tokens, context length x max running requests) are unknown: the pools serve allocates are "
            "at most these"
        ]
        return TierPlan(plan, ps, None, None, None, warnings, reasons)

    running = args.max_running_requests
    snapshots = 0 if getattr(args, "disable_radix_cache", False) else SNAPSHOT_SLOTS_PER_RUNNING_REQUEST * running
    state_slots = running + snapshots if state_slot_bytes else 0
    state_bytes = state_slots * state_slot_bytes
    plan = plan_memory_for_args(facts, decision, args, weight_bytes=weight_bytes + state_bytes,
                                kv_bytes_per_token=kv_bytes_per_token, context_length=context_length)
    warnings, reasons = list(plan.warnings), list(plan.reasons)
    if state_slots:
        what = f"{running} live + {snapshots} for prefix-reuse snapshots" if snapshots else "one per running request"
        reasons.append(f"{state_slots} recurrent-state slots ({what}) of {state_slot_bytes / 2**20:.2f} MiB set "
                       "aside first (counted with the weights above)")
    device_pages = plan.device_kv_tokens // ps
    if device_pages < MIN_DEVICE_PAGES:
        reasons.append(f"raised to the smallest device pool, {MIN_DEVICE_PAGES} pages of {ps} tokens")
        device_pages = MIN_DEVICE_PAGES
    if context_length and device_pages * ps < context_length // 4:
        warnings.append(f"the device KV pool holds only {device_pages * ps} tokens (context length "
                        f"{context_length}): long prompts will be refused")
    host_pages = host_state_slots = 0
    if args.enable_hierarchical_cache:
        host_pages = plan.host_kv_tokens // ps
        if host_pages < 1:
            raise MemoryPlanError("the host KV pool would hold no pages; raise --hicache-ratio or --hicache-size")
        if snapshots and state_slot_bytes and args.hicache_size <= 0:
            # --hicache-ratio sizes the host tier against the device tier's KV *and* snapshots: ratio x each,
            # within the host RAM the KV pages leave
            room = facts.ram_available_bytes - headroom_for(facts.ram_total_bytes) - host_pages * ps * kv_bytes_per_token
            host_state_slots = min(max(1, round(args.hicache_ratio * snapshots)), max(0, room) // state_slot_bytes)
            if host_state_slots < 1:
                raise MemoryPlanError(f"no host RAM left for one {state_slot_bytes / 2**20:.2f} MiB state snapshot "
                                      "after the host KV pages; lower --hicache-ratio or --max-running-requests")
            reasons.append(f"{host_state_slots} host state snapshot slots of {state_slot_bytes / 2**20:.2f} MiB "
                           f"(--hicache-ratio x the device's {snapshots}, next to the host KV pages)")
        elif snapshots and state_slot_bytes:
            # --hicache-size: as many snapshots per page on the host as on the device, out of that budget
            host_state_slots = max(1, round(snapshots * host_pages / device_pages))
            host_pages -= -(-host_state_slots * state_slot_bytes // (kv_bytes_per_token * ps))
            if host_pages < 1:
                raise MemoryPlanError(f"the host tier's {host_state_slots} state snapshot slots of "
                                      f"{state_slot_bytes / 2**20:.2f} MiB leave no host KV pages; raise "
                                      "--hicache-size")
            reasons.append(f"{host_state_slots} host state snapshot slots of {state_slot_bytes / 2**20:.2f} MiB taken "
                           "from the --hicache-size budget")
    return TierPlan(plan, ps, device_pages, host_pages, context_length, warnings, reasons, state_slots, state_bytes,
                    host_state_slots, host_state_slots * state_slot_bytes)


# ------------------------------------------------------------------------------------------------ internals


@dataclass
class _Request:
    facts: Facts
    decision: Decision
    weights: int
    per_token: int
    page_size: int
    max_total_tokens: int | None
    fraction: float | None
    hicache: bool
    ratio: float
    host_size: int  # bytes; >0 overrides the ratio
    context_cap: tuple[int, int] | None = None  # (context length, max running requests) without --max-total-tokens
    context_factor: int = CONTEXT_CAP_FACTOR

    def tokens(self, nbytes: float) -> int:
        """Whole pages of KV that fit in nbytes, as tokens."""
        pages = int(max(0, nbytes) // (self.per_token * self.page_size))
        return pages * self.page_size

    def cap_device_kv(self, l1: float, reasons: list[str]) -> float:
        if self.max_total_tokens and self.max_total_tokens * self.per_token < l1:
            reasons.append(
                f"--max-total-tokens {self.max_total_tokens} caps device KV at {_gb(self.max_total_tokens * self.per_token)}"
                f" (memory would allow {_gb(l1)})"
            )
            return self.max_total_tokens * self.per_token
        if self.context_cap:
            ctx, running = self.context_cap
            cap = self.context_factor * ctx * running
            if cap * self.per_token < l1:
                reasons.append(
                    f"capped at {self.context_factor} x context length {ctx} x max running requests {running} = "
                    f"{cap} tokens = {_gb(cap * self.per_token)} (memory would allow {_gb(l1)}; more can never be "
                    "used: --max-total-tokens sets the size instead)"
                )
                return cap * self.per_token
        return l1

    def host_request(self, l1_bytes: int) -> tuple[int, str]:
        if self.host_size:
            return self.host_size, f"--hicache-size {self.host_size / GB:g} GB"
        return int(self.ratio * l1_bytes), f"--hicache-ratio {self.ratio:g} x device KV {_gb(l1_bytes)}"


def _gb(nbytes: float) -> str:
    """GB with two decimals; MB below 1 GB so a small model's weights do not print as 0.00 GB."""
    if abs(nbytes) < GB:
        return f"{nbytes / 1e6:.2f} MB"
    return f"{nbytes / GB:.2f} GB"


def _plan_discrete(r: _Request) -> MemoryPlan:
    f = r.facts
    reasons: list[str] = []
    warnings: list[str] = []
    total = f.device_memory_total_bytes
    if not total:
        raise MemoryPlanError(
            f"the GPU ({f.device_name}) reports no memory size, so the KV pool cannot be sized: "
            "check nvidia-smi, or pass --max-total-tokens and --mem-fraction-static explicitly"
        )
    free = f.device_memory_free_bytes if f.device_memory_free_bytes is not None else total
    frac = r.fraction if r.fraction is not None else default_gpu_fraction(total)
    source = "--mem-fraction-static" if r.fraction is not None else "default mem_fraction_static"
    reserved = total * (1 - frac)
    l1 = free - r.weights - reserved
    reasons.append(
        f"discrete GPU {f.device_name}: device KV = free {_gb(free)} - weights {_gb(r.weights)} - "
        f"(1 - {source} {frac:g}) x total {_gb(total)} = {_gb(l1)}"
    )
    if r.tokens(l1) < r.page_size:
        raise MemoryPlanError(
            f"no GPU memory left for the KV cache: free {_gb(free)} of {_gb(total)}, weights {_gb(r.weights)}, "
            f"{_gb(reserved)} reserved by mem_fraction_static {frac:g}. Raise --mem-fraction-static, free GPU "
            f"memory held by other processes ({_gb(total - free)} in use), or use a smaller model"
        )
    l1 = r.cap_device_kv(l1, reasons)
    device_tokens = r.tokens(l1)
    l1_bytes = device_tokens * r.per_token

    host_tokens, ratio = 0, None
    headroom = headroom_for(f.ram_total_bytes)
    if r.hicache:
        want, what = r.host_request(l1_bytes)
        limit = f.ram_available_bytes - headroom
        if want > limit:
            raise MemoryPlanError(
                f"not enough host RAM for the HiCache host tier: {what} needs {_gb(want)}, but RAM has "
                f"{_gb(f.ram_available_bytes)} available and {_gb(headroom)} stays free, so at most {_gb(max(0, limit))}. "
                + _host_fix(limit, l1_bytes)
            )
        host_tokens = r.tokens(want)
        ratio = round(host_tokens / device_tokens, 3)
        reasons.append(f"host KV from host RAM: {what} = {_gb(host_tokens * r.per_token)}")
        _warn_small_host(host_tokens, device_tokens, warnings)
    return MemoryPlan(
        KIND_DISCRETE, device_tokens, host_tokens, r.per_token, r.weights, free, headroom, frac, ratio,
        warnings, reasons,
    )


def _plan_shared(r: _Request, kind: str) -> MemoryPlan:
    """Unified memory and CPU: weights, L1 and L2 all come out of one pool, the OS's available memory."""
    f = r.facts
    reasons: list[str] = []
    warnings: list[str] = []
    avail = f.ram_available_bytes
    headroom = headroom_for(f.ram_total_bytes)
    budget = avail - headroom  # weights + L1 + L2
    where = _shared_pool_name(f, kind)
    reasons.append(
        f"{where}: one budget of available {_gb(avail)} - headroom {_gb(headroom)} = {_gb(budget)} "
        "for weights + device KV + host KV"
    )
    if r.weights >= budget:
        raise MemoryPlanError(
            f"the weights ({_gb(r.weights)}) do not fit in {_gb(avail)} of available memory with {_gb(headroom)} "
            "kept free: close other programs or use a smaller (or quantized) model"
        )

    default_frac = DEFAULT_CPU_FRACTION if kind == KIND_CPU else DEFAULT_UNIFIED_FRACTION
    if r.fraction is not None:
        frac, static = r.fraction, avail * r.fraction
        reasons.append(f"--mem-fraction-static {frac:g}: weights + device KV get {_gb(static)}")
        if static > budget:
            warnings.append(
                f"--mem-fraction-static {frac:g} asks for {_gb(static)} but only {_gb(budget)} can be used with "
                f"{_gb(headroom)} kept free: using {_gb(budget)}"
            )
            static = budget
    else:
        frac, static = default_frac, avail * default_frac
        reasons.append(f"weights + device KV get {default_frac:g} of available memory = {_gb(static)}")
        if r.hicache:
            # Size L1 so the requested host tier fits beside it: the ratio is honoured, not cut later.
            fit = budget - r.host_size if r.host_size else r.weights + (budget - r.weights) / (1 + r.ratio)
            if fit < static:
                static = fit
                reasons.append(f"device KV shrunk so the HiCache host tier fits the same budget: weights + device KV = {_gb(static)}")
        if kind == KIND_CPU and not r.max_total_tokens:
            static = _cap_cpu_default(r, static, reasons)
    static = _cap_by_metal_working_set(f, r.decision, static, reasons)
    l1 = static - r.weights
    reasons.append(f"device KV = {_gb(static)} - weights {_gb(r.weights)} = {_gb(l1)}")
    if r.tokens(l1) < r.page_size:
        raise MemoryPlanError(
            f"no memory left for the KV cache: weights + device KV may use {_gb(max(0.0, static))} of the "
            f"{_gb(avail)} available, and the weights alone take {_gb(r.weights)}. "
            + ("Lower --hicache-size or --hicache-ratio, " if r.hicache and r.fraction is None else "Raise --mem-fraction-static, ")
            + "close other programs, or use a smaller model"
        )
    l1 = r.cap_device_kv(l1, reasons)
    device_tokens = r.tokens(l1)
    l1_bytes = device_tokens * r.per_token

    host_tokens, ratio = 0, None
    if r.hicache:
        want, what = r.host_request(l1_bytes)
        room = budget - r.weights - l1_bytes
        host = want
        if want > room:
            numbers = (
                f"{what} = {_gb(want)} on top of weights {_gb(r.weights)} + device KV {_gb(l1_bytes)} + headroom "
                f"{_gb(headroom)} exceeds the {_gb(avail)} available"
            )
            if kind == KIND_CPU or r.tokens(room) <= device_tokens:
                # CPU: explicit settings that do not fit are refused. Unified: a host tier no larger than the
                # device tier holds nothing new, so cutting the ratio that far is refused too.
                raise MemoryPlanError(f"the HiCache host tier does not fit in memory: {numbers}. " + _host_fix(room, l1_bytes, r))
            host = room
            warnings.append(
                f"{where}: {numbers}; host KV reduced to {_gb(room)} (ratio {r.tokens(room) / device_tokens:.2f})."
                + _keep_ratio_hint(r, avail, budget)
            )
        host_tokens = r.tokens(host)
        ratio = round(host_tokens / device_tokens, 3)
        reasons.append(f"host KV = {_gb(host_tokens * r.per_token)} (ratio {ratio:g}) in the same memory")
        _warn_small_host(host_tokens, device_tokens, warnings)
    return MemoryPlan(
        kind, device_tokens, host_tokens, r.per_token, r.weights, avail, headroom, frac, ratio, warnings, reasons
    )


def _cap_cpu_default(r: _Request, static: float, reasons: list[str]) -> float:
    """CPU default: device + host KV at most DEFAULT_CPU_KV_SHARE of total RAM (L1's share of it when the host
    tier follows --hicache-ratio; all of it when --hicache-size fixes L2), so the machine keeps room for other
    instances and programs whatever the available figure said at startup."""
    total = r.facts.ram_total_bytes
    kv_cap = DEFAULT_CPU_KV_SHARE * total
    l1_cap = kv_cap / (1 + r.ratio) if r.hicache and not r.host_size else kv_cap
    if static - r.weights <= l1_cap:
        return static
    reasons.append(
        f"CPU default: device + host KV at most {DEFAULT_CPU_KV_SHARE:g} of total RAM {_gb(total)} = {_gb(kv_cap)}, "
        f"so device KV <= {_gb(l1_cap)} (other instances and programs share this RAM; --mem-fraction-static or "
        "--max-total-tokens sets the size instead)")
    return r.weights + l1_cap


def _shared_pool_name(f: Facts, kind: str) -> str:
    if kind == KIND_CPU:
        return "CPU: device and host KV both live in RAM"
    if f.is_dgx_spark:
        return (
            "DGX Spark (GB10) unified memory, sized from the OS's available memory (CUDA's free figure "
            "excludes the page cache and NVML reports no memory)"
        )
    if f.is_jetson:
        return "Jetson unified memory, sized from the OS's available memory"
    return f"{f.device_name or 'Apple Silicon'} unified memory"


def _cap_by_metal_working_set(f: Facts, d: Decision, static: float, reasons: list[str]) -> float:
    """On Apple Silicon, Metal only keeps its recommended working set resident: weights + L1 must fit it."""
    ws = f.device_memory_total_bytes
    if d.device == "mps" and f.accelerator == ACCELERATOR_APPLE and ws and static > ws:
        reasons.append(f"Metal's recommended working set {_gb(ws)} caps weights + device KV")
        return float(ws)
    return static


def _host_fix(room: float, l1_bytes: int, r: _Request | None = None) -> str:
    if room <= l1_bytes:
        return ("The host tier must be larger than the device tier: lower --mem-fraction-static or --max-total-tokens "
                "to leave room, or drop --enable-hierarchical-cache")
    fix = f"Use --hicache-ratio {max(0.01, int(100 * room / l1_bytes) / 100):g} or --hicache-size {int(room / GB * 100) / 100:g} (GB)"
    if r is not None and r.fraction is not None:
        fix += ", or drop --mem-fraction-static so tierlm sizes both tiers from one budget"
    return fix + ", or free RAM"


def _keep_ratio_hint(r: _Request, avail: int, budget: int) -> str:
    if r.host_size or r.fraction is None:
        return ""
    l1_fit = (budget - r.weights) / (1 + r.ratio)
    frac_fit = (r.weights + l1_fit) / avail
    return f" To keep ratio {r.ratio:g}, use --mem-fraction-static {int(frac_fit * 1000) / 1000:g} or lower."


def _warn_small_host(host_tokens: int, device_tokens: int, warnings: list[str]) -> None:
    if host_tokens <= device_tokens:
        warnings.append(
            f"the host KV tier ({host_tokens} tokens) is not larger than the device tier ({device_tokens} tokens), "
            "so it can hold little the device does not already have: raise --hicache-ratio above 1 or free memory"
        )
