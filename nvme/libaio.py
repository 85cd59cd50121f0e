"""Linux native AIO (libaio), bound through ctypes: the kernel's structures, the library
and one AIO context with what a batch fills.

Why libaio through ctypes, and not io_uring or a compiled extension:

- **No compiler, no new wheel.** ``io_setup``/``io_submit``/``io_getevents`` are ordinary
  symbols of ``libaio.so.1`` (Debian's ``libaio1``), so ctypes calls them directly; the
  fallback when the library is missing is the thread-pool :class:`PosixEngine`, never a
  broken import. A C extension would have to build on every machine CI and users run.
- **A small, frozen ABI.** ``struct iocb`` and ``struct io_event`` have not changed since
  Linux 2.6; the whole binding is three ctypes structures and four calls. io_uring from
  Python means either a binding that lags the kernel or our own ring handling over shared
  memory, whose correctness rests on memory ordering that ctypes cannot express portably.
- **It is what the peers measure.** DeepNVMe (ZeRO-Infinity) and fio's ``libaio`` run the
  same kernel path, and on this project's disk fio ``libaio`` and ``io_uring`` at queue
  depth 32 are within the disk's run-to-run noise of each other. For O_DIRECT on a block
  device or ext4/xfs file, libaio is truly asynchronous; for buffered files it is not
  (io_submit then does the I/O itself), which is why the engine opens files O_DIRECT and
  leaves buffered I/O to the POSIX engine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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

_lib: Any = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def load() -> Any:
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
