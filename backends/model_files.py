"""Turning --model-path into a local Hugging Face model folder, and reading facts from that folder.

``--model-path`` may be omitted (the built-in demo model), a local folder, or a Hugging Face hub id such as
``Qwen/Qwen2.5-0.5B-Instruct``. A hub id is looked up in the local Hugging Face cache first, so a model
downloaded once starts later without any network access; only when it is not cached is it downloaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from tierlm.backends.demo_model import ensure_demo_model
from tierlm.runtime.errors import StartupError

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
WEIGHT_SUFFIXES = (".safetensors", ".bin")
FINGERPRINT_EDGE_BYTES = 1 << 20  # hashed at each end of every weight file
FINGERPRINT_MIDDLE_SAMPLES = 8  # evenly spaced blocks hashed between the two ends
FINGERPRINT_SAMPLE_BYTES = 64 << 10


def resolve_model_path(
    model_path: str | None, *, revision: str | None = None, cache_dir: Path | None = None
) -> Path:
    """Return a local folder holding the model named by ``model_path``; raise StartupError saying what to do.

    None -> the demo model (built on first use). An existing folder -> itself, if it holds config.json and
    weights. Anything else is a hub id: the local Hugging Face cache (``cache_dir``, default the standard hub
    cache) is tried first; if the model is not there it is downloaded with a progress bar, unless the hub is
    unreachable or HF_HUB_OFFLINE=1, which is a StartupError that names the fix.
    """
    if model_path is None:
        return ensure_demo_model()
    local = Path(model_path).expanduser()
    if local.exists():
        return _check_local_folder(local, model_path)
    if _looks_like_path(model_path):
        raise StartupError(
            f"--model-path {model_path!r}: no such folder. Pass an existing model folder, or a Hugging Face "
            "hub id such as Qwen/Qwen2.5-0.5B-Instruct."
        )
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model_path)
    except Exception as exc:  # HFValidationError; its text says which rule the name broke
        raise StartupError(
            f"--model-path {model_path!r} is neither an existing folder nor a valid Hugging Face hub id "
            f"({exc}). Pass a model folder, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct."
        ) from None
    return _resolve_hub_id(model_path, revision, cache_dir)


def model_fingerprint(model_dir: Path) -> str:
    """A sha256 hex digest that identifies the model's config and weights, cheap even for huge models.

    Hashed: a format tag, the bytes of config.json, then for each weight file (*.safetensors, *.bin in the
    folder, sorted by name) its name, its size and a content sample: the first and last 1 MiB plus 8 evenly
    spaced 64 KiB blocks (the whole file when it is small). So a copied folder keeps its fingerprint (no
    paths, mtimes or inodes are hashed), while new weights change it: a safetensors file starts with its
    tensor header, and retrained or re-quantised weights differ throughout. A change confined to unsampled
    bytes of a big file is not detected; that is the price of not reading gigabytes at every start.
    """
    model_dir = Path(model_dir)
    digest = hashlib.sha256(b"tierlm-model-fingerprint-v1\0")
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"<no config.json>")
    for weight in _weight_files(model_dir):
        size = weight.stat().st_size
        digest.update(f"\0{weight.name}\0{size}\0".encode())
        with weight.open("rb") as f:
            for offset, length in _sample_ranges(size):
                f.seek(offset)
                digest.update(f.read(length))
    return digest.hexdigest()


def read_generation_eos(model_dir: Path) -> list[int]:
    """End-of-sequence token ids: generation_config.json's eos_token_id, then config.json's, without repeats.

    Either file may be absent and either value may be an int, a list of ints or null.
    """
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def _check_local_folder(folder: Path, given: str) -> Path:
    if not folder.is_dir():
        raise StartupError(
            f"--model-path {given!r} is a file; pass the folder that holds config.json and the weights."
        )
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not _weight_files(folder):
        missing.append("weights (*.safetensors)")
    if missing:
        raise StartupError(
            f"--model-path {given!r} is not a Hugging Face model folder: it has no {' and no '.join(missing)}. "
            "Pass the folder a model was downloaded or saved to (config.json, *.safetensors, tokenizer files)."
        )
    return folder.resolve()


def _resolve_hub_id(repo_id: str, revision: str | None, cache_dir: Path | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    cache = str(cache_dir) if cache_dir is not None else None
    cached = _cached_snapshot(repo_id, revision, cache)
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
        raise StartupError(f"{not_cached} (HF_HUB_OFFLINE=1 is set); {fix}.")

    logger.info("model %s is not cached; downloading it from the Hugging Face hub (only this once)", repo_id)
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_ALLOW_PATTERNS,
                                   ignore_patterns=HUB_IGNORE_PATTERNS)
    except GatedRepoError:
        raise StartupError(
            f"model {repo_id!r} is gated on the Hugging Face hub: accept its licence on "
            f"https://huggingface.co/{repo_id}, then run `hf auth login` (or set HF_TOKEN) and start again."
        ) from None
    except RepositoryNotFoundError:
        raise StartupError(
            f"no model {repo_id!r} on the Hugging Face hub (or it is private: run `hf auth login`); check the "
            "spelling, e.g. --model-path Qwen/Qwen2.5-0.5B-Instruct, or pass a local folder."
        ) from None
    except RevisionNotFoundError:
        raise StartupError(
            f"model {repo_id!r} has no revision {revision!r}; pass an existing branch, tag or commit."
        ) from None
    except (LocalEntryNotFoundError, OSError) as exc:
        # LocalEntryNotFoundError: no connection and not cached. OSError covers httpx connection errors and a
        # full disk; its text says which.
        cause = exc.__cause__ or exc  # huggingface_hub wraps the connection error in a multi-line message
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise StartupError(f"{not_cached} ({type(cause).__name__}: {reason}); {fix}.") from None
    folder = Path(folder)
    if not _weight_files(folder):
        raise StartupError(
            f"model {repo_id!r} has no .safetensors weights on the hub; tierlm loads safetensors only. Use a "
            "repo that ships them, or convert the model and pass its folder with --model-path."
        )
    return folder


def _cached_snapshot(repo_id: str, revision: str | None, cache: str | None) -> Path | None:
    """The cached snapshot folder of the repo if it holds config.json and weights; no network is used."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                        allow_patterns=HUB_ALLOW_PATTERNS,
                                        ignore_patterns=HUB_IGNORE_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None  # not cached, or cached only in part (IncompleteSnapshotError is a LocalEntryNotFoundError)
    if (folder / "config.json").is_file() and _weight_files(folder):
        return folder
    return None


