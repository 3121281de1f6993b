"""Turning --model-path into a local Hugging Face model folder.

``--model-path`` may be omitted (the built-in model, stories260K), a local folder, or a Hugging Face hub id such as
``Qwen/Qwen2.5-0.5B-Instruct`` (``hub.py``: the local hub cache first, a download only when it is absent).
"""
from __future__ import annotations

import os
from pathlib import Path

import tierlm.backends.model_source.hub as hub  # the module, not the package: __init__ imports this file
from tierlm.backends.model_source.builtin_model import builtin_model_dir
from tierlm.backends.model_source.errors import ModelSourceError
from tierlm.backends.model_source.model_folder import weight_files


def resolve_model_path(
    model_path: str | None, *, revision: str | None = None, cache_dir: Path | None = None
) -> Path:
    """Return a local folder holding the model named by ``model_path``; raise ModelSourceError saying what to do.

    None -> the built-in model shipped in the package (builtin_model.py). An existing folder -> itself, if it
    holds config.json and weights. Anything else is a hub id: the local Hugging Face cache (``cache_dir``, default
    the standard hub cache) is tried first; if the model is not there it is downloaded with a progress bar, unless
    the hub is unreachable or HF_HUB_OFFLINE=1, which is a ModelSourceError that names the fix.
    """
    if model_path is None:
        return builtin_model_dir()
    local = Path(model_path).expanduser()
    if local.exists():
        return _check_local_folder(local, model_path)
    if looks_like_path(model_path):
        raise ModelSourceError(
            f"--model-path {model_path!r}: no such folder. Pass an existing model folder, or a Hugging Face "
            "hub id such as Qwen/Qwen2.5-0.5B-Instruct."
        )
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model_path)
    except Exception as exc:  # HFValidationError; its text says which rule the name broke
        raise ModelSourceError(
            f"--model-path {model_path!r} is neither an existing folder nor a valid Hugging Face hub id "
            f"({exc}). Pass a model folder, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct."
        ) from None
    return hub.resolve_hub_id(model_path, revision, cache_dir)


def _check_local_folder(folder: Path, given: str) -> Path:
    if not folder.is_dir():
        raise ModelSourceError(
            f"--model-path {given!r} is a file; pass the folder that holds config.json and the weights."
        )
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not weight_files(folder):
        missing.append("weights (*.safetensors)")
    if missing:
        raise ModelSourceError(
            f"--model-path {given!r} is not a Hugging Face model folder: it has no {' and no '.join(missing)}. "
            "Pass the folder a model was downloaded or saved to (config.json, *.safetensors, tokenizer files)."
        )
    return folder.resolve()


def looks_like_path(text: str) -> bool:
    """True for names that can only be folders: hub ids are 'name' or 'owner/name'."""
    return (os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text or text.count("/") > 1)
