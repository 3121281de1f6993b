"""The load plan: what a launch will be, decided before anything loads, each choice with its reason.

    flags + model folder (config.json, safetensors headers) + machine facts
    -> backend and device -> attention -> verified architecture? -> weight quantization
    -> the backend's part (dtype, the model as it will hold it, CPU kernel plan, compiled decode)
    -> chat format -> context length -> KV tier sizes (L1, L2)

``plan_load`` is pure apart from reading the folder's small files: no tokenizer, no weights, no torch or mlx. The
builder (runtime/engine_setup.py) executes the plan without deciding again; `tierlm doctor` prints the same plan;
tests check it without loading weights. Every refusal a user can fix is a StartupError that says how.
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from tierlm.backends.base import BackendPlan, Choice, PlanFacts
from tierlm.backends.model_source.hybrid_layout import HybridLayoutError, hybrid_layout
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.verified_architectures import ArchitectureCheck, UnverifiedArchitectureError, check_architecture
from tierlm.backends.weight_format import WeightQuant, check_backend_kind, parse_weight_quant
from tierlm.platforms import (BackendChoiceError, Decision, Facts, MemoryPlanError, TierPlan, choose_backend,
                              size_kv_tiers)
from tierlm.runtime.chat_format import ChatFormat, decide_chat_format
from tierlm.runtime.errors import StartupError
from tierlm.runtime.server_args import ATTENTION_ALIASES, ATTENTION_BACKENDS, ServerArgs

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 2048  # what the backends use when config.json names no max_position_embeddings


@dataclass(frozen=True)
class LoadPlan:
    decision: Decision  # backend and device, with the platform's reasons
    attention: Choice[str]
    architecture: ArchitectureCheck
    quant: WeightQuant | None  # --quantization / --torchao-config
    backend: BackendPlan  # the chosen backend's part: dtype, sizes, CPU kernels, compiled decode
    context_length: Choice[int]
    # config.json's max_position_embeddings; None where it names none (the model class's default, which only the
    # loaded model knows: the builder checks --context-length against it then)
    model_max: int | None
    tiers: TierPlan | None  # None where the folder could not be sized or its count does not fit (the builder
    # sizes from the loaded model, by the same rule, and refuses then)
    facts: PlanFacts  # what the backend's part was planned from
    chat_format: ChatFormat | None = None  # None until the template is known (chat_format_for)

    @property
    def dtype(self) -> str:
        return self.backend.dtype.value

    def to_dict(self) -> dict[str, Any]:
        arch = self.architecture
        return {
            "backend": {"value": f"{self.decision.backend} on {self.decision.device}",
                        "why": "; ".join(self.decision.reasons)},
            "attention": self.attention.to_dict(),
            "architecture": {"value": arch.architecture, "why": "verified" if arch.verified else
                             (arch.warning or "unverified")},
            "weight_quantization": {"value": self.quant.name if self.quant else "none",
                                    "why": self.quant.flag if self.quant else "no --quantization/--torchao-config"},
            **self.backend.to_dict(),
            "sizes_why": self.backend.sizes_why or None,
            "context_length": self.context_length.to_dict(),
            "tiers": self.tiers.to_dict() if self.tiers is not None else None,
            "chat_format": None if self.chat_format is None else {
                "chat_template": self.chat_format.chat_template_source,
                "reasoning_parser": Choice(self.chat_format.reasoning_parser,
                                           self.chat_format.reasoning_parser_source).to_dict(),
                "tool_call_parser": Choice(self.chat_format.tool_call_parser,
                                           self.chat_format.tool_call_parser_source).to_dict()},
        }


def plan_load(args: ServerArgs, facts: Facts, folder: ModelFolder, env: Mapping[str, str],
              decision: Decision | None = None) -> LoadPlan:
    """The plan of launching ``args`` on a machine of ``facts`` with the model ``folder``; StartupError for what
    would stop startup, in the order serve meets it. ``decision``: the backend decision already taken (doctor
    takes it first to report it even when the model is refused)."""
    decision = decision or decide_backend(args, facts, env)
    attention = Choice(*resolve_attention_backend(args, decision, env))
    arch = check_model_architecture(decision, folder, args)  # fail fast: before the tokenizer and weights
    check_hybrid_flags(folder, args)
    quant = weight_quant_for(args, decision.backend)
    backend_facts = PlanFacts(
        folder, decision.device, args.dtype, args.kv_cache_dtype, decision.native_bf16, quant, env,
        architecture=arch.architecture, compute_capability=facts.compute_capability,
        enable_torch_compile=args.enable_torch_compile, static_decode=args.cuda_graph_max_bs is not None,
        cpu=facts.cpu)
    part = plan_backend(decision.backend, backend_facts)
    if part.refusal:
        raise StartupError(part.refusal)
    model_max = stated_max_context(folder)
    if model_max is None:
        context = Choice(args.context_length or DEFAULT_CONTEXT_LENGTH,
                         "--context-length (checked against the loaded model's limit: config.json names none)"
                         if args.context_length else "config.json names no max_position_embeddings: the model "
                         "class's default once loaded")
    else:
        context = Choice(check_context_length(args.context_length, model_max, env),
                         "--context-length" if args.context_length else "the model's max_position_embeddings")
    tiers = None
    if part.sizes is not None:
        try:
            tiers = size_tiers(args, facts, decision, part.sizes.weight_bytes, part.sizes.kv_bytes_per_token,
                               context.value, part.sizes.state_slot_bytes)
        except StartupError:  # the folder's count may be above what loads (e.g. .bin files of another dtype):
            tiers = None  # the builder sizes from the loaded model and refuses then, as it always did
    return LoadPlan(decision, attention, arch, quant, part, context, model_max, tiers, backend_facts)


def plan_backend(backend: str, facts: PlanFacts) -> BackendPlan:
    """The chosen backend's part of the plan (backends/<name>/load_plan.py: no tensor library imported)."""
    if backend == "mlx":
        from tierlm.backends.mlx.load_plan import plan_load as mlx_plan

        return mlx_plan(facts)
    from tierlm.backends.torch.load_plan import plan_load as torch_plan

    return torch_plan(facts)


