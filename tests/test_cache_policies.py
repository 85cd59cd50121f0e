"""Eviction policies on hand-worked access sequences, plus properties checked at random."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tierstore.cache import (
    POLICIES,
    AccountingCache,
    ArcPolicy,
    BeladyPolicy,
    LfuDecayPolicy,
    LfuPolicy,
    LruPolicy,
    SemoePolicy,
    make_policy,
)
from tierstore.cache.policies import heap_walk


def run(policy, keys, capacity):
    """Replay unit-sized ``keys`` at ``capacity`` entries; (hits list, evicted list, cache)."""
    cache = AccountingCache(policy, capacity, log_evictions=True)
    hits = [cache.access(k, 1) for k in keys]
    return hits, cache.evicted, cache


# lru / lfu


def test_lru_victims_by_hand():
    # a b c resident; hit a -> order b c a; d evicts b; e evicts c; b evicts a
    hits, evicted, cache = run(LruPolicy(), list("abcadeb"), 3)
    assert hits == [False, False, False, True, False, False, False]
    assert evicted == ["b", "c", "a"]
    assert set(cache.sizes) == {"d", "e", "b"}


def test_lfu_victims_by_hand():
    # counts a2 b1 c1: d evicts b (tie with c, b older); c->2; e evicts d (1);
    # f evicts e (the only count-1 entry)
    policy = LfuPolicy()
    hits, evicted, _ = run(policy, list("aabcdcef"), 3)
    assert evicted == ["b", "d", "e"]
    assert policy.count("a") == 2 and policy.count("c") == 2 and policy.count("f") == 1


def test_candidates_skip_unevictable_without_evicting_them():
    policy = LruPolicy()
    for k in "abcd":
        policy.record_insert(k, 1)
    order = list(policy.candidates(None, lambda k: k != "b"))
    assert order == ["a", "c", "d"]
    assert policy.victim(None, lambda k: k not in "ab") == "c"
    assert len(policy) == 4


# lfu-decay


def test_lfu_decay_arithmetic_with_external_ticks():
    p = LfuDecayPolicy(beta=0.5, period=2, theta=0, auto_tick=False)
    p.record_miss("a", 1)
    p.record_insert("a", 1)
    assert p.count("a") == 1.0
    for _ in range(3):
        p.record_hit("a")
    assert p.count("a") == 4.0
    p.tick()
    assert p.count("a") == 4.0  # one tick of a period of two: no decay yet
    p.tick()
    assert p.count("a") == 2.0
    p.record_hit("a")
    assert p.count("a") == 3.0
    for _ in range(4):  # two periods: 3 * 0.25
        p.tick()
    assert p.count("a") == 0.75


def test_lfu_decay_arithmetic_with_access_ticks():
    # The clock ticks at the start of every access; with period 2 the 2nd and 4th accesses
    # decay everything before adding their own +1.
    p = LfuDecayPolicy(beta=0.5, period=2, theta=0, clock="access")
    cache = AccountingCache(p, 10)
    cache.access("a", 1)  # tick 1: a = 1
    cache.access("a", 1)  # tick 2 decays: a = 0.5 + 1
    assert p.count("a") == 1.5
    cache.access("a", 1)  # tick 3: a = 2.5
    cache.access("b", 1)  # tick 4 decays: a = 1.25, b = 1
    assert p.count("a") == 1.25
    assert p.count("b") == 1.0


def test_lfu_decay_pass_clock_ticks_when_a_key_repeats():
    # A pass ends at the first access to a key already accessed in it: a b c | a c | b.
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0, clock="pass")
    cache = AccountingCache(p, 10)
    for k in "abc":
        cache.access(k, 1)  # one pass, no decay: a = b = c = 1
    assert (p.count("a"), p.count("b"), p.count("c")) == (1.0, 1.0, 1.0)
    cache.access("a", 1)  # a repeats: tick, all halve, then a += 1
    assert (p.count("a"), p.count("b"), p.count("c")) == (1.5, 0.5, 0.5)
    cache.access("c", 1)  # c is new in this pass: no tick
    assert p.count("c") == 1.5
    cache.access("c", 1)  # c repeats: tick
    assert (p.count("a"), p.count("b"), p.count("c")) == (0.75, 0.25, 1.75)
    cache.access("b", 1)  # same pass as the last c: no tick
    assert p.count("b") == 1.25 and p.count("a") == 0.75


def test_lfu_decay_pass_clock_is_bounded():
    # With no key repeating, a pass still ends after pass_limit distinct keys.
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0, clock="pass")
    p.pass_limit = 3
    cache = AccountingCache(p, 10)
    for k in "abc":
        cache.access(k, 1)
    cache.access("d", 1)  # fourth distinct key: the pass ends, a b c halve
    assert (p.count("a"), p.count("d")) == (0.5, 1.0)


def test_lfu_decay_auto_clock_switches_to_steps_at_first_tick():
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0)  # clock="auto"
    assert p.clock == "auto"
    cache = AccountingCache(p, 10)
    cache.access("a", 1)
    cache.access("a", 1)  # still passes: the repeat ticks, a = 0.5 + 1
    assert p.count("a") == 1.5
    p.tick()  # an external clock exists now: a = 0.75
    assert p.count("a") == 0.75
    for _ in range(3):
        cache.access("a", 1)  # repeats no longer tick
    assert p.count("a") == 3.75
    p.tick()
    assert p.count("a") == 1.875


def test_lfu_decay_clock_names():
    assert LfuDecayPolicy(auto_tick=True).clock == "access"
    assert LfuDecayPolicy(auto_tick=False).clock == "step"
    assert LfuDecayPolicy(clock="step").auto_tick is False
    with pytest.raises(ValueError, match="clock"):
        LfuDecayPolicy(clock="hourly")


def test_lfu_decay_non_power_of_two_beta():
    p = LfuDecayPolicy(beta=0.9, period=3, theta=0, auto_tick=False)
    p.record_miss("a", 1)
    p.record_insert("a", 1)
    p.record_hit("a")
    for _ in range(7):  # two decays
        p.tick()
    assert p.count("a") == pytest.approx(2 * 0.81, rel=1e-12)


def test_lfu_decay_ghost_resumes_decayed_count():
    # turn=0: victims by count alone (the turn classes are tested below)
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0, auto_tick=False, turn=0)
    cache = AccountingCache(p, 2, log_evictions=True)
    for k in "aaab":  # a = 3, b = 1
        cache.access(k, 1)
    cache.access("c", 1)  # b (1) is the smallest: evicted, remembered at 1
    assert cache.evicted == ["b"]
    assert "b" in p.ghost_keys() and p.count("b") == 1.0
    p.tick()  # a = 1.5, c = 0.5, ghost b = 0.5
    assert (p.count("a"), p.count("c"), p.count("b")) == (1.5, 0.5, 0.5)
    cache.access("b", 1)  # resumes 0.5 + 1 for this access; c (0.5) is the victim
    assert cache.evicted == ["b", "c"]
    assert p.count("b") == 1.5
    assert p.count("c") == 0.5  # now in the ghost table
    cache.access("d", 1)  # a and b tie at 1.5: least recently used (a) goes
    assert cache.evicted == ["b", "c", "a"]
    assert p.count("d") == 1.0  # never seen: starts at 1


def test_lfu_decay_ghost_is_lru_bounded():
    p = LfuDecayPolicy(theta=0, ghost_size=2)
    _, evicted, _ = run(p, list("abcd"), 1)
    assert evicted == ["a", "b", "c"]
    assert p.ghost_keys() == ["b", "c"]  # a fell out of the two-key ghost table
    assert p.count("a") == 0.0 and p.count("b") == 1.0


def test_lfu_decay_theta_refuses_cold_key_over_hotter_victim():
    p = LfuDecayPolicy(beta=0.5, period=1000, theta=2)
    hits, evicted, cache = run(p, list("aaa"), 1)
    cache.access("b", 1)  # b would start at 1 < theta and a (3) is hotter: refused
    assert "b" not in cache.sizes and cache.refused == 1
    assert p.count("b") == 1.0  # but the access is remembered
    cache.access("b", 1)  # now 2 >= theta: admitted, a evicted
    assert "b" in cache.sizes and cache.evicted == ["a"]
    assert p.count("b") == 2.0 and p.count("a") == 3.0


def test_lfu_decay_theta_admits_when_victim_not_hotter():
    p = LfuDecayPolicy(beta=0.5, period=1000, theta=5)
    _, evicted, cache = run(p, list("ab"), 1)  # b (1) vs victim a (1): not hotter
    assert evicted == ["a"] and cache.refused == 0


def test_lfu_decay_theta_zero_admits_everything():
    p = LfuDecayPolicy(theta=0)
    _, _, cache = run(p, list("aaaab"), 1)
    assert cache.refused == 0 and "b" in cache.sizes


def test_lfu_decay_renormalizes_exactly():
    """Thousands of decays (past the renormalization point) agree with plain arithmetic."""
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0, auto_tick=False)
    expected = {}
    for k in "ab":
        p.record_miss(k, 1)
        p.record_insert(k, 1)
        expected[k] = 1.0
    for i in range(2500):
        p.tick()
        expected = {k: v * 0.5 for k, v in expected.items()}
        if i % 97 == 0:
            p.record_hit("a")
            expected["a"] += 1
        if i % 211 == 0:
            p.record_hit("b")
            expected["b"] += 1
    for k in "ab":
        assert p.count(k) == pytest.approx(expected[k], rel=1e-12)
    assert p.victim() == min(expected, key=expected.get)


def test_lfu_decay_rejects_bad_parameters():
    for bad in (dict(beta=1.0), dict(beta=0.0), dict(period=0), dict(theta=-1), dict(turn=0.5),
                dict(beta=float("nan")), dict(theta=float("nan")), dict(theta=float("inf"))):
        with pytest.raises(ValueError):
            LfuDecayPolicy(**bad)


def _turn_run(**args):
    """Two steps of unit entries in a three-entry cache (see the turn tests)."""
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0, clock="step", **args)
    cache = AccountingCache(p, 3, log_evictions=True)
    for k in "aaab":  # step 1, accesses 1-4: a = 3 (last used at access 3), b = 1
        cache.access(k, 1)
    p.tick()  # a = 1.5, b = 0.5; the step had 4 accesses; a and b are ahead
    return p, cache


def test_lfu_decay_turn_classes_by_hand():
    p, cache = _turn_run()  # turn = 1.1: passed after 4.4 accesses unused
    cache.access("c", 1)  # access 5 fits: c = 1, used this step
    # access 6: nothing has passed (a was last used at 3 > 6 - 4.4); this step's keys go
    # before the ones ahead, so c (1) goes although b (0.5) has the smaller count
    cache.access("d", 1)
    assert cache.evicted == ["c"]
    cache.access("e", 1)  # access 7: still nothing passed; d, used this step, goes
    assert cache.evicted == ["c", "d"]
    # access 8: a (last used at 3 < 8 - 4.4) has let its turn pass: it goes first, count
    # 1.5 and all, before e (1, this step) and b (0.5, ahead)
    cache.access("f", 1)
    assert cache.evicted == ["c", "d", "a"]
    assert list(p.candidates(None)) == ["e", "f", "b"]
    assert list(p.candidates(None, lambda k: k not in "ef")) == ["b"]  # pinned: skipped
    p.tick()  # e and f are ahead now; b has had a whole step: passed
    assert list(p.candidates(None)) == ["b", "e", "f"]
    assert (p.count("b"), p.count("e")) == (0.25, 0.5)  # counts decay as before


def test_lfu_decay_turn_zero_orders_by_count_alone():
    p, cache = _turn_run(turn=0)
    for k in "cdef":
        cache.access(k, 1)
    # d: b (0.5) goes; e: c and d tie at 1 with a at 1.5, c is older; f: d
    assert cache.evicted == ["b", "c", "d"]


def test_lfu_decay_turns_need_a_step_clock():
    # Without ticks (the pass clock) or before the first tick there is no step length:
    # victims by count alone, as with turn = 0.
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0, clock="pass")
    _, evicted, _ = run(p, list("aaabcdef"), 3)
    q = LfuDecayPolicy(beta=0.5, period=1, theta=0, clock="pass", turn=0)
    assert evicted == run(q, list("aaabcdef"), 3)[1]
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0, clock="step")
    _, evicted, _ = run(p, list("aaabcdef"), 3)  # never ticked
    assert evicted == ["b", "c", "d"]  # a = 3 stays; then the oldest count-1 key each time


def test_lfu_decay_auto_clock_orders_by_turn_once_ticked():
    p = LfuDecayPolicy(beta=0.5, period=1, theta=0)  # clock="auto"
    cache = AccountingCache(p, 4)
    for k in "aba":  # the repeat of a ends a pass before any tick: a = 1.5, b = 0.5
        cache.access(k, 1)
    p.tick()  # a = 0.75, b = 0.25; no step length yet, turns were not tracked
    for k in "ca":  # accesses 4 and 5: c = 1, a = 1.75
        cache.access(k, 1)
    p.tick()  # a 2-access step: a = 0.875, c = 0.5 are ahead, b = 0.125 has passed
    cache.access("d", 1)  # access 6 fits: d = 1, this step
    assert list(p.candidates(None)) == ["b", "d", "c", "a"]  # by count: b c a d


def test_lfu_decay_turn_heaps_stay_compact():
    p = LfuDecayPolicy(theta=0)
    cache = AccountingCache(p, 8)
    for i in range(5000):
        if i % 6 == 0:
            p.tick()
        cache.access((i * 7) % 13, 1)
    assert sum(len(h) for h in p._heaps) <= 2 * len(p) + 64
    assert sorted(p.candidates(None)) == sorted(cache.sizes)


# semoe (literal Algorithm 1)


def test_semoe_threshold_and_cascade_by_hand():
    p = SemoePolicy(threshold=2)
    hits, evicted, cache = run(p, list("ab"), 2)
    cache.access("c", 1)  # full; min count 1 < threshold: nothing evicted, c not cached
    assert cache.evicted == [] and "c" not in cache.sizes
    cache.access("a", 1)
    cache.access("b", 1)  # a = b = 2
    cache.access("d", 1)  # min 2 >= 2: every entry with the minimum goes, a and b
    assert cache.evicted == ["a", "b"]
    assert set(cache.sizes) == {"d"}
    assert p.hits_table() == {}  # d was fetched in the eviction branch: untracked
    cache.access("e", 1)  # room for e, but acc_caches never went down: eviction branch,
    assert "e" not in cache.sizes  # nothing tracked to evict, so e is not cached
    cache.access("d", 1)  # d's first hit gives it a table entry
    assert p.hits_table() == {"d": 1}


def test_semoe_cascade_continues_through_higher_counts():
    # table order x(1) y(2) z(3): deleting x makes 2 the minimum, the loop then meets y,
    # deleting it makes 3 the minimum, and it meets z: the whole cache goes.
    p = SemoePolicy(threshold=1)
    _, _, cache = run(p, list("xyzyzz"), 3)
    assert p.hits_table() == {"x": 1, "y": 2, "z": 3}
    cache.access("w", 1)
    assert cache.evicted == ["x", "y", "z"]
    assert set(cache.sizes) == {"w"}


def test_semoe_cascade_stops_at_entries_already_passed():
    # table order a(2) b(1) c(2) d(3): b goes, then only c (a was passed while b was the
    # minimum and survives, so the minimum stays 2 and d is kept)
    p = SemoePolicy(threshold=1)
    _, _, cache = run(p, list("abcdacdd"), 4)
    assert p.hits_table() == {"a": 2, "b": 1, "c": 2, "d": 3}
    cache.access("e", 1)
    assert cache.evicted == ["b", "c"]
    assert set(cache.sizes) == {"a", "d", "e"}


def test_semoe_never_decays():
    p = SemoePolicy(threshold=1, beta=0.5, period=2)
    run(p, list("aaaaaaa"), 2)  # one miss (count 1) and six hits
    assert p.hits_table() == {"a": 7}


class LiteralSemoe:
    """Algorithm 1's SparseSchedule transcribed line by line (O(n) per miss), unit sizes."""

    def __init__(self, capacity, threshold):
        self.capacity, self.threshold = capacity, threshold
        self.hits, self.cache, self.full = {}, set(), False

    def access(self, p):
        if p in self.cache:
            self.hits[p] = self.hits.get(p, 0) + 1
            return True
        if not self.full and len(self.cache) < self.capacity:
            self.hits[p] = 1
            self.cache.add(p)
            return False
        self.full = True
        fetched = False
        for pa in list(self.hits):
            if pa not in self.hits:
                continue
            hit_a = self.hits[pa]
            if hit_a >= self.threshold and min(self.hits.values()) == hit_a:
                self.cache.discard(pa)
                del self.hits[pa]
                fetched = True
        if fetched:
            self.cache.add(p)
        return False


