"""HostCache: slots, pinning, write-back ordering, capacity, and concurrent use."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tierstore.cache import PAGE, POLICIES, BuddyAllocator, HostCache


def pattern(key, nbytes: int, version: int = 0) -> torch.Tensor:
    """Bytes that identify (key, version) at every position."""
    seed = (hash(key) * 31 + version * 1009) & 0xFFFF
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + seed) % 251).to(torch.uint8)


def put(cache: HostCache, key, nbytes: int, version: int = 0):
    """Insert ``key`` filled with its pattern and release it; True if cached."""
    handle = cache.insert(key, nbytes, meta=version)
    if handle is None:
        return False
    if handle.new:
        handle.view.copy_(pattern(key, nbytes, version))
    handle.release()
    return True


def test_insert_lookup_roundtrip_and_stats():
    cache = HostCache(64 * 1024, policy="lru")
    assert not cache.pinned and cache.capacity_bytes == 64 * 1024
    assert cache.lookup("a") is None
    h = cache.insert("a", 10_000, meta={"v": 1})
    assert h.new and h.view.dtype == torch.uint8 and h.view.numel() == 10_000
    h.view.copy_(pattern("a", 10_000))
    cache.publish(h)
    h2 = cache.lookup("a")
    assert torch.equal(h2.view, pattern("a", 10_000)) and h2.meta == {"v": 1} and not h2.new
    h.release()
    h2.release()
    again = cache.insert("a", 10_000)  # already cached: the existing entry, not a new slot
    assert not again.new and torch.equal(again.view, pattern("a", 10_000))
    again.release()
    with pytest.raises(RuntimeError):
        again.release()
    s = cache.stats()
    assert (s.hits, s.misses, s.entries) == (1, 1, 1)
    assert s.bytes_resident == 10_000 and s.bytes_allocated == 16 * 1024  # 4-page slot
    assert s.hit_rate == 0.5


def test_insert_with_data_and_context_manager():
    cache = HostCache(32 * 1024)
    data = bytes(range(256)) * 20
    with cache.insert("k", len(data), data=data) as h:
        assert bytes(h.view.numpy()) == data
    with cache.insert("t", 400, data=torch.arange(100, dtype=torch.float32)) as h:
        assert torch.equal(h.view.view(torch.float32), torch.arange(100, dtype=torch.float32))
    with pytest.raises(ValueError):
        cache.insert("bad", 10, data=b"123")
    assert "bad" not in cache and len(cache) == 2


def test_pinned_entries_are_never_evicted():
    cache = HostCache(2 * PAGE, policy="lru")
    a = cache.insert("a", PAGE)  # kept pinned
    cache.publish(a)
    assert put(cache, "b", PAGE)
    assert put(cache, "c", PAGE)  # a is older but pinned: b goes
    assert "a" in cache and "b" not in cache and "c" in cache
    c = cache.lookup("c")
    assert cache.insert("d", PAGE) is None  # everything pinned: not cached
    assert cache.stats().no_room == 1
    c.release()
    a.release()
    assert put(cache, "d", PAGE)
    assert cache.stats().evictions == 2


def test_oversize_entry_is_not_cached():
    cache = HostCache(48 * 1024)  # top-level blocks of 32 KiB and 16 KiB
    assert BuddyAllocator(48 * 1024).max_order == 3
    assert cache.insert("big", 40 * 1024) is None
    assert put(cache, "fits", 32 * 1024)


def test_dirty_victim_written_back_with_its_bytes_before_reuse():
    log = []
    cache_ref = {}

    def writeback(key, view, meta):
        # runs without the cache lock: other calls must work from inside it
        assert cache_ref["c"].lookup("nothing") is None
        cache_ref["c"].stats()
        log.append((key, bytes(view.numpy()), meta))

    cache = HostCache(PAGE, policy="lru", writeback=writeback)
    cache_ref["c"] = cache
    h = cache.insert("a", 3000, meta="v0")
    h.view.copy_(pattern("a", 3000))
    cache.mark_dirty("a", meta="v1")
    h.release()
    assert cache.dirty_keys() == ["a"]
    done = threading.Event()
    result = {}

    def insert_b():
        result["h"] = cache.insert("b", 3000)
        done.set()

    t = threading.Thread(target=insert_b)
    t.start()
    t.join(10)
    assert done.is_set(), "insert deadlocked while writing back"
    assert log == [("a", bytes(pattern("a", 3000).numpy()), "v1")]
    hb = result["h"]
    assert hb.new and hb.view.data_ptr() == cache._arena.data_ptr()  # a's slot, reused
    hb.view.copy_(pattern("b", 3000))
    hb.release()
    assert "a" not in cache and cache.stats().writebacks == 1


def test_lookup_of_victim_waits_for_its_write_back():
    backing = {}
    seen = {}
    waiting = threading.Event()
    returned = threading.Event()

    def look(key):
        seen["lookup"] = cache.lookup(key)
        returned.set()

    def writeback(key, view, meta):
        t = threading.Thread(target=look, args=(key,), name="victim-lookup")
        t.start()
        # Rather than guess how long a lookup takes, see it either wait on the cache (for
        # the write-back to end) or return.
        deadline = time.monotonic() + 30
        while not (waiting.is_set() or returned.is_set()) and time.monotonic() < deadline:
            time.sleep(0.001)
        seen["blocked"] = waiting.is_set() and not returned.is_set()
        backing[key] = bytes(view.numpy())
        seen["thread"] = t

    cache = HostCache(PAGE, policy="lru", writeback=writeback)
    real_wait = cache._cond.wait

    def wait(timeout=None):
        if threading.current_thread().name == "victim-lookup":
            waiting.set()
        return real_wait(timeout)

    cache._cond.wait = wait
    put(cache, "a", 100)
    cache.mark_dirty("a")
    put(cache, "b", 100)
    seen["thread"].join(30)
    assert seen["blocked"] is True
    assert seen["lookup"] is None  # then misses: the caller reads the written-back bytes
    assert backing["a"] == bytes(pattern("a", 100).numpy())


def test_failed_write_back_keeps_victim():
    def writeback(key, view, meta):
        raise OSError("disk full")

    cache = HostCache(PAGE, policy="lru", writeback=writeback)
    put(cache, "a", 100)
    cache.mark_dirty("a")
    with pytest.raises(OSError):
        cache.insert("b", 100)
    assert "a" in cache and "b" not in cache and cache.dirty_keys() == ["a"]
    h = cache.lookup("a")
    assert torch.equal(h.view, pattern("a", 100))
    h.release()
    assert cache.stats().bytes_allocated == PAGE


def test_dirty_entries_not_evicted_without_writeback():
    cache = HostCache(PAGE, policy="lru")
    put(cache, "a", 100)
    cache.mark_dirty("a")
    assert cache.insert("b", 100) is None
    written = []
    assert cache.flush(lambda k, v, m: written.append(k)) == 1
    assert written == ["a"] and cache.dirty_keys() == []
    assert put(cache, "b", 100)


def test_flush_cleans_only_what_it_wrote():
    written = {}
    cache = HostCache(8 * PAGE, writeback=lambda k, v, m: None)

    def writeback(key, view, meta):
        written[key] = (bytes(view.numpy()), meta)
        if key == "b":
            cache.mark_dirty("b", meta="newer")  # a write lands during the write-back

    for i, k in enumerate("abc"):
        put(cache, k, 1000, version=i)
    cache.mark_dirty("a", meta=1)
    cache.mark_dirty("b", meta=2)
    assert cache.flush(writeback) == 2
    assert written["a"] == (bytes(pattern("a", 1000, 0).numpy()), 1)
    assert set(written) == {"a", "b"}
    assert cache.dirty_keys() == ["b"]  # re-dirtied during its flush: still dirty
    assert cache.stats().writebacks == 2


def test_invalidate_frees_slot_after_last_release():
    cache = HostCache(4 * PAGE)
    put(cache, "a", PAGE)
    h = cache.lookup("a")
    assert cache.invalidate("a")
    assert cache.lookup("a") is None and "a" not in cache
    assert cache.stats().bytes_allocated == PAGE  # still pinned by h
    assert torch.equal(h.view, pattern("a", PAGE))
    h.release()
    assert cache.stats().bytes_allocated == 0
    assert not cache.invalidate("a")


def test_large_entry_evicts_an_aligned_block():
    cache = HostCache(4 * PAGE, policy="lru")
    for k in "abcd":
        assert put(cache, k, PAGE)
    assert put(cache, "e", 2 * PAGE)  # needs an aligned pair: a (LRU) and its buddy go
    s = cache.stats()
    assert s.evictions == 2 and "a" not in cache and "e" in cache
    assert s.bytes_allocated == 4 * PAGE
    for k in cache:
        with cache.lookup(k) as h:
            assert torch.equal(h.view, pattern(k, h.nbytes))


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "belady"])
def test_every_policy_runs_in_the_cache(policy):
    cache = HostCache(16 * PAGE, policy=policy)
    rng = random.Random(3)
    for _ in range(400):
        k = min(int(rng.expovariate(0.15)), 40)
        h = cache.lookup(k)
        if h is None:
            put(cache, k, PAGE * rng.choice([1, 1, 2]))
        else:
            assert torch.equal(h.view, pattern(k, h.nbytes))
            h.release()
        cache.tick()
    s = cache.stats()
    assert s.hits + s.misses == 400 and s.bytes_allocated <= 16 * PAGE


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["get", "get", "get", "pin", "unpin", "drop", "dirty"]),
            st.integers(0, 15),
            st.integers(1, 9 * PAGE),
        ),
        min_size=1,
        max_size=60,
    ),
    policy=st.sampled_from([p for p in POLICIES if p != "belady"]),
    pages=st.integers(1, 24),
)
def test_capacity_in_bytes_never_exceeded(ops, policy, pages):
    written = {}
    cache = HostCache(
        pages * PAGE,
        policy=policy,
        writeback=lambda k, v, m: written.__setitem__(k, bytes(v.numpy())),
    )
    sizes = {}
    pinned = []
    for op, key, nbytes in ops:
        nbytes = sizes.setdefault(key, nbytes)
        if op in ("get", "pin"):
            h = cache.lookup(key)
            if h is None:
                h = cache.insert(key, nbytes)
                if h is not None and h.new:
                    h.view.copy_(pattern(key, nbytes))
                    cache.publish(h)
            if h is not None:
                assert torch.equal(h.view, pattern(key, nbytes))
                (pinned.append(h) if op == "pin" else h.release())
        elif op == "unpin" and pinned:
            pinned.pop(0).release()
        elif op == "drop":
            cache.invalidate(key)
        elif op == "dirty" and key in cache:
            cache.mark_dirty(key)
        s = cache.stats()
        assert s.bytes_resident <= s.bytes_allocated <= cache.capacity_bytes
        for h in pinned:  # pinned entries are never evicted (unless invalidated)
            assert h.key in cache or h._entry.gone
    for key, data in written.items():
        assert data == bytes(pattern(key, sizes[key]).numpy())
    for h in pinned:
        h.release()


def test_many_threads_with_verified_values():
    """Readers and writers on a small cache: every read sees the latest written version."""
    n_threads, own_keys, shared_keys, rounds = 6, 4, 12, 150
    backing = {}
    backing_lock = threading.Lock()

    def writeback(key, view, meta):
        with backing_lock:
            backing[key] = (meta, view.clone())

    cache = HostCache(14 * PAGE, writeback=writeback)
    size = {("s", i): PAGE * (1 + i % 2) for i in range(shared_keys)}
    size.update({(t, i): 3000 + 500 * i for t in range(n_threads) for i in range(own_keys)})
    errors = []

    def load(key):
        """Lookup, or insert and fill from the backing dict; a pinned handle or None."""
        h = cache.lookup(key)
        if h is not None:
            return h
        h = cache.insert(key, size[key])
        if h is not None and h.new:
            with backing_lock:
                version, data = backing.get(key, (0, pattern(key, size[key])))
            h.view.copy_(data)  # as read from the backing tier: clean
            cache.publish(h)
        return h

    def worker(t):
        rng = random.Random(t)
        version = dict.fromkeys(range(own_keys), 0)
        try:
            for _ in range(rounds):
                if rng.random() < 0.5:
                    key = ("s", rng.randrange(shared_keys))
                    h = load(key)
                    if h is None:
                        continue
                    if not torch.equal(h.view, pattern(key, size[key])):
                        errors.append(f"shared {key} corrupted")
                    h.release()
                else:
                    i = rng.randrange(own_keys)
                    key = (t, i)
                    h = load(key)
                    if h is None:  # not cached: write through
                        version[i] += 1
                        with backing_lock:
                            backing[key] = (version[i], pattern(key, size[key], version[i]))
                        continue
                    if not torch.equal(h.view, pattern(key, size[key], version[i])):
                        errors.append(f"{key} lost version {version[i]}")
                    version[i] += 1
                    h.view.copy_(pattern(key, size[key], version[i]))
                    cache.mark_dirty(key, meta=version[i])
                    h.release()
            for i in range(own_keys):
                final[(t, i)] = version[i]
        except Exception as exc:  # surfaced below
            errors.append(repr(exc))

    final = {}
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert errors == []
    cache.flush()
    for key, v in final.items():
        if v == 0:
            continue
        meta, data = backing[key]
        assert meta == v and torch.equal(data, pattern(key, size[key], v))
    s = cache.stats()
    assert s.bytes_allocated <= cache.capacity_bytes and s.evictions > 0


def test_admission_threshold_refuses_cold_key():
    cache = HostCache(PAGE, policy_args=dict(theta=2, period=1000))
    put(cache, "hot", 100)
    for _ in range(3):
        cache.lookup("hot").release()
    assert cache.insert("cold", 100) is None  # count 1 < theta, and "hot" (4) is hotter
    assert cache.stats().admissions_refused == 1 and "hot" in cache
    assert put(cache, "cold", 100)  # its second miss counts 2 >= theta
    assert "hot" not in cache


def test_external_clock_decays_counts():
    cache = HostCache(4 * PAGE, policy_args=dict(beta=0.5, period=2, auto_tick=False))
    put(cache, "a", 100)
    cache.lookup("a").release()
    assert cache.policy.count("a") == 2.0
    cache.tick()
    cache.tick()
    assert cache.policy.count("a") == 1.0


def test_semoe_cascade_frees_several_slots():
    cache = HostCache(3 * PAGE, policy="semoe")
    for k in "xyzyzz":  # hits table x1 y2 z3
        h = cache.lookup(k)
        if h is None:
            put(cache, k, PAGE)
        else:
            h.release()
    assert cache.policy.hits_table() == {"x": 1, "y": 2, "z": 3}
    assert put(cache, "w", PAGE)
    assert cache.keys() == ["w"] and cache.stats().evictions == 3


@pytest.mark.gpu
def test_arena_is_pinned_with_cuda_and_copies_to_device():
    cache = HostCache(8 * PAGE, pin_memory=True)  # pinning is otherwise lazy: see cache.pinned
    assert cache.pinned
    with cache.insert("a", 5000, data=pattern("a", 5000)) as h:
        assert h.view.is_pinned()
        on_device = h.view.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), pattern("a", 5000))


def test_stats_counters_always_equal_a_recount() -> None:
    """stats() keeps entry and dirty counts incrementally; they must match the index after
    every kind of change, a failed write-back (which undoes an eviction) included."""
    import random

    rng = random.Random(7)
    fail = {"now": False}

    def writeback(key, view, meta) -> None:
        if fail["now"]:
            raise OSError("disk full")

    cache = HostCache(64 * 4096, policy="lru", writeback=writeback, pin_memory=False)
    for _ in range(2000):
        key, op = rng.randrange(40), rng.random()
        fail["now"] = rng.random() < 0.1
        try:
            if op < 0.4:
                h = cache.insert(key, 4096 * rng.randint(1, 4), data=None)
                if h is not None:
                    if h.new and rng.random() < 0.6:
                        cache.mark_dirty(key)
                    h.release()
            elif op < 0.55:
                if key in cache:
                    cache.mark_dirty(key)
            elif op < 0.65:
                cache.clean(key)
            elif op < 0.75:
                cache.invalidate(key)
            elif op < 0.8:
                cache.flush()
            else:
                h = cache.lookup(key)
                if h is not None:
                    h.release()
        except (OSError, KeyError):
            pass
        s = cache.stats()
        assert s.entries == len(cache.keys())
        assert s.dirty_entries == len(cache.dirty_keys())


def test_overwrite_replaces_bytes_in_place_and_marks_dirty():
    cache = HostCache(64 * 1024, policy="lru")
    assert put(cache, "a", 8192, version=1)
    before = cache.stats()
    assert cache.overwrite("a", pattern("a", 8192, 2), meta=2)
    with cache.lookup("a") as h:
        assert torch.equal(h.view, pattern("a", 8192, 2)) and h.meta == 2
    assert cache.dirty_keys() == ["a"]
    after = cache.stats()
    # Same slot: nothing allocated or evicted, and a rewrite is not a lookup.
    assert after.bytes_allocated == before.bytes_allocated and after.evictions == 0
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)


def test_overwrite_refuses_pinned_absent_or_resized_entries():
    cache = HostCache(64 * 1024, policy="lru")
    assert not cache.overwrite("missing", pattern("missing", 4096))
    assert put(cache, "a", 4096, version=1)
    assert not cache.overwrite("a", pattern("a", 8192, 2))  # another size needs another slot
    h = cache.lookup("a")
    assert not cache.overwrite("a", pattern("a", 4096, 2))  # a reader holds the old bytes
    assert torch.equal(h.view, pattern("a", 4096, 1))
    h.release()
    assert cache.overwrite("a", pattern("a", 4096, 2))
    assert cache.dirty_keys() == ["a"]


def test_readers_never_see_a_half_overwritten_entry():
    cache = HostCache(4 << 20, policy="lru")
    nbytes = 1 << 20
    versions = [pattern("k", nbytes, v) for v in range(4)]
    cache.insert("k", nbytes, meta=0, data=versions[0]).release()
    stop = threading.Event()
    bad: list[int] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            h = cache.lookup("k")
            if h is None:
                continue
            with h:
                if not torch.equal(h.view, versions[h.meta]):
                    bad.append(h.meta)
            reads[0] += 1
            time.sleep(0.0002)  # leave gaps in which the entry is unpinned

    threads = [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    done = tried = 0
    # How many rewrites find the entry unpinned, and how many reads overlap them, is up to
    # the scheduler: go on until enough of both have happened (400 tries at least).
    deadline = time.monotonic() + 60
    while tried < 400 or (min(done, reads[0]) < 20 and time.monotonic() < deadline):
        v = tried % 4
        done += cache.overwrite("k", versions[v], meta=v)
        tried += 1
        time.sleep(0.0002)
    stop.set()
    for t in threads:
        t.join()
    assert not bad
    assert done >= 20 and reads[0] >= 20  # rewrites found the entry unpinned, reads ran


def test_watched_entries_retire_before_their_bytes_change():
    """watch/on_retire (the daemon's lock-free index): a watched entry's token comes back
    through on_retire when it is overwritten in place, replaced, invalidated or evicted, and
    only the current, settled version of a key can be watched."""
    retired = []
    cache = HostCache(4 * PAGE, policy="lru")
    cache.on_retire(retired.append)
    tokens = iter(range(100))

    def watch(key):
        h = cache.lookup(key)
        try:
            return cache.watch(h, lambda off, n: (next(tokens), off, n))
        finally:
            h.release()

    put(cache, "a", PAGE)
    tok = watch("a")
    assert tok[1] % PAGE == 0 and tok[2] == PAGE
    assert watch("a") == tok  # one token per entry
    assert cache.overwrite("a", pattern("a", PAGE, 1)) and retired == [tok]
    tok = watch("a")
    assert cache.invalidate("a") and retired[-1] == tok
    put(cache, "b", PAGE)
    tok = watch("b")
    for k in "cdef":  # four pages of newer entries evict b
        put(cache, k, PAGE)
    assert "b" not in cache and retired[-1] == tok
    h = cache.lookup("c")
    staged = cache.stage("c", PAGE)
    assert cache.watch(staged, lambda off, n: 0) is None  # not a version of anything yet
    cache.commit_staged(staged)
    assert cache.watch(h, lambda off, n: 0) is None  # no longer the current version
    h.release()
    n = len(retired)
    cache.on_retire(None)
    h = cache.lookup("c")
    assert cache.watch(h, lambda off, n: 0) is None  # nobody listens: nothing published
    h.release()
    assert len(retired) == n


def test_record_hits_counts_resident_keys_only():
    cache = HostCache(4 * PAGE, policy="lfu")
    put(cache, "a", PAGE)
    before = cache.stats().hits
    assert cache.record_hits(["a", "a", "gone"]) == 2
    assert cache.stats().hits == before + 2


def test_insert_with_data_over_a_cached_key_is_an_error():
    cache = HostCache(4 * PAGE, policy="lru")
    cache.insert("a", 8, data=b"old-byte").release()
    with pytest.raises(ValueError, match="already cached"):
        cache.insert("a", 8, data=b"new-byte")
    h = cache.lookup("a")
    assert bytes(h.view.numpy()) == b"old-byte" and h._entry.pins == 1
    h.release()
