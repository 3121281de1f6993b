"""NGRAM draft source (runtime/speculative/ngram.py): own-sequence matches, the shared LRU store, and a brute-force
reference over random sequences."""
import random
from collections import Counter

import pytest

from tierlm.runtime.speculative.ngram import NgramDrafter


def reference(seq, min_window, max_window, n, match_type):
    """The longest earlier occurrence of the suffix (never the suffix itself) and what followed it."""
    L = len(seq)
    for w in range(min(max_window, L - 1), min_window - 1, -1):
        suffix = seq[L - w:]
        occ = [e for e in range(w, L) if seq[e - w:e] == suffix]  # e: where the continuation starts
        if occ:
            if match_type == "PROB":
                counts = Counter(seq[e] for e in occ)
                e = max(occ, key=lambda e: (counts[seq[e]], e))
            else:
                e = max(occ)
            return seq[e:e + n]
    return []


def drafts_for(seq, max_drafts=8, **kw):
    d = NgramDrafter(kw.pop("min_window", 1), kw.pop("max_window", 12), kw.pop("branch_length", 18),
                     kw.pop("capacity", 10_000), **kw)
    return d.propose(d.new_state(seq), [], max_drafts)


def test_repeated_passage_gives_its_continuation():
    passage = [10, 11, 12, 13, 14, 15, 16, 17]
    seq = [1, 2] + passage + [3, 4] + passage[:3]
    assert drafts_for(seq, 4) == [13, 14, 15, 16]
    assert drafts_for(seq, 100) == [13, 14, 15, 16, 17, 3, 4, 10, 11, 12]  # up to the end of the known tokens


def test_continuation_may_run_into_the_suffix_region():
    assert drafts_for([7, 7, 7], 5) == [7]  # [7,7] at end 2 is followed by the last 7 only


def test_longest_window_wins_over_a_shorter_more_recent_match():
    seq = [1, 2, 3, 50, 9, 3, 60, 1, 2, 3]
    # [3] alone last occurred before 60, but [1, 2, 3] occurred before 50
    assert drafts_for(seq, 1) == [50]
    assert drafts_for(seq, 1, max_window=1) == [60]


def test_bfs_takes_the_most_recent_prob_the_most_frequent_continuation():
    seq = [1, 5, 1, 5, 1, 5, 1, 7, 1]
    assert drafts_for(seq, 2, max_window=1, match_type="BFS") == [7, 1]
    assert drafts_for(seq, 2, max_window=1, match_type="PROB") == [5, 1]


def test_prob_ties_go_to_the_most_recent():
    seq = [1, 5, 1, 7, 1]
    assert drafts_for(seq, 1, max_window=1, match_type="PROB") == [7]


def test_min_window_respected():
    seq = [1, 2, 3, 9, 4, 5, 3]
    assert drafts_for(seq, 3, min_window=1) == [9, 4, 5]
    assert drafts_for(seq, 3, min_window=2) == []


def test_max_drafts_and_branch_length_bound_the_chain():
    seq = list(range(30)) + [0, 1]
    assert drafts_for(seq, 5) == [2, 3, 4, 5, 6]
    assert drafts_for(seq, 0) == []
    assert drafts_for(seq, 50, branch_length=4) == [2, 3, 4, 5]


def test_no_repeat_no_self_match():
    assert drafts_for(list(range(100)), 8) == []
    assert drafts_for([], 8) == []
    assert drafts_for([5], 8) == []


def test_incremental_appends():
    d = NgramDrafter(1, 4, 18, 10_000)
    st = d.new_state([1, 2, 3, 4, 5])
    assert d.propose(st, [], 3) == []
    assert d.propose(st, [1, 2], 3) == [3, 4, 5]
    assert d.propose(st, [3], 0) == []  # still indexed
    assert d.propose(st, [4], 3) == [5, 1, 2]


def test_shared_store_gives_a_finished_request_continuation():
    d = NgramDrafter(1, 4, 6, 10_000)
    a = d.new_state([100, 101, 102])
    d.propose(a, [103, 104, 105, 106, 107, 108], 3)
    assert d.stats()["store_entries"] == 0
    d.finish(a)
    assert d.stats()["store_entries"] > 0
    b = d.new_state([1, 2, 101, 102])
    assert d.propose(b, [], 10) == [103, 104, 105, 106, 107, 108]  # branch_length 6
    assert d.propose(b, [103], 2) == [104, 105]
    assert d.propose(b, [999], 2) == []
    d.finish(a)  # a second finish is a no-op
    assert d.propose(a, [1], 3) == []  # a finished state proposes nothing


