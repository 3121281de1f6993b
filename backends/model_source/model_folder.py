"""ModelFolder: a local model folder read once (config.json, generation_config.json, the weight file list).

The composition root reads it when the folder is resolved and hands the record to every consumer (the
architecture check, the chat format, the dtype choice, the hybrid checks, the backends, the fingerprint), so
config.json is parsed once per start. The tools (doctor, bench) and tests may still pass a plain path where a
folder is taken: ``as_model_folder`` reads it then.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when the file is absent or not JSON."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


@dataclass(frozen=True)
class ModelFolder:
    """What a model folder says before anything loads. The dicts are the files' parsed JSON: read, never edit."""

    path: Path
    config: dict[str, Any]  # config.json; {} when absent or not a JSON object
    config_bytes: bytes | None  # config.json as stored (the fingerprint hashes these bytes); None when absent
    generation_config: dict[str, Any]  # generation_config.json; {} when absent
    weight_files: tuple[Path, ...]  # *.safetensors and *.bin, sorted by name

    @classmethod
    def read(cls, path: str | Path) -> ModelFolder:
        folder = Path(path)
        raw = _read_bytes(folder / "config.json")
        return cls(path=folder, config=_parse_object(raw), config_bytes=raw,
                   generation_config=read_json(folder / "generation_config.json"),
                   weight_files=tuple(weight_files(folder)) if folder.is_dir() else ())

    @property
    def text_config(self) -> dict[str, Any]:
        """config.json, or its language-model part where a multimodal config nests it under text_config."""
        return self.config.get("text_config") or self.config

    @property
    def model_type(self) -> str:
        value = self.config.get("model_type")
        return value if isinstance(value, str) else ""

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence token ids: generation_config.json's eos_token_id, then config.json's, without repeats.

        Either file may be absent and either value may be an int, a list of ints or null."""
        ids: list[int] = []
        for source in (self.generation_config, self.config):
            value = source.get("eos_token_id")
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and token not in ids:
                    ids.append(token)
        return ids


def as_model_folder(source: ModelFolder | str | Path) -> ModelFolder:
    """``source`` itself when it is already read, else the folder at that path read now."""
    return source if isinstance(source, ModelFolder) else ModelFolder.read(source)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def _parse_object(raw: bytes | None) -> dict[str, Any]:
    try:
        value = json.loads(raw.decode("utf-8")) if raw is not None else {}
    except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
        return {}
    return value if isinstance(value, dict) else {}
