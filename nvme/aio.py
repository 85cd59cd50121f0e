"""Linux native AIO (libaio) engine: deep queues, one system call per batch of requests.

Why libaio through ctypes, and not io_uring or a compiled extension:

- **No compiler, no new wheel.** ``io_setup``/``io_submit``/``io_getevents`` are ordinary
  symbols of ``libaio.so.1`` (Debian's ``libaio1``), so ctypes calls them directly; the
  fallback when the library is missing is the thread-pool :class:`PosixEngine`, never a
  broken import. A C extension would have to build on every machine CI and users run.
- **A small, frozen ABI.** ``struct iocb`` and ``struct io_event`` have not changed since
  Linux 2.6; the whole binding is two ctypes structures and four calls. io_uring from
  Python means either a binding that lags the kernel or our own ring handling over shared
  memory, whose correctness rests on memory ordering that ctypes cannot express portably.
- **It is what the peers measure.** DeepNVMe (ZeRO-Infinity) and fio's ``libaio`` run the
  same kernel path, and on this project's disk fio ``libaio`` and ``io_uring`` at queue
  depth 32 are within the disk's run-to-run noise of each other. For O_DIRECT on a block
  device or ext4/xfs file, libaio is truly asynchronous; for buffered files it is not
  (io_submit then does the I/O itself), which is why this engine opens files O_DIRECT and
  leaves buffered I/O to the POSIX engine.

How it is driven: :meth:`AioEngine.run` takes a batch of requests, keeps up to ``depth`` of
them in flight, submits every request that fits in one ``io_submit`` and reaps completions
in one ``io_getevents``, and calls back on the caller's thread as each request completes,
so the caller checksums one chunk while the kernel moves the others. No Python thread is
woken per request. Each running batch owns an AIO context (taken from a pool), so
concurrent batches never reap each other's completions.

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
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np

from .engines import FileHandle, PosixEngine, _open_fd

IOCB_CMD_PREAD = 0
IOCB_CMD_PWRITE = 1
DEFAULT_DEPTH = 32
# Bytes a batch keeps in flight, at most (but always one request): past a few MiB in
# flight a disk is no faster, and a writer staging unaligned bytes needs a buffer for each.
DEFAULT_WINDOW = 64 << 20


class _Iocb(ctypes.Structure):
    # The kernel's struct iocb (include/uapi/linux/aio_abi.h), little-endian field order.
    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


assert ctypes.sizeof(_Iocb) == 64 and ctypes.sizeof(_Event) == 32

_lib: Any = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def _load() -> Any:
    """libaio, loaded once; raises OSError naming why it cannot be used."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is None and _lib_error is None:
            _lib_error = _try_load()
        if _lib_error is not None:
            raise OSError(errno.ENOSYS, _lib_error)
        return _lib


def _try_load() -> str | None:
    global _lib
    if not sys.platform.startswith("linux"):
        return "Linux AIO needs Linux"
    if sys.byteorder != "little":
        return "the iocb layout here is the little-endian one"
    name = ctypes.util.find_library("aio") or "libaio.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return "libaio is not installed (apt-get install libaio1t64, or libaio1)"
    lib.io_setup.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    lib.io_destroy.argtypes = [ctypes.c_void_p]
    lib.io_submit.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    lib.io_getevents.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                 ctypes.c_void_p, ctypes.c_void_p]
    for fn in (lib.io_setup, lib.io_destroy, lib.io_submit, lib.io_getevents):
        fn.restype = ctypes.c_int
    ctx = ctypes.c_void_p(0)
    rc = lib.io_setup(1, ctypes.byref(ctx))  # returns -errno (e.g. seccomp's ENOSYS/EPERM)
    if rc < 0:
        return f"io_setup failed: {os.strerror(-rc)}"
    lib.io_destroy(ctx)
    _lib = lib
    return None


def unavailable() -> str | None:
    """Why the AIO engine cannot run here, or None when it can."""
    try:
        _load()
    except OSError as e:
        return e.strerror
    return None


class BatchError(OSError):
    """A request of a batch failed; ``index`` is its position in the batch and ``phase``
    says whether the kernel refused it (``"submit"``) or it failed (``"complete"``)."""

    def __init__(self, err: int, index: int, phase: str, what: str) -> None:
        super().__init__(err, f"{os.strerror(err)} ({what}, at {phase})")
        self.index, self.phase = index, phase


