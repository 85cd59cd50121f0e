"""The Linux AIO engine: batches, short transfers and errors, below and through the store.

Errors are real where the kernel can be made to produce them (a read past the end of a
file, a misaligned O_DIRECT request, a write on a file opened read-only); elsewhere the
engine's own injection hook stands in for the kernel's answer at submission or completion,
and everything after it (continuing a short transfer, draining the queue, naming the
entry) is the engine's and the store's real code.
"""

# Over 600 lines: batches, errors and closing, below and through the store, share one set
# of files, hooks and stores.
from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tierstore.nvme import AioEngine, BatchError, FileHandle, aligned_empty, libaio
from tierstore.nvme import aio as aio_mod
from tierstore.nvme.aio import address
from tierstore.nvme.engines import make_engine, resolve_engine

import tierstore
from tierstore import landing

pytestmark = pytest.mark.skipif(libaio.unavailable() is not None,
                                reason=f"Linux AIO unavailable: {libaio.unavailable()}")

MiB = 1 << 20


def _file(tmp_path: Path, nbytes: int, seed: int = 0) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    path = str(tmp_path / "f.dat")
    with open(path, "wb") as f:
        f.write(data.tobytes())
    return path, data


@contextlib.contextmanager
def _open_engine(tmp_path: Path, nbytes: int, depth: int) -> Iterator[tuple[AioEngine, FileHandle, np.ndarray]]:
    """An engine of ``depth`` with a file of ``nbytes`` random bytes open on it, and the bytes."""
    path, data = _file(tmp_path, nbytes)
    eng = AioEngine(threads=1, depth=depth)
    fh = eng.open(path)
    try:
        yield eng, fh, data
    finally:
        eng.close_file(fh)
        eng.close()


def test_auto_picks_aio_and_the_fallback_when_it_cannot_run(monkeypatch) -> None:
    assert resolve_engine("auto") == "aio"
    eng = make_engine("auto", threads=2)
    try:
        assert isinstance(eng, AioEngine) and "queue depth 32" in eng.describe()
    finally:
        eng.close()
    monkeypatch.setattr(libaio, "unavailable", lambda: "io_setup failed: Function not implemented")
    assert resolve_engine("auto") == "posix-direct"


def test_batch_reads_and_writes_with_callbacks_in_order_of_completion(tmp_path) -> None:
    with _open_engine(tmp_path, 8 * MiB, 4) as (eng, fh, data):
        buf = aligned_empty(8 * MiB)
        pulled: list[int] = []

        def requests() -> Any:
            for i in range(32):  # 256 KiB each, backwards through the file
                pulled.append(i)
                off = (31 - i) * 256 * 1024
                yield fh, address(buf) + off, 256 * 1024, off, False

        seen: list[int] = []

        def done(i: int) -> None:
            # At most depth in flight, and as many made ahead of them or completed with
            # their callbacks still due.
            assert i in pulled and len(pulled) - len(seen) <= 2 * 4
            seen.append(i)

        assert eng.run(requests(), done) == 32
        assert sorted(seen) == list(range(32))
        assert np.array_equal(buf, data)
        out = aligned_empty(MiB)
        out[:] = 3
        eng.run([(fh, address(out), MiB, 2 * MiB, True)])
        back = aligned_empty(MiB)
        eng.read(fh, memoryview(back), 2 * MiB)
        assert (back == 3).all()


def test_requests_made_while_the_disk_waits_go_each_as_it_is_made(tmp_path) -> None:
    # A producer that stages each request (a copy) is slow to make the next one: with
    # nothing made ahead each goes at once, not once a window's worth is made.
    with _open_engine(tmp_path, 4 * MiB, 8) as (eng, fh, data):
        buf = aligned_empty(4 * MiB)
        events: list[tuple[str, int]] = []

        def requests() -> Any:
            for i in range(16):
                events.append(("made", i))
                off = i * 256 * 1024
                yield fh, address(buf) + off, 256 * 1024, off, False

        def inject(phase: str, index: int, req: Any) -> None:
            if phase == "submit":
                events.append(("sent", index))

        eng.inject = inject
        assert eng.run(requests()) == 16
        # Until the ring's 8 slots are taken; nothing is reaped in between.
        assert events[:16] == [(what, i) for i in range(8) for what in ("made", "sent")]
        sent = [i for what, i in events if what == "sent"]
        assert sorted(sent) == list(range(16))
        assert np.array_equal(buf, data)