def compile_for_loaded(plan: LoadPlan, weight_bytes: int, weight_format: str) -> Choice[bool]:
    """The backend's compile choice again, for the weights as loaded, where they are not what the folder counted
    (the default compiles by weight bytes and format)."""
    sizes = plan.backend.sizes
    if plan.decision.backend != "torch" or (sizes is not None and (sizes.weight_bytes, sizes.weight_format) ==
                                            (weight_bytes, weight_format)):
        return plan.backend.compile
    from tierlm.backends.torch.load_plan import plan_compile

    return plan_compile(plan.facts, weight_bytes, weight_format)


def chat_format_for(args: ServerArgs, folder: ModelFolder, template: str | None, template_source: str | None
                    ) -> ChatFormat:
    """The chat format (runtime/chat_format.py), once the template is known: --reasoning-parser and
    --tool-call-parser, or the parsers the model unambiguously needs. ServerArgs stays as parsed."""
    return decide_chat_format(folder.model_type, template, template_source, args.reasoning_parser,
                              args.tool_call_parser)


def model_max_context(folder: ModelFolder) -> int:
    return stated_max_context(folder) or DEFAULT_CONTEXT_LENGTH


def stated_max_context(folder: ModelFolder) -> int | None:
    value = folder.text_config.get("max_position_embeddings")
    return int(value) if value else None


def size_tiers(args: ServerArgs, facts: Facts, decision: Decision, weight_bytes: int, kv_bytes_per_token: int,
               context_length: int, state_slot_bytes: int = 0) -> TierPlan:
    """Device (L1) and host (L2) pages by the platform's one sizing rule (platforms/memory_plan.size_kv_tiers)."""
    try:
        return size_kv_tiers(facts, decision, args, weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token,
                             context_length=context_length, state_slot_bytes=state_slot_bytes)
    except MemoryPlanError as e:  # carries the numbers and the flag to change
        raise StartupError(str(e)) from e


def decide_backend(args: ServerArgs, facts: Facts, env: Mapping[str, str]) -> Decision:
    """Backend + device with the reasons; the platform layer decides from the machine's facts."""
    try:
        return choose_backend(facts, env, args.device, backend_override=args.backend)
    except BackendChoiceError as e:  # says what to install or which flag to change
        raise StartupError(str(e)) from e


