from tierlm.runtime.cache.page_allocator import PageAllocator
from tierlm.runtime.cache.radix_cache import RadixCache

PS = 2


def make(num_pages=32):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(PS, alloc.free)


def test_match_is_page_granular_and_longest_prefix():
    alloc, tree = make()
    pages = alloc.alloc(3)
    tree.insert([1, 2, 3, 4, 5, 6], pages)
    m = tree.match_prefix([1, 2, 3, 4, 9, 9, 9])
    assert m.device_pages == pages[:2]
    m = tree.match_prefix([1, 2, 3])  # the last token is a partial page: not matched
    assert m.device_pages == pages[:1]
    assert tree.match_prefix([7, 7]).device_pages == []
    assert tree.match_prefix([1, 2, 3, 4, 5, 6], max_pages=1).device_pages == pages[:1]


def test_insert_returns_existing_pages_for_duplicates():
    alloc, tree = make()
    first = alloc.alloc(2)
    tree.insert([1, 2, 3, 4], first)
    second = alloc.alloc(3)
    got, _ = tree.insert([1, 2, 3, 4, 5, 6], second)
    assert got == first + second[2:]  # the tree keeps its own copy of the shared prefix
    assert tree.device_pages_cached == 3


def test_split_keeps_both_branches():
    alloc, tree = make()
    a = alloc.alloc(3)
    tree.insert([1, 1, 2, 2, 3, 3], a)
    b = alloc.alloc(3)
    got, _ = tree.insert([1, 1, 2, 2, 4, 4], b)
    assert got == a[:2] + b[2:]
    assert tree.match_prefix([1, 1, 2, 2, 3, 3]).device_pages == a
    assert tree.match_prefix([1, 1, 2, 2, 4, 4]).device_pages == a[:2] + b[2:]


def test_locked_pages_are_never_evicted_and_lru_goes_first():
    alloc, tree = make(8)
    old = alloc.alloc(2)
    tree.insert([1, 1, 2, 2], old)
    new = alloc.alloc(2)
    tree.insert([5, 5, 6, 6], new)
    tree.match_prefix([5, 5, 6, 6])  # touch: now most recently used
    locked = alloc.alloc(2)
    _, node = tree.insert([7, 7, 8, 8], locked)
    tree.lock(node)
    assert tree.evictable_pages == 4
    freed = tree.evict(1)
    assert freed >= 1
    assert tree.match_prefix([1, 1, 2, 2]).device_pages == old[:2 - freed]  # LRU branch lost pages
    assert tree.match_prefix([5, 5, 6, 6]).device_pages == new
    tree.evict(100)
    assert tree.match_prefix([7, 7, 8, 8]).device_pages == locked
    tree.unlock(node)
    tree.evict(100)
    assert tree.device_pages_cached == 0 and alloc.num_free == 8


def test_evicting_a_leaf_exposes_its_parent():
    alloc, tree = make(8)
    a = alloc.alloc(2)
    tree.insert([1, 1, 2, 2], a)
    b = alloc.alloc(1)
    tree.insert([1, 1, 2, 2, 3, 3], a + b)
    assert tree.evict(3) == 3
    assert alloc.num_free == 8 and tree.root.children == {}


def test_lock_accounting_follows_the_path():
    alloc, tree = make()
    p = alloc.alloc(3)
    _, node = tree.insert([1, 1, 2, 2, 3, 3], p)
    m = tree.match_prefix([1, 1, 2, 2])  # splits the edge
    tree.lock(m.last_node)
    assert tree.device_pages_locked == 2
    tree.lock(node)
    assert tree.device_pages_locked == 3
    tree.unlock(m.last_node)
    tree.unlock(node)
    assert tree.device_pages_locked == 0
