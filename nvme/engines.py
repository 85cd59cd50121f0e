"""I/O engines: how bytes move between host memory and a file.

Every engine has the same small surface. ``pread``/``pwrite`` return a future and are the
primitives; ``read``/``write`` block on them. Files are opened through the engine because the
engine decides the open flags (O_DIRECT) and, for kvikio, owns a ``CuFile`` handle.

- :class:`PosixEngine` issues ``os.preadv``/``os.pwritev`` on a thread pool (the GIL is
  released for the system call, so threads give real queue depth). With ``direct=True`` it
  opens files with ``O_DIRECT`` and falls back to buffered I/O per file where the filesystem
  refuses it (tmpfs, some overlay filesystems).
- :class:`nvme.aio.AioEngine` (Linux native AIO, raw system calls) keeps up to 32 requests in
  flight per batch with one ``io_submit`` and one ``io_getevents`` per round, and no thread
  per request; ``auto`` picks it wherever it runs, this thread-pool engine elsewhere.
- :class:`KvikioEngine` uses kvikio's ``CuFile``. It runs only when asked for by name:
  ``auto`` never picks it. Nothing has measured kvikio against POSIX on this
  project's workloads, and the store only ever hands the medium host buffers (cache slots,
  staging buffers), for which kvikio either goes through its POSIX path (compat mode, or
  cuFile's own fallback for host memory) or bounces through device memory: there is no
  reason to expect it to beat ``preadv`` on host memory, so it is not chosen on a guess.
  Its thread pool (process-wide, one thread unless configured) is sized to the store's
  ``io_threads``, and its reads and writes bypass the page cache (``auto_direct_io_read`` /
  ``auto_direct_io_write``) like the POSIX engine's O_DIRECT, where the kvikio version has
  those settings; :meth:`KvikioEngine.describe` says what was applied.

Why device reads are staged through host memory rather than read with GDS: every chunk's
crc32c is verified on the host before its bytes are published, and the host cache is where
entries are reused; a GDS read into device memory would skip both (verification would have
to move onto the device). The cost of the staging copy on a GPU system is unmeasured.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .buffers import ALIGNMENT

HANDOFF_MIN_BYTES = 1 << 20  # blocking requests this large go through the pool (see read)


@dataclass
class FileHandle:
    path: str
    fd: int
    direct: bool
    extra: Any = field(default=None, repr=False)  # engine-private (a kvikio CuFile)
    # The alignment of the memory its I/O moves bytes into or out of (file_alignment).
    align: int = ALIGNMENT


_libc = ctypes.CDLL(None, use_errno=True)
_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000
_STATX_BYTES = 256  # sizeof(struct statx)
_STX_DIO_MEM_ALIGN = 0x98  # its stx_dio_mem_align, a u32


def dio_alignment(fd: int) -> int:
    """The alignment of the memory an O_DIRECT transfer on ``fd`` needs, as the kernel
    reports it for the file's filesystem and device (``statx``'s ``STATX_DIOALIGN``, Linux
    6.1): the device's DMA alignment, 512 bytes on the development VM's virtio disk and 4
    on NVMe, not the page. :data:`ALIGNMENT` where the kernel does not say. Memory that
    is aligned this far moves straight to or from the disk; only memory aligned less is
    copied through the store's buffers (:mod:`tierstore.landing`)."""
    statx = getattr(_libc, "statx", None)  # glibc 2.28
    if statx is None:
        return ALIGNMENT
    buf = ctypes.create_string_buffer(_STATX_BYTES)
    if statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return ALIGNMENT
    mask = int.from_bytes(buf.raw[:4], "little")
    got = int.from_bytes(buf.raw[_STX_DIO_MEM_ALIGN : _STX_DIO_MEM_ALIGN + 4], "little")
    # 0: no O_DIRECT on this file after all; more than a page: what the store assumed.
    return got if mask & _STATX_DIOALIGN and 0 < got <= ALIGNMENT else ALIGNMENT


