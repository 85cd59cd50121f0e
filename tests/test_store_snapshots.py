"""Snapshots: restore brings back exactly the snapshot, its space is never reused while it
exists, dropping it frees that space, and tag errors are SnapshotErrors."""

from __future__ import annotations

import pytest
import torch

import tierstore

PAGE = 4096


def pattern(i: int, version: int, n: int = 50_000) -> torch.Tensor:
    """A tensor whose every element depends on (entry, version): stale or reused bytes show."""
    return torch.arange(n, dtype=torch.int64) * 1_000_003 + i * 7919 + version


def check_ok(st: tierstore.Store) -> None:
    report = st.fsck()
    assert report.ok, report.problems


def test_restore_brings_back_old_bytes_and_removes_newer_entries(store) -> None:
    store.put("a", pattern(0, 1))
    store.put("b", pattern(1, 1), kind="exp_avg")
    store.put("e", torch.empty(0, 3))
    va = store.info("a").version
    info = store.snapshot("step-1")
    assert isinstance(info, tierstore.SnapshotInfo)
    assert (info.tag, info.entries) == ("step-1", 3)
    assert info.nbytes == 2 * pattern(0, 1).nbytes

    store.put("a", pattern(0, 2))  # overwritten
    store.delete("b", "exp_avg")  # deleted
    store.put("c", pattern(2, 1))  # created after
    store.put("b", pattern(1, 5), kind="grad")  # another kind created after
    before_restore = store.info("c").version

    restored = store.restore("step-1")
    assert restored.tag == "step-1" and restored.entries == 3
    assert sorted(store.keys()) == [("a", "param"), ("b", "exp_avg"), ("e", "param")]
    assert torch.equal(store.get("a"), pattern(0, 1))
    assert torch.equal(store.get("b", "exp_avg"), pattern(1, 1))
    assert store.get("e").shape == (0, 3)
    assert "c" not in store and ("b", "grad") not in store
    assert store.info("a").version == va
    stats = store.stats()
    assert stats["entries"] == 3 and stats["bytes_stored"] == 2 * pattern(0, 1).nbytes
    check_ok(store)

    # versions stay monotonic after a restore
    assert store.put("a", pattern(0, 3)) > before_restore
    # the snapshot still exists and can be restored again
    assert [s.tag for s in store.snapshots()] == ["step-1"]
    store.restore("step-1")
    assert torch.equal(store.get("a"), pattern(0, 1))
    check_ok(store)


