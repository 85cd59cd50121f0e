"""Linux native AIO engine: deep queues, one system call per batch of requests.

The kernel interface, and why it is bound through ctypes with no library, is in
:mod:`nvme.libaio`.

How it is driven: :meth:`AioEngine.run` takes a batch of requests, keeps up to ``depth`` of
them in flight, submits every request that fits in one ``io_submit`` and reaps completions
in one ``io_getevents``, and calls back on the caller's thread as each request completes,
so the caller checksums one chunk while the kernel moves the others. No Python thread is
woken per request. A request may be vectored (``IOCB_CMD_PREADV``/``PWRITEV``): one range
of the file gathered from or scattered into several buffers, so a caller can move many
small entries that sit next to each other on disk as one large request. Each running batch owns an AIO context (taken from a pool), so
concurrent batches never reap each other's completions. An engine keeps at most
``max(2, threads)`` contexts (each counts against the system-wide ``fs.aio-max-nr``); a
batch waits for a free one, and where the kernel refuses to set one up (EAGAIN, ENOMEM)
with none to wait for, the batch runs with ``preadv``/``pwritev`` on the calling thread.

:meth:`AioEngine.close` is safe while batches run: a running batch stops taking requests,
drains what it has in flight, fails with :class:`EngineClosedError` and destroys its own
context; close waits for that before it destroys the idle ones (a context is never
destroyed under a batch that still reaps from it).

A short transfer is continued from where it stopped; a read that reaches the end of the
file fails with EIO. An error fails the batch with :class:`BatchError`, which says which
request failed, after every request still in flight has completed (a buffer must never be
written by the kernel once its owner has moved on).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .engines import (
    FileHandle,
    PosixEngine,
    _full_preadv,
    _full_pwritev,
    _open_fd,
    file_alignment,
)
from .libaio import (
    IOCB_CMD_PREAD,
    IOCB_CMD_PREADV,
    IOCB_CMD_PWRITE,
    IOCB_CMD_PWRITEV,
    Iovec,
    Ring,
    load,
)

# Pieces one vectored request may gather, at most (the kernel's UIO_MAXIOV is 1024).
MAX_PIECES = 256
DEFAULT_DEPTH = 32
# Bytes a batch keeps in flight, at most (but always one request): past a few MiB in
# flight a disk is no faster, and a writer staging unaligned bytes needs a buffer for each.
# A disk may complete everything in flight at once (the development VM's does), and the
# engine then asks for a window's worth of requests in a row: a writer stages two windows
# ahead (tierstore.writes.STAGE_AHEAD_BYTES) so they are ready. 64 MiB in flight with 32
# staged ahead left the batch waiting on staging: 1 GiB of 256 KiB torch.empty tensors
# wrote at 3.15-3.19 GB/s against 4.23-4.26 with 32 and 64 (10 rounds, alternated), as fast
# as from aligned memory (4.30-4.36); reads, and 64 MiB entries, were even from 8 to 64 MiB
# in flight. DeepNVMe keeps as much in flight as now (32 requests of 1 MiB).
DEFAULT_WINDOW = 32 << 20


class BatchError(OSError):
    """A request of a batch failed; ``index`` is its position in the batch and ``phase``
    says whether the kernel refused it (``"submit"``) or it failed (``"complete"``)."""

    def __init__(self, err: int, index: int, phase: str, what: str) -> None:
        super().__init__(err, f"{os.strerror(err)} ({what}, at {phase})")
        self.index, self.phase = index, phase


class EngineClosedError(OSError):
    """The engine was closed before or during the batch."""

    def __init__(self) -> None:
        super().__init__(errno.EBADF, "the I/O engine is closed")


def address(buf: Any) -> int:
    """The address of a buffer's first byte (numpy array, memoryview or bytes-like).

    Through a ctypes view where the buffer is writable: ``ndarray.ctypes.data`` costs a
    microsecond, five times as much, and a batch of small entries asks once an entry."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):  # read-only, empty, or not one contiguous range
        pass
    if isinstance(buf, np.ndarray):
        return int(buf.ctypes.data)
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


