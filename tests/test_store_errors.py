"""Every failure is a :class:`tierstore.StoreError` of the right kind, and leaves the store as
it was: missing entries, non-stores, locks, closed stores, unsupported tensors, bad names."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import tierstore


# -- missing entries -------------------------------------------------------------------------
def test_missing_entry(store) -> None:
    store.put("present", torch.arange(3))
    for call in (lambda: store.get("absent"), lambda: store.info("absent"),
                 lambda: store.delete("absent"), lambda: store.get("present", "grad"),
                 lambda: store.view("absent")):
        with pytest.raises(tierstore.EntryNotFoundError) as ei:
            call()
        assert isinstance(ei.value, KeyError) and isinstance(ei.value, tierstore.StoreError)
    err = pytest.raises(tierstore.EntryNotFoundError, store.get, "absent", "grad").value
    assert (err.name, err.kind) == ("absent", "grad")
    assert "absent" in str(err) and "grad" in str(err)
    assert torch.equal(store.get("present"), torch.arange(3))


# -- paths that are not stores -----------------------------------------------------------------
def test_open_missing_path_without_create(make_store, tmp_path) -> None:
    path = tmp_path / "nothing-here"
    with pytest.raises(tierstore.NotAStoreError):
        tierstore.open(path)
    assert not path.exists(), "a failed open must not create anything"


def test_open_empty_directory_without_create(make_store, tmp_path) -> None:
    path = tmp_path / "empty"
    path.mkdir()
    with pytest.raises(tierstore.NotAStoreError):
        tierstore.open(path)
    assert os.listdir(path) == []


def test_create_in_foreign_directory_refused(make_store, tmp_path) -> None:
    path = tmp_path / "foreign"
    path.mkdir()
    (path / "precious.txt").write_text("do not touch")
    with pytest.raises(tierstore.NotAStoreError):
        tierstore.open(path, create=True, **make_store.options(path))
    assert os.listdir(path) == ["precious.txt"]
    assert (path / "precious.txt").read_text() == "do not touch"


@pytest.mark.parametrize("create", [False, True])
def test_open_regular_file(make_store, tmp_path, create: bool) -> None:
    path = tmp_path / "a-file"
    path.write_bytes(b"not a store")
    with pytest.raises(tierstore.NotAStoreError):
        if create:
            tierstore.open(path, create=True, **make_store.options(path))
        else:
            tierstore.open(path)
    assert path.read_bytes() == b"not a store"


@pytest.mark.parametrize("marker", [b"", b"{not json", json.dumps({"format": 999}).encode()],
                         ids=["empty", "garbage", "future-format"])
def test_bad_marker(make_store, marker: bytes) -> None:
    st = make_store()
    st.put("a", torch.arange(3))
    path = st.path
    st.close()
    with open(os.path.join(path, "TIERSTORE"), "rb") as f:
        good = f.read()
    with open(os.path.join(path, "TIERSTORE"), "wb") as f:
        f.write(marker)
    with pytest.raises(tierstore.NotAStoreError):
        tierstore.open(path)
    with open(os.path.join(path, "TIERSTORE"), "wb") as f:
        f.write(good)
    st = make_store(path, reopen=True)  # the lock was not leaked by the failed opens
    assert torch.equal(st.get("a"), torch.arange(3))


def test_reopen_with_the_other_backing_refused(make_store, backing) -> None:
    st = make_store()
    st.put("a", torch.arange(3))
    st.close()
    other = "pmem" if backing == "nvme" else "nvme"
    with pytest.raises(tierstore.StoreError):
        tierstore.open(st.path, backing=other)
    st = make_store(st.path, reopen=True, backing=backing)
    assert torch.equal(st.get("a"), torch.arange(3))


@pytest.mark.parametrize(
    "bad",
    [{"chunk_size": 1000}, {"chunk_size": 0}, {"io_threads": 0}, {"backing": "tape"},
     {"slab_size": 0}],
    ids=["chunk-unaligned", "chunk-zero", "no-threads", "unknown-backing", "slab-zero"],
)
def test_bad_open_options(make_store, tmp_path, bad) -> None:
    opts = make_store.options(tmp_path / "s")
    opts.update(bad)
    if "slab_size" in bad and opts.get("backing") == "pmem":
        opts["backing"] = "nvme"  # slab_size only means something to nvme
    with pytest.raises(tierstore.StoreError):
        tierstore.open(tmp_path / "s", create=True, **opts)


def test_pmem_needs_pool_path_and_size(make_store, tmp_path) -> None:
    with pytest.raises(tierstore.StoreError):
        tierstore.open(tmp_path / "p1", create=True, backing="pmem", pmem_size="8MiB")
    with pytest.raises(tierstore.StoreError):
        tierstore.open(tmp_path / "p2", create=True, backing="pmem",
                       pmem_path=tmp_path / "pool2")


# -- one owner at a time ---------------------------------------------------------------------
def test_second_open_in_same_process_is_locked(make_store) -> None:
    st = make_store()
    st.put("a", torch.arange(3))
    with pytest.raises(tierstore.StoreLockedError):
        make_store(st.path, reopen=True)
    # the refused open did not disturb the owner
    st.put("b", torch.arange(4))
    assert torch.equal(st.get("a"), torch.arange(3))
    st.close()
    st2 = make_store(st.path, reopen=True)
    assert torch.equal(st2.get("b"), torch.arange(4))


_CHILD_OPEN = """
import sys, tierstore
try:
    st = tierstore.open(sys.argv[1])
