"""Reads into, and writes from, every kind of memory a caller hands the store: torch's own
tensors (not page-aligned), read buffers, a slice at an odd offset, an aligned tensor whose
storage ends before the entry's last page, pinned host memory, a transposed (non-contiguous)
tensor, a dtype view and an empty tensor. Each gets the right bytes on both NVMe engines
and on PMem, mixed in one batch, and a corrupt chunk is still named whatever memory it was
written from and is read into. A read of several requests checks each one on the chunk
workers as it lands; these entries are eight requests each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
from tierstore.cache.pinned import arena_tensor
from tierstore.nvme.libaio import unavailable

import tierstore
from tierstore import landing

CHUNK = 64 << 10
SHAPE = (3, 40001)  # float32: 480,012 bytes, eight chunks, the last one partial


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()


def _odd_slice(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = _nbytes(shape, dtype)
    return tierstore.read_buffer(n + 4096)[128 : 128 + n].view(dtype).view(shape)


def _short_storage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Page-aligned on huge pages, but its storage is exactly the entry: the last page is
    # not all there.
    n = _nbytes(shape, dtype)
    return torch.from_numpy(tierstore.read_buffer(n).numpy()[:n]).view(dtype).view(shape)


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return arena_tensor(_nbytes(shape, dtype), pin=False)[0].view(dtype).view(shape)


def _dtype_view(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(_nbytes(shape, dtype) // 2, dtype=torch.int16).view(dtype).view(shape)


DESTINATIONS: dict[str, Callable[[tuple[int, ...], torch.dtype], torch.Tensor]] = {
    "torch.empty": lambda s, d: torch.empty(s, dtype=d),
    "read_buffer": lambda s, d: tierstore.read_buffer(s, d),
    "odd slice": _odd_slice,
    "short storage": _short_storage,
    "pinned": _pinned,
    "transposed": lambda s, d: torch.empty(s[::-1], dtype=d).t(),
    "dtype view": _dtype_view,
}
ENGINES = ["posix-direct", pytest.param("aio", marks=pytest.mark.skipif(
    unavailable() is not None, reason=f"no AIO here: {unavailable()}"))]


def _value(seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _open(tmp_path, kind: str) -> tierstore.Store:  # "pmem", or an NVMe engine's name
    where = ({"backing": "pmem", "pmem_path": tmp_path / "pool", "pmem_size": "96MiB"}
             if kind == "pmem" else {"engine": kind})
    return tierstore.open(tmp_path / "st", create=True, host_cache=0, chunk_size=CHUNK,
                          **where)


@pytest.fixture(params=[*ENGINES, "pmem"])
def store(request: pytest.FixtureRequest, tmp_path) -> tierstore.Store:
    with _open(tmp_path, request.param) as st:
        yield st


@pytest.fixture(params=ENGINES)  # NVMe slabs only: what O_DIRECT takes of caller memory
def nvme_store(request: pytest.FixtureRequest, tmp_path) -> tierstore.Store:
    with _open(tmp_path, request.param) as st:
        yield st


def _copies_any_memory(store: tierstore.Store) -> bool:
    """Whether the medium moves any memory in place (PMem: a CPU copy)."""
    return store._medium.memory_alignment == 1


@pytest.mark.parametrize("group", ["default", "one entry"])
def test_every_destination_gets_the_bytes_in_one_batch(store, monkeypatch, group) -> None:
    # Small entries next to each other on disk share requests: bounced and direct pieces
    # of one request, and entries of every kind in one call. On AIO the targets are worked
    # out a group at a time as requests are made (landing.Deferred): here also one apiece.
    if group == "one entry":
        monkeypatch.setattr(landing, "DEFERRED_GROUP_BYTES", 1)
    small = (7, 1001)
    names = [f"{kind}.{size}" for kind in DESTINATIONS for size in ("big", "small")]
    values = {n: _value(i, SHAPE if n.endswith("big") else small) for i, n in enumerate(names)}
    values["empty"] = torch.empty((0, 5))
    store.put_many(values)
    outs = {n: DESTINATIONS[n.rsplit(".", 1)[0]](tuple(v.shape), v.dtype)
            for n, v in values.items() if n != "empty"}
    outs["empty"] = torch.empty((0, 5))
    got = store.get_many(list(values), out=outs)
    for n, v in values.items():
        assert got[n] is outs[n], n
        assert torch.equal(outs[n], v), n


@pytest.mark.skipif(unavailable() is not None, reason=f"no AIO here: {unavailable()}")
def test_targets_worked_out_as_requests_are_made_name_a_corrupt_entry(
        tmp_path, monkeypatch) -> None:
    """A read's targets worked out one entry at a time as its requests are made
    (``landing.Deferred``), entries read into buffers of their own between them: every
    entry before a corrupt one lands whole, the corrupt one is named, and a read after it
    gets the right bytes."""
    monkeypatch.setattr(landing, "DEFERRED_GROUP_BYTES", 1)
    kinds = sorted(k for k in DESTINATIONS if k != "transposed")
    names = [f"e{i}" for i in range(2 * len(kinds))]
    values = {n: _value(i) for i, n in enumerate(names)}
    with tierstore.open(tmp_path / "st", create=True, host_cache=0, chunk_size=CHUNK,
                        engine="aio") as st:
        st.put_many(values)
        info = st.info("e9")
        with open(info.path, "r+b") as f:
            f.seek(info.offset + 3 * CHUNK + 5)
            b = f.read(1)
            f.seek(info.offset + 3 * CHUNK + 5)
            f.write(bytes([b[0] ^ 0x5A]))
        # Every other entry into a buffer of its own (no out=).
        outs = {n: DESTINATIONS[kinds[i // 2]](SHAPE, torch.float32)
                for i, n in enumerate(names) if i % 2 == 0}
        with pytest.raises(tierstore.CorruptEntryError, match="'e9'.*bytes 196608"):
            st.get_many(names, out=outs)
        for i, n in enumerate(names[:9]):
            if i % 2 == 0:
                assert torch.equal(outs[n], values[n]), n
        good = [n for n in names if n != "e9"]
        got = st.get_many(good, out={n: o for n, o in outs.items() if n != "e9"})
        assert all(torch.equal(got[n], values[n]) for n in good)


@pytest.mark.parametrize("kind", sorted(DESTINATIONS))
def test_every_source_is_written_right(store, kind: str) -> None:
    src = DESTINATIONS[kind](SHAPE, torch.float32)
    src.copy_(_value(3))
    store.put_many({"a": src, "b": _value(4)})
    assert torch.equal(store.get("a"), _value(3))
    assert torch.equal(store.get("b"), _value(4))


@pytest.mark.parametrize("kind", sorted(DESTINATIONS))
@pytest.mark.parametrize("where", ["first chunk", "last chunk"])
def test_a_corrupt_chunk_is_named_whatever_the_memory(store, kind: str, where: str) -> None:
    # Written from and read into the same kind of memory: the checksums a staged (copied)
    # source gets are checked as a bounced destination's bytes land.
    srcs = {n: DESTINATIONS[kind](SHAPE, torch.float32) for n in ("ok", "bad")}
    srcs["ok"].copy_(_value(1))
    srcs["bad"].copy_(_value(2))
    store.put_many(srcs)
    info = store.info("bad")
    at = 5 if where == "first chunk" else info.nbytes - 3
    with open(info.path, "r+b") as f:
        f.seek(info.offset + at)
        b = f.read(1)
        f.seek(info.offset + at)
        f.write(bytes([b[0] ^ 0x5A]))
    outs = {n: DESTINATIONS[kind](SHAPE, torch.float32) for n in ("ok", "bad")}
    with pytest.raises(tierstore.CorruptEntryError, match="'bad'"):
        store.get_many(["ok", "bad"], out=outs)
    assert torch.equal(store.get_many(["ok"], out={"ok": outs["ok"]})["ok"], _value(1))


def test_small_entries_needing_a_copy_are_joined_on_the_workers(tmp_path) -> None:
    # A worker's job holds several small entries; those that need staging and lie next to
    # each other on disk are copied into one buffer and written as one request, each with
    # its own checksum (a corrupt one is still named).
    st = tierstore.open(tmp_path / "st", create=True, host_cache=0, io_threads=1,
                        engine="posix-direct")
    try:
        values = {f"s{i:02d}": _value(i, (70_000,)) for i in range(16)}  # 280,000 bytes
        srcs = {}
        for n, v in values.items():
            srcs[n] = _odd_slice(tuple(v.shape), v.dtype)
            srcs[n].copy_(v)
        writes: list[int] = []
        inner = st._medium.write

        def counted(seg: int, offset: int, buf: memoryview) -> None:
            writes.append(len(buf))
            inner(seg, offset, buf)

        st._medium.write = counted
        st.put_many(srcs)
        assert sum(writes) >= 16 * 280_000 and len(writes) <= 6
        got = st.get_many(list(values))
        assert all(torch.equal(got[n], v) for n, v in values.items())
        info = st.info("s05")
        with open(info.path, "r+b") as f:
            f.seek(info.offset + 1000)
            f.write(b"\xff\xfe")
        with pytest.raises(tierstore.CorruptEntryError, match="'s05'"):
            st.get_many(list(values))
        assert st.get("s06").equal(values["s06"])
    finally:
        st.close()


@pytest.mark.skipif(unavailable() is not None, reason=f"no AIO here: {unavailable()}")
@pytest.mark.parametrize("route", [None, "workers"])
def test_every_batch_moves_as_one_aio_batch_unless_sent_to_the_chunk_workers(
        tmp_path, monkeypatch, route) -> None:
    """On AIO, reads and writes of any size go as one batch, whether their memory is
    O_DIRECT's (page-aligned) or needs a copy (an odd slice); sent to the chunk workers (the
    benchmark's ``--paths``), each chunk is a ``preadv``/``pwritev`` of its own and no AIO
    batch sees them. Every path gives the same bytes."""
    from tierstore import landing

    monkeypatch.setattr(landing, "ROUTE", route)
    batched = route is None
    with tierstore.open(tmp_path / "s", create=True, host_cache=0, engine="aio",
                        slab_size="64MiB", chunk_size="256KiB", io_threads=2) as st:
        at: list[int] = []  # each submitted request's position in its batch

        def inject(ph: str, index: int, req: Any) -> None:
            if ph == "submit":
                at.append(index)

        st._medium.engine.inject = inject
        for n in (600_000, 300_000):  # 2.4 MB and 1.2 MB
            loose = {f"u{i}": _odd_slice((n + i,), torch.float32).copy_(_value(i, (n + i,)))
                     for i in range(4)}
            st.put_many(loose)
            assert (at != []) == batched, n
            at.clear()
            outs = {k: _odd_slice(tuple(t.shape), t.dtype) for k, t in loose.items()}
            st.get_many(list(loose), out=outs)
            assert (at != []) == batched, n
            assert all(torch.equal(outs[k], t) for k, t in loose.items())
            at.clear()
            st.put_many({k: tierstore.read_buffer(tuple(t.shape), t.dtype).copy_(t)
                         for k, t in loose.items()})
            assert (at != []) == batched, n
            at.clear()
            got = {k: tierstore.read_buffer(tuple(t.shape), t.dtype) for k, t in loose.items()}
            st.get_many(list(loose), out=got)
            assert (at != []) == batched, n
            assert all(torch.equal(got[k], t) for k, t in loose.items())
            at.clear()
        # 8-12 KiB entries from torch's allocator: many entries, one batch of few requests
        st.put_many({f"s{i:02d}": torch.randn(2048 + 512 * (i % 3)) for i in range(40)})
        assert (max(at, default=0) > 0) == batched
        st._medium.engine.inject = None
        assert st.fsck().ok


@pytest.mark.skipif(unavailable() is not None, reason=f"no AIO here: {unavailable()}")
def test_an_aligned_sources_checksums_are_taken_beside_its_transfer(tmp_path) -> None:
    """Handed to the chunk workers as each request is made, not once it has landed: a
    put that fits in one window (which a disk may complete in one go) does not take all
    its checksums after its last transfer."""
    values = {f"e{i}": _value(i) for i in range(3)}
    with tierstore.open(tmp_path / "st", create=True, host_cache=0, chunk_size=CHUNK,
                        engine="aio") as st:
        srcs = {n: DESTINATIONS["read_buffer"](SHAPE, torch.float32) for n in values}
        for n, v in values.items():
            srcs[n].copy_(v)
        events: list[str] = []
        submit = st._workers.submit
        st._workers.submit = lambda fn, *a, **k: (
            events.append(getattr(fn, "__name__", "")), submit(fn, *a, **k))[1]
        st._medium.engine.inject = lambda phase, index, req: events.append(phase) and None
        try:
            st.put_many(srcs)
        finally:
            del st._workers.submit
            st._medium.engine.inject = None
        assert "checksum" in events and "complete" in events
        assert events.index("checksum") < events.index("complete")
        assert all(torch.equal(st.get(n), v) for n, v in values.items())
        assert st.fsck().ok


def test_an_aligned_source_stages_only_its_last_partial_page(store, monkeypatch) -> None:
    # Page-aligned memory whose entry ends part way into a page: its whole pages are written
    # from the tensor itself, and only the partial page is copied to an aligned buffer.
    import tierstore.write_jobs as write_jobs
    import tierstore.writes as writes

    copied: list[int] = []
    inner = writes.copy_checked

    def counted(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
        copied.append(src.nbytes)
        return inner(dst, src, crc)

    for module in (writes, write_jobs):  # the AIO batch's and the chunk workers' copies
        monkeypatch.setattr(module, "copy_checked", counted)
    values = {f"a{i}": _value(i) for i in range(3)}
    srcs = {}
    for n, v in values.items():
        srcs[n] = _short_storage(SHAPE, v.dtype)
        srcs[n].copy_(v)
    store.put_many(srcs)
    # 480,012 bytes each: 12 bytes past the last page; all of it where the kernel put the
    # buffer on 4 KiB pages (it may not give huge ones), as any memory on them.
    from tierstore.nvme.pages import on_small_pages

    assert sum(copied) == sum(
        t.nbytes if on_small_pages(t.data_ptr(), t.nbytes) and not _copies_any_memory(store)
        else t.nbytes % 4096 for t in srcs.values())
    got = store.get_many(list(values))
    assert all(torch.equal(got[n], v) for n, v in values.items())
    info = store.info("a1")
    for at in (1000, _nbytes(SHAPE, torch.float32) - 5):  # a whole page's, the staged tail's
        with open(info.path, "r+b") as f:
            f.seek(info.offset + at)
            f.write(b"\xff\xfe")
        with pytest.raises(tierstore.CorruptEntryError, match="'a1'"):
            store.get_many(list(values))
        store.put("a1", values["a1"])
        info = store.info("a1")


def test_which_batches_go_to_the_chunk_workers(monkeypatch) -> None:
    from tierstore import landing

    assert not landing.on_workers()  # reads and writes: one AIO batch whatever the sizes
    # The benchmark's override (bench tiers --paths)
    monkeypatch.setattr(landing, "ROUTE", "batch")
    assert not landing.on_workers()
    monkeypatch.setattr(landing, "ROUTE", "workers")
    assert landing.on_workers()


@pytest.mark.parametrize("libpmem", [True, False], ids=["streaming", "numpy"])
def test_a_copy_and_its_checksum_are_exact_at_any_offset(monkeypatch, libpmem: bool) -> None:
    # Non-temporal stores (libpmem) move whole cache lines; the bytes around an odd-sized
    # copy at an odd offset must be left as they were, and the checksum match the bytes.
    from tierstore.pmem.libpmem import ENV_HIDE, load

    if libpmem and load() is None:
        pytest.skip("libpmem is not installed")
    monkeypatch.setenv(ENV_HIDE, "0" if libpmem else "1")
    rng = np.random.default_rng(0)
    step = landing.STEP
    for n in (1, 63, 4097, step - 1, step, 2 * step + 77):
        for at, to in ((0, 0), (3, 64), (100, 5)):
            src = rng.integers(0, 256, n + at, dtype=np.uint8)[at:]
            dst = np.full(n + to + 70, 0xAB, np.uint8)
            assert landing.copy_checked(dst[to : to + n], src, 7) == crc32c.crc32c(src, 7)
            assert np.array_equal(dst[to : to + n], src)
            assert (dst[:to] == 0xAB).all() and (dst[to + n :] == 0xAB).all()


def _on_small_pages(nbytes: int) -> torch.Tensor:
    """Memory a caller might hand the store: an anonymous mapping kept off huge pages,
    faulted in."""
    import mmap
    import warnings

    m = mmap.mmap(-1, nbytes)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    with warnings.catch_warnings():  # torch warns that the mapping's buffer is writable
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(m, dtype=torch.uint8)
    return t.fill_(0)


def test_memory_on_small_pages_is_copied_and_on_huge_pages_is_not(monkeypatch) -> None:
    # The rule, whatever this kernel can tell: memory on 4 KiB pages is bounced and staged
    # at every size; memory on huge pages is not, and unaligned memory always is.
    from tierstore import landing

    mib = 1 << 20
    small = {True}
    monkeypatch.setattr(landing, "small_pages",
                        lambda addrs, sizes: [True in small] * len(addrs))
    buf = tierstore.read_buffer(8 * mib)
    parts = [buf, buf[: 4 * mib], buf[: mib]]
    sizes = [8 * mib, 4 * mib, mib]
    assert [t.direct for t in landing.targets(parts, sizes, sizes)] == [0, 0, 0]
    assert landing.staged([p.data_ptr() for p in parts], sizes) == [True] * 3
    assert landing.direct_end(True, 8 * mib, 0, mib) == 0
    small.clear()
    assert [t.direct for t in landing.targets(parts, sizes, sizes)] == sizes
    assert landing.staged([p.data_ptr() for p in parts], sizes) == [False] * 3
    assert landing.staged([buf.data_ptr() + 64], [8 * mib]) == [True]  # not page-aligned


def test_the_kernel_is_asked_once_for_a_batch_and_answers_per_range() -> None:
    from tierstore.nvme import pages

    mib = 1 << 20
    maps = [_on_small_pages(mib) for _ in range(20)]
    huge = tierstore.read_buffer(20 * mib).fill_(1)
    addrs = [t.data_ptr() for t in maps] + [huge.data_ptr() + i * mib for i in range(20)]
    got = pages.small_pages(addrs, [mib] * 40)
    if not pages.on_small_pages(maps[0].data_ptr(), mib):
        assert got == [False] * 40  # this kernel cannot say (PAGEMAP_SCAN, Linux 6.7)
        return
    assert got == [pages.on_small_pages(a, mib) for a in addrs]
    assert got[:20] == [True] * 20
    assert pages.small_pages(addrs[::-1], [mib] * 40) == got[::-1]
    assert pages.small_pages([addrs[0]], [0]) == [False]


def _spoil(store: tierstore.Store, name: str, at: int) -> None:
    """Two bytes of ``name``'s extent, from byte ``at``, overwritten on disk."""
    info = store.info(name)
    with open(info.path, "r+b") as f:
        f.seek(info.offset + at)
        f.write(b"\xff\x00")


