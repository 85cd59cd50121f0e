"""Zero-copy access: Store.borrow_many (lent read-only views) and Store.stage_many (new
versions written in place, then committed), and the HostCache staging underneath."""

from __future__ import annotations

import threading

import pytest
import torch
from tierstore.cache import HostCache

import tierstore


def _t(seed: int, shape: tuple[int, ...] = (64, 32)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["1GiB", "64KiB", 0], ids=["cache", "tiny-cache", "no-cache"])
def store(request: pytest.FixtureRequest, tmp_path) -> tierstore.Store:
    st = tierstore.open(tmp_path / "st", create=True, host_cache=request.param)
    yield st
    st.close()


def test_borrow_many_lends_the_stored_values(store) -> None:
    store.put_many([("a", _t(1)), ("b", "exp_avg", _t(2))])
    with store.borrow_many(["a", ("b", "exp_avg")]) as lent:
        assert torch.equal(lent.tensors["a"], _t(1))
        assert torch.equal(lent.tensors[("b", "exp_avg")], _t(2))
        # A write during the loan is a new version elsewhere; the loan keeps the old bytes.
        store.put("a", _t(3))
        assert torch.equal(lent.tensors["a"], _t(1))
    assert torch.equal(store.get("a"), _t(3))
    with pytest.raises(tierstore.EntryNotFoundError):
        store.borrow_many(["missing"])


def test_stage_commit_makes_new_versions_without_a_put(store, tmp_path) -> None:
    store.put("a", _t(1))
    v0 = store.info("a").version
    staged = store.stage_many([("a", "param", torch.float32, (64, 32)),
                               ("n", "step", torch.int64, (5,))])
    staged.tensors[("a", "param")].copy_(_t(2))
    staged.tensors[("n", "step")].copy_(torch.arange(5))
    assert torch.equal(store.get("a"), _t(1))  # not visible before the commit
    assert "n" not in store
    versions = staged.commit()
    assert min(versions) > v0
    assert torch.equal(store.get("a"), _t(2))
    assert torch.equal(store.get("n", "step"), torch.arange(5))
    with pytest.raises(RuntimeError):
        staged.commit()
    store.flush()
    path = store.path
    store.close()
    with tierstore.open(path) as again:  # durable after flush, like a put
        assert torch.equal(again.get("a"), _t(2))
        assert again.info("a").version == max(versions) - 1
        assert again.fsck().ok


def test_discarded_or_failed_stage_leaves_nothing(store) -> None:
    store.put("a", _t(1))
    before = store.info("a").version
    staged = store.stage_many([("a", "param", torch.float32, (64, 32))])
    staged.tensors[("a", "param")].fill_(7)
    staged.discard()
    with (pytest.raises(ValueError, match="boom"),
          store.stage_many([("a", "param", torch.float32, (64, 32))]) as s2):
        s2.tensors[("a", "param")].fill_(9)
        raise ValueError("boom")
    with store.stage_many([("a", "param", torch.float32, (64, 32))]):
        pass  # ended without a commit: discarded too
    assert torch.equal(store.get("a"), _t(1)) and store.info("a").version == before
    cache = store.stats()["cache"]
    if cache:
        assert cache["bytes_resident"] <= 64 * 32 * 4  # no staged slot was left behind


def test_stage_rejects_bad_input(store) -> None:
    with pytest.raises(tierstore.StoreError):
        store.stage_many([("bad\0name", "param", torch.float32, (2,))])
    with pytest.raises(tierstore.StoreError):
        store.stage_many([("a", "Not A Kind", torch.float32, (2,))])
    with pytest.raises(ValueError):
        store.stage_many([("a", "param", torch.float32, (-1, 2))])


def test_readers_see_old_or_new_never_a_mix(tmp_path) -> None:
    n = 1 << 18
    with tierstore.open(tmp_path / "st", create=True, host_cache="64MiB") as st:
        st.put("k", torch.zeros(n))
        stop = threading.Event()
        bad: list[float] = []

        def reader() -> None:
            while not stop.is_set():
                t = st.get("k")
                if not bool((t == t[0]).all()):
                    bad.append(float(t[0]))

        th = threading.Thread(target=reader)
        th.start()
        try:
            for i in range(1, 40):
                with st.stage_many([("k", "param", torch.float32, (n,))]) as s:
                    s.tensors[("k", "param")].fill_(float(i))
                    s.commit()
        finally:
            stop.set()
            th.join()
        assert not bad
        assert float(st.get("k")[0]) == 39.0


