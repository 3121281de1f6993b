"""The architectures each backend serves: only those whose output tierlm's reference tests verify.

Both backends build the model from config.json's ``model_type`` (transformers' AutoModelForCausalLM; mlx-lm's
model module of that name), so they would load almost any architecture those libraries know, including ones
whose math tierlm's paged attention does not cover. Hybrids (linear-attention / Mamba layers) would load fine and
then run those layers without their recurrent state: every answer wrong and nothing says so. The hybrids listed
here run their state through tierlm's state pool (backends/*/linear_state.py), verified like every other family. So a backend first checks config.json (``architectures``, ``model_type``)
against ``VERIFIED_ARCHITECTURES`` and refuses anything else, before any weights load, unless the user passes
``--trust-unverified-architecture``; then it loads with a warning (log and /server_info).

An entry belongs here only when the reference tests build that architecture (tests/model_factory.py) and check
its greedy output against transformers' on that backend; tests/test_verified_architectures.py holds this list
to the test models and to docs/models.md, which shows it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierlm.backends.model_source.model_folder import ModelFolder, as_model_folder

FLAG = "--trust-unverified-architecture"
BACKENDS = ("torch", "mlx")
HYBRID_BACKENDS = ("torch", "mlx")  # the backends with a state pool for hybrid models


@dataclass(frozen=True)
class VerifiedArchitecture:
    architecture: str  # the transformers class named in config.json's "architectures"
    model_type: str  # config.json's "model_type": what both backends build the model from
    backends: tuple[str, ...]  # the backends whose reference tests cover it


VERIFIED_ARCHITECTURES: tuple[VerifiedArchitecture, ...] = (
    VerifiedArchitecture("LlamaForCausalLM", "llama", BACKENDS),
    VerifiedArchitecture("Qwen2ForCausalLM", "qwen2", BACKENDS),
    VerifiedArchitecture("Qwen3ForCausalLM", "qwen3", BACKENDS),
    VerifiedArchitecture("MistralForCausalLM", "mistral", BACKENDS),
    VerifiedArchitecture("GptOssForCausalLM", "gpt_oss", BACKENDS),
    # hybrids: recurrent state in a state pool (tests/test_hybrid_models.py); no prefix reuse yet
    VerifiedArchitecture("Qwen3_5ForCausalLM", "qwen3_5_text", HYBRID_BACKENDS),
    VerifiedArchitecture("Qwen3NextForCausalLM", "qwen3_next", HYBRID_BACKENDS),
    VerifiedArchitecture("GraniteMoeHybridForCausalLM", "granitemoehybrid", HYBRID_BACKENDS),
    VerifiedArchitecture("NemotronHForCausalLM", "nemotron_h", HYBRID_BACKENDS),
)

# Known model types with layers that keep a recurrent state (linear attention, Mamba / SSM) next to or instead of
# attention: unless verified above (their state in a state pool), the paged KV cache holds no such state and their
# output is wrong. Only used to say why.
RECURRENT_MODEL_TYPES = frozenset({
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "granitemoehybrid", "nemotron_h",
    "falcon_h1", "jamba", "bamba", "zamba", "zamba2", "lfm2", "lfm2_moe", "mamba", "mamba2", "kimi_linear",
    "minimax", "recurrent_gemma", "rwkv", "plamo2",
})
RECURRENT_NOTE = ("Its linear-attention / state-space (Mamba) layers keep a recurrent state that tierlm's paged KV "
                  "cache does not hold, so its output is wrong.")


class UnverifiedArchitectureError(RuntimeError):
    """The model's architecture is not verified on this backend (or config.json cannot say which it is); the
    message names the verified list and the flag (the engine reports it as a startup error)."""


@dataclass(frozen=True)
class ArchitectureCheck:
    """What config.json says about a model folder's architecture, and whether ``backend`` verifies it."""

    architecture: str  # config.json's architectures[0], else its model_type
    model_type: str
    backend: str
    verified: bool
    refusal: str | None = None  # when unverified: why it is refused, the verified list and the flag
    warning: str | None = None  # when unverified: what to log and show in /server_info if loaded anyway


def verified_for(backend: str) -> dict[str, str]:
    """Architecture class name -> model_type of the architectures verified on ``backend``."""
    return {v.architecture: v.model_type for v in VERIFIED_ARCHITECTURES if backend in v.backends}


def verified_list(backend: str) -> str:
    return ", ".join(f"{a} ({t})" for a, t in verified_for(backend).items())


def check_architecture(model_dir: ModelFolder | str | Path, backend: str, trust_unverified: bool = False,
                       trust_remote_code: bool = False) -> ArchitectureCheck:
    """Whether ``backend`` may load the model, before any weights load: raises UnverifiedArchitectureError for
    an unverified architecture unless ``trust_unverified`` (then the result's ``warning`` is set)."""
    check = assess_architecture(model_dir, backend, trust_remote_code)
    if check.refusal and not trust_unverified:
        raise UnverifiedArchitectureError(check.refusal)
    return check


def assess_architecture(model_dir: ModelFolder | str | Path, backend: str, trust_remote_code: bool = False
                        ) -> ArchitectureCheck:
    """Read config.json and say whether ``backend`` verifies the model's architecture; cheap (no weights, no
    libraries). Raises UnverifiedArchitectureError only when config.json cannot be read.

    Verified means: ``model_type`` is a verified one and every class in ``architectures`` (when given) is the
    verified class of that model_type. With ``trust_remote_code`` on torch, a config whose ``auto_map`` names its
    own AutoModelForCausalLM runs remote code, which no test covers.
    """
    model = as_model_folder(model_dir)
    folder, config = model.path, model.config
    if not config:
        raise UnverifiedArchitectureError(
            f"{folder} has no readable config.json, so its architecture cannot be checked; pass a Hugging Face "
            "model folder")
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else ""
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    archs = [a for a in archs if isinstance(a, str)]
    name = archs[0] if archs else (model_type or "unknown")
    table = verified_for(backend)
    verified = model_type in table.values() and all(table.get(a) == model_type for a in archs)
    remote = backend == "torch" and trust_remote_code and _remote_causal_lm(config)
    if verified and not remote:
        return ArchitectureCheck(name, model_type, backend, True)
    what = (f"{name} (model_type {model_type!r})" if model_type else f"{name} (config.json has no model_type)")
    if remote:
        what += " with its own remote code (auto_map)"
    note = f" {RECURRENT_NOTE}" if model_type in RECURRENT_MODEL_TYPES else ""
    elsewhere = [b for b in BACKENDS if b != backend and model_type in verified_for(b).values()]
    if elsewhere and not remote:
        note += (f" It runs verified on the {' and '.join(elsewhere)} backend for now: serve it there "
                 f"(TIERLM_BACKEND={elsewhere[0]}).")
    refusal = (f"{folder} is {what}, which the {backend} backend does not serve: tierlm loads only architectures "
               f"whose greedy output its reference tests verify against transformers: {verified_list(backend)} "
               f"(docs/models.md).{note} To try this one anyway, pass {FLAG} (its output may be wrong).")
    warning = (f"unverified architecture {what} on the {backend} backend, loaded because of {FLAG}: no reference "
               f"test checks its output, which may be wrong.{note} Verified: {verified_list(backend)}.")
    return ArchitectureCheck(name, model_type, backend, False, refusal, warning)


def _remote_causal_lm(config: dict) -> bool:
    auto_map = config.get("auto_map")
    return isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map