@pytest.mark.parametrize("windows", [2, 1], ids=["two windows", "one window"])
def test_a_counted_batch_ends_with_half_of_what_is_left_in_flight(tmp_path, windows) -> None:
    # Told how many requests there are, once the last is made the engine keeps at most
    # half of what is left in flight (one request at least), so the caller's checks of
    # each part overlap the next part's transfer rather than all following the last one:
    # also a batch that fits in one window, made whole while its first request moves.
    size = 256 * 1024
    with _open_engine(tmp_path, 4 * MiB, 16) as (eng, fh, data):
        eng.window = 16 * size // windows
        buf = aligned_empty(4 * MiB)
        made = [0]
        flight: set[int] = set()
        seen: list[tuple[int, int, int]] = []  # (request, made, in flight with it)

        def requests() -> Any:
            for i in range(16):
                made[0] += 1
                yield fh, address(buf) + i * size, size, i * size, False

        def inject(phase: str, index: int, req: Any) -> None:
            if phase == "submit":
                flight.add(index)
                seen.append((index, made[0], len(flight)))
            else:
                flight.discard(index)

        eng.inject = inject
        assert eng.run(requests(), count=16) == 16
        assert np.array_equal(buf, data)
        assert sorted(i for i, _, _ in seen) == list(range(16))
        for index, had, together in seen:
            if had == 16:  # all made: what is left is in flight or not yet sent
                left = together - 1 + 16 - index
                assert together == 1 or 2 * (together - 1) < left, seen
        assert seen[-1][2] == 1  # the last went alone


def test_a_real_short_read_at_the_end_of_the_file_is_eio(tmp_path) -> None:
    path, data = _file(tmp_path, 8192)
    eng = AioEngine(threads=1)
    fh = eng.open(path)
    try:
        buf = aligned_empty(16384)
        with pytest.raises(BatchError) as got:
            eng.run([(fh, address(buf), 4096, 0, False), (fh, address(buf) + 4096, 12288, 4096, False)])
        assert got.value.errno == errno.EIO and got.value.index == 1
        assert got.value.phase == "complete" and "end of file" in str(got.value)
        assert np.array_equal(buf[:8192], data)  # the part that was there was read
    finally:
        eng.close_file(fh)
        eng.close()


def test_real_kernel_errors_at_submission_and_at_completion(tmp_path) -> None:
    path, _ = _file(tmp_path, MiB)
    eng = AioEngine(threads=1)
    fh = eng.open(path)
    ro = FileHandle(path, os.open(path, os.O_RDONLY), False)
    try:
        buf = aligned_empty(2 * 4096)
        if fh.direct:  # a misaligned O_DIRECT request: the kernel fails it with EINVAL
            with pytest.raises(BatchError) as got:
                eng.run([(fh, address(buf), 4096, 0, False), (fh, address(buf) + 1, 4096, 0, False)])
            assert got.value.errno == errno.EINVAL and got.value.index == 1
        with pytest.raises(BatchError) as got:  # io_submit refuses a write on a read-only fd
            eng.run([(fh, address(buf), 4096, 0, False), (ro, address(buf), 4096, 0, True)])
        assert got.value.errno == errno.EBADF and got.value.index == 1
        assert got.value.phase == "submit"
        eng.run([(fh, address(buf), 4096, 0, False)])  # the engine is fine afterwards
    finally:
        os.close(ro.fd)
        eng.close_file(fh)
        eng.close()


