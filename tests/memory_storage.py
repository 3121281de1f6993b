"""An in-memory KVStorage for tests of the L3 I/O machinery; subclasses gate or hang its calls."""
from __future__ import annotations

from tierlm.runtime.cache.storage.base import KVStorage


class MemoryStorage(KVStorage):
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def known(self, keys):
        return [k in self.data for k in keys]

    def get(self, key):
        return self.data.get(key)

    def set(self, key, payload):
        self.data[key] = bytes(payload)
        return True

    def clear(self):
        n = len(self.data)
        self.data.clear()
        return n

    def stats(self):
        return {}

    def close(self):
        pass
