"""A flipped byte on the backing tier is a CorruptEntryError naming the entry, never wrong data;
fsck reports it; every other entry still reads.

Entries are written, flushed and the store reopened before a byte is flipped, so reads go to
the backing tier rather than being answered from the host cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tierstore

CHUNK = 64 * 1024


def flip_byte(info: tierstore.EntryInfo, at: int) -> None:
    """XOR one byte of the entry's stored bytes, straight in the backing file."""
    assert info.path is not None and info.offset is not None
    assert 0 <= at < info.nbytes
    with open(info.path, "r+b") as f:
        f.seek(info.offset + at)
        b = f.read(1)
        f.seek(info.offset + at)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()


def fill_and_reopen(make_store, **kw) -> tuple[tierstore.Store, dict[str, torch.Tensor]]:
    st = make_store(chunk_size=CHUNK, **kw)
    data = fill(st)
    st.close()
    return make_store(st.path, reopen=True, chunk_size=CHUNK, **kw), data


def fill(store: tierstore.Store) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    data = {
        "victim": torch.randn(3 * CHUNK // 4 + 123, generator=gen),  # several chunks
        "neighbour.before": torch.randn(1000, generator=gen),
        "neighbour.after": torch.randn(5000, generator=gen),
        "small": torch.randint(0, 100, (17,), generator=gen),
    }
    for name, t in data.items():
        store.put(name, t)
    return data


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_is_detected(make_store, cache_kw, where: str) -> None:
    st, data = fill_and_reopen(make_store, **cache_kw)
    info = st.info("victim")
    at = {"first": 0, "middle": info.nbytes // 2, "last": info.nbytes - 1}[where]
    flip_byte(info, at)

    with pytest.raises(tierstore.CorruptEntryError) as ei:
        st.get("victim")
    with pytest.raises(tierstore.CorruptEntryError):  # and again: bad bytes are never cached
        st.get("victim")
    err = ei.value
    assert isinstance(err, tierstore.StoreError)
    assert (err.name, err.kind) == ("victim", "param")
    assert "victim" in str(err)

    with pytest.raises(tierstore.CorruptEntryError) as ei:
        st.get_many(["small", "victim", "neighbour.after"])
    assert ei.value.name == "victim"
    out = torch.zeros_like(data["victim"])
    with pytest.raises(tierstore.CorruptEntryError):
        st.get("victim", out=out)
    with pytest.raises(tierstore.CorruptEntryError):
        st.view("victim")

    for name, t in data.items():  # everything else still reads
        if name != "victim":
            assert torch.equal(st.get(name), t)

    report = st.fsck()
    assert not report.ok
    assert len(report.problems) == 1, report.problems
    assert "victim" in report.problems[0]

    # rewriting the entry (copy-on-write: fresh space) heals the store
    st.put("victim", data["victim"])
    assert torch.equal(st.get("victim"), data["victim"])
    report = st.fsck()
    assert report.ok, report.problems


def test_corruption_survives_reopen_and_is_still_detected(make_store) -> None:
    st, data = fill_and_reopen(make_store)
    flip_byte(st.info("neighbour.after"), 4321)
    st.close()
    st = make_store(st.path, reopen=True)
    with pytest.raises(tierstore.CorruptEntryError) as ei:
        st.get("neighbour.after")
    assert ei.value.name == "neighbour.after"
    assert torch.equal(st.get("victim"), data["victim"])
    assert not st.fsck().ok


def test_corrupt_snapshot_version_reported_by_fsck(make_store) -> None:
    st, data = fill_and_reopen(make_store)
    st.snapshot("s")
    old = st.info("small")
    st.put("small", torch.arange(17))  # live version moves; the snapshot keeps the old one
    flip_byte(old, 3)
    assert torch.equal(st.get("small"), torch.arange(17))
    report = st.fsck()
    assert not report.ok
    assert any("small" in p for p in report.problems), report.problems
    st.restore("s")
    with pytest.raises(tierstore.CorruptEntryError):
        st.get("small")
    assert torch.equal(st.get("victim"), data["victim"])


def test_corrupt_kind_is_named(make_store) -> None:
    st = make_store(chunk_size=CHUNK)
    st.put("w", torch.randn(100))
    st.put("w", torch.randn(100), kind="exp_avg_sq")
    st.close()
    st = make_store(st.path, reopen=True)
    flip_byte(st.info("w", "exp_avg_sq"), 50)
    st.get("w")
    with pytest.raises(tierstore.CorruptEntryError) as ei:
        st.get("w", "exp_avg_sq")
    assert (ei.value.name, ei.value.kind) == ("w", "exp_avg_sq")
    assert "exp_avg_sq" in str(ei.value)


def test_the_first_corrupt_entry_of_a_batch_is_named(make_store, cache_kw) -> None:
    """With several corrupt entries in one read, the error names the first of them in the
    order asked, every time, and the healthy ones still read afterwards."""
    st, data = fill_and_reopen(make_store, **cache_kw)
    flip_byte(st.info("victim"), st.info("victim").nbytes - 1)  # its last chunk
    flip_byte(st.info("neighbour.after"), 0)
    for _ in range(5):
        with pytest.raises(tierstore.CorruptEntryError) as ei:
            st.get_many(["small", "victim", "neighbour.before", "neighbour.after"])
        assert ei.value.name == "victim"
        with pytest.raises(tierstore.CorruptEntryError) as ei:
            st.get_many(["neighbour.after", "small", "victim"])
        assert ei.value.name == "neighbour.after"
    got = st.get_many(["small", "neighbour.before"])
    assert all(torch.equal(got[n], data[n]) for n in got)


def test_fsck_beside_writes_never_reports_reused_space_as_corrupt(make_store) -> None:
    # Writes committed while fsck runs free the versions fsck is about to verify, and the
    # writes after them take that space: made to happen at exactly that point, on this
    # thread, by the first verification.
    st = make_store(host_cache=0, slab_size="8MiB")
    data = {f"e{i}": torch.randn(3000) for i in range(12)}
    st.put_many(data)
    verify = st._verify_record
    rewritten: list[int] = []

    def verify_after_rewrites(name: str, kind: str, rec: Any) -> None:
        if not rewritten:
            for round_ in range(3):  # the old versions' space is free after the first
                st.put_many({k: v + (round_ + 1) for k, v in data.items()})
            rewritten.append(1)
        verify(name, kind, rec)

    st._verify_record = verify_after_rewrites
    report = st.fsck()
    assert rewritten and report.ok, report.problems
    del st._verify_record
    assert st.fsck().ok
    assert all(torch.equal(st.get(k), v + 3) for k, v in data.items())
