"""L3 storage backends by name: what ``--hicache-storage-backend NAME`` opens.

Each backend is one module exposing ``open_storage(args, namespace, page_bytes, extra_config) -> KVStorage``
(base.py is the contract). Modules are imported only when their backend is opened, so an optional
dependency (mooncake) costs nothing to servers that do not use it. A third store (3FS, NIXL, Redis/Valkey) is
one module plus one line in ``BACKENDS`` (or a ``register()`` call from code that runs before the engine).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from tierlm.runtime.cache.storage.base import KVStorage
    from tierlm.runtime.cache.storage.namespace import StorageNamespace

# (args: ServerArgs, namespace, page_bytes, extra_config without the controller's own keys) -> KVStorage
StorageFactory = Callable[[Any, "StorageNamespace", int, Mapping[str, Any]], "KVStorage"]

# name -> "module path" holding open_storage(), or the factory itself (register()).
BACKENDS: dict[str, str | StorageFactory] = {
    "file": "tierlm.runtime.cache.storage.file_storage",
    "mooncake": "tierlm.runtime.cache.storage.mooncake_storage",
}


def register(name: str, factory: str | StorageFactory) -> None:
    """Add (or replace) a backend: a module path with ``open_storage``, or the factory itself."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a storage backend needs a non-empty name, got {name!r}")
    BACKENDS[name] = factory


def names() -> list[str]:
    return sorted(BACKENDS)


def check_name(name: str) -> None:
    """ValueError naming the available backends unless ``name`` is one of them."""
    if name not in BACKENDS:
        raise ValueError(f"--hicache-storage-backend {name}: tierlm has the {', '.join(names())} backends "
                         "(docs/hicache.md); SGLang's others (hf3fs, nixl, aibrix, eic, ...) are not implemented")


def factory(name: str) -> StorageFactory:
    check_name(name)
    entry = BACKENDS[name]
    if isinstance(entry, str):
        return importlib.import_module(entry).open_storage
    return entry


def open_storage(name: str, args: Any, namespace: "StorageNamespace", page_bytes: int,
                 extra_config: Mapping[str, Any]) -> "KVStorage":
    """Open backend ``name`` (ValueError for an unknown one; a backend raises StartupError when it cannot start)."""
    return factory(name)(args, namespace, page_bytes, extra_config)
