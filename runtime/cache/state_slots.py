"""StateSlots: the free list of a hybrid model's recurrent-state slots (backends/base.StateGeometry).

A slot holds the conv and recurrent state of every linear layer. Requests hold slots (*in use*: one live slot per
running request, plus the one its latest unpublished snapshot sits in); radix-tree nodes hold snapshots
(*cached*, runtime/cache/state_snapshots.py). The backend owns the contents, this file only the indices, as
PageAllocator does for KV pages. The invariant, shown in /server_info:

    free + cached + in_use == total
"""
from __future__ import annotations


class StateSlots:
    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a state pool needs at least one slot, got {total}")
        self.total = total
        self._free = list(range(total - 1, -1, -1))  # pop() hands out slot 0 first
        self._is_free = [True] * total
        self.in_use = 0  # held by requests
        self.cached = 0  # held by radix-tree nodes (snapshots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot for a request, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = False
        self.in_use += 1
        return slot

    def _release(self, slot: int) -> None:
        if not 0 <= slot < self.total:
            raise ValueError(f"state slot {slot} is outside the pool of {self.total}")
        if self._is_free[slot]:  # a double free would hand one slot to two owners
            raise ValueError(f"state slot {slot} is already free")
        self._is_free[slot] = True
        self._free.append(slot)

    def free(self, slot: int) -> None:
        """A request gives its slot back."""
        self._release(slot)
        self.in_use -= 1

    def to_cache(self) -> None:
        """A request's slot became a tree node's snapshot (same index, new owner)."""
        self.in_use -= 1
        self.cached += 1

    def free_cached(self, slot: int) -> None:
        """A tree node dropped its snapshot."""
        self._release(slot)
        self.cached -= 1

    def accounting(self) -> dict[str, int]:
        return {"total_slots": self.total, "free_slots": self.num_free, "cached_slots": self.cached,
                "in_use_slots": self.in_use}