def test_a_failing_callback_drains_the_queue_before_it_is_raised(tmp_path) -> None:
    path, data = _file(tmp_path, 4 * MiB)
    eng = AioEngine(threads=1, depth=8)
    fh = eng.open(path)
    try:
        buf = aligned_empty(4 * MiB)
        reqs = [(fh, address(buf) + i * 65536, 65536, i * 65536, False) for i in range(64)]

        def done(i: int) -> None:
            if i == 3:
                raise ValueError("checksum")

        with pytest.raises(ValueError, match="checksum"):
            eng.run(reqs, done)
        assert all(r.idle for r in eng._rings)  # nothing in flight once it raised
        assert eng.run(reqs) == 64 and np.array_equal(buf, data)
    finally:
        eng.close_file(fh)
        eng.close()


# --------------------------------------------------------------------------- through the store
def _store(tmp_path: Path) -> tierstore.Store:
    return tierstore.open(tmp_path / "s", create=True, host_cache=0, engine="aio",
                          slab_size="64MiB", chunk_size="256KiB", io_threads=2)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-aligned memory: the AIO batch's own path (most bytes of unaligned
    memory go to the chunk workers instead)."""
    out = tierstore.read_buffer(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def _entries(st: tierstore.Store) -> dict[str, torch.Tensor]:
    # several chunks each, under 1 MiB (larger entries go to the chunk workers)
    data = {f"e{i}": _aligned(torch.randn(200_000 + i)) for i in range(6)}
    st.put_many(data)
    return data


def _scribble(info: Any, at: int, data: bytes) -> None:
    """Overwrite bytes of a stored entry on disk, behind the store's back."""
    fd = os.open(info.path, os.O_RDWR)
    try:
        os.pwrite(fd, data, info.offset + at)
        os.fsync(fd)
    finally:
        os.close(fd)


def _hook(target: tuple[str, int], phase: str, result: int, once: bool = True) -> Any:
    """An injection hook: at ``phase``, the request that touches byte ``target`` of its
    file gets ``result``."""
    fired: list[int] = []

    def inject(ph: str, index: int, req: Any) -> int | None:
        fh, _, nbytes, offset, _ = req
        if ph == phase and fh.path == target[0] and offset <= target[1] < offset + nbytes:
            if once and fired:
                return None
            fired.append(index)
            return result
        return None

    return inject


def test_store_runs_on_aio(tmp_path) -> None:
    with _store(tmp_path) as st:
        assert "aio (Linux AIO)" in st.describe()


def test_a_short_completion_is_continued_and_the_read_verified(tmp_path) -> None:
    with _store(tmp_path) as st:
        data = _entries(st)
        info = st.info("e3")
        st._medium.engine.inject = _hook((info.path, info.offset), "complete", 4096 * 5,
                                         once=False)
        got = st.get_many(list(data))
        for name, t in data.items():
            assert torch.equal(got[name], t)


@pytest.mark.parametrize("phase,err", [("submit", errno.EINVAL), ("submit", errno.EIO),
                                       ("complete", errno.EIO), ("complete", errno.EINVAL)])
def test_a_read_error_names_the_entry_and_the_store_goes_on(tmp_path, phase, err) -> None:
    with _store(tmp_path) as st:
        data = _entries(st)
        info = st.info("e4")
        st._medium.engine.inject = _hook((info.path, info.offset + 256 * 1024), phase, -err
                                         if phase == "complete" else err)
        with pytest.raises(tierstore.CorruptEntryError, match="'e4'") as got:
            st.get_many(list(data))
        assert os.strerror(err) in str(got.value)
        st._medium.engine.inject = None
        for name, t in st.get_many(list(data)).items():
            assert torch.equal(t, data[name])


@pytest.mark.parametrize("phase,err", [("submit", errno.EINVAL), ("complete", errno.EIO)])
def test_a_write_error_names_the_entry_and_commits_nothing(tmp_path, phase, err) -> None:
    with _store(tmp_path) as st:
        data = _entries(st)
        newer = {name: _aligned(t + 1) for name, t in data.items()}
        # put_many of one entry of five chunks: request 1 is its second chunk.
        before = st.info("e2").version
        hits: list[str] = []

        def inject(ph: str, index: int, req: Any) -> int | None:
            if ph == phase and index == 1:
                hits.append(req[0].path)
                return err if phase == "submit" else -err
            return None

        st._medium.engine.inject = inject
        with pytest.raises(OSError, match="'e2'") as got:
            st.put_many({"e2": newer["e2"]})
        assert got.value.errno == err and hits
        st._medium.engine.inject = None
        assert st.info("e2").version == before
        assert torch.equal(st.get("e2"), data["e2"])  # the old version, intact
        st.put_many({"e2": newer["e2"]})
        assert torch.equal(st.get("e2"), newer["e2"])


