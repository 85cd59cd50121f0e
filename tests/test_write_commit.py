"""A batch of many entries builds its commit while its last requests are in flight
(``tierstore.commits.Committer``): it commits only once the batch is synced, and a batch
that fails at any point, the commit already built or not, leaves the catalog as it was.
Real files, the real AIO engine; the engine's fault hook fails one request."""

from __future__ import annotations

import errno
import threading
from typing import Any

import pytest
import torch
from tierstore.nvme import libaio

import tierstore
from tierstore import commits

pytestmark = pytest.mark.skipif(libaio.unavailable() is not None,
                                reason=f"Linux AIO unavailable: {libaio.unavailable()}")
N = commits.AHEAD_MIN_ENTRIES + 16
WAIT = 60


def batch(fill: float, n: int = N) -> dict[str, torch.Tensor]:
    return {f"e{i}": torch.full((3000 + i,), fill + i) for i in range(n)}  # a page or so each


def same(st: tierstore.Store, data: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(st.get(k), v) for k, v in data.items())


@pytest.fixture
def st(tmp_path: Any) -> Any:
    with tierstore.open(tmp_path / "s", create=True, host_cache=0, engine="aio",
                        chunk_size="64KiB", io_threads=2) as s:
        yield s


def test_the_commit_is_built_in_flight_and_lands_after_the_sync(st: Any) -> None:
    """The batch's transaction is open before the sync (the catalog's writer is held),
    yet a reader still sees the old versions until the sync is done."""
    old = batch(0.0)
    st.put_many(old)
    medium, inner = st._medium, st._medium.sync
    at_sync, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def sync(segs: Any) -> None:
        at_sync.set()
        assert release.wait(WAIT)
        inner(segs)

    medium.sync = sync
    new = batch(100.0)
    t = threading.Thread(target=st.put_many, args=(new,))
    t.start()
    try:
        assert at_sync.wait(WAIT)
        for _ in range(WAIT * 100):  # the committer holds the writer (or soon will)
            if st._catalog._commit.locked():
                break
            threading.Event().wait(0.01)
        seen.append(st._catalog._commit.locked())
        seen.append(same(st, old))
    finally:
        release.set()
        t.join(WAIT)
        medium.sync = inner
    assert seen == [True, True]
    assert same(st, new) and st.fsck().ok


@pytest.mark.parametrize("where", ["complete", "sync"])
def test_a_batch_that_fails_after_its_commit_was_begun_commits_nothing(st: Any,
                                                                        where: str) -> None:
    """A request that fails after the commit began (the last one), or the sync failing
    with every record already put: the put raises, old versions stay, the space is free
    again, and the catalog's writer is let go (the next put commits)."""
    old = batch(0.0)
    st.put_many(old)
    free = st.stats()["free_bytes"]
    engine, medium, inner = st._medium.engine, st._medium, st._medium.sync
    sent: list[int] = []

    def inject(phase: str, index: int, req: Any) -> int | None:
        if phase == "submit":
            sent.append(index)
        if where == "complete" and phase == "complete" and started:
            return -errno.EIO  # the first request to land after the commit began
        return None

    def failing_sync(segs: Any) -> None:
        raise OSError(errno.EIO, "sync failed")

    engine.inject = inject
    if where == "sync":
        medium.sync = failing_sync
    started = []
    begin = commits.Committer.start
    commits.Committer.start = lambda self, b: (started.append(1), begin(self, b))[1]
    try:
        with pytest.raises(OSError):
            st.put_many(batch(100.0))
    finally:
        commits.Committer.start = begin
        engine.inject = None
        medium.sync = inner
    assert started and len(sent) > 1
    assert same(st, old) and st.stats()["free_bytes"] == free and st.fsck().ok
    assert not st._catalog._commit.locked()
    st.put_many(batch(200.0))
    assert same(st, batch(200.0))