def resolve_attention_backend(args: ServerArgs, decision: Decision, env: Mapping[str, str]) -> tuple[str, str]:
    """The attention implementation and why. --attention-backend must name one of the chosen backend's
    (ServerArgs.check() refused unknown names); tierlm_paged is torch_native's old name. Default on torch: triton on
    CUDA when Triton is installed, else torch_native. triton off CUDA is a StartupError, except under
    TRITON_INTERPRET=1 (Triton's CPU interpreter: how the tests run the kernels)."""
    name = args.attention_backend
    if name is not None:
        owner = ATTENTION_BACKENDS[name]
        if owner != decision.backend:
            own = next(n for n, b in ATTENTION_BACKENDS.items() if b == decision.backend)
            raise StartupError(f"--attention-backend {name} belongs to the {owner} backend, but this server runs the "
                               f"{decision.backend} backend; use --attention-backend {own} or drop the flag")
    if decision.backend != "torch":
        return name or "mlx_paged", "--attention-backend" if name else "the MLX backend's paged attention"
    has_triton = importlib.util.find_spec("triton") is not None
    interpret = str(env.get("TRITON_INTERPRET", "")).strip() == "1"
    if name is None:
        if decision.device != "cuda":
            return "torch_native", f"default on {decision.device} (the Triton kernels need CUDA)"
        if not has_triton:
            return "torch_native", "default on CUDA without Triton installed (pip install triton for the kernels)"
        return "triton", "default on CUDA with Triton installed: kernels that read KV pages in place"
    name = ATTENTION_ALIASES.get(name, name)
    if name == "triton":
        if not has_triton:
            raise StartupError("--attention-backend triton needs the triton package (it ships with torch on Linux "
                               "CUDA: pip install triton); or use --attention-backend torch_native")
        if decision.device != "cuda":
            if not interpret:
                raise StartupError(f"--attention-backend triton needs a CUDA device, but this server runs on "
                                   f"{decision.device}; use --attention-backend torch_native or drop the flag "
                                   "(TRITON_INTERPRET=1 runs the kernels in Triton's CPU interpreter, for tests)")
            return name, f"--attention-backend, on {decision.device} in Triton's interpreter (TRITON_INTERPRET=1)"
    return name, "--attention-backend"


def check_model_architecture(decision: Decision, folder: ModelFolder, args: ServerArgs) -> ArchitectureCheck:
    """Whether the chosen backend serves the model's architecture verified (backends/verified_architectures.py),
    from config.json alone; an unverified one is refused unless --trust-unverified-architecture (the backend
    logs the warning when it loads)."""
    try:
        return check_architecture(folder, decision.backend, args.trust_unverified_architecture,
                                  args.trust_remote_code)
    except UnverifiedArchitectureError as e:  # names the verified list and the flag
        raise StartupError(str(e)) from e


def choose_dtype(args: ServerArgs, decision: Decision, folder: ModelFolder,
                 env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The dtype the chosen backend computes in and why: its load plan's (backends/*/load_plan.py)."""
    if decision.backend == "mlx":
        from tierlm.backends.mlx.load_plan import plan_dtype
    else:
        from tierlm.backends.torch.load_plan import plan_dtype
    c = plan_dtype(PlanFacts(folder, decision.device, args.dtype, args.kv_cache_dtype, decision.native_bf16, None,
                             env or {}))
    return c.value, c.why


def weight_quant_for(args: ServerArgs, backend: str) -> WeightQuant | None:
    """--quantization / --torchao-config as a WeightQuant for the chosen backend; a name neither backend knows,
    or one meant for the other backend, stops startup naming the flag and the alternatives."""
    try:
        quant = parse_weight_quant(args.quantization, args.torchao_config)
        check_backend_kind(quant, backend)
    except ValueError as e:
        raise StartupError(str(e)) from e
    return quant


def check_context_length(requested: int | None, model_max: int, env: Mapping[str, str]) -> int:
    """--context-length, or the model's max_position_embeddings. Above the model's limit is a StartupError unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (SGLang's rule), which turns it into a warning."""
    if not requested:
        return model_max
    if requested > model_max:
        if str(env.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "")).strip().lower() in ("1", "true"):
            log.warning("--context-length %d exceeds the model's max_position_embeddings %d "
                        "(allowed by SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN); outputs past %d may be wrong",
                        requested, model_max, model_max)
        else:
            raise StartupError(
                f"--context-length {requested} is above the model's limit (max_position_embeddings {model_max}); "
                f"use --context-length {model_max} or less, or set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 "
                "to allow it anyway")
    return requested


def check_hybrid_flags(folder: ModelFolder, args: ServerArgs) -> None:
    """Hybrid models (linear-attention / Mamba layers, backends/model_source/hybrid_layout.py) keep a recurrent
    state per request: refuse, from config.json and before any weights load, the features that cannot serve
    them correctly yet."""
    try:
        layout = hybrid_layout(folder.text_config)
    except HybridLayoutError as e:
        raise StartupError(str(e)) from e
    if layout is None:
        return
    what = f"this hybrid model ({layout.model_type}: {layout.kind} layers with a recurrent state)"
    if args.speculative_algorithm is not None:
        raise StartupError(f"--speculative-algorithm {args.speculative_algorithm}: not for hybrid models; {what} "
                           "cannot roll its recurrent state back past rejected draft tokens. Drop the flag.")
