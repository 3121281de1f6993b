"""Hugging Face hub ids: the local hub cache first (no network), a download with progress only when absent."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from tierlm.backends.model_source.errors import ModelSourceError
from tierlm.backends.model_source.model_folder import weight_files

logger = logging.getLogger(__name__)

# What a server needs from a hub repo: configs, tokenizer files, chat templates and safetensors weights.
# Not *.bin / *.pt / *.gguf / *.onnx / *.msgpack weights, which would multiply the download.
HUB_ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
    "*.safetensors", "*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja",
]
# Some repos also carry the original (non-HF) checkpoint, e.g. Mistral's consolidated.safetensors or Llama's
# original/ folder: skipping them halves the download.
HUB_IGNORE_PATTERNS = ["original/*", "consolidated*"]


def resolve_hub_id(repo_id: str, revision: str | None, cache_dir: Path | None) -> Path:
    """The local snapshot folder of ``repo_id``: from the hub cache without network if it is complete there,
    else downloaded (config, tokenizer, safetensors only); ModelSourceError with the fix when neither works."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = str(cache_dir) if cache_dir is not None else None
    cached = cached_snapshot(repo_id, revision, cache)
    if cached is not None:
        logger.info("model %s found in the local Hugging Face cache at %s", repo_id, cached)
        return cached

    where = Path(cache or constants.HF_HUB_CACHE)
    not_cached = (
        f"model {repo_id!r} is not in the local Hugging Face cache ({where}) and the hub cannot be reached"
    )
    fix = (
        f"download it on a connected machine with `hf download {repo_id}` (or `huggingface-cli download "
        f"{repo_id}`) and copy its Hugging Face cache folder ({where}) to this machine, or pass a local "
        "folder with --model-path /path/to/model"
    )
    if _offline_mode():
        raise ModelSourceError(f"{not_cached} (HF_HUB_OFFLINE=1 is set); {fix}.")

    logger.info("model %s is not cached; downloading it from the Hugging Face hub (only this once)", repo_id)
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_ALLOW_PATTERNS,
                                   ignore_patterns=HUB_IGNORE_PATTERNS)
    except GatedRepoError:
        raise ModelSourceError(
            f"model {repo_id!r} is gated on the Hugging Face hub: accept its licence on "
            f"https://huggingface.co/{repo_id}, then run `hf auth login` (or set HF_TOKEN) and start again."
        ) from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"no model {repo_id!r} on the Hugging Face hub (or it is private: run `hf auth login`); check the "
            "spelling, e.g. --model-path Qwen/Qwen2.5-0.5B-Instruct, or pass a local folder."
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(
            f"model {repo_id!r} has no revision {revision!r}; pass an existing branch, tag or commit."
        ) from None
    except (LocalEntryNotFoundError, OSError) as exc:
        # LocalEntryNotFoundError: no connection and not cached. OSError covers httpx connection errors and a
        # full disk; its text says which.
        cause = exc.__cause__ or exc  # huggingface_hub wraps the connection error in a multi-line message
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise ModelSourceError(f"{not_cached} ({type(cause).__name__}: {reason}); {fix}.") from None
    folder = Path(folder)
    if not weight_files(folder):
        raise ModelSourceError(
            f"model {repo_id!r} has no .safetensors weights on the hub; tierlm loads safetensors only. Use a "
            "repo that ships them, or convert the model and pass its folder with --model-path."
        )
    return folder


def cached_snapshot(repo_id: str, revision: str | None, cache: str | None) -> Path | None:
    """The cached snapshot folder of the repo if it holds config.json and weights; no network is used."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                        allow_patterns=HUB_ALLOW_PATTERNS,
                                        ignore_patterns=HUB_IGNORE_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None  # not cached, or cached only in part (IncompleteSnapshotError is a LocalEntryNotFoundError)
    if (folder / "config.json").is_file() and weight_files(folder):
        return folder
    return None


def _offline_mode() -> bool:
    """HF_HUB_OFFLINE as it is now; huggingface_hub reads it once at import, which may be before it was set."""
    from huggingface_hub import constants

    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().upper()
    return constants.is_offline_mode() or env in {"1", "ON", "YES", "TRUE"}
