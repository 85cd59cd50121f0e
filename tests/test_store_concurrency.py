"""Many threads putting and getting at once: no torn, stale-beyond-commit or foreign reads."""

from __future__ import annotations

import random
import threading

import torch

THREADS = 8
ITERATIONS = 25
SHARED = [f"shared.{i}" for i in range(4)]
STRIDE = 1 << 20  # (thread, iteration) -> thread * STRIDE + iteration
CHUNK = 16 * 1024  # small chunks: most values span several, read in parallel


def value(tag: int, n: int) -> torch.Tensor:
    """Every element depends on ``tag``: any mix of two writes fails ``decode``."""
    return torch.arange(n, dtype=torch.int64) * 2_654_435_761 + tag


def decode(t: torch.Tensor) -> int:
    tag = int(t[0])
    assert t.dtype == torch.int64 and t.ndim == 1
    assert torch.equal(t, value(tag, t.numel())), f"torn or foreign read (tag {tag})"
    return tag


def sizes(rng: random.Random) -> int:
    return rng.choice([1, 511, 512, 4096, 9000, 40_000, 100_000])


def test_threads_put_and_get_concurrently(make_store, cache_kw) -> None:
    # a small host cache, so evictions and their write-backs race the puts and gets too
    st = make_store(chunk_size=CHUNK, io_threads=4, host_cache=cache_kw.get("host_cache", "2MiB"))
    errors: list[BaseException] = []
    latest: dict[str, int] = {}  # private names: the tag their owner last committed
    barrier = threading.Barrier(THREADS + 1)
    stop = threading.Event()

    def check_shared_tag(tag: int) -> None:
        t, i = divmod(tag, STRIDE)
        assert 0 <= t < THREADS and 0 <= i < ITERATIONS, f"impossible tag {tag}"

    def worker(t: int) -> None:
        rng = random.Random(t)
        mine = [f"private.{t}.{j}" for j in range(2)]
        try:
            barrier.wait()
            for i in range(ITERATIONS):
                tag = t * STRIDE + i
                op = rng.random()
                if op < 0.3:
                    name = rng.choice(SHARED)
                    st.put(name, value(tag, sizes(rng)))
                elif op < 0.5:
                    batch = {rng.choice(SHARED): value(tag, sizes(rng)),
                             mine[i % 2]: value(tag, sizes(rng))}
                    st.put_many(batch)
                    latest[mine[i % 2]] = tag
                else:
                    name = mine[i % 2]
                    st.put(name, value(tag, sizes(rng)))
                    latest[name] = tag
                # read back my own names: exactly what I committed last
                for name in mine:
                    if name in latest:
                        assert decode(st.get(name)) == latest[name], f"{name} lost a write"
                # read shared names: whichever committed value, but whole
                present = [n for n in SHARED if n in st]
                for tag_read in (decode(v) for v in st.get_many(present).values()):
                    check_shared_tag(tag_read)
                if rng.random() < 0.2:
                    out = st.get(mine[0]) if mine[0] in latest else None
                    if out is not None:
                        buf = torch.empty_like(out)
                        st.get(mine[0], out=buf)
                        decode(buf)
        except BaseException as e:
            errors.append(e)
            stop.set()

    def snapshotter() -> None:
        # snapshots and drops racing the writers exercise the reference counts
        n = 0
        try:
            barrier.wait()
            while not stop.is_set() and n < 30:
                st.snapshot(f"snap-{n}")
                if n:
                    st.drop_snapshot(f"snap-{n - 1}")
                n += 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    snap = threading.Thread(target=snapshotter)
    for th in [*threads, snap]:
        th.start()
    for th in threads:
        th.join(timeout=300)
    stop.set()
    snap.join(timeout=300)
    assert not any(th.is_alive() for th in [*threads, snap]), "a thread hung"
    if errors:
        raise errors[0]

    for name, tag in latest.items():
        assert decode(st.get(name)) == tag
    for name in SHARED:
        if name in st:
            decode(st.get(name))
    report = st.fsck()
    assert report.ok, report.problems
    stats = st.stats()
    assert stats["entries"] == len(st.keys())

    # and the same state after a reopen
    st.close()
    st = make_store(st.path, reopen=True)
    for name, tag in latest.items():
        assert decode(st.get(name)) == tag
    report = st.fsck()
    assert report.ok, report.problems


