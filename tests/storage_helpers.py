"""Conveniences over a KVStorage, StorageIO or PrefetchHandle that only tests use: the runtime's contract
(runtime/cache/storage/base.py) lists only what the runtime calls, so these live here."""
from __future__ import annotations

import time
from typing import Any, Sequence

from tierlm.runtime.cache.storage.storage_io import BackupCallback, PrefetchHandle, StorageIO


def exists_prefix(store: Any, keys: Sequence[str]) -> int:
    """How many leading keys ``store.exists`` finds, asking one key at a time (stops at the first miss)."""
    n = 0
    for key in keys:
        if not store.exists([key])[0]:
            break
        n += 1
    return n


def get_all(store: Any, keys: Sequence[str]) -> list[bytes | None]:
    """store.get() of each key."""
    return [store.get(k) for k in keys]


def set_all(store: Any, keys: Sequence[str], payloads: Sequence[Any]) -> list[bool]:
    """store.set() of each key with its payload."""
    if len(keys) != len(payloads):
        raise ValueError(f"set_all got {len(keys)} keys but {len(payloads)} payloads")
    return [store.set(k, p) for k, p in zip(keys, payloads)]


def backup_all(io: StorageIO, keys: Sequence[str], payloads: Sequence[bytes],
               on_done: BackupCallback | None = None) -> int:
    """Queue several page writes in order; how many were queued (stops at the first dropped one)."""
    for n, (key, payload) in enumerate(zip(keys, payloads)):
        if not io.backup(key, payload, on_done):
            return n
    return len(keys)


def wait_io_idle(handle: PrefetchHandle, timeout: float) -> bool:
    """Wait until no read writes into the handle's buffers; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not handle.io_idle:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def mooncake_client(store: Any) -> Any:
    """The Mooncake client of a MooncakeKVStorage (None while offline), to reach the stored objects directly."""
    return store.connection.store