def test_concurrent_batches_each_commit_whole(st: Any) -> None:
    """Two threads' batches (each building its commit in flight) and a third's deletes:
    every entry ends as its last put or delete left it."""
    errors: list[BaseException] = []

    def writer(prefix: str) -> None:
        try:
            for r in range(3):
                st.put_many({f"{prefix}{k}": v for k, v in batch(10.0 * r).items()})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(p,)) for p in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not errors
    for i in range(0, N, 7):
        st.delete(f"ae{i}")
    last = batch(20.0)
    for k, v in last.items():
        assert torch.equal(st.get(f"b{k}"), v)
        assert (f"a{k}" in st) == (int(k[1:]) % 7 != 0)
    assert st.fsck().ok


def aligned_batch(fill: float, n: int = N) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Page-aligned entries of 4 KiB, slices of one read buffer (and the buffer)."""
    buf = tierstore.read_buffer(n * 1024, torch.float32)
    return buf, {f"e{i}": buf[i * 1024 : (i + 1) * 1024].fill_(fill + i) for i in range(n)}


@pytest.mark.parametrize(("slab", "memory"), [("64MiB", "aligned"), ("64MiB", "torch"),
                                              ("256KiB", "aligned")])
def test_the_commit_begins_with_the_first_request_where_one_extent_holds_the_batch(
        tmp_path: Any, slab: str, memory: str) -> None:
    """Where one free extent holds the whole batch, its commit is begun once its first
    group is placed (placing cannot add a slab then; a batch of under COMMIT_AHEAD_BYTES
    has no more to wait for), unless that memory needs staging
    (torch's own tensors; memory on 4 KiB pages); otherwise (a fresh store, which has no
    slab yet, or slabs smaller than the batch) only once every entry is placed. Either way
    every entry lands whole."""
    from tierstore.nvme.pages import on_small_pages

    at_start: list[int] = []
    begin = commits.Committer.start
    commits.Committer.start = lambda self, b: (at_start.append(len(self._records)),
                                               begin(self, b))[1]
    staged = memory == "torch"
    try:
        with tierstore.open(tmp_path / "s", create=True, host_cache=0, engine="aio",
                            chunk_size="64KiB", io_threads=2, slab_size=slab) as st:
            for fill in (0.0, 100.0):
                if memory == "torch":
                    data = batch(fill)
                else:
                    buf, data = aligned_batch(fill)
                    staged = on_small_pages(buf.data_ptr(), buf.nbytes)  # as the store asks
                st.put_many(data)
            assert same(st, data) and st.fsck().ok
    finally:
        commits.Committer.start = begin
    assert at_start[0] == N
    assert (at_start[1] < N) == (slab == "64MiB" and not staged)


def test_a_large_batch_begins_its_commit_only_near_its_end(tmp_path: Any,
                                                           monkeypatch: Any) -> None:
    """With one extent for a batch larger than COMMIT_AHEAD_BYTES, the commit begins once
    at most that many of its bytes are left to place: not with the first group (it would
    hold the catalog's writer across all of the batch's I/O), not after the last."""
    from tierstore.nvme.pages import on_small_pages

    from tierstore import writes

    monkeypatch.setattr(writes, "COMMIT_AHEAD_BYTES", 64 << 10)
    at_start: list[int] = []
    begin = commits.Committer.start
    monkeypatch.setattr(commits.Committer, "start",
                        lambda self, b: (at_start.append(len(self._records)), begin(self, b))[1])
    n = 200  # 800 KiB: groups of 64 entries (4 chunks of 64 KiB)
    with tierstore.open(tmp_path / "s", create=True, host_cache=0, engine="aio",
                        chunk_size="64KiB", io_threads=2, slab_size="64MiB") as st:
        for fill in (0.0, 100.0):
            buf, data = aligned_batch(fill, n)
            st.put_many(data)
        assert same(st, data) and st.fsck().ok
    assert at_start[0] == n
    if on_small_pages(buf.data_ptr(), buf.nbytes):  # staged (as the store asks): after placing
        assert at_start[1] == n
    else:
        assert 64 < at_start[1] < n
