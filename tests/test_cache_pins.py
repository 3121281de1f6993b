"""Prompt-caching pins (runtime/cache/pins.py) on the radix tree alone: eviction passes over pinned nodes until
nothing else is left, pins expire after their TTL on an injected clock, refreshes, splits, the per-tier bound.
The engine-level behaviour (floods, tiers, retraction, both backends) is in test_cache_pins_engine.py."""
import pytest

from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.pins import PinTable
from tierlm.runtime.cache.radix_cache import RadixCache

PS = 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(num_pages=32, fraction=0.5):
    alloc = PageAllocator(num_pages)
    tree = RadixCache(PS, alloc.free)
    clock = Clock()
    pins = PinTable(tree, lambda: {"device": num_pages}, fraction=fraction, clock=clock)
    return alloc, tree, pins, clock


def put(alloc, tree, tokens):
    pages = alloc.alloc(len(tokens) // PS)
    _, node = tree.insert(tokens, pages)
    return pages, node


def test_unpinned_pages_go_first_and_pinned_ones_only_under_pressure():
    alloc, tree, pins, _ = make(16)
    pinned, node = put(alloc, tree, [1, 1, 2, 2, 3, 3, 4, 4])
    assert pins.pin_prefix(node, 4, ttl_s=300) == 4
    put(alloc, tree, [5, 5, 6, 6, 7, 7])
    tree.match_prefix([5, 5, 6, 6, 7, 7])  # the unpinned branch is the most recently used, and still goes first
    assert tree.evict(3) == 3
    assert tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4]).device_pages == pinned
    assert tree.match_prefix([5, 5, 6, 6, 7, 7]).device_pages == []
    assert pins.pinned_pages() == {"device": 4}
    # nothing unpinned is left: pressure takes pinned pages, and says so in the counter
    assert tree.evict(2) >= 2
    assert tree.evicted_pinned_pages >= 2
    assert len(tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4]).device_pages) <= 2


def test_pin_of_part_of_an_edge_splits_it_and_the_rest_stays_evictable():
    alloc, tree, pins, _ = make(16)
    pages, node = put(alloc, tree, [1, 1, 2, 2, 3, 3, 4, 4])
    assert pins.pin_prefix(node, 2, ttl_s=300) == 2
    assert tree.evict(2) == 2  # the two unpinned pages past the pin
    assert tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4]).device_pages == pages[:2]
    assert pins.pinned_pages() == {"device": 2}


def test_pins_expire_after_their_ttl():
    alloc, tree, pins, clock = make(16)
    pages, node = put(alloc, tree, [1, 1, 2, 2])
    pins.pin_prefix(node, 2, ttl_s=60)
    clock.now += 59
    put(alloc, tree, [5, 5, 6, 6])  # newer than the pinned branch: lru alone would keep it longer
    assert tree.evict(2) == 2
    assert tree.match_prefix([1, 1, 2, 2]).device_pages == pages and pins.pinned_pages() == {"device": 2}
    pins.sweep()
    assert pins.info()["prefixes"] == 1
    clock.now += 2
    assert pins.pinned_pages() == {"device": 0}
    assert pins.sweep() >= 1 and pins.info()["prefixes"] == 0
    put(alloc, tree, [7, 7, 8, 8])
    assert tree.evict(2) == 2 and tree.evicted_pinned_pages == 0  # an ordinary eviction, oldest first
    assert tree.match_prefix([1, 1, 2, 2]).device_pages == []


def test_pinning_again_refreshes_the_ttl_and_never_shortens_it():
    alloc, tree, pins, clock = make(16)
    _, node = put(alloc, tree, [1, 1, 2, 2])
    pins.pin_prefix(node, 2, ttl_s=60)
    clock.now += 50
    assert pins.pin_prefix(node, 2, ttl_s=60) == 2  # refreshed: counted as pinned by this call
    clock.now += 50
    assert pins.pinned_pages() == {"device": 2}  # 100 s after the first pin, 50 after the refresh
    pins.pin_prefix(node, 2, ttl_s=3600)
    pins.pin_prefix(node, 2, ttl_s=1)  # a shorter pin leaves the longer expiry
    clock.now += 600
    assert pins.pinned_pages() == {"device": 2}


def test_a_pin_beyond_the_bound_is_truncated_then_refused():
    alloc, tree, pins, _ = make(16, fraction=0.25)  # 4 pages may be pinned
    _, node = put(alloc, tree, [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    assert pins.pin_prefix(node, 6, ttl_s=300) == 4
    assert pins.pinned_pages() == {"device": 4} and pins.truncated_pins == 1
    _, other = put(alloc, tree, [7, 7, 8, 8])
    assert pins.pin_prefix(other, 2, ttl_s=300) == 0  # refused: the bound is spent
    assert pins.pin_prefix(node, 4, ttl_s=300) == 4  # a refresh costs nothing
    assert pins.info()["tiers"] == {"device": {"pinned_pages": 4, "limit_pages": 4}}
    assert tree.evict(16) >= 8  # everything unpinned, then (pressure) the pinned pages too
    assert pins.pinned_pages() == {"device": 0}


def test_zero_fraction_pins_nothing():
    alloc, tree, pins, _ = make(16, fraction=0.0)
    _, node = put(alloc, tree, [1, 1, 2, 2])
    assert pins.pin_prefix(node, 2, ttl_s=300) == 0
    assert pins.pinned_pages() == {"device": 0}


def test_a_later_split_of_a_pinned_edge_keeps_both_parts_pinned():
    alloc, tree, pins, _ = make(16)
    pages, node = put(alloc, tree, [1, 1, 2, 2, 3, 3])
    pins.pin_prefix(node, 3, ttl_s=300)
    put(alloc, tree, [1, 1, 9, 9])  # splits the pinned edge after its first page
    assert tree.evict(1) == 1  # only the unpinned [9, 9] page can go
    assert tree.match_prefix([1, 1, 2, 2, 3, 3]).device_pages == pages
    assert pins.pinned_pages() == {"device": 3}
    assert pins.info()["prefixes"] == 1


def test_flush_drops_pins():
    alloc, tree, pins, _ = make(16)
    _, node = put(alloc, tree, [1, 1, 2, 2])
    pins.pin_prefix(node, 2, ttl_s=300)
    tree.reset()
    assert pins.pinned_pages() == {"device": 0} and pins.info()["prefixes"] == 0
    assert alloc.num_free == 16


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_the_flag_is_checked(fraction):
    from tierlm.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="--cache-pin-fraction"):
        ServerArgs(cache_pin_fraction=fraction).check()
