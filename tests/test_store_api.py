"""The catalog-facing API: put_many/get_many, versions, delete, names/keys, info, stats,
and catalog map growth."""

from __future__ import annotations

import os

import pytest
import torch

import tierstore

PAGE = 4096


def aligned(n: int) -> int:
    return -(-n // PAGE) * PAGE


def used_bytes(st: tierstore.Store) -> int:
    """Bytes of backing space the live entries occupy (each extent rounded up to 4 KiB)."""
    live = st.keys()  # (name, kind) pairs, not a dict view
    return sum(aligned(st.info(n, k).nbytes) for n, k in live)


def test_put_many_forms_and_get_many(store) -> None:
    a, b, c = torch.randn(10), torch.arange(7), torch.ones(3, 3, dtype=torch.bfloat16)
    v1 = store.put_many({"m.a": a, "m.b": b})
    assert len(v1) == 2 and v1[0] < v1[1]
    v2 = store.put_many([("p.a", a), ("p.b", b)], kind="grad")
    v3 = store.put_many([("t.a", "exp_avg", a), ("t.c", "master", c), ("t.b", b)], kind="grad")
    assert len(v2) == 2 and len(v3) == 3
    versions = v1 + v2 + v3
    assert versions == sorted(versions) and len(set(versions)) == len(versions)

    assert ("p.a", "grad") in store and "p.a" not in store  # "p.a" alone means kind param
    assert ("t.b", "grad") in store and ("t.a", "exp_avg") in store
    assert ("t.c", "master") in store

    got = store.get_many(["m.a", "m.b"])
    assert list(got) == ["m.a", "m.b"]
    assert torch.equal(got["m.a"], a) and torch.equal(got["m.b"], b)
    got = store.get_many(["p.a", "p.b"], kind="grad")
    assert torch.equal(got["p.a"], a) and torch.equal(got["p.b"], b)
    mixed = store.get_many([("t.a", "exp_avg"), ("t.c", "master"), "m.b"])
    assert set(mixed) == {("t.a", "exp_avg"), ("t.c", "master"), "m.b"}
    assert torch.equal(mixed[("t.a", "exp_avg")], a)
    assert torch.equal(mixed[("t.c", "master")], c)
    assert torch.equal(mixed["m.b"], b)
    assert store.get_many([]) == {}


def test_put_many_is_all_or_nothing(store) -> None:
    store.put("keep", torch.arange(100))
    free_before = store.stats()["free_bytes"]
    batch = [("new.a", torch.randn(5000)), ("keep", torch.zeros(100, dtype=torch.int64)),
             ("bad", torch.eye(3).to_sparse()), ("new.c", torch.randn(10))]
    with pytest.raises(tierstore.UnsupportedTensorError):
        store.put_many(batch)
    assert "new.a" not in store and "bad" not in store and "new.c" not in store
    assert torch.equal(store.get("keep"), torch.arange(100))
    assert store.stats()["free_bytes"] == free_before, "a failed batch leaked space"
    report = store.fsck()
    assert report.ok, report.problems


def test_get_many_missing_raises(store) -> None:
    store.put("a", torch.arange(3))
    with pytest.raises(tierstore.EntryNotFoundError) as ei:
        store.get_many(["a", "nope"])
    assert ei.value.name == "nope"


def test_overwrite_bumps_version(store) -> None:
    v1 = store.put("w", torch.zeros(100))
    assert store.info("w").version == v1
    v2 = store.put("w", torch.ones(100))
    assert v2 > v1
    assert store.info("w").version == v2
    assert torch.equal(store.get("w"), torch.ones(100))
    # versions are monotonic across entries and kinds, too
    v3 = store.put("other", torch.ones(1), kind="grad")
    v4 = store.put("w", torch.full((3, 4), 2, dtype=torch.int16))  # new dtype and shape
    assert v1 < v2 < v3 < v4
    info = store.info("w")
    assert (info.version, info.dtype, info.shape, info.nbytes) == (v4, torch.int16, (3, 4), 24)
    assert torch.equal(store.get("w"), torch.full((3, 4), 2, dtype=torch.int16))
    store.flush()
    assert store.info("w").version == v4
    # the old extents are freed: only the live entries' space is used
    stats = store.stats()
    assert stats["free_bytes"] + used_bytes(store) == stats["capacity_bytes"]


@pytest.mark.parametrize("flushed", [False, True], ids=["unflushed", "flushed"])
def test_delete(store, flushed: bool) -> None:
    free0 = store.stats()["free_bytes"]
    store.put("w", torch.randn(3000))
    store.put("w", torch.randn(10), kind="grad")
    if flushed:
        store.flush()
    assert store.delete("w") is True
    assert "w" not in store
    assert ("w", "grad") in store, "delete removed another kind of the same name"
    with pytest.raises(tierstore.EntryNotFoundError):
        store.get("w")
    with pytest.raises(tierstore.EntryNotFoundError):
        store.delete("w")
    assert store.delete("w", missing_ok=True) is False
    assert store.delete("w", "grad") is True
    assert store.keys() == []
    store.flush()
    stats = store.stats()
    assert stats["entries"] == 0 and stats["bytes_stored"] == 0
    if free0:  # a segment existed before the first put
        assert stats["free_bytes"] == free0
    assert stats["free_bytes"] == stats["capacity_bytes"], "deleted entries' space was not freed"
    # the name can be used again
    store.put("w", torch.arange(4))
    assert torch.equal(store.get("w"), torch.arange(4))
    # and a deleted entry stays deleted after a reopen
    store.delete("w")
    store.close()
    st = tierstore.open(store.path)
    try:
        assert st.keys() == []
        assert st.fsck().ok
    finally:
        st.close()


def test_delete_empty_tensor(store) -> None:
    store.put("e", torch.empty(0))
    assert store.delete("e")
    assert "e" not in store
    assert store.fsck().ok


def test_names_keys_and_prefixes(store) -> None:
    entries = [
        ("layers.1.experts.0.w1", "param"), ("layers.1.experts.0.w1", "exp_avg"),
        ("layers.1.experts.1.w1", "param"), ("layers.10.experts.0.w1", "grad"),
        ("layers.2.norm", "param"), ("embed", "master"), ("a", "param"), ("a.b", "param"),
        ("ünïcode.名前", "param"),
    ]
    store.put_many([(n, k, torch.arange(2)) for n, k in entries])
    all_names = sorted({n for n, _ in entries})
    assert store.names() == all_names
    assert store.names("layers.1.") == ["layers.1.experts.0.w1", "layers.1.experts.1.w1"]
    assert store.names("layers.1") == [
        "layers.1.experts.0.w1", "layers.1.experts.1.w1", "layers.10.experts.0.w1"]
    assert store.names(kind="exp_avg") == ["layers.1.experts.0.w1"]
    assert store.names("layers.", kind="grad") == ["layers.10.experts.0.w1"]
    assert store.names("nothing") == []
    assert store.names("a") == ["a", "a.b"]
    assert store.names("ünï") == ["ünïcode.名前"]
    assert sorted(store.keys()) == sorted(entries)
    assert sorted(store.keys("layers.1.experts.0.")) == [
        ("layers.1.experts.0.w1", "exp_avg"), ("layers.1.experts.0.w1", "param")]
    for n, k in entries:
        assert (n, k) in store
    assert ("embed", "param") not in store
    assert torch.equal(store.get("ünïcode.名前"), torch.arange(2))


def test_info_fields(store, backing) -> None:
    t = torch.randn(1000, 3, dtype=torch.float64)
    v = store.put("w", t, kind="exp_avg")
    store.flush()  # on the backing tier now
    info = store.info("w", "exp_avg")
    assert isinstance(info, tierstore.EntryInfo)
    assert (info.name, info.kind) == ("w", "exp_avg")
    assert info.dtype == torch.float64 and info.shape == (1000, 3)
    assert info.nbytes == 24000 and info.version == v
    assert info.tier == backing == store.backing
    assert isinstance(info.checksum, str) and info.checksum.startswith("crc32c:")
    assert info.path is not None and os.path.isfile(info.path)
    assert info.offset is not None and info.offset % PAGE == 0
    assert os.path.getsize(info.path) >= info.offset + info.nbytes
    # info points at the actual bytes
    with open(info.path, "rb") as f:
        f.seek(info.offset)
        on_disk = f.read(info.nbytes)
    assert on_disk == t.numpy().tobytes()

    # the checksum follows the contents
    store.put("w", t + 1, kind="exp_avg")
    store.put("w2", t)
    store.flush()
    assert store.info("w", "exp_avg").checksum != info.checksum
    assert store.info("w2").checksum == info.checksum

    store.put("e", torch.empty(0, 4))
    store.flush()
    empty = store.info("e")
    assert empty.nbytes == 0 and empty.shape == (0, 4)
    assert empty.path is None and empty.offset is None

    with pytest.raises(tierstore.EntryNotFoundError):
        store.info("w")  # only the exp_avg kind exists


def test_info_before_and_after_flush(make_store, backing, cache_kw) -> None:
    """Before a flush an entry may live only in the host cache (tier "host", no location);
    its dtype, shape, size and version are right either way, and after flush() it is on
    the backing tier."""
    st = make_store(**cache_kw)
    t = torch.randn(7, 9)
    v = st.put("w", t)
    info = st.info("w")
    assert (info.dtype, info.shape, info.nbytes, info.version) == (torch.float32, (7, 9), 252, v)
    assert info.tier in ("host", backing)
    if info.tier == "host":
        assert info.path is None and info.offset is None
    else:
        assert info.path is not None and info.checksum.startswith("crc32c:")
    assert "w" in st and st.names() == ["w"] and st.keys() == [("w", "param")]
    st.flush()
    info = st.info("w")
    assert (info.tier, info.version, info.nbytes) == (backing, v, 252)
    assert info.path is not None and info.offset % PAGE == 0
    assert info.checksum.startswith("crc32c:")
    assert torch.equal(st.get("w"), t)


def test_distinct_entries_never_share_bytes(store) -> None:
    """Every live entry has its own aligned, non-overlapping extent."""
    store.put_many({f"e{i}": torch.full((i * 700 + 1,), i, dtype=torch.int32) for i in range(40)})
    store.flush()
    spans = sorted((store.info(n).path, store.info(n).offset, store.info(n).nbytes)
                   for n in store.names())
    for (p1, o1, n1), (p2, o2, _) in zip(spans, spans[1:]):
        if p1 == p2:
            assert o1 + n1 <= o2, "two entries overlap on the backing tier"
    for i in range(40):
        assert torch.equal(store.get(f"e{i}"), torch.full((i * 700 + 1,), i, dtype=torch.int32))


def test_stats_counts(make_store, backing, cache_kw) -> None:
    store = make_store(**cache_kw)
    s0 = store.stats()
    assert s0["entries"] == 0 and s0["bytes_stored"] == 0 and s0["snapshots"] == 0
    assert s0["catalog_map_bytes"] > 0
    tiers0 = s0["tiers"][backing]

    store.put("a", torch.zeros(1000, dtype=torch.uint8))
    store.put("a", torch.zeros(10, dtype=torch.uint8), kind="grad")
    store.put_many({"b": torch.zeros(5000, dtype=torch.uint8), "c": torch.empty(0)})
    store.flush()  # stats count what is committed to the backing tier
    s1 = store.stats()
    assert s1["entries"] == 4
    assert s1["bytes_stored"] == 1000 + 10 + 5000
    assert s1["capacity_bytes"] > 0
    assert s1["free_bytes"] + used_bytes(store) == s1["capacity_bytes"]
    t1 = s1["tiers"][backing]
    assert t1["writes"] - tiers0["writes"] == 4
    assert t1["bytes_written"] - tiers0["bytes_written"] == 6010

    store.close()  # a reopened store has an empty cache: these reads reach the tier
    store = make_store(store.path, reopen=True, **cache_kw)
    t1 = store.stats()["tiers"][backing]
    assert (t1["reads"], t1["writes"]) == (0, 0)
    store.get("a")
    store.get_many(["b", "c"])
    t2 = store.stats()["tiers"][backing]
    assert t2["reads"] - t1["reads"] == 3
    assert t2["bytes_read"] - t1["bytes_read"] == 6000
    store.get("a")  # a cache hit, where there is a cache
    t3 = store.stats()["tiers"][backing]
    cache = store.stats()["cache"]
    if cache is None:
        assert t3["reads"] - t2["reads"] == 1
    else:
        assert t3["reads"] == t2["reads"]
        assert cache["hits"] >= 1

    store.put("b", torch.zeros(200, dtype=torch.uint8))  # overwrite with a smaller tensor
    store.delete("a", "grad")
    store.flush()
    s3 = store.stats()
    assert s3["entries"] == 3
    assert s3["bytes_stored"] == 1000 + 200
    assert s3["free_bytes"] + used_bytes(store) == s3["capacity_bytes"]

    store.snapshot("s")
    assert store.stats()["snapshots"] == 1


def test_catalog_map_grows(make_store) -> None:
    """A tiny LMDB map is grown on MDB_MAP_FULL instead of failing a commit."""
    st = make_store(map_size="64KiB")
    start = st.stats()["catalog_map_bytes"]
    assert start <= 64 * 1024
    pad = "x" * 300  # long names: bigger records, more pages
    want = {}
    for batch in range(6):
        items = {f"layer.{batch}.expert.{i}.{pad}": torch.full((3,), batch * 1000 + i)
                 for i in range(250)}
        st.put_many(items)
        want.update(items)
    for i in range(100):  # and single commits
        name = f"single.{i}.{pad}"
        want[name] = torch.tensor([i])
        st.put(name, want[name])
    st.snapshot("grown")  # a snapshot copies every record: another big commit
    assert st.stats()["catalog_map_bytes"] > start
    assert st.stats()["entries"] == len(want)
    for name, t in want.items():
        assert torch.equal(st.get(name), t)
    report = st.fsck()
    assert report.ok, report.problems

    st.close()
    st = make_store(st.path, reopen=True, map_size="64KiB")
    assert len(st.keys()) == len(want)
    st.put("after.reopen", torch.arange(5))
    st.drop_snapshot("grown")
    for name, t in list(want.items())[::37]:
        assert torch.equal(st.get(name), t)
    report = st.fsck()
    assert report.ok, report.problems


# -- the store over a small host cache -------------------------------------------------------
def test_small_cache_evicts_and_writes_back_without_losing_data(make_store) -> None:
    """Far more data than the cache holds: dirty entries evicted to make room are written
    back, and every entry reads back right, before and after a reopen."""
    st = make_store(host_cache="1MiB", chunk_size="64KiB")
    want = {}
    for i in range(40):
        t = torch.full((25_000 + i,), i, dtype=torch.int32)  # ~100 KB each, 4 MB in all
        st.put(f"e{i}", t)
        want[f"e{i}"] = t
    for i in range(0, 40, 3):  # overwrite some, evicted or not
        want[f"e{i}"] = torch.full((10_000,), 1000 + i, dtype=torch.int32)
        st.put(f"e{i}", want[f"e{i}"])
    for name in reversed(list(want)):
        assert torch.equal(st.get(name), want[name]), name
    cache = st.stats()["cache"]
    assert cache is not None and cache["evictions"] > 0 and cache["writebacks"] > 0
    assert cache["bytes_allocated"] <= cache["capacity_bytes"] <= 1 << 20
    report = st.fsck()
    assert report.ok, report.problems
    st.close()
    st = make_store(st.path, reopen=True, host_cache="1MiB")
    assert sorted(st.names()) == sorted(want)
    for name, t in want.items():
        assert torch.equal(st.get(name), t), name
        assert st.info(name).version > 0


def test_entry_larger_than_the_cache_goes_straight_through(make_store, backing) -> None:
    st = make_store(host_cache="256KiB")
    big = torch.randn(200_000)  # 800 KB: no slot can hold it
    v = st.put("big", big)
    info = st.info("big")
    assert info.tier == backing and info.version == v  # committed by the put itself
    assert torch.equal(st.get("big"), big)
    st.put("small", torch.arange(10))
    st.flush()
    st.close()
    st = make_store(st.path, reopen=True, host_cache="256KiB")
    assert torch.equal(st.get("big"), big)
    assert torch.equal(st.get("small"), torch.arange(10))


def test_one_batch_naming_a_key_twice_keeps_the_last_and_frees_the_rest(make_store) -> None:
    # Within one commit the first version of "a" is carved, replaced and freed: the free
    # map must end up with exactly what no entry uses (fsck checks it to the byte).
    st = make_store(host_cache=0)
    st.put_many([(f"n{i}", torch.full((3000,), float(i))) for i in range(6)])
    st.put_many([("a", torch.ones(5000)), *[(f"n{i}", torch.zeros(3000)) for i in range(6)],
                 ("a", torch.full((7000,), 2.0))])
    assert torch.equal(st.get("a"), torch.full((7000,), 2.0))
    assert all(torch.equal(st.get(f"n{i}"), torch.zeros(3000)) for i in range(6))
    report = st.fsck()
    assert report.ok, report.problems
    before = st.stats()["free_bytes"]
    st.delete("a")
    for i in range(6):
        st.delete(f"n{i}")
    assert st.fsck().ok and st.stats()["free_bytes"] > before