def test_the_first_corrupt_entry_in_the_order_asked_is_named_whatever_fails_after_it(
        tmp_path) -> None:
    with _store(tmp_path) as st:
        data = _entries(st)
        e1, e4 = st.info("e1"), st.info("e4")
        _scribble(e1, 100, b"\xff" * 16)
        # e4's second chunk fails after e1's chunks were sent, at completion or at
        # submission: e1's checksum failure is still the one reported, every time.
        for phase, result in [("complete", -errno.EIO), ("submit", errno.EIO)] * 10:
            st._medium.engine.inject = _hook((e4.path, e4.offset + 256 * 1024), phase, result)
            with pytest.raises(tierstore.CorruptEntryError, match="'e1'.*crc32c"):
                st.get_many(list(data))
        st._medium.engine.inject = None
        with pytest.raises(tierstore.CorruptEntryError, match="'e1'"):
            st.get_many(list(data))


def test_a_zero_byte_write_completion_is_not_called_a_short_read(tmp_path) -> None:
    with _store(tmp_path) as st:
        st._medium.engine.inject = lambda ph, i, req: 0 if ph == "complete" else None
        with pytest.raises(OSError, match="no progress") as got:
            st.put("w", _aligned(torch.ones(100_000)))
        assert "short read" not in str(got.value)


# --------------------------------------------------------------------------- contexts and close
class _Lib:
    """libaio with io_setup answering ``fail`` (a negative errno) while it is set: the
    kernel's answer once fs.aio-max-nr is exhausted, which cannot be provoked here without
    starving every other process of AIO."""

    def __init__(self, lib: Any) -> None:
        self._lib, self.fail = lib, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def io_setup(self, n: int, ctx: Any) -> int:
        return self.fail if self.fail else self._lib.io_setup(n, ctx)


def test_no_aio_context_to_be_had_runs_the_batch_without_aio(tmp_path) -> None:
    with _store(tmp_path) as st:
        eng = st._medium.engine
        lib = eng._lib = _Lib(eng._lib)
        lib.fail = -errno.EAGAIN  # before the store's first I/O: no context exists
        data = _entries(st)
        got = st.get_many(list(data))
        for name, t in data.items():
            assert torch.equal(got[name], t)
        assert st.fsck().ok
        assert eng._all == []  # all of it ran through preadv/pwritev
        lib.fail = -errno.ENOMEM
        assert torch.equal(st.get("e2"), data["e2"])
        lib.fail = 0
        assert torch.equal(st.get("e3"), data["e3"])
        assert len(eng._all) == 1  # AIO again once the kernel allows a context
        # Any other refusal is the batch's error, not the entry's corruption.
        with eng._ring_free:  # the idle context goes, so the next batch needs a new one
            for ring in eng._rings:
                eng._all.remove(ring)
                eng._made -= 1
                ring.close()
            eng._rings.clear()
        lib.fail = -errno.EINVAL
        with pytest.raises(tierstore.StoreError, match="e0") as err:
            st.get_many(list(data))
        assert not isinstance(err.value, tierstore.CorruptEntryError)
        lib.fail = 0


def test_concurrent_batches_share_a_bounded_number_of_contexts(tmp_path) -> None:
    with _store(tmp_path) as st:
        data = _entries(st)
        eng = st._medium.engine
        start = threading.Barrier(8)
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                start.wait()
                for _ in range(5):
                    got = st.get_many(list(data))
                    assert all(torch.equal(got[n], t) for n, t in data.items())
            except BaseException as e:  # noqa: BLE001 (asserted below)
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert 1 <= len(eng._all) <= eng.max_rings == 2