except tierstore.StoreLockedError as e:
    print("LOCKED", e)
    sys.exit(0)
except Exception as e:
    print("OTHER", type(e).__name__, e)
    sys.exit(2)
print("OPENED")
sys.exit(1)
"""


def test_second_process_is_locked(make_store) -> None:
    st = make_store()
    st.put("a", torch.arange(3))
    res = subprocess.run([sys.executable, "-c", _CHILD_OPEN, st.path],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert res.stdout.startswith("LOCKED")
    assert str(os.getpid()) in res.stdout, "the message should name the owning process"
    st.put("b", torch.arange(4))  # still ours
    assert torch.equal(st.get("a"), torch.arange(3))


# -- closed stores ---------------------------------------------------------------------------
CLOSED_CALLS = {
    "put": lambda st: st.put("a", torch.arange(3)),
    "put_many": lambda st: st.put_many({"a": torch.arange(3)}),
    "get": lambda st: st.get("a"),
    "get_out": lambda st: st.get("a", out=torch.empty(3, dtype=torch.int64)),
    "get_many": lambda st: st.get_many(["a"]),
    "delete": lambda st: st.delete("a"),
    "names": lambda st: st.names(),
    "keys": lambda st: st.keys(),
    "info": lambda st: st.info("a"),
    "stats": lambda st: st.stats(),
    "snapshot": lambda st: st.snapshot("new"),
    "snapshots": lambda st: st.snapshots(),
    "restore": lambda st: st.restore("snap"),
    "drop_snapshot": lambda st: st.drop_snapshot("snap"),
    "fsck": lambda st: st.fsck(),
    "view": lambda st: st.view("a"),
    "flush": lambda st: st.flush(),
    "contains": lambda st: "a" in st,
}


@pytest.mark.parametrize("call", list(CLOSED_CALLS))
def test_use_after_close(make_store, cache_kw, call: str) -> None:
    st = make_store(**cache_kw)
    st.put("a", torch.arange(3))
    st.snapshot("snap")
    st.close()
    st.close()  # idempotent
    with pytest.raises(tierstore.StoreClosedError):
        CLOSED_CALLS[call](st)


def test_context_manager_closes_and_unlocks(make_store) -> None:
    with make_store() as st:
        st.put("a", torch.arange(3))
    with pytest.raises(tierstore.StoreClosedError):
        st.get("a")
    st2 = make_store(st.path, reopen=True)
    assert torch.equal(st2.get("a"), torch.arange(3))


def test_a_put_that_lands_while_close_runs_is_not_lost(make_store) -> None:
    # Another thread's put reaching the store after close()'s flush and before close takes
    # the operations gate: made to happen at exactly that point, on this thread, by the
    # step close runs in between (closing the prefetch queues).
    st = make_store(host_cache="8MiB")
    st.put("a", torch.arange(3))
    queues_close = st._queues.close

    def put_late() -> None:
        st.put("late", torch.arange(5))
        assert st.stats()["cache"]["dirty_entries"] == 1  # in the cache, not yet durable
        queues_close()

    st._queues.close = put_late
    st.close()
    st2 = make_store(st.path, reopen=True)
    assert torch.equal(st2.get("late"), torch.arange(5))
    assert torch.equal(st2.get("a"), torch.arange(3))


# -- tensors the store cannot hold -----------------------------------------------------------
UNSUPPORTED = {
    "sparse_coo": lambda: torch.eye(3).to_sparse(),
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
    "meta": lambda: torch.empty(3, device="meta"),
    "nested": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
    "numpy": lambda: torch.arange(3).numpy(),
    "list": lambda: [1, 2, 3],
    "none": lambda: None,
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("what", list(UNSUPPORTED))
def test_unsupported_tensor(store, what: str) -> None:
    store.put("x", torch.arange(3))
    stats = store.stats()
    with pytest.raises(tierstore.UnsupportedTensorError) as ei:
        store.put("x", UNSUPPORTED[what]())
    assert isinstance(ei.value, TypeError)
    with pytest.raises(tierstore.UnsupportedTensorError):
        store.put_many({"y": torch.arange(2), "x": UNSUPPORTED[what]()})
    assert torch.equal(store.get("x"), torch.arange(3)), "a refused put changed the entry"
    assert "y" not in store
    after = store.stats()
    assert (after["entries"], after["bytes_stored"], after["free_bytes"]) == (
        stats["entries"], stats["bytes_stored"], stats["free_bytes"])


def test_lazy_views_are_stored_resolved(store) -> None:
    """conj() and neg views are ordinary dense tensors; the store must keep their values."""
    z = torch.randn(6, dtype=torch.complex64)
    x = torch.randn(6)
    store.put("conj", z.conj())
    assert torch.equal(store.get("conj"), z.conj().resolve_conj())
    store.put("neg", x._neg_view())
    assert torch.equal(store.get("neg"), -x)


def test_failed_batch_leaves_no_write_in_flight(make_store, monkeypatch) -> None:
    """When a batch fails (here: no room for a new segment for its second tensor), the
    first tensor's chunk writes may still be running. Its extents must not be handed to the
    next writer before they finish, or the stale bytes land on that writer's entry.

    White-box: the first tensor's write is held back until the next put has committed (or
    for at most 2 s, which is what a store that waits for it will see)."""
    st = make_store(host_cache=0, io_threads=4)
    st.put("seed", torch.arange(10))  # the first segment exists
    medium = st._medium
    real_write = medium.write  # the chunk jobs' blocking write
    hold = {"armed": True}
    gate, stale_done = threading.Event(), threading.Event()

    def write(seg, offset, buf):
        if hold.pop("armed", False):
            gate.wait(2)
            real_write(seg, offset, buf)
            stale_done.set()
            return
        real_write(seg, offset, buf)

    def no_room(seg, min_bytes):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(medium, "write", write)
    monkeypatch.setattr(medium, "create_segment", no_room)
    a = torch.full((1 << 18,), 1, dtype=torch.int32)  # 1 MiB, one chunk
    too_big = torch.empty(200 << 20, dtype=torch.uint8)  # needs a segment it cannot get
    with pytest.raises(tierstore.StoreFullError):
        st.put_many({"a": a, "too_big": too_big})
    assert "a" not in st and "too_big" not in st
    c = torch.full((1 << 18,), 2, dtype=torch.int32)  # same size: first fit offers a's space
    st.put("c", c)
    gate.set()
    if not getattr(medium, "batched", False):  # a batch writes nothing before all is allocated
        stale_done.wait(10)
    monkeypatch.undo()
    assert torch.equal(st.get("c"), c)
    report = st.fsck()
    assert report.ok, report.problems


def test_small_entries_written_a_group_a_job_fail_and_succeed_whole(make_store,
                                                                   monkeypatch) -> None:
    """Without a batching engine (PMem, POSIX) a worker writes several small entries'
    chunks as one job (``write_jobs.GROUP_BYTES``). A batch of empty, unaligned, one-page,
    one-chunk and many-chunk entries reads back whole, in fewer jobs than chunks there; a
    write failing in the middle of a job fails the batch with nothing of it committed and
    every extent it took free again, and the store goes on."""
    from tierstore import write_jobs

    st = make_store(host_cache=0, io_threads=1, chunk_size="64KiB")
    gen = torch.Generator().manual_seed(5)
    sizes = [0, 1000, 4096, 64 << 10, 200_000, 4096 + 3]
    data = {f"e{i}": torch.randint(0, 255, (sizes[i % len(sizes)],), dtype=torch.uint8,
                                   generator=gen) for i in range(48)}
    data["u"] = torch.randn(7000, generator=gen)[1:]  # not page-aligned: staged
    batched = getattr(st._medium, "batched", False)
    jobs = []
    real_submit = st._workers.submit

    def submit(fn, *a, **kw):
        jobs.append(fn)
        return real_submit(fn, *a, **kw)

    monkeypatch.setattr(st._workers, "submit", submit)
    st.put_many(data)
    monkeypatch.undo()
    chunks = sum(-(-t.nbytes // (64 << 10)) for t in data.values())
    assert batched or 0 < len(jobs) < chunks
    assert all(torch.equal(st.get(k), v) for k, v in data.items())
    free = st.stats()["free_bytes"]
    if not batched:  # the AIO engine does not write through medium.write
        real_write, calls = st._medium.write, []

        def write(seg, offset, buf):
            calls.append(offset)
            if len(calls) == 5:
                raise OSError(errno.EIO, "Input/output error (injected)")
            real_write(seg, offset, buf)

        monkeypatch.setattr(st._medium, "write", write)
        new = {k: v + 1 for k, v in data.items()}
        with pytest.raises(OSError, match="injected"):
            st.put_many(new)
        monkeypatch.undo()
        # Every extent it took is free again (a segment it added stays, free).
        assert st.stats()["free_bytes"] >= free
        holes = {(sg, o): n for sg, h in st._alloc._holes.items() for o, n in h.lens.items()}
        with st._catalog.read() as txn:
            assert holes == {(sg, o): n for sg, o, n in st._catalog.free_extents(txn)}
        assert all(torch.equal(st.get(k), v) for k, v in data.items())
        st.put_many(new)
        assert all(torch.equal(st.get(k), v) for k, v in new.items())
    assert st.fsck().ok
    assert write_jobs.GROUP_BYTES >= 64 << 10  # a job holds one chunk at least


def test_requires_grad_tensor_is_stored_detached(store) -> None:
    w = torch.randn(5, requires_grad=True)
    store.put("w", w)
    got = store.get("w")
    assert not got.requires_grad
    assert torch.equal(got, w.detach())


# -- invalid names, kinds and tags -----------------------------------------------------------
BAD_NAMES = ["", "a\0b", "x" * 401, "é" * 201, 7, None, b"bytes"]
BAD_KINDS = ["", "Param", "1st", "exp-avg", "a b", "k" * 33, None, 3]
BAD_TAGS = ["", "bad tag", "-leading-dash", ".hidden", "a/b", "x" * 129, "tag\0", None, 5]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_names_rejected(store, name) -> None:
    for call in (lambda: store.put(name, torch.arange(3)),
                 lambda: store.put_many([(name, torch.arange(3))]),
                 lambda: store.get(name)):
        with pytest.raises(tierstore.StoreError):
            call()
    assert store.keys() == []


def test_longest_name_accepted(store) -> None:
    name = "n" * 400
    store.put(name, torch.arange(3))
    assert torch.equal(store.get(name), torch.arange(3))
    assert store.names() == [name]


@pytest.mark.parametrize("kind", BAD_KINDS, ids=repr)
def test_bad_kinds_rejected(store, kind) -> None:
    for call in (lambda: store.put("a", torch.arange(3), kind=kind),
                 lambda: store.put_many({"a": torch.arange(3)}, kind=kind),
                 lambda: store.put_many([("a", kind, torch.arange(3))]),
                 lambda: store.get("a", kind)):
        with pytest.raises(tierstore.StoreError):
            call()
    assert store.keys() == []


@pytest.mark.parametrize("tag", BAD_TAGS, ids=repr)
def test_bad_tags_rejected(store, tag) -> None:
    store.put("a", torch.arange(3))
    with pytest.raises(tierstore.SnapshotError):
        store.snapshot(tag)
    assert store.snapshots() == []


# -- batch calls given the wrong shape of argument -----------------------------------------
BAD_BATCHES = {
    "get_many of an int": (lambda st: st.get_many(5), "names or (name, kind) pairs"),
    "get_many of ints": (lambda st: st.get_many([5]), "a name or a (name, kind) pair"),
    "get_many of a triple": (lambda st: st.get_many([("w", "param", "x")]), "(name, kind)"),
    "out= a list": (lambda st: st.get_many(["w"], out=[torch.zeros(3)]), "out= maps"),
    "put_many of an int": (lambda st: st.put_many(5), "a mapping of names to tensors"),
    "put_many of a str": (lambda st: st.put_many("ab"), "a mapping of names to tensors"),
    "put_many of a 1-tuple": (lambda st: st.put_many([("a",)]), "(name, tensor)"),
}


@pytest.mark.parametrize("what", list(BAD_BATCHES))
def test_batch_calls_say_what_they_take(store, what: str) -> None:
    store.put("w", torch.arange(3.0))
    call, says = BAD_BATCHES[what]
    with pytest.raises(tierstore.StoreError) as ei:
        call(store)
    assert says in str(ei.value)
    assert store.names() == ["w"]


def test_one_name_alone_is_one_key(store) -> None:
    store.put("weights", torch.arange(3.0))
    got = store.get_many("weights")
    assert list(got) == ["weights"] and torch.equal(got["weights"], torch.arange(3.0))
    pair = store.get_many([["weights", "param"]])  # a list pair keys the dict as a tuple
    assert list(pair) == [("weights", "param")]


@pytest.mark.parametrize("size, pool, why", [
    (0, "pool", "at least 8 KiB"),
    ("1MiB", "missing/pool", "does not exist"),
])
def test_a_pmem_store_that_cannot_have_its_pool_is_refused_leaving_nothing(
        tmp_path, size, pool, why) -> None:
    with pytest.raises(tierstore.StoreError, match=why):
        tierstore.open(tmp_path / "s", create=True, backing="pmem", pmem_size=size,
                       pmem_path=tmp_path / pool)
    assert not (tmp_path / "s").exists()  # so the same init, corrected, succeeds
    with tierstore.open(tmp_path / "s", create=True, backing="pmem", pmem_size="8MiB",
                        pmem_path=tmp_path / "pool") as st:
        st.put("a", torch.ones(3))
