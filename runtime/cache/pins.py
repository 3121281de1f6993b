"""Prompt-caching pins: the KV of a prompt prefix kept in the memory tiers for a TTL (Anthropic's ``cache_control``
breakpoints, GenerateRequest.pins).

A pin marks the radix-tree nodes of a prefix (root down to the page the pin ends on; the edge is split there) with
an expiry (``TreeNode.pin_until``). Eviction (radix_cache.py, hiradix_cache.py) passes over pinned nodes while
unpinned ones can go; only when a tier has nothing else left does a pinned node move down a tier (device -> host
-> storage, the way any node does), so a pin never makes a running request wait or be retracted. With a host tier,
a pinned node is backed up to the host (and from there written to L3) when it is pinned.

The bound: pinned pages of each tier stay within ``fraction`` of that tier's pages; a pin that would pass it is
truncated to what fits (possibly nothing), logged, and the request reports only what was pinned. A pin on a prefix
already pinned refreshes its expiry (never shortens it). Expiry is lazy: a node is pinned while ``pin_until`` is
ahead of the clock; ``sweep`` (the scheduler calls it each step) drops expired nodes from the table.
Runs on the scheduler thread; the gauges read a copy of the table from the metrics thread.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Callable, Iterable

from tierlm.runtime.io_struct import PinRequest

if TYPE_CHECKING:
    from tierlm.runtime.cache.radix_cache import RadixCache, TreeNode

log = logging.getLogger(__name__)

DEFAULT_PIN_FRACTION = 0.5  # --cache-pin-fraction: half of each tier may hold pinned pages


class PinTable:
    def __init__(self, tree: RadixCache, capacity: Callable[[], dict[str, int]],
                 fraction: float = DEFAULT_PIN_FRACTION, clock: Callable[[], float] = time.monotonic) -> None:
        """``capacity``: pages per memory tier ({"device": n} and, with HiCache, "host"), read when a pin is
        made; ``clock``: seconds, monotonic (tests pass their own)."""
        self.tree = tree
        tree.pins = self
        self.capacity = capacity
        self.fraction = fraction
        self.clock = clock
        self._nodes: set[TreeNode] = set()
        self._next_expiry = math.inf
        self.truncated_pins = 0  # pins cut short (or refused) by the bound since start

    # ------------------------------------------------------------ what eviction asks
    def pinned_now(self) -> Callable[[TreeNode], bool] | None:
        """A predicate for one eviction: is this node pinned (the clock is read once); None when nothing is."""
        if not self._nodes:
            return None
        now = self.clock()
        return lambda node: node.pin_until > now

    # ------------------------------------------------------------ pinning
    def pin_prefix(self, last_node: TreeNode, pages: int, ttl_s: float) -> int:
        """Pin the first ``pages`` pages of the path ending at ``last_node`` (its pages are in the device tier, the
        path locked by the request that computed it) for ``ttl_s`` seconds, within the bound. Returns the pages
        now pinned by this call (new or refreshed)."""
        now = self.clock()
        self.sweep(now)
        path = self.tree.path_to(last_node)
        ps = self.tree.page_size
        room = self._room()
        host_copy = self.tree.keeps_host_copies
        until = now + ttl_s
        done = 0
        for node in path:
            if done >= pages:
                break
            k = len(node.key) // ps
            fresh = node.pin_until <= now  # newly pinned pages count against the bound; refreshed ones already do
            take = min(k, pages - done)
            if fresh:
                take = min(take, room)
                if take < min(k, pages - done):
                    self.truncated_pins += 1
                    log.warning("pin cut to %d of %d tokens: pinned pages would pass --cache-pin-fraction %g of a "
                                "tier", (done + take) * ps, pages * ps, self.fraction)
                if take == 0:
                    break
            if take < k:
                node = self.tree.split(node, take)  # the pin ends inside this edge: pin its upper part only
            node.pin_until = max(node.pin_until, until)
            self._nodes.add(node)
            self._next_expiry = min(self._next_expiry, node.pin_until)
            if fresh:
                room -= take
            if host_copy and node.host_pages is None:
                self.tree.write_through_pin(node)
            done += take
            if take < k:
                break
        return done

    def pin_request(self, pins: Iterable[PinRequest], last_node: TreeNode | None, cached_pages: int,
                     prompt_len: int) -> int:
        """Each of a finished request's pins on its prompt's pages in the tree (``cached_pages`` of them along the
        path to ``last_node``); returns the prompt tokens pinned (the longest pin that held, whole pages)."""
        if last_node is None:
            return 0
        ps = self.tree.page_size
        best = 0
        for pin in sorted(pins, key=lambda p: p.tokens):
            pages = min(pin.tokens, prompt_len) // ps
            pages = min(pages, cached_pages)
            if pages > 0:
                best = max(best, self.pin_prefix(last_node, pages, pin.ttl_s))
        return best * ps

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """An edge of a pinned node was split: its upper part is pinned as long (the tree copies pin_until)."""
        if lower in self._nodes:
            self._nodes.add(upper)

    # ------------------------------------------------------------ expiry and reset
    def sweep(self, now: float | None = None) -> int:
        """Drop expired pins from the table (cheap until the earliest expiry). Returns how many went."""
        now = self.clock() if now is None else now
        if now < self._next_expiry:
            return 0
        gone = {n for n in self._nodes if n.pin_until <= now}
        self._nodes -= gone
        self._next_expiry = min((n.pin_until for n in self._nodes), default=math.inf)
        return len(gone)

    def clear(self) -> None:
        """/flush_cache: every pin goes with the pages."""
        for node in self._nodes:
            node.pin_until = 0.0
        self._nodes.clear()
        self._next_expiry = math.inf

    # ------------------------------------------------------------ accounting
    def pinned_pages(self) -> dict[str, int]:
        """Pinned pages per memory tier now (expired pins not counted). Safe from another thread."""
        now = self.clock()
        out = {tier: 0 for tier in self.capacity()}
        for node in list(self._nodes):
            if node.pin_until <= now:
                continue
            if node.device_pages is not None:
                out["device"] += len(node.device_pages)
            if node.host_pages is not None and "host" in out:
                out["host"] += len(node.host_pages)
        return out

    def limits(self) -> dict[str, int]:
        """The most pages each tier may have pinned (the bound)."""
        return {tier: int(self.fraction * n) for tier, n in self.capacity().items()}

    def _room(self) -> int:
        """Pages a new pin may add before some tier passes its bound (a newly pinned page costs one in every
        tier: with a host tier it is backed up to the host when pinned)."""
        used, limits = self.pinned_pages(), self.limits()
        return max(0, min(limits[t] - used[t] for t in limits))

    def info(self) -> dict[str, object]:
        """/server_info's ``pins``: pinned pages and the bound per tier."""
        used, limits = self.pinned_pages(), self.limits()
        now = self.clock()
        prefixes = sum(1 for n in list(self._nodes) if n.pin_until > now and not any(
            c in self._nodes and c.pin_until > now for c in list(n.children.values())))
        return {"fraction": self.fraction, "prefixes": prefixes, "truncated_pins": self.truncated_pins,
                "tiers": {t: {"pinned_pages": used[t], "limit_pages": limits[t]} for t in limits}}
