"""Hybrid models under HiCache: recurrent-state snapshots in the host (L2) and storage (L3) tiers.

A hybrid's prefix is usable only up to a node holding a snapshot (runtime/cache/state_snapshots.py), so a snapshot
travels with its node's pages:
- **L2**: a host state pool (backends/base.HostStatePool, one row per snapshot in SHARED_STATE_LAYOUT) whose slots
  belong to tree nodes with host pages (``TreeNode.host_state_slot``). A snapshot is copied there when its node's
  pages reach the host (or later, once the node has one), and before its device slot is dropped; a load from the
  host brings it back into a device snapshot slot (``to_device``). HiRadixCache frees it with its pages.
- **L3**: a second store of the same backend beside the page store, in its own namespace (the KV facts plus the
  state geometry, so a different state layout never loads), with the same 128-byte header and checksum rules
  (page_header.py). The snapshot at the end of page i is stored under ``state_key(page_keys(...)[i])``. A storage
  prefetch reads pages only up to the deepest position whose snapshot the store knows, plus that snapshot; a
  snapshot that is missing, damaged or late makes the hit a miss at that depth (the request resumes from the
  deepest snapshot in memory), never a wrong one.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Sequence

import numpy as np

from tierlm.backends.base import SHARED_STATE_LAYOUT, HostStatePool, ModelBackend
from tierlm.runtime.cache.hiradix_cache import HiRadixCache
from tierlm.runtime.cache.radix_cache import TreeNode
from tierlm.runtime.cache.state_slots import StateSlots
from tierlm.runtime.cache.state_snapshots import StateSnapshots
from tierlm.runtime.cache.storage.base import KVStorage
from tierlm.runtime.cache.storage.page_keys import page_keys
from tierlm.runtime.cache.storage.storage_io import FreeAfterRead, PrefetchHandle, StorageIO

log = logging.getLogger(__name__)


def state_key(page_key: str) -> str:
    """The L3 key of the snapshot at the end of the page keyed ``page_key`` (64 hex, like a page key)."""
    return hashlib.sha256(b"state:" + page_key.encode("ascii")).hexdigest()


def state_namespace_fields(backend: ModelBackend, page_size: int) -> dict[str, Any]:
    """What makes two stored snapshots the same bytes: the KV facts and the state geometry."""
    g = backend.info.state
    assert g is not None  # only a hybrid model has state snapshots
    return {**backend.kv_namespace(), "page_size": page_size, "layout": "page_first", "entry": "state",
            "state_layout": SHARED_STATE_LAYOUT, "linear_layers": g.num_linear_layers, "conv_dim": g.conv_dim,
            "conv_kernel": g.conv_kernel, "rec_shape": "x".join(map(str, g.rec_shape)), "conv_dtype": g.conv_dtype,
            "rec_dtype": g.rec_dtype}


class StateTiers:
    def __init__(self, backend: ModelBackend, tree: HiRadixCache, snapshots: StateSnapshots, host_slots: int,
                 page_size: int, storage: KVStorage | None = None, storage_io: StorageIO | None = None) -> None:
        self.backend = backend
        self.tree = tree
        self.snapshots = snapshots
        self.page_size = page_size
        assert backend.info.state is not None  # only a hybrid model has state tiers
        self.host = HostStatePool(host_slots, backend.info.state)
        self.alloc = StateSlots(host_slots)  # cached: held by tree nodes; in_use: reserved for an L3 read
        self.storage = storage
        self.io = storage_io
        tree.backup_state = self.backup
        tree.free_host_state_slot = self.alloc.free_cached
        self.loaded_host_states = 0  # host snapshots copied back into device slots
        self.loaded_storage_states = 0  # snapshots read from L3 and used
        self._reads: dict[PrefetchHandle, tuple[PrefetchHandle, int]] = {}  # page prefetch -> (state read, slot)
        # slots a cancelled read may still be writing: freed once it has left them
        self._deferred: FreeAfterRead[int] = FreeAfterRead(self.alloc.free)

    # ------------------------------------------------------------ L2
    def _alloc_host(self) -> int | None:
        self.sweep()
        slot = self.alloc.alloc()
        if slot is None:
            self.tree.evict_host_states(1)
            slot = self.alloc.alloc()
        return slot

    def backup(self, node: TreeNode) -> bool:
        """Copy ``node``'s device snapshot to a host state slot (its pages are on the host) and queue it for L3.
        False when there is nothing to copy or no host slot can be freed."""
        if node.state_slot is None or node.host_pages is None or node.host_state_slot is not None:
            return False
        hs = self._alloc_host()
        if hs is None:
            return False
        self.backend.copy_states_to_host(np.asarray([node.state_slot], np.int32), self.host,
                                         np.asarray([hs], np.int32))
        self.tree.set_host_state(node, hs)
        self.alloc.to_cache()
        self._to_storage(node, hs)
        return True

    def to_device(self, last: TreeNode) -> None:
        """Make the deepest snapshot at or above ``last`` (any tier) a device snapshot, so the request resumes there;
        when no device slot is free it stays on the host and the request resumes at a shallower one."""
        node, _ = self.tree.state_ancestor(last, 0, any_tier=True)
        if node is self.tree.root or node.state_slot is not None:
            return
        self.tree.lock(last)  # nothing on this path is evicted while a slot is made free
        try:
            slot = self.snapshots.alloc()
        finally:
            self.tree.unlock(last)
        if slot is None:
            return
        if node.host_state_slot is None:  # the host copy went while making room: resume shallower
            self.snapshots.slots.free(slot)
            return
        self.backend.copy_states_from_host(self.host, np.asarray([node.host_state_slot], np.int32),
                                           np.asarray([slot], np.int32))
        self.tree.set_state(node, slot)
        self.snapshots.slots.to_cache()
        self.loaded_host_states += 1

    # ------------------------------------------------------------ L3
    def _to_storage(self, node: TreeNode, hs: int) -> None:
        if self.io is None or self.io.stalled:
            return
        key = state_key(page_keys(self.tree.path_tokens(node), self.page_size)[-1])
        assert self.storage is not None  # given with its StorageIO
        if not self.storage.known([key])[0]:
            self.io.backup(key, self.host.data[hs])  # copied now: the host slot may be reused at once

    def deepest_known(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` (page keys, in order, all stored) end at the deepest snapshot the store knows (0:
        none)."""
        if self.storage is None or not keys:
            return 0
        known = self.storage.known([state_key(k) for k in keys])
        return max((i + 1 for i, k in enumerate(known) if k), default=0)

    def reserve(self) -> int | None:
        """A host slot for a snapshot read (None: none can be freed)."""
        return self._alloc_host()

    def start_read(self, page_handle: PrefetchHandle, page_key: str, slot: int) -> None:
        """Read the snapshot at the end of the page keyed ``page_key`` into host slot ``slot``, alongside the page
        prefetch ``page_handle``."""
        view = memoryview(self.host.data[slot]).cast("B")
        assert self.io is not None  # a page prefetch runs only with L3 storage
        handle = self.io.prefetch([state_key(page_key)], known=1, into=[[view]])
        self._reads[page_handle] = (handle, slot)

    def read_done(self, page_handle: PrefetchHandle) -> bool:
        r = self._reads.get(page_handle)
        return r is None or r[0].done

    def take(self, page_handle: PrefetchHandle, wait_s: float = 0.0) -> int | None:
        """The host slot (in use) holding the snapshot read with ``page_handle``; None when it is missing, damaged
        or not read in time (its slot then goes back)."""
        r = self._reads.pop(page_handle, None)
        if r is None:
            return None
        handle, slot = r
        if wait_s > 0:
            handle.wait(wait_s)
        if len(handle.cancel()) == 1:
            return slot
        self._deferred.release(handle, slot)
        return None

    def give_back(self, page_handle: PrefetchHandle) -> None:
        """The page prefetch ended unused: stop its snapshot read and free the slot."""
        r = self._reads.pop(page_handle, None)
        if r is not None:
            r[0].cancel()
            self._deferred.release(*r)

    def adopt(self, node: TreeNode, slot: int) -> None:
        """``node`` (with host pages) takes the snapshot read into ``slot``, or keeps the one it has."""
        if self.tree.set_host_state(node, slot):
            self.alloc.to_cache()
            self.loaded_storage_states += 1
        else:
            self.alloc.free(slot)

    def sweep(self) -> None:
        self._deferred.sweep()

    # ------------------------------------------------------------ flush / close / reporting
    def flush_storage(self) -> int:
        if self.io is None:
            return 0
        self.io.flush(timeout=self.io.io_timeout_s)
        assert self.storage is not None  # given with its StorageIO
        return self.storage.clear()

    def close(self, timeout: float) -> None:
        if self.io is not None:
            self.io.close(flush=True, timeout=timeout)
        if self.storage is not None:
            self.storage.close()

    def accounting(self) -> dict[str, int]:
        acc = self.alloc.accounting()
        assert acc["cached_slots"] == self.tree.host_states_cached, "host state slots and tree snapshots disagree"
        return {f"host_{k}": v for k, v in acc.items()}

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"total_slots": self.host.num_slots,
                               "used_slots": self.host.num_slots - self.alloc.num_free,
                               "slot_bytes": self.host.slot_bytes, "total_bytes": self.host.total_bytes,
                               "loaded_host_states": self.loaded_host_states,
                               "loaded_storage_states": self.loaded_storage_states,
                               "evicted_host_states": self.tree.evicted_host_states}
        if self.storage is not None:
            assert self.io is not None  # given with the storage
            out["storage"] = {**self.storage.stats(), "io": self.io.stats()}
        return out