def test_store_and_own_match_the_longer_wins_own_wins_ties():
    d = NgramDrafter(1, 4, 8, 10_000)
    d.finish(d.new_state([1, 2, 3, 40, 41]))
    assert d.propose(d.new_state([3, 50, 1, 2, 3]), [], 2) == [40, 41]  # store [1,2,3] beats own [3]
    assert d.propose(d.new_state([2, 3, 60, 2, 3]), [], 1) == [60]  # both match [2,3]: own wins
    assert d.propose(d.new_state([7, 1, 2, 3, 61, 7, 1, 2, 3]), [], 1) == [61]  # own [7,1,2,3] beats the store


def test_store_capacity_counts_tokens_and_evicts_least_recently_used():
    # one window of 2, continuations of up to 3: [a,b,c,d,e,f] -> entries at ends 2..5 costing 5, 5, 4, 3 tokens
    d = NgramDrafter(2, 2, 3, 40)

    def record(base):
        d.finish(d.new_state([base + i for i in range(6)]))

    def hit(base):
        return d.propose(d.new_state([900, base, base + 1]), [], 3)

    record(0)
    record(100)
    assert d.stats() == {"store_entries": 8, "store_tokens": 34, "capacity": 40}
    assert hit(0) == [2, 3, 4]  # a use: A's first entry is now the newest
    record(200)  # 51 tokens, 11 over: the least recently used go first, A's (1,2), (2,3), (3,4): 12 tokens
    assert d.stats() == {"store_entries": 9, "store_tokens": 39, "capacity": 40}
    assert [hit(1), hit(2), hit(3)] == [[], [], []]
    assert hit(0) == [2, 3, 4]  # used after B was recorded: outlives B
    assert hit(100) == [102, 103, 104]
    assert hit(200) == [202, 203, 204]
    # 17 more, 16 over: B's three unused entries (12 tokens), then C's oldest unused one
    record(300)
    assert d.stats() == {"store_entries": 9, "store_tokens": 39, "capacity": 40}
    assert [hit(101), hit(102), hit(103), hit(201)] == [[], [], [], []]
    assert [hit(0), hit(100), hit(202)] == [[2, 3, 4], [102, 103, 104], [204, 205]]
    assert hit(300) == [302, 303, 304]


def test_store_same_ngram_is_replaced_by_the_newest():
    d = NgramDrafter(1, 2, 4, 10_000)
    d.finish(d.new_state([1, 2, 30, 31]))
    tokens = d.stats()["store_tokens"]
    d.finish(d.new_state([1, 2, 40, 41]))
    assert d.propose(d.new_state([9, 1, 2]), [], 2) == [40, 41]
    assert d.stats()["store_tokens"] < 2 * tokens  # replaced entries are not counted twice


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        NgramDrafter(3, 2, 18, 100)
    with pytest.raises(ValueError):
        NgramDrafter(1, 2, 18, 100, "DFS")


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_random_sequences_match_the_brute_force_reference(match_type):
    rng = random.Random(1234)
    for _ in range(150):
        alphabet = rng.randint(2, 5)
        min_w = rng.randint(1, 3)
        max_w = rng.randint(min_w, 6)
        branch = rng.randint(1, 10)
        d = NgramDrafter(min_w, max_w, branch, 10_000, match_type)
        prompt = [rng.randrange(alphabet) for _ in range(rng.randint(0, 40))]
        st = d.new_state(prompt)
        seq = list(prompt)
        while len(seq) < 110:
            chunk = [rng.randrange(alphabet) for _ in range(rng.choice([0, 1, 1, 1, 2, 5]))]
            seq += chunk
            max_drafts = rng.choice([0, 1, 3, 8])
            got = d.propose(st, chunk, max_drafts)
            want = reference(seq, min_w, max_w, min(max_drafts, branch), match_type)
            assert got == want, (seq, min_w, max_w, max_drafts)
            # the same sequence indexed from scratch
            assert d.propose(d.new_state(seq), [], max_drafts) == want
        assert d.stats()["store_entries"] == 0  # no finish: nothing shared


def test_store_releases_sequences_over_many_requests():
    d = NgramDrafter(1, 2, 3, 50)
    for i in range(70_000 // 100):
        d.finish(d.new_state([i, i + 1, i + 2]))
    d._next_sid = 1 << 20  # ids past 16 bits pack and release like small ones
    for i in range(200):
        d.finish(d.new_state([i, i + 1, i + 2]))
    assert d.stats()["store_tokens"] <= 50
    assert len(d._seqs) <= d.stats()["store_entries"]  # sequences no entry points into are dropped
    assert d.propose(d.new_state([7, 198, 199]), [], 3) == [200]
