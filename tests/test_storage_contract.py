"""The L3 storage contract is the whole contract: a store written here, in this file alone, registered by name,
serves storage (L3) hits through the real engine, with no change anywhere else."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping, Sequence

import pytest
from engine_harness import greedy, pool_is_clean, run, start_engine

from tierlm.runtime.cache.storage import registry
from tierlm.runtime.cache.storage.base import STAT_FIELDS, KVStorage
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.server_args import ServerArgs

PS = 4


class DictStorage(KVStorage):
    """Pages in a dict per namespace, shared by every store opened in this process (so they outlive an engine)."""

    name = "dict"
    shelves: dict[str, dict[str, bytes]] = {}

    def __init__(self, namespace: StorageNamespace, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.location = f"memory://{namespace.folder_name}"
        self._pages = self.shelves.setdefault(namespace.id, {})
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STAT_FIELDS, 0)

    def known(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._pages for k in keys]

    def get(self, key: str) -> bytes | None:
        with self._lock:
            page = self._pages.get(key)
            self._counts["reads" if page is not None else "misses"] += 1
            self._counts["bytes_read"] += len(page or b"")
        return page

    def set(self, key: str, payload: Any) -> bool:
        page = bytes(payload)
        assert len(page) == self.page_bytes
        with self._lock:
            if key not in self._pages:
                self._pages[key] = page
                self._counts["writes"] += 1
                self._counts["bytes_written"] += len(page)
        return True

    def clear(self) -> int:
        with self._lock:
            n = len(self._pages)
            self._pages.clear()
        return n

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._counts, "files": len(self._pages), "bytes": len(self._pages) * self.page_bytes}

    def close(self) -> None:
        pass


def open_dict_storage(namespace: StorageNamespace, page_bytes: int, extra_config: Mapping[str, Any]
                      ) -> DictStorage:
    return DictStorage(namespace, page_bytes)


@pytest.fixture
def dict_backend(monkeypatch):
    """"dict" registered for this test only."""
    monkeypatch.setattr(registry, "BACKENDS", dict(registry.BACKENDS))
    monkeypatch.setattr(DictStorage, "shelves", {})
    registry.register("dict", open_dict_storage)
    return "dict"


def engine_with(backend_name: str, model, storage: str):
    return start_engine(model, backend_name, page_size=PS, max_total_tokens=96, enable_hierarchical_cache=True,
                        hicache_ratio=4.0, hicache_storage_backend=storage,
                        hicache_storage_prefetch_policy="wait_complete")


def test_a_store_registered_by_name_serves_l3_hits_through_the_engine(tiny_llama, dict_backend, backend_name):
    prompt = [(2 * 31 + j * 7) % 270 + 5 for j in range(60)] + [7]
    engine = engine_with(backend_name, tiny_llama, dict_backend)
    try:
        cold, = run(engine, [prompt], greedy(12))
    finally:
        engine.shutdown()  # flushes queued writes
    engine = engine_with(backend_name, tiny_llama, dict_backend)
    try:
        hot, = run(engine, [prompt], greedy(12))
        assert hot.last.cached.storage == 60 and hot.token_ids == cold.token_ids
        info = engine.parts.cache.tiers_info()["storage"]
        assert info["backend"] == "dict" and info["dir"].startswith("memory://") and info["state"] == "online"
        assert info["reads"] == 15 and pool_is_clean(engine)
    finally:
        engine.shutdown()


def test_the_backend_name_is_checked_once_with_one_message(dict_backend):
    args = ServerArgs(model_path="m", enable_hierarchical_cache=True, hicache_storage_backend="dict")
    args.check()  # registered: accepted
    with pytest.raises(ValueError, match="tierlm has the dict, file, mooncake backends"):
        dataclasses.replace(args, hicache_storage_backend="hf3fs").check()