def _count_copies(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """The bytes of each copy through the store's buffers from here on: a write's staged
    pieces (the AIO batch's and the chunk workers'), and a read's bounced ones."""
    import tierstore.fetch as fetch
    import tierstore.write_jobs as write_jobs
    import tierstore.writes as writes

    copied: list[int] = []
    landed: list[int] = []
    copy_checked, land = writes.copy_checked, fetch.land

    def counted_copy(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
        copied.append(src.nbytes)
        return copy_checked(dst, src, crc)

    def counted_land(t: Any, start: int, piece: np.ndarray, crc: int) -> int:
        landed.append(piece.nbytes)
        return land(t, start, piece, crc)

    for module in (writes, write_jobs):
        monkeypatch.setattr(module, "copy_checked", counted_copy)
    monkeypatch.setattr(fetch, "land", counted_land)
    return copied, landed


def test_memory_on_small_pages_moves_through_the_store_buffers(nvme_store, monkeypatch) -> None:
    from tierstore.nvme.pages import on_small_pages

    store = nvme_store
    nbytes = 8 << 20
    probe = _on_small_pages(nbytes)
    if not on_small_pages(probe.data_ptr(), nbytes):
        pytest.skip("this kernel cannot say which pages are small (PAGEMAP_SCAN, Linux 6.7)")
    copied, landed = _count_copies(monkeypatch)
    values = {n: _value(i, (nbytes // 4,)) for i, n in enumerate(("a", "b"))}
    srcs = {n: _on_small_pages(nbytes).view(torch.float32).copy_(v) for n, v in values.items()}
    store.put_many(srcs)
    assert sum(copied) == 2 * nbytes  # staged, every byte
    outs = {n: _on_small_pages(nbytes).view(torch.float32) for n in values}
    store.get_many(list(values), out=outs)
    assert sum(landed) == 2 * nbytes  # bounced, every byte
    assert all(torch.equal(outs[n], v) for n, v in values.items())
    copied.clear()
    landed.clear()
    # Smaller entries on small pages too; on huge pages they are written and read straight.
    half = {f"h{n}": _on_small_pages(nbytes // 4).view(torch.float32).copy_(v[: nbytes // 16])
            for n, v in values.items()}
    store.put_many(half)
    got = {n: _on_small_pages(nbytes // 4).view(torch.float32) for n in half}
    store.get_many(list(half), out=got)
    assert sum(copied) == sum(landed) == nbytes // 2
    assert all(torch.equal(got[n], t) for n, t in half.items())
    copied.clear()
    landed.clear()
    # Read buffers: on huge pages where the kernel gave them (it may not), and only what
    # is not moves through the store's buffers.
    huge = {f"g{n}": tierstore.read_buffer(nbytes // 4).view(torch.float32).copy_(t)
            for n, t in half.items()}
    store.put_many(huge)
    got = {n: tierstore.read_buffer(nbytes // 4).view(torch.float32) for n in huge}
    store.get_many(list(huge), out=got)

    def on_small(ts: dict[str, torch.Tensor]) -> int:
        return sum(t.nbytes for t in ts.values() if on_small_pages(t.data_ptr(), t.nbytes))

    assert (sum(copied), sum(landed)) == (on_small(huge), on_small(got))
    assert all(torch.equal(got[n], t) for n, t in huge.items())
    _spoil(store, "b", nbytes - 9)
    with pytest.raises(tierstore.CorruptEntryError, match="'b'"):
        store.get_many(list(values), out=outs)


def test_memory_aligned_as_the_disk_needs_moves_straight(nvme_store, monkeypatch) -> None:
    """Memory aligned to what O_DIRECT needs on the slab files (the kernel's answer, not a
    page: 512 bytes on a virtio disk, 4 on NVMe) is written and read in place, with no
    copy through the store's buffers; memory aligned less is copied. Each gets its bytes,
    and a corrupt chunk is named."""
    from tierstore.nvme.pages import on_small_pages

    store = nvme_store
    store.put("first", _value(0))  # a slab file: the medium knows the rule now
    align = store._medium.memory_alignment
    if align == tierstore.nvme.ALIGNMENT:
        pytest.skip("O_DIRECT here needs page-aligned memory, or the kernel does not say")
    copied, landed = _count_copies(monkeypatch)
    nbytes = 4 * CHUNK  # whole pages: nothing partial to copy
    buf = tierstore.read_buffer(4 << 20).fill_(0)  # whole huge pages, faulted in
    if on_small_pages(buf.data_ptr(), buf.nbytes):
        pytest.skip("no huge pages for the read buffer here")

    def at(skip: int, k: int) -> torch.Tensor:
        return buf[skip + k * nbytes : skip + (k + 1) * nbytes].view(torch.float32)

    values = {n: _value(i, (nbytes // 4,)) for i, n in enumerate(("a", "b"))}
    for skip, copies in ((align, 0), (align // 2, 2 * nbytes)):
        srcs = {n: at(skip, k).copy_(v) for k, (n, v) in enumerate(values.items())}
        store.put_many(srcs)
        outs = {n: at(skip, k + 2) for k, n in enumerate(values)}
        store.get_many(list(values), out=outs)
        assert (sum(copied), sum(landed)) == (copies, copies), skip
        copied.clear()
        landed.clear()
        assert all(torch.equal(outs[n], v) for n, v in values.items())
    _spoil(store, "b", nbytes - 9)
    with pytest.raises(tierstore.CorruptEntryError, match="'b'"):
        store.get_many(list(values), out={n: at(align, k + 2) for k, n in enumerate(values)})


@pytest.mark.parametrize("backing", ["pmem", "posix-buffered"])
def test_a_cpu_copy_moves_any_memory_in_place(tmp_path, monkeypatch, backing: str) -> None:
    """A PMem store, and NVMe slabs without O_DIRECT, copy with the CPU: reads land in, and
    puts come from, memory at any offset and on 4 KiB pages in place, with no copy through
    the store's buffers but a partial last page's. Each gets its bytes, and a corrupt chunk
    is named."""
    nbytes = 4 * CHUNK + 4096  # whole pages, and a chunk of one
    made = {
        "torch.empty": lambda: torch.empty(nbytes, dtype=torch.uint8),
        "odd slice": lambda: tierstore.read_buffer(nbytes + 4096)[7 : 7 + nbytes],
        "small pages": lambda: _on_small_pages(nbytes),
        "short tail": lambda: torch.empty(nbytes - 100, dtype=torch.uint8),
    }
    values = {k: torch.randint(0, 255, (m().numel(),), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(i))
              for i, (k, m) in enumerate(made.items())}
    with _open(tmp_path, backing) as st:
        copied, landed = _count_copies(monkeypatch)
        st.put_many({k: m().copy_(values[k]) for k, m in made.items()})
        outs = {k: m() for k, m in made.items()}
        got = st.get_many(list(made), out=outs)
        assert sum(copied) == sum(landed) == 4096 - 100  # the short tail's last page
        assert all(got[k] is outs[k] and torch.equal(outs[k], v) for k, v in values.items())
        _spoil(st, "odd slice", 3 * CHUNK + 11)
        with pytest.raises(tierstore.CorruptEntryError, match="'odd slice'.*bytes 196608"):
            st.get_many(list(made), out=outs)


def test_a_chunks_checksum_is_joined_from_its_parts() -> None:
    gen = np.random.default_rng(7)
    for la, lb in [(0, 0), (5, 0), (0, 5), (1, 1), (100, 4096), (1 << 20, (3 << 20) + 17)]:
        a, b = gen.bytes(la), gen.bytes(lb)
        assert landing.crc_join(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b)


@pytest.mark.skipif(unavailable() is not None, reason=f"no AIO here: {unavailable()}")
def test_a_staged_batch_ramps_its_first_requests_up(tmp_path, monkeypatch) -> None:
    # A batch whose memory is staged sends its first request after copying that much only,
    # each next twice the last, cutting a chunk in two where a request ends inside it; the
    # parts' checksums are joined into the chunk's, so each entry reads back verified and a
    # corrupt part is named. An aligned entry's chunk is never cut.
    from tierstore import writes

    monkeypatch.setattr(writes, "FIRST_REQUEST_BYTES", 32 << 10)
    sizes = [25_000, 75_001, 12_345, 200_000, 70_000]  # float32 elements
    values = {f"r{i}": _value(i, (n,)) for i, n in enumerate(sizes)}
    # At an odd offset, so staged whatever pages the allocator gives.
    srcs = {n: _odd_slice(tuple(v.shape), torch.float32) for n, v in values.items()}
    srcs["r1"] = tierstore.read_buffer(values["r1"].shape, torch.float32)  # aligned
    for n, v in values.items():
        srcs[n].copy_(v)
    with tierstore.open(tmp_path / "s", create=True, host_cache=0, chunk_size="256KiB",
                        engine="aio") as st:
        sent: list[int] = []
        st._medium.engine.inject = lambda phase, index, req: (
            sent.append(req[2]) if phase == "submit" else None)
        try:
            st.put_many(srcs)
        finally:
            st._medium.engine.inject = None
        # r0 (100,000 bytes) goes as 32 KiB, then 64 KiB, then its last 4 KiB page, which
        # the next chunk, r1's first (aligned, crossing where the 128 KiB request would
        # end), does not join: a request is a chunk at most.
        assert sent[:4] == [32 << 10, 64 << 10, 4 << 10, 256 << 10]
        got = st.get_many(list(values))
        assert all(torch.equal(got[n], v) for n, v in values.items())
        assert st.fsck().ok
        info = st.info("r0")
        with open(info.path, "r+b") as f:
            f.seek(info.offset + 50_000)  # in its second part
            f.write(b"\xff\xfe")
        with pytest.raises(tierstore.CorruptEntryError, match="'r0'"):
            st.get("r0")