def address(buf: Any) -> int:
    """The address of a buffer's first byte (numpy array, memoryview or bytes-like)."""
    if isinstance(buf, np.ndarray):
        return int(buf.ctypes.data)
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


# A request: (file, buffer address, length, file offset, write?)
Request = tuple[FileHandle, int, int, int, bool]
# Fault injection (tests): called as inject(phase, index, request); an int it returns
# replaces what the kernel said: at "submit", an errno io_submit refused the request with;
# at "complete", the event's result (a negative errno, or a byte count for a short one).
Inject = Callable[[str, int, Request], "int | None"]


class _Ring:
    """One AIO context and the structures a batch fills: owned by one batch at a time."""

    def __init__(self, lib: Any, depth: int) -> None:
        self.lib, self.depth = lib, depth
        self.ctx = ctypes.c_void_p(0)
        rc = lib.io_setup(depth, ctypes.byref(self.ctx))
        if rc < 0:
            raise OSError(-rc, f"io_setup({depth}): {os.strerror(-rc)}")
        self.iocbs = (_Iocb * depth)()
        self.ptrs = (ctypes.c_void_p * depth)()
        self.events = (_Event * depth)()
        base = ctypes.addressof(self.iocbs)
        self.slot_addr = [base + i * 64 for i in range(depth)]
        self.idle = True  # nothing in flight: safe to hand to the next batch

    def close(self) -> None:
        if self.ctx:
            self.lib.io_destroy(self.ctx)
            self.ctx = ctypes.c_void_p(0)