def test_snapshot_space_is_not_reused(make_store, cache_kw) -> None:
    """Overwrite every entry many times: copy-on-write must never land on snapshot space."""
    st = make_store(slab_size="4MiB", pmem_size="64MiB", **cache_kw)
    n_entries, rounds = 6, 25
    for i in range(n_entries):
        st.put(f"e{i}", pattern(i, 0))
    st.snapshot("base")
    capacity_at_snapshot = st.stats()["capacity_bytes"]
    for r in range(1, rounds + 1):
        st.put_many({f"e{i}": pattern(i, r) for i in range(0, n_entries, 2)})
        for i in range(1, n_entries, 2):
            st.put(f"e{i}", pattern(i, r))
        st.flush()  # every round reaches the backing tier (and frees the round before)
        if r == rounds // 2:
            st.snapshot("middle")
    check_ok(st)  # verifies the snapshot versions' checksums, too
    for i in range(n_entries):
        assert torch.equal(st.get(f"e{i}"), pattern(i, rounds))
    assert st.stats()["capacity_bytes"] >= capacity_at_snapshot

    st.restore("middle")
    for i in range(n_entries):
        assert torch.equal(st.get(f"e{i}"), pattern(i, rounds // 2))
    st.restore("base")
    for i in range(n_entries):
        assert torch.equal(st.get(f"e{i}"), pattern(i, 0))
    check_ok(st)


def test_drop_frees_space(store) -> None:
    for i in range(4):
        store.put(f"e{i}", pattern(i, 0))
    store.snapshot("s")
    free_with_snapshot_only = store.stats()["free_bytes"]
    for i in range(4):
        store.put(f"e{i}", pattern(i, 1))
    store.flush()
    held = store.stats()
    # both versions are held now: the snapshot's and the live one
    assert held["free_bytes"] < free_with_snapshot_only
    used_live = sum(-(-store.info(f"e{i}").nbytes // PAGE) * PAGE for i in range(4))
    assert held["free_bytes"] + 2 * used_live == held["capacity_bytes"]

    store.drop_snapshot("s")
    dropped = store.stats()
    assert dropped["snapshots"] == 0
    assert dropped["free_bytes"] == held["free_bytes"] + used_live
    assert dropped["free_bytes"] + used_live == dropped["capacity_bytes"]
    assert store.snapshots() == []
    with pytest.raises(tierstore.SnapshotError):
        store.restore("s")
    for i in range(4):
        assert torch.equal(store.get(f"e{i}"), pattern(i, 1))
    check_ok(store)


def test_drop_keeps_space_another_snapshot_holds(store) -> None:
    store.put("a", pattern(0, 0))
    store.snapshot("one")
    store.snapshot("two")  # both hold the same extent
    store.put("a", pattern(0, 1))
    store.flush()
    free = store.stats()["free_bytes"]
    store.drop_snapshot("one")
    assert store.stats()["free_bytes"] == free, "space still held by 'two' was freed"
    for _ in range(5):  # churn: any reuse of the held extent would corrupt 'two'
        store.put("a", pattern(0, 9))
        store.put("b", pattern(1, 9))
        store.flush()
    store.restore("two")
    assert torch.equal(store.get("a"), pattern(0, 0))
    assert "b" not in store
    store.drop_snapshot("two")
    check_ok(store)


def test_delete_of_snapshotted_entry_keeps_its_bytes(store) -> None:
    store.put("a", pattern(0, 0))
    store.snapshot("s")
    free = store.stats()["free_bytes"]
    store.delete("a")
    assert store.stats()["free_bytes"] == free
    store.put("b", pattern(1, 0))  # would take the freed extent if delete had freed it
    store.flush()
    store.restore("s")
    assert torch.equal(store.get("a"), pattern(0, 0))
    check_ok(store)


def test_snapshots_listing_and_persistence(make_store) -> None:
    st = make_store()
    st.put("a", pattern(0, 0))
    st.snapshot("t1")
    st.put("b", pattern(1, 0))
    st.snapshot("t2")
    listed = {s.tag: s for s in st.snapshots()}
    assert set(listed) == {"t1", "t2"}
    assert listed["t1"].entries == 1 and listed["t2"].entries == 2
    assert listed["t2"].nbytes == 2 * pattern(0, 0).nbytes
    assert listed["t1"].created <= listed["t2"].created
    st.put("a", pattern(0, 1))
    st.close()

    st = make_store(st.path, reopen=True)
    assert {s.tag for s in st.snapshots()} == {"t1", "t2"}
    assert st.stats()["snapshots"] == 2
    st.restore("t1")
    assert st.keys() == [("a", "param")]
    assert torch.equal(st.get("a"), pattern(0, 0))
    st.drop_snapshot("t1")
    st.restore("t2")
    assert torch.equal(st.get("b"), pattern(1, 0))
    check_ok(st)


def test_snapshot_tag_errors(store) -> None:
    store.put("a", pattern(0, 0))
    store.snapshot("s")
    with pytest.raises(tierstore.SnapshotError):
        store.snapshot("s")  # duplicate
    store.put("a", pattern(0, 1))
    with pytest.raises(tierstore.SnapshotError):
        store.snapshot("s")  # still a duplicate after changes
    with pytest.raises(tierstore.SnapshotError):
        store.restore("missing")
    with pytest.raises(tierstore.SnapshotError):
        store.drop_snapshot("missing")
    # none of the failures changed anything
    assert [s.tag for s in store.snapshots()] == ["s"]
    assert torch.equal(store.get("a"), pattern(0, 1))
    store.restore("s")
    assert torch.equal(store.get("a"), pattern(0, 0))
    # tags that are prefixes of one another are distinct snapshots
    store.snapshot("s.1")
    store.put("a", pattern(0, 2))
    store.drop_snapshot("s")
    store.restore("s.1")
    assert torch.equal(store.get("a"), pattern(0, 0))
    check_ok(store)


def test_snapshot_of_empty_store(store) -> None:
    info = store.snapshot("empty")
    assert info.entries == 0 and info.nbytes == 0
    store.put("a", pattern(0, 0))
    store.restore("empty")
    assert store.keys() == []
    assert store.stats()["bytes_stored"] == 0
    check_ok(store)


def test_drop_removes_only_its_own_tag_whose_name_prefixes_another(store) -> None:
    for i in range(20):
        store.put(f"e{i}", pattern(i, 0, 1_000))
    store.snapshot("s")
    for i in range(20):
        store.put(f"e{i}", pattern(i, 1, 1_000))
    store.snapshot("s2")  # sorts right after "s"'s records in the catalog
    store.snapshot("r")  # and this one before them
    store.drop_snapshot("s")
    assert sorted(s.tag for s in store.snapshots()) == ["r", "s2"]
    check_ok(store)
    for i in range(20):
        store.put(f"e{i}", pattern(i, 2, 1_000))
    store.flush()
    for tag in ("s2", "r"):
        store.restore(tag)
        assert all(torch.equal(store.get(f"e{i}"), pattern(i, 1, 1_000)) for i in range(20))
    store.drop_snapshot("s2")
    store.drop_snapshot("r")
    check_ok(store)
