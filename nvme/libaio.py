"""Linux native AIO, bound through ctypes to the kernel's system calls: the kernel's
structures, the calls and one AIO context with what a batch fills.

Why the raw system calls through ctypes, and not libaio, io_uring or a compiled extension:

- **No system package, no compiler, no new wheel.** ``io_setup``/``io_submit``/
  ``io_getevents``/``io_destroy`` are system calls; libc's ``syscall()`` makes them from
  ctypes, so the engine runs on any Linux with the AIO calls enabled, with nothing to
  install: a fresh machine gets the engine the figures are quoted for. libaio's functions
  are thin wrappers of the same calls (its ``io_getevents`` peeks at the ring in user
  space only for a zero timeout, which the engine never passes). A C extension would have
  to build on every machine CI and users run.
- **A small, frozen ABI.** ``struct iocb`` and ``struct io_event`` have not changed since
  Linux 2.6; the whole binding is three ctypes structures and four calls, and their
  numbers are fixed per architecture (:data:`SYSCALLS`). io_uring from Python means either
  a binding that lags the kernel or our own ring handling over shared memory, whose
  correctness rests on memory ordering that ctypes cannot express portably.
- **It is what the peers measure.** DeepNVMe (ZeRO-Infinity) and fio's ``libaio`` run the
  same kernel path, and on this project's disk fio ``libaio`` and ``io_uring`` at queue
  depth 32 are within the disk's run-to-run noise of each other. For O_DIRECT on a block
  device or ext4/xfs file, Linux AIO is truly asynchronous; for buffered files it is not
  (io_submit then does the I/O itself), which is why the engine opens files O_DIRECT and
  leaves buffered I/O to the POSIX engine.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from typing import Any

IOCB_CMD_PREAD = 0
IOCB_CMD_PWRITE = 1
IOCB_CMD_PREADV = 7
IOCB_CMD_PWRITEV = 8


class Iocb(ctypes.Structure):
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


class Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_uint64), ("iov_len", ctypes.c_uint64)]


class Event(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


assert ctypes.sizeof(Iocb) == 64 and ctypes.sizeof(Event) == 32

# The AIO system calls' numbers: (io_setup, io_destroy, io_getevents, io_submit).
SYSCALLS = {
    "x86_64": (206, 207, 208, 209),
    "aarch64": (0, 1, 4, 2),  # the generic table (asm-generic/unistd.h)
    "riscv64": (0, 1, 4, 2),
    "loongarch64": (0, 1, 4, 2),
}

_lib: Any = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


class Calls:
    """The four AIO calls as libaio spells them, made as raw system calls: each returns
    its result, or a negative errno (libaio's convention; libc's ``syscall()`` returns -1
    and sets errno)."""

    def __init__(self, numbers: tuple[int, int, int, int]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._setup, self._destroy, self._getevents, self._submit = (
            ctypes.c_long(n) for n in numbers)

    def _call(self, *args: Any) -> int:
        rc = int(self._syscall(*args))
        return -ctypes.get_errno() if rc == -1 else rc

    def io_setup(self, nr: int, ctx: Any) -> int:
        return self._call(self._setup, ctypes.c_long(nr), ctx)

    def io_destroy(self, ctx: Any) -> int:
        return self._call(self._destroy, ctypes.c_ulong(_ctx_value(ctx)))

    def io_submit(self, ctx: Any, nr: int, iocbpp: Any) -> int:
        return self._call(self._submit, ctypes.c_ulong(_ctx_value(ctx)), ctypes.c_long(nr),
                          iocbpp)

    def io_getevents(self, ctx: Any, min_nr: int, nr: int, events: Any, timeout: Any) -> int:
        return self._call(self._getevents, ctypes.c_ulong(_ctx_value(ctx)),
                          ctypes.c_long(min_nr), ctypes.c_long(nr), events, timeout)


def _ctx_value(ctx: Any) -> int:
    return int(ctx.value or 0) if isinstance(ctx, ctypes.c_void_p) else int(ctx)


def load() -> Any:
    """The AIO calls (:class:`Calls`), set up once; raises OSError naming why they cannot
    be used."""
    global _lib_error
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
    numbers = SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return f"the AIO system calls' numbers on {os.uname().machine} are not known here"
    lib = Calls(numbers)
    ctx = ctypes.c_void_p(0)
    rc = lib.io_setup(1, ctypes.byref(ctx))  # -errno where seccomp or the kernel refuses it
    if rc < 0:
        return f"io_setup failed: {os.strerror(-rc)}"
    lib.io_destroy(ctx)
    _lib = lib
    return None


def unavailable() -> str | None:
    """Why the AIO engine cannot run here, or None when it can."""
    try:
        load()
    except OSError as e:
        return e.strerror
    return None


class Ring:
    """One AIO context and the structures a batch fills: owned by one batch at a time."""

    def __init__(self, lib: Any, depth: int) -> None:
        self.lib, self.depth = lib, depth
        self.ctx = ctypes.c_void_p(0)
        rc = lib.io_setup(depth, ctypes.byref(self.ctx))
        if rc < 0:
            raise OSError(-rc, f"io_setup({depth}): {os.strerror(-rc)}")
        self.iocbs = (Iocb * depth)()
        self.ptrs = (ctypes.c_void_p * depth)()
        self.events = (Event * depth)()
        base = ctypes.addressof(self.iocbs)
        self.slot_addr = [base + i * 64 for i in range(depth)]
        # Each slot's iovec array, made the first time the slot carries a vectored request.
        self.iovs: list[Any] = [None] * depth
        self.idle = True  # nothing in flight: safe to hand to the next batch

    def close(self) -> None:
        if self.ctx:
            self.lib.io_destroy(self.ctx)
            self.ctx = ctypes.c_void_p(0)