def test_close_during_a_read_waits_for_it_then_the_store_is_closed(tmp_path) -> None:
    st = _store(tmp_path)
    data = _entries(st)
    eng = st._medium.engine
    in_flight, closing = threading.Event(), threading.Event()
    gate = st._ops
    enter_closing = gate.closing

    def signalled_closing() -> Any:
        closing.set()
        return enter_closing()

    gate.closing = signalled_closing  # type: ignore[method-assign]

    def hold(ph: str, index: int, req: Any) -> None:
        # The batch stops mid-flight, with requests submitted, until close() has begun.
        if ph == "complete" and index == 2 and not in_flight.is_set():
            in_flight.set()
            assert closing.wait(60)

    eng.inject = hold
    outcome: list[Any] = []

    def reader() -> None:
        try:
            outcome.append(st.get_many(list(data)))
        except BaseException as e:  # noqa: BLE001 (asserted below)
            outcome.append(e)

    t = threading.Thread(target=reader)
    t.start()
    assert in_flight.wait(60)
    st.close()  # waits for the read: nothing is closed under it
    t.join()
    (got,) = outcome
    assert not isinstance(got, BaseException), got
    assert all(torch.equal(got[n], v) for n, v in data.items())
    assert eng.closed and eng._all == []
    with pytest.raises(tierstore.StoreClosedError):
        st.get_many(list(data))
    st.close()  # again: nothing to do


def test_an_operation_that_reaches_the_gate_after_close_sees_a_closed_store(tmp_path) -> None:
    st = _store(tmp_path)
    data = _entries(st)
    st._check_open()  # what every operation does first; close() comes after it here
    st.close()
    with pytest.raises(tierstore.StoreClosedError), st._ops.shared():
        pass
    with pytest.raises(tierstore.StoreClosedError):
        st.get_many(list(data))


def test_engine_closed_during_its_own_batch_fails_it_cleanly(tmp_path) -> None:
    path, data = _file(tmp_path, 4 * MiB)
    eng = AioEngine(threads=1, depth=8)
    fh = eng.open(path)
    other = eng.open(path)
    try:
        buf = aligned_empty(4 * MiB)
        reqs = [(fh, address(buf) + i * 65536, 65536, i * 65536, False) for i in range(64)]
        eng.run(reqs[:4])  # leaves an idle context, which close() destroys
        seen: list[int] = []

        def done(i: int) -> None:
            seen.append(i)
            if i == 3:
                eng.close()  # from inside the batch: its own context is still in use

        with pytest.raises(aio_mod.EngineClosedError):
            eng.run(reqs, done)
        assert eng.closed and eng._all == [] and eng._rings == []
        assert 4 <= len(seen) < 64  # stopped early, after draining what was in flight
        with pytest.raises(aio_mod.EngineClosedError):
            eng.run(reqs[:1])
        with pytest.raises(OSError):
            eng.read(other, memoryview(buf[:4096]), 0)
    finally:
        eng.close_file(fh)
        eng.close_file(other)


# -- adjacent small entries as one vectored request ---------------------------------------

def test_a_vectored_request_gathers_and_scatters_and_continues_a_short_transfer(
        tmp_path) -> None:
    eng = AioEngine(threads=1, depth=4)
    fh = eng.open(str(tmp_path / "v.dat"), create=True)
    try:
        parts = [aligned_empty(n) for n in (4096, 8192, 12288)]
        for i, p in enumerate(parts):
            p[:] = i + 1
        pieces = tuple((address(p), p.nbytes) for p in parts)
        eng.run([(fh, pieces, 24576, 4096, True)])
        whole = aligned_empty(24576)
        eng.run([(fh, address(whole), 24576, 4096, False)])
        assert np.array_equal(whole, np.concatenate(parts))
        # Scattered into two buffers, the first completion stopping inside the second.
        a, b = aligned_empty(8192), aligned_empty(16384)
        shorts: list[int] = []

        def short_once(ph: str, index: int, req: Any) -> int | None:
            if ph == "complete" and not shorts:
                shorts.append(index)
                return 12288
            return None

        eng.inject = short_once
        eng.run([(fh, ((address(a), 8192), (address(b), 16384)), 24576, 4096, False)])
        assert shorts and np.array_equal(np.concatenate([a, b]), np.concatenate(parts))
    finally:
        eng.close()


