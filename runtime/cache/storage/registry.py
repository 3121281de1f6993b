"""L3 storage backends by name: what ``--hicache-storage-backend NAME`` opens.

Each store is its own package under stores/ (stores/file/, stores/mooncake/) whose ``storage`` module exposes
``open_storage(namespace, page_bytes, extra_config) -> KVStorage`` (base.py is the contract). Modules are imported
only when their store is opened, so an optional dependency (mooncake) costs nothing to servers that do not use it.
A third store (3FS, NIXL, S3, Redis/Valkey) is one package under stores/ plus one line in ``BACKENDS`` (or a
``register()`` call from code that runs before the engine starts).
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, cast

if TYPE_CHECKING:
    from tierlm.runtime.cache.storage.base import KVStorage
    from tierlm.runtime.cache.storage.namespace import StorageNamespace

# (namespace, page_bytes, extra_config without the HiCache manager's own keys) -> KVStorage
StorageFactory = Callable[["StorageNamespace", int, Mapping[str, object]], "KVStorage"]

# name -> "module path" holding open_storage(), or the factory itself (register()).
BACKENDS: dict[str, str | StorageFactory] = {
    "file": "tierlm.runtime.cache.storage.stores.file.storage",
    "mooncake": "tierlm.runtime.cache.storage.stores.mooncake.storage",
}


def register(name: str, factory: str | StorageFactory) -> None:
    """Add (or replace) a backend: a module path with ``open_storage``, or the factory itself."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a storage backend needs a non-empty name, got {name!r}")
    BACKENDS[name] = factory


def names() -> list[str]:
    return sorted(BACKENDS)


def check_name(name: str) -> None:
    """The one check of --hicache-storage-backend (ServerArgs.check() calls it): ValueError naming the
    available backends unless ``name`` is one of them."""
    if name not in BACKENDS:
        raise ValueError(f"--hicache-storage-backend {name}: tierlm has the {', '.join(names())} backends "
                         "(docs/hicache.md); SGLang's others (hf3fs, nixl, aibrix, eic, ...) are not implemented")


def factory(name: str) -> StorageFactory:
    check_name(name)
    entry = BACKENDS[name]
    if isinstance(entry, str):
        # a module found by name is untyped to mypy: its open_storage is the contract's factory (base.py)
        return cast(StorageFactory, importlib.import_module(entry).open_storage)
    return entry


def open_storage(name: str, namespace: "StorageNamespace", page_bytes: int,
                 extra_config: Mapping[str, object]) -> "KVStorage":
    """Open backend ``name`` (ValueError for an unknown one; a backend raises StartupError when it cannot start)."""
    store = factory(name)(namespace, page_bytes, extra_config)
    if not store.name:  # a store that does not name itself is shown under the name it was opened by
        store.name = name
    if not store.location:
        store.location = name
    return store


def parse_extra_config(s: str | None) -> dict[str, Any]:
    """--hicache-storage-backend-extra-config: a JSON object, or @path to a file holding one. None/"" -> {}."""
    if s is None or not s.strip():
        return {}
    text, source = s.strip(), "--hicache-storage-backend-extra-config"
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        source = f"extra-config file {path}"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(
                f"cannot read {source}: {e.strerror or e}; pass @<existing JSON file> or a JSON string"
            ) from e
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{source} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
            "pass a JSON object such as '{\"max_size_gb\": 50}' or @path/to/config.json"
        ) from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{source} must be a JSON object like {{\"max_size_gb\": 50}}, got {type(cfg).__name__}")
    return cfg