@settings(max_examples=150, deadline=None)
@given(
    keys=st.lists(st.integers(0, 7), min_size=1, max_size=60),
    capacity=st.integers(1, 5),
    threshold=st.integers(0, 3),
)
def test_semoe_matches_line_by_line_transcription(keys, capacity, threshold):
    ref = LiteralSemoe(capacity, threshold)
    policy = SemoePolicy(threshold=threshold)
    cache = AccountingCache(policy, capacity)
    for k in keys:
        assert cache.access(k, 1) == ref.access(k)
        assert set(cache.sizes) == ref.cache
        assert policy.hits_table() == ref.hits


# arc


def test_arc_by_hand():
    # c = 2 entries. Worked with Megiddo & Modha's cases:
    # a, b: T1=[a,b]; a hit: T1=[b] T2=[a]; c: REPLACE from T1 (|T1|=1 > p=0): b -> B1;
    # b (B1 hit): p=1, REPLACE from T2 (|T1|=1 not > 1): a -> B2, b -> T2;
    # d: REPLACE from T2: b -> B2, d -> T1; a (B2 hit): p=0, REPLACE from T1: c -> B1;
    # e: case IV-A (|T1|+|B1| = c): B1's c is dropped, d -> B1, e -> T1.
    policy = ArcPolicy()
    _, evicted, cache = run(policy, list("abacbda"), 2)
    assert evicted == ["b", "a", "b", "c"]
    assert policy.lists() == {"t1": ["d"], "t2": ["a"], "b1": ["c"], "b2": ["b"]}
    assert policy.p == 0
    cache.access("e", 1)
    assert cache.evicted[-1] == "d"
    assert policy.lists() == {"t1": ["e"], "t2": ["a"], "b1": ["d"], "b2": ["b"]}


