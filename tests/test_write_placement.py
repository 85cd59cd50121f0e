"""A batch written through the AIO engine is placed a group of chunks at a time, as the
engine takes its requests (``tierstore.writes.PLACE_AHEAD_CHUNKS``): whole batches read
back, and a group that cannot be placed fails the batch cleanly after earlier groups were
sent. Real files, the real engine; its submission hook only counts requests."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_nvme_aio import _count
from tierstore.nvme import libaio

import tierstore
from tierstore import writes

pytestmark = pytest.mark.skipif(libaio.unavailable() is not None,
                                reason=f"Linux AIO unavailable: {libaio.unavailable()}")

def test_a_batch_placed_group_by_group_reads_back_whole(tmp_path) -> None:
    """A batch of many groups (see ``PLACE_AHEAD_CHUNKS``), with empty entries, entries of
    several chunks and unaligned sources among small ones: every entry reads back, before
    and after a reopen, and no request is longer than a chunk."""
    chunk = 64 << 10
    gen = torch.Generator().manual_seed(3)
    sizes = [0, 1000, chunk, 3 * chunk + 4096, 4096, 70_000]  # bytes
    data = {f"e{i}": torch.randint(0, 255, (sizes[i % len(sizes)],), dtype=torch.uint8,
                                   generator=gen) for i in range(60)}
    data.update({f"f{i}": torch.randn(5000 + i, generator=gen) for i in range(10)})
    assert sum(t.nbytes for t in data.values()) > 8 * writes.PLACE_AHEAD_CHUNKS * chunk
    kw = dict(host_cache=0, engine="aio", slab_size="4MiB", chunk_size=chunk, io_threads=1)
    with tierstore.open(tmp_path / "s", create=True, **kw) as st:
        sent: list[Any] = []
        st._medium.engine.inject = _count("submit", sent)
        st.put_many(data)
        st._medium.engine.inject = None
        assert sent and max(r[2] for r in sent) <= chunk
        assert all(torch.equal(st.get(k), v) for k, v in data.items())
    with tierstore.open(tmp_path / "s", **kw) as st:
        assert st.fsck().ok
        assert all(torch.equal(st.get(k), v) for k, v in data.items())


def test_a_group_that_cannot_be_placed_fails_the_batch_after_earlier_ones_were_sent(
        tmp_path) -> None:
    """The first group is on its way before the next is placed; where the next cannot be
    (its slab cannot grow), what was sent lands, every extent the batch took is free
    again, and nothing of it is committed."""
    chunk = 64 << 10
    group = writes.PLACE_AHEAD_CHUNKS

    def vals(prefix: str, n: int, fill: float) -> dict[str, torch.Tensor]:  # a chunk each
        return {f"{prefix}{i}": torch.full((chunk // 4,), fill + i) for i in range(n)}

    slab = 16 * chunk
    first = vals("a", 16 - group, 0.0)  # the first slab, but for one group's room
    with tierstore.open(tmp_path / "s", create=True, host_cache=0, engine="aio",
                        slab_size=slab, chunk_size=chunk, io_threads=1) as st:
        st.put_many(first)
        assert st.stats()["free_bytes"] == group * chunk
        slabs = sorted((tmp_path / "s" / "slabs").iterdir())
        in_the_way = slabs[-1].with_name(f"slab-{len(slabs):06d}.dat")
        in_the_way.write_bytes(b"x" * 4096)  # the next slab's file: it cannot grow
        sent: list[Any] = []
        st._medium.engine.inject = _count("submit", sent)
        with pytest.raises(tierstore.StoreError, match="holds data"):
            st.put_many(vals("b", 2 * group, 100.0))
        st._medium.engine.inject = None
        assert sent  # the first group's requests were sent before the second was placed
        assert st.stats()["free_bytes"] == group * chunk
        assert not any(f"b{i}" in st for i in range(2 * group))
        in_the_way.unlink()
        assert st.fsck().ok
        st.put_many(vals("c", 2 * group, 200.0))
        for prefix, n, fill in (("a", 16 - group, 0.0), ("c", 2 * group, 200.0)):
            assert all(torch.equal(st.get(k), v) for k, v in vals(prefix, n, fill).items())
        assert st.fsck().ok


@pytest.mark.timeout(120)
def test_groups_of_one_entry_each(tmp_path, monkeypatch) -> None:
    """However small the group is set, each takes an entry at least, so a batch ends."""
    monkeypatch.setattr(writes, "PLACE_AHEAD_CHUNKS", 0)
    data = {f"e{i}": torch.full((1000 + i,), float(i)) for i in range(20)}
    data["empty"] = torch.empty(0)
    with tierstore.open(tmp_path / "s", create=True, host_cache=0, engine="aio",
                        chunk_size=64 << 10, io_threads=1) as st:
        st.put_many(data)
        assert all(torch.equal(st.get(k), v) for k, v in data.items())
        assert st.fsck().ok


def _mixed(n: int, fill: float, aligned_first: int = 0) -> dict[str, torch.Tensor]:
    """Entries of every kind of memory a put meets: slices of one aligned buffer, torch's
    own tensors (not page-aligned), non-contiguous views, other dtypes, an empty one; the
    first ``aligned_first`` all slices."""
    buf = tierstore.read_buffer(n * 4096, torch.float32)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        kind = 0 if i < aligned_first else i % 5
        if kind == 0:
            t = buf[i * 4096 : (i + 1) * 4096].fill_(fill + i)
        elif kind == 1:
            t = torch.full((3000 + i,), fill + i)
        elif kind == 2:
            t = torch.full((64, 2 * 48), fill + i)[:, ::2]  # non-contiguous
        elif kind == 3:
            t = torch.full((1000 + i,), fill + i, dtype=torch.bfloat16)
        else:
            t = torch.full((0,), fill) if i == 4 else torch.arange(i, dtype=torch.int64)
        out[f"e{i}"] = t
    return out


@pytest.mark.parametrize(("cache", "rest"), [(0, "at once"), ("64MiB", "at once"),
                                             (0, "as placed")])
def test_a_batch_made_bytes_as_it_is_placed_lands_every_kind_of_memory(
        tmp_path, monkeypatch, cache, rest) -> None:
    """A wide batch takes its tensors' bytes a group at a time as it places them (see
    ``WritePath._converted_as_placed``): every kind of memory lands whole, with or without
    the host cache (``durable=True``), and reads back after a reopen. Memory met part way
    that needs staging (after groups that did not) has the rest taken at once where its
    entries are small, else as it is placed (``STAGED_AS_PLACED_MIN``)."""
    if rest == "as placed":
        monkeypatch.setattr(writes, "STAGED_AS_PLACED_MIN", 0)
    n = 3 * writes.AHEAD_MIN_ENTRIES
    kw = dict(host_cache=cache, engine="aio", chunk_size=64 << 10, io_threads=2)
    with tierstore.open(tmp_path / "s", create=True, **kw) as st:
        assert st._converted_as_placed([(k, "param", v) for k, v in _mixed(n, 0.0).items()])
        for fill, aligned in ((0.0, 0), (100.0, n // 2)):
            st.put_many(_mixed(n, fill, aligned), durable=True)
        assert all(torch.equal(st.get(k), v) for k, v in _mixed(n, 100.0, n // 2).items())
    with tierstore.open(tmp_path / "s", **kw) as st:
        assert st.fsck().ok
        assert all(torch.equal(st.get(k), v) for k, v in _mixed(n, 100.0, n // 2).items())


def test_a_tensor_that_cannot_be_stored_fails_a_batch_made_bytes_as_placed(tmp_path) -> None:
    """A tensor found unstorable only as its group is placed (a meta tensor, well after
    the first requests): the put raises that in one line, commits nothing, and every
    extent the batch took is free again."""
    n = 3 * writes.AHEAD_MIN_ENTRIES
    with tierstore.open(tmp_path / "s", create=True, host_cache=0, engine="aio",
                        chunk_size=64 << 10, io_threads=2) as st:
        st.put_many(_mixed(n, 0.0))
        free = st.stats()["free_bytes"]
        bad = _mixed(n, 100.0)
        bad[f"e{n - 3}"] = torch.empty(3000, device="meta")
        with pytest.raises(tierstore.UnsupportedTensorError, match="meta"):
            st.put_many(bad)
        assert st.stats()["free_bytes"] == free
        assert all(torch.equal(st.get(k), v) for k, v in _mixed(n, 0.0).items())
        assert st.fsck().ok
