"""The NVMe tier's I/O engines and slab medium, below the store."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tierstore.nvme import (
    ALIGNMENT,
    PosixEngine,
    RecycledBuffers,
    SlabMedium,
    StagingPool,
    aligned_empty,
    is_aligned,
    make_engine,
)


@pytest.mark.parametrize("direct", [True, False])
def test_engine_round_trip_at_offsets(tmp_path, direct: bool) -> None:
    eng = PosixEngine(threads=4, direct=direct)
    try:
        fh = eng.open(str(tmp_path / "f"), create=True)
        os.posix_fallocate(fh.fd, 0, 1 << 20)
        data = aligned_empty(256 << 10)
        data[:] = np.random.default_rng(0).integers(0, 256, data.size, dtype=np.uint8)
        futures = [eng.pwrite(fh, memoryview(data[i : i + 65536]), (1 << 19) + i)
                   for i in range(0, data.size, 65536)]
        assert [f.result() for f in futures] == [65536] * 4
        back = aligned_empty(data.size)
        assert eng.read(fh, memoryview(back), 1 << 19) == data.size
        assert np.array_equal(back, data)
        eng.close_file(fh)
    finally:
        eng.close()


def test_blocking_calls_hand_large_requests_to_the_pool(tmp_path, monkeypatch) -> None:
    """A small blocking read or write runs on the caller's thread; a large one (1 MiB and
    up) runs on the engine's threads, which take the next queued request at once. Both
    come back with the bytes, and never more than ``threads`` are in flight."""
    import threading

    import tierstore.nvme.engines as engines
    where: list[str] = []
    inflight, peak = [0], [0]
    guard = threading.Lock()

    def traced(fn):
        def call(fd, buf, offset):
            with guard:
                where.append(threading.current_thread().name)
                inflight[0] += 1
                peak[0] = max(peak[0], inflight[0])
            try:
                return fn(fd, buf, offset)
            finally:
                with guard:
                    inflight[0] -= 1
        return call

    monkeypatch.setattr(engines, "_full_preadv", traced(engines._full_preadv))
    monkeypatch.setattr(engines, "_full_pwritev", traced(engines._full_pwritev))
    eng = PosixEngine(threads=2, direct=False)
    try:
        fh = eng.open(str(tmp_path / "f"), create=True)
        big = aligned_empty(engines.HANDOFF_MIN_BYTES)
        big[:] = np.random.default_rng(1).integers(0, 256, big.size, dtype=np.uint8)
        assert eng.write(fh, memoryview(big[:4096]), 0) == 4096
        assert eng.write(fh, memoryview(big), 0) == big.size
        back = aligned_empty(big.size)
        assert eng.read(fh, memoryview(back[:4096]), 0) == 4096
        assert eng.read(fh, memoryview(back), 0) == big.size
        assert np.array_equal(back, big)
        me = threading.current_thread().name
        assert where[0] == me and where[2] == me
        assert where[1].startswith("tierstore-io") and where[3].startswith("tierstore-io")
        where.clear()
        callers = [threading.Thread(target=eng.read, args=(fh, memoryview(aligned_empty(n)), 0))
                   for n in (4096, big.size) * 4]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert len(where) == 8 and peak[0] <= 2
        eng.close_file(fh)
    finally:
        eng.close()


def test_depth_limit_serves_waiters_in_arrival_order() -> None:
    """A thread that frees a slot and asks again queues behind the threads already waiting
    (readers issuing request after request cannot starve a writer), and no more than
    ``slots`` threads ever hold one."""
    import threading
    import time

    from tierstore.nvme.engines import FairDepth

    depth = FairDepth(1)
    order: list[str] = []
    depth.__enter__()

    def waiter() -> None:
        with depth:
            order.append("waiter")

    t = threading.Thread(target=waiter)
    t.start()
    deadline = time.monotonic() + 10
    while not depth._waiters and time.monotonic() < deadline:
        time.sleep(0.001)
    depth.__exit__(None, None, None)
    with depth:
        order.append("again")
    t.join()
    assert order == ["waiter", "again"]

    depth = FairDepth(3)
    held, peak, guard = [0], [0], threading.Lock()

    def hammer() -> None:
        for _ in range(200):
            with depth:
                with guard:
                    held[0] += 1
                    peak[0] = max(peak[0], held[0])
                with guard:
                    held[0] -= 1

    ts = [threading.Thread(target=hammer) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert held[0] == 0 and 1 <= peak[0] <= 3
    with pytest.raises(ValueError):
        FairDepth(0)


def test_short_read_past_end_of_file_is_an_error(tmp_path) -> None:
    eng = PosixEngine(threads=1, direct=False)
    try:
        fh = eng.open(str(tmp_path / "f"), create=True)
        os.pwrite(fh.fd, b"x" * 4096, 0)
        with pytest.raises(OSError) as ei:
            eng.read(fh, memoryview(aligned_empty(8192)), 0)
        assert ei.value.errno == errno.EIO
        eng.close_file(fh)
    finally:
        eng.close()


def test_o_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    eng = PosixEngine(threads=1, direct=True)
    try:
        fh = eng.open(str(tmp_path / "f"), create=True)
        assert not fh.direct
        assert fh.align == 1  # buffered I/O copies through the page cache: any memory
        assert "refused" in eng.describe()
        eng.close_file(fh)
    finally:
        eng.close()


@pytest.mark.parametrize("engine", ["posix-direct", "auto"])  # auto: AIO where it runs
def test_a_file_says_the_memory_alignment_o_direct_needs(tmp_path, engine: str) -> None:
    """A file's ``align`` is the kernel's rule (statx's ``STATX_DIOALIGN``): an O_DIRECT
    read lands in memory that far from a page boundary, and not in memory aligned less. A
    file O_DIRECT refuses says nothing is needed (buffered: a copy through the page cache),
    and a medium with no slab yet says a page."""
    eng = make_engine(engine, 1)
    medium = SlabMedium(str(tmp_path / "m"), engine=eng)
    try:
        assert medium.memory_alignment == ALIGNMENT
        medium.create_segment(0, 1 << 20)
        fh = eng.open(str(tmp_path / "m" / "slabs" / "slab-000000.dat"))
        align = fh.align
        assert medium.memory_alignment == align
        assert align & (align - 1) == 0 and 0 < align <= ALIGNMENT
        if not fh.direct:
            assert align == 1
            pytest.skip("this filesystem refuses O_DIRECT")
        if align == ALIGNMENT:
            pytest.skip("the kernel does not say (statx STATX_DIOALIGN, Linux 6.1)")
        page = aligned_empty(3 * ALIGNMENT)
        page[:] = 7
        eng.write(fh, memoryview(page[:ALIGNMENT]), 0)  # written: no hole, real I/O
        page[:] = 0
        assert os.preadv(fh.fd, [memoryview(page[align : align + ALIGNMENT])], 0) == ALIGNMENT
        assert (page[align : align + ALIGNMENT] == 7).all()
        with pytest.raises(OSError) as e:
            os.preadv(fh.fd, [memoryview(page[align // 2 : align // 2 + ALIGNMENT])], 0)
        assert e.value.errno == errno.EINVAL
        eng.close_file(fh)
    finally:
        medium.close()


def test_unknown_engine_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown I/O engine"):
        make_engine("spdk")


def test_slab_medium_segments_and_orphans(tmp_path) -> None:
    m = SlabMedium(str(tmp_path), slab_bytes=1 << 20, engine="posix-direct", threads=2)
    try:
        seg, rel, base, size = m.create_segment(0, 4096)
        assert (seg, base, size) == (0, 0, 1 << 20) and not os.path.isabs(rel)
        big = m.create_segment(1, (3 << 20) + 1)  # an entry larger than a slab gets its own
        assert big[3] == (3 << 20) + 4096
        buf = aligned_empty(8192)
        buf[:] = 7
        m.pwrite(1, 1 << 20, memoryview(buf)).result()
        m.sync([1])
        back = aligned_empty(8192)
        m.pread(1, 1 << 20, memoryview(back)).result()
        assert np.array_equal(back, buf)
        assert m.location(1, 4096) == (str(tmp_path / "slabs" / "slab-000001.dat"), 4096)
        (tmp_path / "slabs" / "slab-000009.dat").write_bytes(b"")
        assert m.orphans([0, 1]) == [str(tmp_path / "slabs" / "slab-000009.dat")]
    finally:
        m.close()


def test_aligned_buffers_and_staging_pool() -> None:
    for n in (4096, 12288, 1 << 20):
        assert is_aligned(aligned_empty(n))
    pool = StagingPool(8192, keep=1)
    a, b = pool.take(), pool.take()
    assert a.ctypes.data != b.ctypes.data and is_aligned(a)
    pool.give(a)
    pool.give(b)  # beyond keep: dropped
    assert pool.take() is a
    assert pool.take() is not b


def test_recycled_buffers_come_back_when_the_last_view_is_dropped() -> None:
    pool = RecycledBuffers(keep_bytes=3 << 20, min_bytes=1 << 20)
    a = pool.take(1 << 20)
    addr = a.ctypes.data
    assert is_aligned(a) and a.flags.writeable and a.nbytes == 1 << 20
    t = torch.from_numpy(a[:4096]).view(torch.int32)  # a typed view outlives the array
    del a
    assert pool.idle_bytes == 0
    t[:] = 7
    del t
    assert pool.idle_bytes == 1 << 20
    b = pool.take(1 << 20)
    assert b.ctypes.data == addr and pool.reused == 1 and pool.idle_bytes == 0
    c = pool.take(2 << 20)  # another size: fresh memory
    assert c.ctypes.data != addr and pool.reused == 1
    d = pool.take(2 << 20)
    del b, c, d  # 1 + 2 MiB fit under keep_bytes, the second 2 MiB does not
    assert pool.idle_bytes == 3 << 20
    small = pool.take(4096)  # below min_bytes: plain aligned memory, never pooled
    assert is_aligned(small)
    del small
    assert pool.idle_bytes == 3 << 20
    pool.close()
    assert pool.idle_bytes == 0
    e = pool.take(1 << 20)
    del e  # returned after close: freed, not kept
    assert pool.idle_bytes == 0


def test_store_reads_reuse_dropped_results(tmp_path) -> None:
    import tierstore

    with tierstore.open(tmp_path / "st", create=True, host_cache=0, slab_size="32MiB") as st:
        data = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB
        st.put_many([(f"e.{i}", data) for i in range(3)])
        first = st.get_many([f"e.{i}" for i in range(3)])
        assert all(torch.equal(t, data) for t in first.values())
        addrs = {t.data_ptr() for t in first.values()}
        kept = first["e.0"]
        del first
        again = st.get_many(["e.1", "e.2"])  # lands in the two dropped buffers
        assert {t.data_ptr() for t in again.values()} == addrs - {kept.data_ptr()}
        assert all(torch.equal(t, data) for t in again.values())
        assert torch.equal(kept, data)  # a result still held is never handed out again
        st.put("e.1", data + 1)
        assert torch.equal(st.get("e.1"), data + 1)
        # Small entries too (a 128 KiB expert tensor): fresh buffers that size are mapped
        # anew by the C allocator on every read.
        small = torch.arange(1 << 15, dtype=torch.float32)
        st.put_many([(f"s.{i}", small) for i in range(2)])
        st.get_many(["s.0", "s.1"])  # the results are dropped at once
        reused = st._results.reused  # the same address could be a fresh mapping: count
        again = st.get_many(["s.0", "s.1"])
        assert st._results.reused == reused + 2
        assert all(torch.equal(t, small) for t in again.values())


@pytest.mark.gpu
def test_kvikio_reads_into_device_memory_match(tmp_path) -> None:
    pytest.importorskip("kvikio")
    from tierstore.nvme import KvikioEngine

    eng = KvikioEngine(threads=2)
    try:
        fh = eng.open(str(tmp_path / "f"), create=True)
        os.posix_fallocate(fh.fd, 0, 1 << 20)
        host = aligned_empty(1 << 20)
        host[:] = np.random.default_rng(1).integers(0, 256, host.size, dtype=np.uint8)
        eng.write(fh, host, 0)
        dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        assert eng.read(fh, dev, 0) == 1 << 20
        assert torch.equal(dev.cpu(), torch.from_numpy(host))
        eng.close_file(fh)
    finally:
        eng.close()


def test_gds_ceiling_is_skipped_with_a_reason_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GDS rows run")
    from tierstore.bench.ceilings import gds_unavailable

    assert gds_unavailable() == "no CUDA device"


def test_gds_ceiling_runs_on_a_file_of_its_own_never_the_slab(tmp_path) -> None:
    from tierstore.bench.ceilings import GdsioCeiling

    slab = tmp_path / "slab-0"
    slab.write_bytes(b"live entries" * 1000)
    before = slab.read_bytes()
    ceiling = GdsioCeiling(1 << 20, 2)
    path = ceiling.file_for(str(slab), 3 << 20)
    assert os.path.dirname(path) == str(tmp_path) and path != str(slab)
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) == 3 << 20 and data.count(0) < len(data) // 2  # real bytes, no hole
    assert ceiling.file_for(str(slab), 1 << 20) == path  # large enough already: kept
    ceiling.close()
    assert not os.path.exists(path) and slab.read_bytes() == before


def test_the_engine_needs_no_aio_library(tmp_path: Path) -> None:
    # A fresh machine has no libaio: the engine makes the system calls itself, so `auto`
    # still picks it and a store reads and writes through it.
    code = (
        "import ctypes, ctypes.util\n"
        "real = ctypes.CDLL\n"
        "def cdll(name, *a, **k):\n"
        "    if name and 'aio' in str(name): raise OSError('no libaio here')\n"
        "    return real(name, *a, **k)\n"
        "ctypes.CDLL = cdll\n"
        "ctypes.util.find_library = lambda name: None if name == 'aio' else 'libc.so.6'\n"
        "import torch, tierstore\n"
        "from tierstore.nvme.engines import resolve_engine\n"
        "assert resolve_engine('auto') == 'aio', resolve_engine('auto')\n"
        f"with tierstore.open({str(tmp_path / 'st')!r}, create=True, host_cache=0) as st:\n"
        "    st.put('a', torch.arange(5000.0))\n"
        "    assert torch.equal(st.get('a'), torch.arange(5000.0))\n"
        "    print(st.describe())\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    assert "aio (Linux AIO) O_DIRECT" in got.stdout