def test_arc_ghost_bounds_in_bytes():
    policy = ArcPolicy()
    cache = AccountingCache(policy, 6)
    for i in range(300):
        key = (i * 7) % 13 if i % 3 else i % 4
        cache.access(key, 1 + key % 3)
        lists = policy.lists()
        assert set(lists["t1"]) | set(lists["t2"]) == set(cache.sizes)
        size = policy._size
        assert size["t1"] + size["b1"] <= 6
        assert sum(size.values()) <= 12
        assert 0 <= policy.p <= 6


# belady


def test_belady_by_hand():
    # future a b c b a c, room for 2
    keys = list("abcbac")
    classic = BeladyPolicy(keys, bypass=False)
    hits, evicted, _ = run(classic, keys, 2)
    # c: a (next at 4) is farther than b (3): evict a; a: b is never used again: evict b
    assert evicted == ["a", "b"]
    assert sum(hits) == 2
    bypass = BeladyPolicy(keys, bypass=True)
    hits, evicted, _ = run(bypass, keys, 2)
    # c (next at 5) is needed later than a (4): not cached; then a and b hit
    assert hits == [False, False, False, True, True, False]
    assert evicted == []


def test_belady_checks_the_future():
    policy = BeladyPolicy(list("ab"))
    policy.record_miss("a", 1)
    with pytest.raises(ValueError):
        policy.record_miss("c", 1)