def file_alignment(fd: int, direct: bool) -> int:
    """What a file opened with O_DIRECT (``direct``) or without needs of the memory it
    moves bytes into or out of: :func:`dio_alignment`; nothing (1) for buffered I/O, which
    copies through the page cache."""
    return dio_alignment(fd) if direct else 1


def _open_fd(path: str, direct: bool, create: bool) -> tuple[int, bool]:
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def _full_preadv(fd: int, buf: memoryview, offset: int) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"short read at offset {offset + done} (end of file)")
        done += n
    return done


def _full_pwritev(fd: int, buf: memoryview, offset: int) -> int:
    done = 0
    while done < len(buf):
        done += os.pwritev(fd, [buf[done:]], offset + done)
    return done


class FairDepth:
    """A bound on requests in flight that serves waiters in arrival order.

    ``threading.Semaphore`` lets a thread that releases a slot take it straight back, so
    readers issuing request after request kept every slot and a writer's chunks waited
    for minutes behind them. Here a freed slot passes to the longest waiter, and a newcomer
    queues behind anyone already waiting. Use as a context manager around one request.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self._free = slots
        self._lock = threading.Lock()
        self._waiters: deque[threading.Lock] = deque()

    def __enter__(self) -> FairDepth:
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return self
            turn = threading.Lock()
            turn.acquire()
            self._waiters.append(turn)
        turn.acquire()  # released by the holder that hands us its slot
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().release()  # the slot passes on, never freed between
            else:
                self._free += 1


class PosixEngine:
    """``preadv``/``pwritev`` on a thread pool, O_DIRECT where the filesystem allows it."""

    def __init__(self, threads: int = 8, direct: bool = True) -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self.threads, self.direct = threads, direct
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tierstore-io")
        # At most ``threads`` requests in flight, whether issued by the pool or, through
        # the blocking calls, on callers' threads: the queue depth is the thread count.
        self._depth = FairDepth(threads)
        self._refused: set[str] = set()
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return "posix-direct" if self.direct else "posix-buffered"

    @property
    def memory_alignment(self) -> int:
        """What its files need of memory before one is opened (each then says,
        ``FileHandle.align``): a page with O_DIRECT, nothing without."""
        return ALIGNMENT if self.direct else 1

    def describe(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        s = f"posix {mode}, {self.threads} threads"
        if self._refused:
            s += " (O_DIRECT refused by the filesystem: buffered)"
        return s

    def open(self, path: str, create: bool = False) -> FileHandle:
        fd, direct = _open_fd(path, self.direct, create)
        if self.direct and not direct:
            with self._lock:
                self._refused.add(path)
        return FileHandle(path, fd, direct, align=file_alignment(fd, direct))

    def close_file(self, fh: FileHandle) -> None:
        os.close(fh.fd)

    def pread(self, fh: FileHandle, buf: memoryview, offset: int) -> Future[int]:
        return self._pool.submit(self._read_now, fh, buf, offset)

    def pwrite(self, fh: FileHandle, buf: memoryview, offset: int) -> Future[int]:
        return self._pool.submit(self._write_now, fh, buf, offset)

    # The blocking calls issue a small request's system call on the caller's thread: the
    # hand-off to the pool and back costs as much CPU as a 128 KiB read. A large request
    # goes through the pool, whose threads take the next queued request the moment one
    # ends; callers woken in turn by the depth limit start theirs a thread wake-up late,
    # which cost a quarter of the bandwidth at one thread on 4 MiB requests.
    def read(self, fh: FileHandle, buf: memoryview, offset: int) -> int:
        return self._blocking(self._read_now, fh, buf, offset)

    def write(self, fh: FileHandle, buf: memoryview, offset: int) -> int:
        return self._blocking(self._write_now, fh, buf, offset)

    def _blocking(self, now: Any, fh: FileHandle, buf: Any, offset: int) -> int:
        if len(buf) >= HANDOFF_MIN_BYTES:
            return int(self._pool.submit(now, fh, buf, offset).result())
        return int(now(fh, buf, offset))

    def _read_now(self, fh: FileHandle, buf: memoryview, offset: int) -> int:
        with self._depth:
            return _full_preadv(fh.fd, buf, offset)

    def _write_now(self, fh: FileHandle, buf: memoryview, offset: int) -> int:
        with self._depth:
            return _full_pwritev(fh.fd, buf, offset)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class KvikioEngine(PosixEngine):
    """kvikio ``CuFile`` reads and writes of host buffers (see the module docstring).

    ``threads`` sizes both this engine's requests in flight and kvikio's own thread pool
    (which would otherwise run every request on one thread: a queue depth of 1 whatever
    ``io_threads`` says). ``direct`` asks kvikio to bypass the page cache. Both settings are
    kvikio's process-wide defaults: the last kvikio engine made sets them for all.
    """

    def __init__(self, threads: int = 8, direct: bool = True) -> None:
        import kvikio  # fails with ImportError where kvikio is missing
        import kvikio.defaults

        super().__init__(threads=threads, direct=False)
        self._kvikio = kvikio
        self.settings = configure_kvikio(kvikio, threads, direct)
        self.direct_reads = bool(self.settings.get("auto_direct_io_read", False))
        self._mode = _kvikio_compat_mode(kvikio)

    @property
    def name(self) -> str:
        return "kvikio"

    @property
    def memory_alignment(self) -> int:
        return ALIGNMENT  # kvikio may read with O_DIRECT of its own (see describe)

    def describe(self) -> str:
        # AUTO uses GDS where cuFile is usable and falls back to POSIX I/O elsewhere; for
        # the host buffers the store passes, that is POSIX I/O either way.
        pool = self.settings.get("num_threads", "unknown")
        io = "direct I/O" if self.direct_reads else "through the page cache"
        return (f"kvikio (compat mode {self._mode}, {pool}-thread pool, reads {io}), "
                f"{self.threads} threads")

    def open(self, path: str, create: bool = False) -> FileHandle:
        fh = super().open(path, create)
        fh.extra = self._kvikio.CuFile(path, "r+")
        fh.align = self.memory_alignment
        return fh

    def close_file(self, fh: FileHandle) -> None:
        fh.extra.close()
        super().close_file(fh)

    # ``pread``/``pwrite`` and the blocking ``read``/``write`` (inherited) end up here.
    def _read_now(self, fh: FileHandle, buf: Any, offset: int) -> int:
        with self._depth:
            try:
                return int(fh.extra.pread(buf, len(buf), offset).get())
            except RuntimeError as e:
                raise kvikio_oserror(e, "reading", fh.path, offset, len(buf)) from e

    def _write_now(self, fh: FileHandle, buf: Any, offset: int) -> int:
        with self._depth:
            try:
                return int(fh.extra.pwrite(buf, len(buf), offset).get())
            except RuntimeError as e:
                raise kvikio_oserror(e, "writing", fh.path, offset, len(buf)) from e


def kvikio_oserror(e: RuntimeError, doing: str, path: str, offset: int, n: int) -> OSError:
    """kvikio's failure as the OSError every engine raises. Its C++ exceptions (a cuFile
    error, a failed system call) reach Python as RuntimeError with the message only; the
    store tells a full disk (StoreFullError) and a failed read (an error naming the
    entry) apart by errno, so the errno is taken back from the message where it names one
    of those, and is EIO otherwise."""
    text = str(e)
    code = next((c for c in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                 if os.strerror(c).lower() in text.lower()), errno.EIO)
    return OSError(code, f"kvikio failed {doing} {n} bytes at offset {offset}: {text}", path)


def _kvikio_set(defaults: Any, key: str, value: Any) -> bool:
    """Set one of kvikio's defaults, across its API versions; False if it has no such
    setting."""
    if hasattr(defaults, "set"):  # 25.x and later: set(name, value) / set({name: value})
        for call in (lambda: defaults.set(key, value), lambda: defaults.set({key: value})):
            try:
                call()
                return True
            except (KeyError, ValueError, TypeError, AttributeError):
                continue
    legacy = {"num_threads": "num_threads_reset"}.get(key)
    if legacy and hasattr(defaults, legacy):
        getattr(defaults, legacy)(value)
        return True
    return False


def _kvikio_get(defaults: Any, key: str) -> Any:
    if hasattr(defaults, "get"):
        with contextlib.suppress(KeyError, ValueError, TypeError, AttributeError):
            return defaults.get(key)
    legacy = getattr(defaults, f"get_{key}", None) or getattr(defaults, key, None)
    if callable(legacy):
        with contextlib.suppress(Exception):
            return legacy()
    return None


def configure_kvikio(kvikio: Any, threads: int, direct: bool) -> dict[str, Any]:
    """Size kvikio's thread pool to ``threads`` and make its reads and writes bypass the
    page cache if ``direct``; returns the settings kvikio reports afterwards (a setting
    this kvikio version lacks is left out)."""
    defaults = kvikio.defaults
    wanted = {"num_threads": int(threads), "auto_direct_io_read": bool(direct),
              "auto_direct_io_write": bool(direct)}
    applied: dict[str, Any] = {}
    for key, value in wanted.items():
        if _kvikio_set(defaults, key, value):
            got = _kvikio_get(defaults, key)
            applied[key] = value if got is None else got
    return applied


def _kvikio_compat_mode(kvikio: Any) -> str:
    """kvikio's configured compatibility mode (ON, OFF or AUTO), across its API versions:
    a bool in the oldest, a ``CompatMode`` enum later (an int enum, so AUTO is truthy and
    its str() may be just the number)."""
    defaults = kvikio.defaults
    mode: Any = None
    if hasattr(defaults, "get"):
        with contextlib.suppress(KeyError, ValueError, TypeError):
            mode = defaults.get("compat_mode")
    if mode is None and hasattr(defaults, "compat_mode"):
        mode = defaults.compat_mode()
    if mode is None:
        return "unknown"
    name = getattr(mode, "name", None)
    if name is not None:
        return str(name)
    return "ON" if mode is True else "OFF" if mode is False else str(mode).rsplit(".", 1)[-1]


ENGINES = ("auto", "aio", "posix-direct", "posix-buffered", "kvikio")


def cuda_and_kvikio() -> bool:
    """Whether the kvikio engine could run here (it is still only used when named)."""
    try:
        import kvikio  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_engine(name: str = "auto") -> str:
    """The engine ``name`` stands for. ``auto`` is Linux AIO (:mod:`nvme.aio`: batched,
    queue depth 32, O_DIRECT, raw system calls: no library) where the kernel allows
    ``io_setup``, and
    POSIX O_DIRECT on a thread pool elsewhere. kvikio runs only when named: it has not been
    measured faster (see the module docstring)."""
    if name != "auto":
        return name
    from .libaio import unavailable

    return "aio" if unavailable() is None else "posix-direct"


def make_engine(name: str = "auto", threads: int = 8) -> PosixEngine:
    """The engine called ``name`` (``"auto"``: see :func:`resolve_engine`)."""
    name = resolve_engine(name)
    if name == "aio":
        from .aio import AioEngine

        return AioEngine(threads)
    if name == "kvikio":
        return KvikioEngine(threads)
    if name in ("posix-direct", "posix"):
        return PosixEngine(threads, direct=True)
    if name == "posix-buffered":
        return PosixEngine(threads, direct=False)
    raise ValueError(f"unknown I/O engine {name!r}; choose one of {', '.join(ENGINES)}")