# A request: (file, buffer, length, file offset, write?). The buffer is an address, or the
# ``(address, length)`` pieces of a vectored request (one contiguous range of the file,
# several buffers: adjacent small entries read or written as one request).
Buffer = int | tuple[tuple[int, int], ...]
Request = tuple[FileHandle, Buffer, int, int, bool]


def _pieces_after(buf: Buffer, nbytes: int, moved: int) -> list[tuple[int, int]]:
    """The ``(address, length)`` pieces of ``buf`` left after its first ``moved`` bytes."""
    if isinstance(buf, int):
        return [(buf + moved, nbytes - moved)]
    left: list[tuple[int, int]] = []
    for addr, length in buf:
        if moved >= length:
            moved -= length
            continue
        left.append((addr + moved, length - moved))
        moved = 0
    return left
# Fault injection (tests): called as inject(phase, index, request); an int it returns
# replaces what the kernel said: at "submit", an errno io_submit refused the request with;
# at "complete", the event's result (a negative errno, or a byte count for a short one).
Inject = Callable[[str, int, Request], "int | None"]


class AioEngine(PosixEngine):
    """Linux native AIO, O_DIRECT, ``depth`` requests in flight per batch (see the module
    docstring). ``threads`` sizes the inherited pool that serves single ``pread``/``pwrite``
    futures; batches (:meth:`run`) use no threads."""

    def __init__(self, threads: int = 8, depth: int = DEFAULT_DEPTH,
                 window: int = DEFAULT_WINDOW) -> None:
        self._lib = load()
        super().__init__(threads=threads, direct=True)
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.depth, self.window = depth, window
        self._rings: list[Ring] = []  # idle, ready for the next batch
        self._all: list[Ring] = []  # every live context, idle or owned by a batch
        self._rings_lock = threading.Lock()
        self._ring_free = threading.Condition(self._rings_lock)
        # Contexts live or being set up, and the most there may be: a context pins kernel
        # memory and a share of fs.aio-max-nr, so concurrent batches queue for one instead.
        self._made = 0
        self.max_rings = max(2, threads)
        # Contexts the kernel last refused to go beyond (EAGAIN: fs.aio-max-nr reached),
        # until a batch ends: then a new one is tried again, as the limit is system-wide
        # and other processes give theirs back.
        self._refused_at: int | None = None
        self._active = 0  # batches running
        self._running = threading.local()  # whether this thread is inside run()
        self._closed = False
        self.inject: Inject | None = None

    @property
    def name(self) -> str:
        return "aio"

    def describe(self) -> str:
        s = f"aio (Linux AIO) O_DIRECT, queue depth {self.depth}"
        if self._refused:
            s += " (O_DIRECT refused by the filesystem: buffered, synchronous)"
        return s

    def open(self, path: str, create: bool = False) -> FileHandle:
        fd, direct = _open_fd(path, True, create)
        if not direct:
            with self._lock:
                self._refused.add(path)
        return FileHandle(path, fd, direct, align=file_alignment(fd, direct))

    # The single-request forms (read, write, pread, pwrite) are the inherited ``preadv``/
    # ``pwritev``: one request gains nothing from a queue, and the chunk workers issue
    # them while a batch waits on those workers (for checks and staging). Were they
    # batches of one, each would need a context, and with every context held by such
    # batches the two would wait on each other for good.
    def _read_now(self, fh: FileHandle, buf: memoryview, offset: int) -> int:
        if self._closed:
            raise EngineClosedError()
        return super()._read_now(fh, buf, offset)

    def _write_now(self, fh: FileHandle, buf: memoryview, offset: int) -> int:
        if self._closed:
            raise EngineClosedError()
        return super()._write_now(fh, buf, offset)

    @property
    def closed(self) -> bool:
        return self._closed

    def _take_ring(self) -> Ring | None:
        """An idle context, a new one while under :attr:`max_rings`, else the next one a
        batch gives back. None where the kernel refuses a new context (EAGAIN, ENOMEM:
        ``fs.aio-max-nr`` reached) and none exists to wait for: the caller runs the batch
        without AIO. Raises :class:`EngineClosedError` once the engine is closed."""
        with self._ring_free:
            while True:
                if self._closed:
                    raise EngineClosedError()
                if self._rings:
                    return self._rings.pop()
                if self._made < self.max_rings and (
                        self._made == 0 or self._refused_at is None
                        or self._made < self._refused_at):
                    self._made += 1
                    break
                self._ring_free.wait()
        try:
            ring = Ring(self._lib, self.depth)
        except OSError as e:
            with self._ring_free:
                self._made -= 1
                self._ring_free.notify()
                if e.errno not in (errno.EAGAIN, errno.ENOMEM):
                    raise
                # The kernel's limit, not ours: wait for one of the contexts there are,
                # if any, and try for a new one once a batch has ended.
                self._refused_at = self._made
                if self._made == 0:
                    return None
            return self._take_ring()
        with self._ring_free:
            if self._closed:  # closed while it was set up: never used
                self._made -= 1
                ring.close()
                raise EngineClosedError()
            self._all.append(ring)
        return ring

    def _give_ring(self, ring: Ring) -> None:
        """Back to the pool; destroyed instead where it may still have requests in flight
        or the engine has been closed meanwhile."""
        with self._ring_free:
            self._refused_at = None
        if not ring.idle or self._closed:
            # io_destroy waits for requests in flight, so no buffer is written after this
            # returns. Destroyed before it leaves the list, so an interruption in between
            # can never leave a live context that nobody tracks.
            ring.close()
            with self._ring_free:
                self._all.remove(ring)
                self._made -= 1
                self._ring_free.notify()
            return
        with self._ring_free:
            if self._closed:
                self._all.remove(ring)
                self._made -= 1
                ring.close()
            else:
                self._rings.append(ring)
            self._ring_free.notify()

    def run(self, requests: Iterable[Request],
            done: Callable[[int], object] | None = None, count: int | None = None,
            window: Callable[[int], int] | None = None) -> int:
        """Carry out ``requests`` with up to ``depth`` in flight; ``done(i)`` is called on
        this thread once request ``i`` (its position in ``requests``) has moved all its
        bytes. ``requests`` may be a generator: it is advanced at most a window (and
        ``depth`` requests) ahead of what is in flight, the next window's requests made
        while the last one's are in flight, so a producer can stage (copy, checksum) them
        meanwhile. ``count``, where the caller knows it: how many requests there are, so
        the batch's end is tapered (see :meth:`_run`). ``window``, where given, says from
        the engine's window the bytes to keep in flight and made ahead, asked as the batch
        goes (a batch whose bytes move through the store's buffers keeps fewer of them
        moving). Returns the number of requests.

        Raises, once nothing is in flight any more: :class:`BatchError` for a failed
        request (the lowest-numbered one, when several fail), what the generator raised,
        what ``done`` raised (no ``done`` is called after that), or
        :class:`EngineClosedError` if the engine is or gets closed. After a request fails,
        no new request is taken, but ``done`` is still called for every one in flight that
        completes: a caller that checks what lands sees every request before the failed
        one."""
        with self._ring_free:
            if self._closed:
                raise EngineClosedError()
            self._active += 1
        nested = getattr(self._running, "depth", 0)
        self._running.depth = nested + 1
        try:
            ring = self._take_ring()
            if ring is None:
                return self._run_posix(iter(requests), done)
            ring.idle = False
            try:
                return self._run(ring, iter(requests), done, count, window)
            finally:
                self._give_ring(ring)
        finally:
            self._running.depth = nested
            with self._ring_free:
                self._active -= 1
                self._ring_free.notify_all()

    def _run_posix(self, todo: Any, done: Callable[[int], object] | None) -> int:
        """A batch without AIO (no context could be set up), one request at a time on
        this thread; errors as :meth:`run` reports them."""
        count = 0
        for req in todo:
            if self._closed:
                raise EngineClosedError()
            fh, buf, nbytes, offset, write = req
            try:
                with self._depth:
                    at = offset
                    for addr, length in _pieces_after(buf, nbytes, 0):
                        view = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
                        (_full_pwritev if write else _full_preadv)(fh.fd, view, at)
                        at += length
            except OSError as e:
                what = _what(req) if e.errno != errno.EIO or write else (
                    f"{_what(req)}: {e.strerror}")
                raise BatchError(e.errno or errno.EIO, count, "complete", what) from e
            if done is not None:
                done(count)
            count += 1
        return count

    def _run(self, ring: Ring, todo: Any, done: Callable[[int], object] | None,
             total: int | None = None, window_of: Callable[[int], int] | None = None) -> int:
        lib, ctx, depth = self._lib, ring.ctx, ring.depth
        iocbs, ptrs, events, slot_addr = ring.iocbs, ring.ptrs, ring.events, ring.slot_addr
        inject = self.inject
        free = list(range(depth))
        # slot -> [index, request, bytes done]
        busy: dict[int, list[Any]] = {}
        again: deque[int] = deque()  # slots whose request continues after a short transfer
        count, inflight, exhausted, held = 0, 0, False, 0

        def current() -> int:  # the bytes to keep in flight and made ahead, now
            return self.window if window_of is None else window_of(self.window)

        # The failure to raise once idle, and the request it belongs to: the lowest-numbered
        # one wins, so what is reported does not depend on the order completions land in.
        failure: BaseException | None = None
        failed_at = 0
        # ``done`` raised, or the engine was closed: nothing more is continued or handed
        # back. A failed request alone stops only new requests.
        halted = False
        finished: list[int] = []
        # Requests made (taken from ``todo``, numbered) but not yet submitted: the next
        # window's, made while this one is in flight (see below).
        early: deque[tuple[int, Request]] = deque()
        early_bytes = 0

        def fail(exc: BaseException, at: int) -> None:
            nonlocal failure, failed_at
            if failure is None or at < failed_at:
                failure, failed_at = exc, at

        def make() -> bool:
            """Take the next request from ``todo`` into ``early``, numbered; False where
            there is none (``todo`` is exhausted, or raised: the batch's failure)."""
            nonlocal count, exhausted, early_bytes
            if exhausted:
                return False
            try:
                req = next(todo, None)
            except BaseException as e:  # noqa: BLE001 (raised once the ring is idle)
                fail(e, count)
                return False
            if req is None:
                exhausted = True
                return False
            early.append((count, req))
            early_bytes += req[2]
            count += 1
            return True

        def make_window() -> None:
            """Make requests ahead, up to a window's bytes (and ``depth`` of them)."""
            while (failure is None and not halted and early_bytes < current()
                   and len(early) < depth and make()):
                pass

        def drop(slot: int) -> None:
            nonlocal held
            held -= busy.pop(slot)[1][2]
            free.append(slot)

        def fill(slot: int, req: Request, moved: int) -> None:
            fh, buf, nbytes, offset, write = req
            cb = iocbs[slot]
            cb.aio_data = slot
            cb.aio_fildes = fh.fd
            cb.aio_offset = offset + moved
            if isinstance(buf, int):
                cb.aio_lio_opcode = IOCB_CMD_PWRITE if write else IOCB_CMD_PREAD
                cb.aio_buf = buf + moved
                cb.aio_nbytes = nbytes - moved
                return
            left = _pieces_after(buf, nbytes, moved)
            iov = ring.iovs[slot]
            if iov is None or len(iov) < len(left):
                iov = ring.iovs[slot] = (Iovec * max(len(left), MAX_PIECES))()
            for k, (addr, length) in enumerate(left):
                iov[k].iov_base, iov[k].iov_len = addr, length
            cb.aio_lio_opcode = IOCB_CMD_PWRITEV if write else IOCB_CMD_PREADV
            cb.aio_buf = ctypes.addressof(iov)
            cb.aio_nbytes = len(left)

        while True:
            if self._closed and not halted:
                # The files may be closed next: submit nothing more, drain, fail.
                halted = True
                fail(EngineClosedError(), -1)
            if halted:
                while again:
                    drop(again.popleft())
            # Gather what can be submitted: continuations first, then new requests.
            n = 0
            while again:
                slot = again.popleft()
                ptrs[n] = slot_addr[slot]
                n += 1
            # With the disk idle and nothing made ahead (a batch's start, or a producer that
            # fell behind), the first request made goes at once, alone, and the rest of the
            # window is made while it moves: a writer staging unaligned memory otherwise
            # kept the disk idle until a whole window was copied. A put of 128 MiB of
            # 256 KiB entries on 4 KiB pages, 24 alternated rounds, medians: its first write
            # 4.3-4.9 -> 2.4-4.2 ms in, the put 33.1-37.4 -> 32.8-34.6 ms (and with the
            # staging in order, tierstore.ordered, 29.6-30.7).
            solo = not busy and not early
            # The batch's end tapered: once its last request is made, at most half of what
            # is left goes in flight (one request at least). A disk that completes all in
            # flight at once (the development VMs') otherwise handed back the last window,
            # 32 MiB, in one go, and the caller's checks of it (crc32c, bounce copies) ran
            # after the I/O, not beside it; halving, each part's checks overlap the next
            # part's transfer. 1 GiB read in 256 MiB calls, 7 alternated rounds: torch.empty
            # tensors 2.03 -> 2.13 GB/s (256 KiB), 2.24 -> 2.32 (1 MiB), 2.13 -> 2.21
            # (4 MiB), 2.27 -> 2.34 (64 MiB); slices of one buffer 0.6-1.7 % faster.
            # With the first request moving, the rest of the window is made before any more
            # go, so a batch that fits in one window (a layer's experts) is tapered too: it
            # went in flight whole and all its checks ran after it. Calls of 32 MiB into
            # torch.empty tensors, 1 GiB, 9 alternated rounds beside DeepNVMe reading 32 MiB
            # a call: 1 MiB entries 0.87 -> 1.11 of its rate, 4 MiB 0.92 -> 1.12, 16 MiB
            # 0.92 -> 1.13; 16 MiB calls of 1 MiB 0.90 -> 1.01.
            if total is not None and not solo:
                make_window()
            limit = current()
            if total is not None and count >= total:
                limit = min(limit, (held + early_bytes) // 2)
            # A request made now, not ahead (the producer fell behind: a writer staging
            # memory, the batch's start) goes at once, alone, while the next is made: a
            # window made and sent together held each staged request back until the last
            # was copied. Puts of 32 MiB of 4 MiB torch.empty tensors: their second to
            # fourth requests 1.1 ms earlier. Requests made ahead go together.
            fresh = False
            while failure is None and free and (held < limit or not busy):
                fresh = not early
                if fresh and not make():
                    break
                index, req = early.popleft()
                early_bytes -= req[2]
                slot = free.pop()
                busy[slot] = [index, req, 0]
                held += req[2]
                fill(slot, req, 0)
                ptrs[n] = slot_addr[slot]
                n += 1
                if solo or fresh:
                    break
            sent = 0
            while sent < n:
                slot = (ptrs[sent] - slot_addr[0]) // 64
                err = 0
                if inject is not None:
                    index, req, _ = busy[slot]
                    err = inject("submit", index, req) or 0
                # With a hook, one request per call, so each one passes it.
                nr = n - sent if inject is None else 1
                rc = -err if err else lib.io_submit(ctx, nr, ctypes.byref(ptrs, sent * 8))
                if rc == -errno.EAGAIN and inflight:
                    break  # the kernel's queue is full: reap, then submit the rest
                if rc == -errno.EINTR:
                    continue
                if rc < 0:
                    index, req, _ = busy[slot]
                    drop(slot)
                    fail(BatchError(-rc, index, "submit", _what(req)), index)
                    # The requests after it were never sent.
                    for k in range(sent + 1, n):
                        drop((ptrs[k] - slot_addr[0]) // 64)
                    n = sent
                    break
                inflight += rc
                sent += rc
            # Not sent for lack of room in the kernel's queue: they go first next round.
            again.extendleft((ptrs[k] - slot_addr[0]) // 64 for k in range(n - 1, sent - 1, -1))
            # Completed requests are handed back only now, with their successors already
            # submitted: the disk stays busy while the caller checksums. Also after another
            # request failed, so every request before the failed one is seen.
            for index in finished:
                if not halted:
                    try:
                        done(index)  # type: ignore[misc]
                    except BaseException as exc:  # noqa: BLE001 (raised once idle)
                        halted = True
                        fail(exc, index)
            finished.clear()
            if (solo or fresh) and sent:
                continue  # the rest of the window, made and sent before any reaping
            # The next window's requests made now, while this one is in flight, not once it
            # has landed: a disk that completes a window at once (the development VM's)
            # otherwise waited while the caller made them (a read's pieces and bounce
            # buffers, a write's staged copies). 1 GiB of 256 KiB entries, alternated in one
            # process, 9 rounds: reads into slices of one buffer 2.87 -> 3.08 GB/s, into
            # pinned memory 2.92 -> 3.00; writes from pinned 4.68 -> 4.81, from slices even;
            # 1 MiB torch.empty reads 3.32 -> 3.38, writes 4.62 -> 4.83.
            if inflight:
                make_window()
            if inflight == 0:
                if halted or failure is not None and not again:
                    ring.idle = True
                    raise failure  # type: ignore[misc]
                if exhausted and not again and not early:
                    ring.idle = True
                    return count
                continue
            got = lib.io_getevents(ctx, 1, depth, events, None)
            if got == -errno.EINTR:
                continue
            if got < 0:
                # Not a request's failure: the ring is destroyed (run's finally), which
                # waits for what is in flight.
                raise OSError(-got, f"io_getevents: {os.strerror(-got)}")
            inflight -= got
            for e in range(got):
                ev = events[e]
                slot = int(ev.data)
                entry = busy[slot]
                index, req, moved = entry
                res = int(ev.res)
                if inject is not None:
                    forced = inject("complete", index, req)
                    if forced is not None:
                        res = forced
                want = req[2] - moved
                if res < 0 or (res == 0 and want > 0):
                    err = -res if res < 0 else errno.EIO
                    if res < 0:
                        what = _what(req)
                    elif req[4]:
                        what = f"{_what(req)}: no progress at offset {req[3] + moved}"
                    else:
                        what = f"{_what(req)}: short read at offset {req[3] + moved} (end of file)"
                    drop(slot)
                    fail(BatchError(err, index, "complete", what), index)
                    continue
                if res < want:  # short: go on from where it stopped
                    entry[2] = moved + res
                    fill(slot, req, entry[2])
                    if halted:
                        drop(slot)
                    else:
                        again.append(slot)
                    continue
                drop(slot)
                if done is not None:
                    finished.append(index)

    def close(self) -> None:
        """Close the engine, safe while batches run on other threads: they stop taking
        requests, drain and fail with :class:`EngineClosedError`; this waits for them,
        then destroys the idle contexts. A batch running on this thread (close called from
        its ``done``) destroys its own context when it ends."""
        with self._ring_free:
            if self._closed:
                return
            self._closed = True
            self._ring_free.notify_all()  # batches waiting for a context fail now
        # Its queued futures now fail at once; a running one drains like any batch.
        super().close()
        mine = getattr(self._running, "depth", 0)
        with self._ring_free:
            while self._active > mine:
                self._ring_free.wait()
            idle, self._rings = self._rings, []
        for ring in idle:
            ring.close()
            with self._ring_free:
                self._all.remove(ring)
                self._made -= 1


def _what(req: Request) -> str:
    fh, _, nbytes, offset, write = req
    return f"{'write' if write else 'read'} of {nbytes} bytes at offset {offset} of {fh.path}"