def _small(st: tierstore.Store, n: int = 40) -> dict[str, torch.Tensor]:
    data = {f"s{i:02d}": torch.randn(2048 + 512 * (i % 3)) for i in range(n)}  # 8–12 KiB
    st.put_many(data)
    return data


def _count(phase: str, into: list[Any]) -> Any:
    def inject(ph: str, index: int, req: Any) -> None:
        if ph == phase:
            into.append(req)
    return inject


def test_small_entries_next_to_each_other_move_as_few_requests(tmp_path) -> None:
    with _store(tmp_path) as st:
        sent: list[Any] = []
        st._medium.engine.inject = _count("submit", sent)
        data = _small(st)
        # 40 entries of 8–12 KiB, at most 256 KiB (the chunk) a request.
        assert 1 < len(sent) <= 3 and sum(r[2] for r in sent) >= 40 * 8192
        sent.clear()
        got = st.get_many(list(data))
        assert 1 < len(sent) <= 3
        assert all(torch.equal(got[k], v) for k, v in data.items())
        # Asked out of disk order: only the neighbours that stay neighbours are joined.
        sent.clear()
        names = list(data)[::-1]
        got = st.get_many(names)
        assert len(sent) == 40 and all(torch.equal(got[k], data[k]) for k in names)
        st._medium.engine.inject = None
        assert st.fsck().ok


def test_a_reads_last_request_of_several_chunks_goes_as_two(tmp_path) -> None:
    # Its halves go one after the other (the engine's taper), so only the second's checks
    # follow the read's last transfer.
    with _store(tmp_path) as st:
        data = _small(st)
        sent: list[Any] = []
        st._medium.engine.inject = _count("submit", sent)
        got = st.get_many(list(data))
        assert all(torch.equal(got[k], v) for k, v in data.items())
        *_, (_, _, n1, off1, _), (_, _, n2, off2, _) = sent
        assert off1 + n1 == off2 and 0 <= n1 - n2 <= 12288  # cut at a chunk past the middle
        before = len(sent)
        assert torch.equal(st.get("s00"), data["s00"])  # a request of one chunk stays one
        assert len(sent) == before + 1
        st._medium.engine.inject = None


@pytest.mark.parametrize("phase,err", [("submit", errno.EIO), ("complete", errno.EIO)])
def test_a_failed_joined_read_names_the_entry_whose_bytes_fail(tmp_path, phase, err) -> None:
    with _store(tmp_path) as st:
        data = _small(st)
        bad = st.info("s17")
        st._medium.engine.inject = _hook((bad.path, bad.offset + 100), phase,
                                         -err if phase == "complete" else err, once=False)
        with pytest.raises(tierstore.CorruptEntryError, match="'s17'") as got:
            st.get_many(list(data))
        assert os.strerror(err) in str(got.value)
        # A failure that does not come back costs nothing: the joined request fails once,
        # its entries are read one by one, and everything arrives verified.
        st._medium.engine.inject = _hook((bad.path, bad.offset + 100), phase,
                                         -err if phase == "complete" else err)
        got2 = st.get_many(list(data))
        assert all(torch.equal(got2[k], v) for k, v in data.items())
        st._medium.engine.inject = None


def test_a_corrupt_small_entry_inside_a_joined_read_is_named(tmp_path) -> None:
    with _store(tmp_path) as st:
        data = _small(st)
        for victim in ("s23", "s05"):
            _scribble(st.info(victim), 64, b"\x01" * 8)
        with pytest.raises(tierstore.CorruptEntryError, match="'s05'.*crc32c"):
            st.get_many(list(data))
        with pytest.raises(tierstore.CorruptEntryError, match="'s23'.*crc32c"):
            st.get_many([k for k in data if k != "s05"])
        assert torch.equal(st.get("s24"), data["s24"])