@functools.cache
def _opt(keys: tuple, capacity: int, i: int, resident: frozenset, optional: bool) -> int:
    """Most hits achievable from position i (exhaustive over eviction/admission choices)."""
    if i == len(keys):
        return 0
    k = keys[i]
    if k in resident:
        return 1 + _opt(keys, capacity, i + 1, resident, optional)
    options = []
    if optional:
        options.append(resident)
    if len(resident) < capacity:
        options.append(resident | {k})
    else:
        options.extend((resident - {v}) | {k} for v in resident)
    return max(_opt(keys, capacity, i + 1, r, optional) for r in options)


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.sampled_from("abcde"), min_size=1, max_size=11),
    capacity=st.integers(1, 3),
)
def test_belady_equals_brute_force_optimum(keys, capacity):
    for bypass in (False, True):
        hits, _, _ = run(BeladyPolicy(keys, bypass=bypass), keys, capacity)
        assert sum(hits) == _opt(tuple(keys), capacity, 0, frozenset(), bypass)


# all policies


def _make(name, keys):
    return make_policy(name, future=keys) if name == "belady" else make_policy(name)


@settings(max_examples=150, deadline=None)
@given(
    accesses=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 5)), min_size=1, max_size=80),
    capacity=st.integers(1, 16),
    name=st.sampled_from(POLICIES),
)
def test_capacity_never_exceeded_and_policy_agrees_with_cache(accesses, capacity, name):
    size_of = {}
    trace = []
    for key, size in accesses:
        size_of.setdefault(key, size)
        trace.append((key, size_of[key]))
    policy = _make(name, [k for k, _ in trace])
    cache = AccountingCache(policy, capacity)
    for key, size in trace:
        cache.access(key, size)
        assert cache.used == sum(cache.sizes.values()) <= capacity
        assert len(policy) == len(cache.sizes)
        assert all(k in policy for k in cache.sizes)


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.integers(0, 9), min_size=1, max_size=60), capacity=st.integers(1, 6))
def test_no_policy_beats_belady_on_equal_sizes(keys, capacity):
    best = sum(run(BeladyPolicy(keys), keys, capacity)[0])
    for name in POLICIES:
        assert sum(run(_make(name, keys), keys, capacity)[0]) <= best


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "belady"])
def test_a_batch_of_hits_is_the_hits_one_by_one(name):
    """record_hits (one call per cache lookup) leaves the policy as record_hit in turn."""
    keys = [0, 1, 2, 3, 1, 2, 4, 0, 5]
    policies = [make_policy(name), make_policy(name)]
    for p in policies:
        cache = AccountingCache(p, 5)
        for k in keys:
            cache.access(k, 1)
    hits = [k for k in (3, 1, 4, 1, 5, 3, 1) if k in policies[0]]
    policies[0].record_hits(hits)
    for k in hits:
        policies[1].record_hit(k)
    assert list(policies[0].candidates(9)) == list(policies[1].candidates(9))


def test_make_policy_registry():
    assert POLICIES[0] == "lfu-decay"
    assert set(POLICIES) == {"lfu-decay", "semoe", "lru", "lfu", "arc", "belady"}
    assert isinstance(make_policy("lfu-decay", beta=0.8), LfuDecayPolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo")


def test_heap_walk_is_sorted_and_leaves_heap_alone():
    import heapq
    import random

    rng = random.Random(1)
    heap = [rng.random() for _ in range(300)]
    heapq.heapify(heap)
    before = list(heap)
    assert list(heap_walk(heap)) == sorted(heap)
    assert heap == before


def test_heap_policies_compact_stale_items():
    """Hits leave stale heap items behind; the heap stays within a constant of live keys."""
    p = LfuDecayPolicy(theta=0)
    cache = AccountingCache(p, 8)
    for i in range(5000):
        cache.access(i % 8, 1)
    assert len(p._heap) <= 2 * len(p) + 64