def _offline_mode() -> bool:
    """HF_HUB_OFFLINE as it is now; huggingface_hub reads it once at import, which may be before it was set."""
    from huggingface_hub import constants

    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().upper()
    return constants.is_offline_mode() or env in {"1", "ON", "YES", "TRUE"}


def _looks_like_path(text: str) -> bool:
    """True for names that can only be folders: hub ids are 'name' or 'owner/name'."""
    return (os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text or text.count("/") > 1)


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _sample_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) pairs of a file of ``size`` bytes to hash: all of it if small, else ends + samples."""
    if size <= 2 * FINGERPRINT_EDGE_BYTES + FINGERPRINT_MIDDLE_SAMPLES * FINGERPRINT_SAMPLE_BYTES:
        return [(0, size)]
    ranges = [(0, FINGERPRINT_EDGE_BYTES)]
    span = size - 2 * FINGERPRINT_EDGE_BYTES - FINGERPRINT_SAMPLE_BYTES
    for i in range(1, FINGERPRINT_MIDDLE_SAMPLES + 1):
        ranges.append((FINGERPRINT_EDGE_BYTES + span * i // (FINGERPRINT_MIDDLE_SAMPLES + 1),
                       FINGERPRINT_SAMPLE_BYTES))
    ranges.append((size - FINGERPRINT_EDGE_BYTES, FINGERPRINT_EDGE_BYTES))
    return ranges