class AioEngine(PosixEngine):
    """Linux native AIO, O_DIRECT, ``depth`` requests in flight per batch (see the module
    docstring). ``threads`` sizes the inherited pool that serves single ``pread``/``pwrite``
    futures; batches (:meth:`run`) use no threads."""

    def __init__(self, threads: int = 8, depth: int = DEFAULT_DEPTH,
                 window: int = DEFAULT_WINDOW) -> None:
        self._lib = _load()
        super().__init__(threads=threads, direct=True)
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.depth, self.window = depth, window
        self._rings: list[_Ring] = []
        self._all: list[_Ring] = []
        self._rings_lock = threading.Lock()
        self.inject: Inject | None = None

    @property
    def name(self) -> str:
        return "aio"

    def describe(self) -> str:
        s = f"aio (libaio) O_DIRECT, queue depth {self.depth}"
        if self._refused:
            s += " (O_DIRECT refused by the filesystem: buffered, synchronous)"
        return s

    def open(self, path: str, create: bool = False) -> FileHandle:
        fd, direct = _open_fd(path, True, create)
        if not direct:
            with self._lock:
                self._refused.add(path)
        return FileHandle(path, fd, direct)

    # The single-request forms go through a batch of one on the calling thread (the
    # futures through the pool), so every byte takes the same path.
    def _read_now(self, fh: FileHandle, buf: Any, offset: int) -> int:
        self.run([(fh, address(buf), len(buf), offset, False)])
        return len(buf)

    def _write_now(self, fh: FileHandle, buf: Any, offset: int) -> int:
        self.run([(fh, address(buf), len(buf), offset, True)])
        return len(buf)

    def read(self, fh: FileHandle, buf: memoryview, offset: int) -> int:
        return self._read_now(fh, buf, offset)

    def write(self, fh: FileHandle, buf: memoryview, offset: int) -> int:
        return self._write_now(fh, buf, offset)

    def pread(self, fh: FileHandle, buf: memoryview, offset: int) -> Future[int]:
        return self._pool.submit(self._read_now, fh, buf, offset)

    def pwrite(self, fh: FileHandle, buf: memoryview, offset: int) -> Future[int]:
        return self._pool.submit(self._write_now, fh, buf, offset)

    def _take_ring(self) -> _Ring:
        with self._rings_lock:
            if self._rings:
                return self._rings.pop()
        ring = _Ring(self._lib, self.depth)
        with self._rings_lock:
            self._all.append(ring)
        return ring

    def run(self, requests: Iterable[Request],
            done: Callable[[int], object] | None = None) -> int:
        """Carry out ``requests`` with up to ``depth`` in flight; ``done(i)`` is called on
        this thread once request ``i`` (its position in ``requests``) has moved all its
        bytes. ``requests`` may be a generator: it is advanced only as slots free, so a
        producer can stage (copy, checksum) the next request while others are in flight.
        Returns the number of requests. Raises :class:`BatchError` for a failed request,
        or what ``done`` or the generator raised, once nothing is in flight any more."""
        ring = self._take_ring()
        ring.idle = False
        try:
            return self._run(ring, iter(requests), done)
        finally:
            if ring.idle:
                with self._rings_lock:
                    self._rings.append(ring)
            else:
                # Interrupted with requests in flight: io_destroy waits for them, so no
                # buffer is written after this returns; the context is not reused.
                with self._rings_lock:
                    self._all.remove(ring)
                ring.close()

    def _run(self, ring: _Ring, todo: Any, done: Callable[[int], object] | None) -> int:
        lib, ctx, depth = self._lib, ring.ctx, ring.depth
        iocbs, ptrs, events, slot_addr = ring.iocbs, ring.ptrs, ring.events, ring.slot_addr
        inject = self.inject
        free = list(range(depth))
        # slot -> [index, request, bytes done]
        busy: dict[int, list[Any]] = {}
        again: deque[int] = deque()  # slots whose request continues after a short transfer
        count, inflight, exhausted, held, window = 0, 0, False, 0, self.window
        failure: BaseException | None = None
        finished: list[int] = []

        def fill(slot: int, req: Request, moved: int) -> None:
            fh, addr, nbytes, offset, write = req
            cb = iocbs[slot]
            cb.aio_data = slot
            cb.aio_lio_opcode = IOCB_CMD_PWRITE if write else IOCB_CMD_PREAD
            cb.aio_fildes = fh.fd
            cb.aio_buf = addr + moved
            cb.aio_nbytes = nbytes - moved
            cb.aio_offset = offset + moved

        while True:
            # Gather what can be submitted: continuations first, then new requests.
            n = 0
            while failure is None and again:
                slot = again.popleft()
                ptrs[n] = slot_addr[slot]
                n += 1
            while failure is None and free and not exhausted and (held < window or not busy):
                try:
                    req = next(todo, None)
                except BaseException as e:  # noqa: BLE001 (raised once the ring is idle)
                    failure, req = e, None
                if req is None:
                    exhausted = True
                    break
                slot = free.pop()
                busy[slot] = [count, req, 0]
                held += req[2]
                count += 1
                fill(slot, req, 0)
                ptrs[n] = slot_addr[slot]
                n += 1
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
                    index, req, _ = busy.pop(slot)
                    held -= req[2]
                    free.append(slot)
                    if failure is None:
                        failure = BatchError(-rc, index, "submit", _what(req))
                    # The requests after it were never sent.
                    for k in range(sent + 1, n):
                        s = (ptrs[k] - slot_addr[0]) // 64
                        held -= busy.pop(s)[1][2]
                        free.append(s)
                    n = sent
                    break
                inflight += rc
                sent += rc
            # Not sent for lack of room in the kernel's queue: they go first next round.
            again.extendleft((ptrs[k] - slot_addr[0]) // 64 for k in range(n - 1, sent - 1, -1))
            # Completed requests are handed back only now, with their successors already
            # submitted: the disk stays busy while the caller checksums.
            for index in finished:
                if failure is None:
                    try:
                        done(index)  # type: ignore[misc]
                    except BaseException as exc:  # noqa: BLE001 (raised once idle)
                        failure = exc
            finished.clear()
            if inflight == 0:
                if failure is not None:
                    ring.idle = True
                    raise failure
                if exhausted and not again:
                    ring.idle = True
                    return count
                continue
            got = lib.io_getevents(ctx, 1, depth, events, None)
            if got == -errno.EINTR:
                continue
            if got < 0:
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
                    what = _what(req) if res < 0 else (
                        f"{_what(req)}: short read at offset {req[3] + moved} (end of file)")
                    busy.pop(slot)
                    held -= req[2]
                    free.append(slot)
                    if failure is None:
                        failure = BatchError(err, index, "complete", what)
                    continue
                if res < want:  # short: go on from where it stopped
                    entry[2] = moved + res
                    fill(slot, req, entry[2])
                    if failure is None:
                        again.append(slot)
                    else:
                        busy.pop(slot)
                        held -= req[2]
                        free.append(slot)
                    continue
                busy.pop(slot)
                held -= req[2]
                free.append(slot)
                if done is not None:
                    finished.append(index)

    def close(self) -> None:
        with self._rings_lock:
            rings, self._all, self._rings = self._all, [], []
        for ring in rings:
            ring.close()
        super().close()


def _what(req: Request) -> str:
    fh, _, nbytes, offset, write = req
    return f"{'write' if write else 'read'} of {nbytes} bytes at offset {offset} of {fh.path}"