def test_hostcache_staged_slot_is_invisible_until_committed() -> None:
    cache = HostCache(1 << 20, policy="lru")
    h = cache.insert("k", 4096, meta=1, data=torch.full((4096,), 1, dtype=torch.uint8))
    h.release()
    reader = cache.lookup("k")  # holds version 1 through the swap
    s = cache.stage("k", 4096)
    assert s is not None and s.new
    s.view.fill_(2)
    with cache.lookup("k") as current:
        assert bool((current.view == 1).all())
    cache.commit_staged(s, meta=2)
    with cache.lookup("k") as now:
        assert now.meta == 2 and bool((now.view == 2).all())
    assert bool((reader.view == 1).all())  # the old slot lives until its reader is done
    stats = cache.stats()
    assert stats.entries == 1 and stats.dirty_entries == 1
    assert stats.bytes_resident == 4096
    reader.release()
    # Discarded and released-instead-of-committed stages give their slots back.
    for finish in (cache.discard_staged, lambda handle: handle.release()):
        t = cache.stage("k", 4096)
        finish(t)
        assert cache.stats().bytes_resident == 4096
    with pytest.raises(RuntimeError):
        cache.commit_staged(t)
    assert cache.stats().bytes_allocated == 4096


def test_borrowed_views_are_fresh_aliases_of_one_slot(tmp_path) -> None:
    """Each borrow gets its own tensor object over the entry's slot (nothing one borrower
    sets on it reaches the next), and a rewrite in another dtype is seen as that dtype."""
    with tierstore.open(tmp_path / "s", create=True, host_cache="16MiB") as st:
        st.put("w", torch.arange(8, dtype=torch.float32))
        with st.borrow_many(["w"]) as a:
            t = a.tensors["w"]
            t.requires_grad_(True)
        with st.borrow_many(["w"]) as b:
            u = b.tensors["w"]
            assert u is not t and not u.requires_grad and u.data_ptr() == t.data_ptr()
        st.put("w", torch.arange(8, dtype=torch.int32))  # same size: rewritten in place
        with st.borrow_many(["w"]) as c:
            v = c.tensors["w"]
            assert v.dtype == torch.int32 and torch.equal(v, torch.arange(8, dtype=torch.int32))
        st.put("w", torch.arange(8, dtype=torch.int32).view(2, 4))  # and in another shape
        with st.borrow_many(["w"]) as d:
            assert d.tensors["w"].shape == (2, 4)


def test_a_released_borrow_renews_only_while_its_entries_are_unchanged(store) -> None:
    """``renew`` pins the same cached entries again (a hit each, the same tensors) while
    each is the version it was; a rewrite (new version, same slot or not), an eviction or
    a read that bypassed the cache makes it refuse, pinning nothing, and a new borrow then
    sees the current bytes."""
    store.put_many({"a": _t(1), "b": _t(2)})
    lent = store.borrow_many(["a", "b"])
    with pytest.raises(tierstore.StoreError):
        lent.renew()  # still lent
    views = dict(lent.tensors)
    lent.release()
    if store._cache is None:  # read into buffers of their own: nothing to pin again
        assert not lent.renew()
        return
    hits = store.stats()["cache"]["hits"]
    assert lent.renew()
    assert store.stats()["cache"]["hits"] == hits + 2
    assert all(lent.tensors[k] is views[k] for k in views)
    assert torch.equal(lent.tensors["a"], _t(1)) and torch.equal(lent.tensors["b"], _t(2))
    # Renewed means pinned: a write is a new version elsewhere, the views keep the old bytes.
    store.put("a", _t(3))
    assert torch.equal(lent.tensors["a"], _t(1))
    lent.release()
    assert not lent.renew()  # "a" changed
    entries = store._cache._entries
    assert not any(e.pins for e in entries.values())  # and "b" was not left pinned
    with store.borrow_many(["a", "b"]) as again:
        assert torch.equal(again.tensors["a"], _t(3))
    # A same-size rewrite in place (same slot, a new version) refuses as well.
    fresh = store.borrow_many(["b"])
    fresh.release()
    store.put("b", _t(4))
    assert not fresh.renew()
    fresh = store.borrow_many(["b"])
    assert torch.equal(fresh.tensors["b"], _t(4))
    fresh.release()
    store._cache.invalidate(("b", "param"))  # as an eviction does
    assert not fresh.renew()
    assert not any(e.pins for e in entries.values())
