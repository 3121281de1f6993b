import pytest

from tierlm.runtime.cache.page_allocator import OutOfPages, PageAllocator


def test_alloc_and_free_account_exactly():
    a = PageAllocator(8)
    p = a.alloc(3)
    assert len(set(p)) == 3 and a.num_free == 5
    q = a.alloc(5)
    assert a.num_free == 0 and not set(p) & set(q)
    with pytest.raises(OutOfPages):
        a.alloc(1)
    a.free(p)
    assert a.num_free == 3
    assert sorted(a.alloc(3)) == sorted(p)


def test_double_free_and_foreign_pages_raise():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free(p[:1])
    with pytest.raises(ValueError, match="twice"):
        a.free(p[:1])
    with pytest.raises(ValueError, match="not in this pool"):
        a.free([4])


def test_alloc_zero_is_empty():
    a = PageAllocator(2)
    assert a.alloc(0) == [] and a.num_free == 2


def test_pages_are_handed_out_in_ascending_order():
    """A request's pages follow its positions in memory order, so decode reads its K/V forward (last-first pages
    made a 3.9k-token CPU decode step 1.6x slower)."""
    a = PageAllocator(64)
    first = a.alloc(5)
    assert first == [0, 1, 2, 3, 4] and a.alloc(3) == [5, 6, 7]
    a.free([3, 1, 4])
    assert a.alloc(3) == [1, 3, 4]  # whatever order they came back in