def test_a_failed_joined_write_names_its_entries_and_commits_nothing(tmp_path) -> None:
    with _store(tmp_path) as st:
        data = _small(st)
        newer = {k: v + 1 for k, v in data.items()}
        versions = {k: st.info(k).version for k in data}

        def inject(ph: str, index: int, req: Any) -> int | None:
            return -errno.EIO if ph == "complete" and index == 1 else None

        st._medium.engine.inject = inject
        with pytest.raises(OSError, match=r"one request with the \d+ entries after it") as got:
            st.put_many(newer)
        assert got.value.errno == errno.EIO
        st._medium.engine.inject = None
        assert {k: st.info(k).version for k in data} == versions
        assert all(torch.equal(st.get(k), v) for k, v in data.items())
        assert st.fsck().ok


def test_joined_requests_without_an_aio_context(tmp_path) -> None:
    with _store(tmp_path) as st:
        eng = st._medium.engine
        eng._lib = _Lib(eng._lib)
        eng._lib.fail = -errno.EAGAIN  # every batch runs with preadv/pwritev
        data = _small(st)
        got = st.get_many(list(data))
        assert all(torch.equal(got[k], v) for k, v in data.items())
        assert eng._all == [] and st.fsck().ok
        eng._lib.fail = 0


def test_a_refused_context_is_tried_again_once_a_batch_has_ended(tmp_path) -> None:
    eng = AioEngine(threads=2)
    lib = eng._lib = _Lib(eng._lib)
    try:
        first = eng._take_ring()
        assert first is not None

        def refuse_and_end_a_batch(n: int, ctx: Any) -> int:
            # The kernel refuses a second context while the first batch still runs; that
            # batch ends just after, so the refused one waits for its context.
            lib.io_setup = lib._lib.io_setup
            eng._give_ring(first)
            return -errno.EAGAIN

        lib.io_setup = refuse_and_end_a_batch
        again = eng._take_ring()
        assert again is first and len(eng._all) == 1
        eng._give_ring(again)  # a batch ended: the limit may have moved
        held = [eng._take_ring(), None]
        got = threading.Thread(target=lambda: held.__setitem__(1, eng._take_ring()))
        got.start()
        got.join(timeout=30)  # only bounds a regression that would wait forever
        assert held[1] is not None and held[1] is not held[0] and len(eng._all) == 2
        for ring in held:
            eng._give_ring(ring)
    finally:
        eng.close()


@pytest.mark.parametrize("into", ["torch.empty", "read_buffer"])
def test_a_read_keeps_a_bounced_window_moving_and_a_direct_one_a_window(tmp_path, monkeypatch,
                                                                         into) -> None:
    # Bytes landing in bounce buffers (torch's tensors sit 64 bytes into a page) are kept
    # to COPIED_WINDOW in flight; bytes landing in the caller's aligned memory to the
    # engine's window. Scaled down: 256 KiB requests, a 512 KiB bounced window, 4 MiB.
    monkeypatch.setattr(landing, "COPIED_WINDOW", 512 * 1024)
    with _store(tmp_path) as st:
        st._medium.engine.window = 4 * MiB
        src = {f"e{i}": _aligned(torch.randn(64 * 1024)) for i in range(32)}  # 8 MiB
        st.put_many(src)
        outs = {name: torch.empty(64 * 1024) if into == "torch.empty"
                else tierstore.read_buffer((64 * 1024,), torch.float32) for name in src}
        flight: dict[int, int] = {}  # request -> its bytes, submitted and not reaped
        most = [0]

        def inject(phase: str, index: int, req: Any) -> None:
            if phase == "submit":
                flight[index] = req[2]
                most[0] = max(most[0], sum(flight.values()))
            else:
                flight.pop(index)

        st._medium.engine.inject = inject
        st.get_many(list(src), out=outs)
        for name, t in src.items():
            assert torch.equal(outs[name], t)
        assert most[0] == (512 * 1024 if into == "torch.empty" else 4 * MiB)