def test_readers_during_overwrites_never_see_corruption(make_store, cache_kw) -> None:
    """One writer overwrites an entry as fast as it can while readers read it: a reader must
    get one whole committed version (never a CorruptEntryError from reused space)."""
    st = make_store(chunk_size=CHUNK, io_threads=4, **cache_kw)
    n = 60_000
    st.put("hot", value(0, n))
    errors: list[BaseException] = []
    done = threading.Event()
    reads = [0] * 4

    def writer() -> None:
        try:
            for v in range(1, 80):
                st.put("hot", value(v, n))
                if v % 4 == 0:
                    st.flush()  # write-backs (and freed extents) while readers read
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    def reader(r: int) -> None:
        try:
            last = -1
            while not done.is_set() or reads[r] == 0:
                tag = decode(st.get("hot"))
                assert tag >= last, "a read went back in time"
                last = tag
                reads[r] += 1
        except BaseException as e:
            errors.append(e)

    ths = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader, args=(r,)) for r in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in ths)
    if errors:
        raise errors[0]
    assert decode(st.get("hot")) == 79
    assert st.fsck().ok


def test_extent_being_read_is_not_reused(make_store, monkeypatch) -> None:
    """A reader's extent stays reserved until its read ends, even when a writer commits two
    newer versions meanwhile (the second would otherwise take the freed space, first fit).

    White-box: one chunk read of the backing medium is held back while the writer runs. No
    host cache: with one, a read from the backing tier holds the entry's lock, so a put of
    the same entry waits for it anyway."""
    st = make_store(chunk_size=CHUNK, io_threads=4, host_cache=0)
    n = 40_000  # 320 KB: about 20 chunks
    st.put("hot", value(0, n))
    first = st.info("hot")
    medium = st._medium
    real_read = medium.read  # the chunk jobs' blocking read
    held, release = threading.Event(), threading.Event()
    armed = [True]
    lock = threading.Lock()

    def read(seg, offset, buf):
        with lock:
            hold, armed[0] = armed[0], False
        if hold:
            held.set()
            release.wait(60)
        real_read(seg, offset, buf)

    monkeypatch.setattr(medium, "read", read)
    if getattr(medium, "batched", False):  # the AIO engine: the read is one batch
        real_run = medium.run

        def run(requests, *args):
            with lock:
                hold, armed[0] = armed[0], False
            if hold:
                held.set()
                release.wait(60)
            return real_run(requests, *args)

        monkeypatch.setattr(medium, "run", run)
    result: list[torch.Tensor | BaseException] = []

    def reader() -> None:
        try:
            result.append(st.get("hot"))
        except BaseException as e:
            result.append(e)

    th = threading.Thread(target=reader)
    th.start()
    try:
        assert held.wait(60), "the read never reached the medium (is it served elsewhere now?)"
        st.put("hot", value(1, n))  # frees the extent being read
        st.put("hot", value(2, n))  # would reuse it
        second = st.info("hot")
    finally:
        release.set()
        th.join(60)
    assert (second.path, second.offset) != (first.path, first.offset), (
        "a version was written over an extent a reader still holds")
    assert not th.is_alive()
    got = result[0]
    if isinstance(got, BaseException):
        raise got
    assert decode(got) == 0
    # once the read is over the parked extent is free again
    monkeypatch.undo()
    stats = st.stats()
    used = sum(-(-st.info(k).nbytes // 4096) * 4096 for k in st.names())
    assert stats["free_bytes"] + used == stats["capacity_bytes"]
    assert decode(st.get("hot")) == 2
