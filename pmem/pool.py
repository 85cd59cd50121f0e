"""``PoolMedium``: the persistent-memory backing tier, one mapped pool file.

The file starts with a 4 KiB header (``pmem.header``); segments are 4 KiB-aligned regions
after it, handed out in order. The header records how far that has gone (``assigned_end``),
so a segment is never handed out twice even if ``create_segment`` runs before ``attach`` on
a reopened pool; the first ``attach`` then lowers the mark to the end of the segments the
catalog actually knows, reclaiming space a crash left between creating a segment and the
catalog recording it. When the unassigned space runs out the file grows.

Growth and views: libpmem can only map a file whole, from offset 0, so growing means a new
mapping of the whole, longer file. Earlier mappings stay mapped until ``close()`` (address
space is all they cost), so a view handed out before the growth keeps reading the same
bytes; both mappings are MAP_SHARED views of one file and stay coherent. A view also keeps
its own mapping alive past ``close()`` (see ``pmem.mapping``), so no view can ever read
unmapped memory.

Concurrency: ``pread``/``pwrite`` copy on a thread pool through ctypes (``memmove``,
``pmem_memcpy_nodrain``), which releases the GIL; a large buffer is split across the
threads. The blocking ``read``/``write`` copy a buffer too small to split on the calling
thread. Completed writes are remembered per segment until ``sync`` makes them durable.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import header as hdr
from ._buffers import buffer_address
from .libpmem import Libpmem, PmemError, load, unavailable_reason
from .mapping import LibpmemMapping, MmapMapping

__all__ = ["PmemFallbackWarning", "PoolMedium"]

ALIGNMENT = hdr.ALIGNMENT
_SPLIT_MIN = 4 << 20  # below this a copy is not worth splitting across threads
_ENGINES = ("auto", "libpmem", "mmap")

Mapping = LibpmemMapping | MmapMapping


class PmemFallbackWarning(RuntimeWarning):
    """libpmem is not available; the pmem tier runs on mmap + msync."""


_warn_lock = threading.Lock()
_warned = False


def _warn_fallback(reason: str) -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(
        f"{reason}: the pmem tier falls back to Python mmap with msync for durability "
        "(correct, but without libpmem's persistent-memory fast paths); install PMDK's "
        "libpmem (e.g. the libpmem1 package) to use them",
        PmemFallbackWarning,
        stacklevel=4,
    )


def _align_up(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _split(nbytes: int, threads: int) -> list[tuple[int, int]]:
    parts = max(1, min(threads, nbytes // _SPLIT_MIN))
    step = _align_up(-(-nbytes // parts))
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


class PoolMedium:
    """A backing medium (``tierstore.media.Medium``) on one persistent-memory pool file.

    ``path``: the pool file. ``create``: make a new pool (the file must not exist) or open
    an existing one (its header is validated; ``PoolFormatError``, a ``ValueError``, if it is
    not a pool of this layout). ``size``: total file size of a new pool, header included,
    rounded up to 4 KiB (default: the header alone; segments then grow the file); ignored
    when opening. ``threads``: copy threads. ``engine``: ``"auto"`` uses libpmem where it
    can be loaded and otherwise falls back to mmap with a ``PmemFallbackWarning``;
    ``"libpmem"`` insists on it (``PmemError`` without it); ``"mmap"`` always uses the
    fallback.

    The pool is locked (``flock``) while open, so a second ``PoolMedium`` on the same file,
    in this process or another, gets ``BlockingIOError``.
    """

    kind = "pmem"
    # Bytes move by a CPU copy (``pread``/``pwrite``), which takes any memory: the store
    # reads into and writes from a caller's tensor in place at any address and on pages of
    # any size, rather than through its buffers (tierstore.media.memory_alignment).
    memory_alignment = 1

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool,
        size: int | None = None,
        threads: int = 4,
        engine: str = "auto",
    ) -> None:
        if engine not in _ENGINES:
            raise ValueError(f"engine must be one of {_ENGINES}, not {engine!r}")
        if threads < 1:
            raise ValueError("threads must be at least 1")
        if create and size is not None and size < hdr.HEADER_SIZE:
            raise ValueError(f"pool size {size} is smaller than its {hdr.HEADER_SIZE}-byte header")
        self.path = os.path.abspath(os.fspath(path))
        self._threads = threads
        self._lib, self._fallback_reason = self._choose_engine(engine)
        self._lock = threading.Lock()
        self._dirty_lock = threading.Lock()
        self._segments: dict[int, tuple[int, int]] = {}
        self._dirty: dict[int, list[tuple[int, int]]] = {}
        self._mappings: list[Mapping] = []
        self._closed = False
        self._attached = False
        self._created_here = False
        self._fd = -1
        self._file_size = 0
        self._pool_size = 0  # what the header records (the file may be longer)
        self._assigned_end = hdr.HEADER_SIZE
        if create:
            self._create(_align_up(size or hdr.HEADER_SIZE))
        else:
            self._open()
        # Every mapping is of the same file, so growth cannot change the answer.
        self._durability = self._mappings[-1].durability
        self._describe = self._description()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pmem-io")

    # -- opening ---------------------------------------------------------------------

    @staticmethod
    def _choose_engine(engine: str) -> tuple[Libpmem | None, str | None]:
        if engine == "mmap":
            return None, "requested"
        lib = load()
        if lib is not None:
            return lib, None
        reason = unavailable_reason() or "libpmem not found"
        if engine == "libpmem":
            raise PmemError(errno.ENOENT, f"engine='libpmem' but {reason}")
        _warn_fallback(reason)
        return None, reason

    def _lock_file(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BlockingIOError(
                errno.EWOULDBLOCK, "pool is already open (in this or another process)", self.path
            ) from None

    def _map(self) -> Mapping:
        m: Mapping = LibpmemMapping(self._lib, self.path) if self._lib else MmapMapping(self.path)
        self._mappings.append(m)
        return m

    def _create(self, size: int) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            self._lock_file()
            os.posix_fallocate(self._fd, 0, size)
            os.fsync(self._fd)
            _fsync_dir(os.path.dirname(self.path))
            m = self._map()
            self._file_size, self._pool_size = m.length, size
            fixed = hdr.encode_fixed(uuid.uuid4().bytes, time.time_ns())
            self._store(len(hdr.MAGIC), fixed)
            self._store(hdr.POOL_SIZE_OFFSET, hdr.encode_word(size))
            self._store(hdr.ASSIGNED_END_OFFSET, hdr.encode_word(hdr.HEADER_SIZE))
            m.persist_range(0, hdr.HEADER_SIZE)
            # Magic last: until it is durable the file does not claim to be a pool.
            self._store(0, hdr.MAGIC)
            m.persist_range(0, hdr.HEADER_SIZE)
            self._assigned_end = hdr.HEADER_SIZE
        except BaseException:
            self._release()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._lock_file()
            file_size = os.fstat(self._fd).st_size
            raw = os.pread(self._fd, hdr.HEADER_SIZE, 0)
            header = hdr.decode(raw, file_size, self.path)
            m = self._map()
            self._file_size = m.length
            self._pool_size = header.pool_size
            self._assigned_end = header.assigned_end
        except BaseException:
            self._release()
            raise

    def _description(self) -> str:
        m = self._mappings[-1]
        if self._lib is None:
            head = f"mmap fallback ({self._fallback_reason}): msync"
        elif m.durability == "persist":
            head = f"{self._lib.version_string}, DAX: persist"
        elif m.forced:
            head = f"{self._lib.version_string}, not DAX (PMEM_IS_PMEM_FORCE ignored): msync"
        else:
            head = f"{self._lib.version_string}, not DAX: msync"
        return f"{head}, {self._threads} threads"

    # -- header ----------------------------------------------------------------------

    def _store(self, offset: int, data: bytes) -> None:
        addr, nbytes, _keep = buffer_address(data, writable=False)
        self._mappings[-1].write(offset, addr, nbytes)

    def _set_word(self, offset: int, value: int) -> None:
        self._store(offset, hdr.encode_word(value))
        self._mappings[-1].persist_range(offset, 8)

    def _grow(self, new_size: int) -> None:
        old = self._file_size
        try:
            os.posix_fallocate(self._fd, old, new_size - old)
            os.fsync(self._fd)
            m = self._map()
        except BaseException:
            # Nothing the catalog references lies past `old`, so cutting back is safe.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, old)
            raise
        self._file_size = m.length
        # Recorded only after the file size itself is durable, and before assigned_end
        # moves, so a header on disk always satisfies assigned_end <= pool_size <= file.
        self._set_word(hdr.POOL_SIZE_OFFSET, new_size)
        self._pool_size = new_size

    # -- Medium ----------------------------------------------------------------------

    @property
    def durability(self) -> str:
        """``"persist"`` (cache flushes reach the medium) or ``"msync"``."""
        return self._durability

    @property
    def engine(self) -> str:
        """``"libpmem"`` or ``"mmap"``."""
        return "libpmem" if self._lib is not None else "mmap"

    @property
    def size(self) -> int:
        """Current size of the pool file in bytes."""
        return self._file_size

    def describe(self) -> str:
        """E.g. ``"libpmem 1.12, not DAX: msync, 4 threads"``."""
        return self._describe

    def attach(self, segments: Iterable[tuple[int, str, int, int]]) -> None:
        """Register the segments the catalog knows; validates that they fit this pool."""
        incoming: dict[int, tuple[int, int]] = {}
        for item in segments:
            seg, path, base, size = item
            if not self._is_pool_path(path):
                raise ValueError(f"segment {seg} lives in {path}, not in pool {self.path}")
            if base % ALIGNMENT or size % ALIGNMENT or size <= 0 or base < hdr.HEADER_SIZE:
                raise ValueError(f"segment {seg}: bad extent base={base} size={size}")
            incoming[seg] = (base, size)
        with self._lock:
            self._check_open()
            for seg, extent in incoming.items():
                known = self._segments.get(seg)
                if known is not None and known != extent:
                    raise ValueError(f"segment {seg}: {extent} conflicts with {known}")
                if extent[0] + extent[1] > self._file_size:
                    raise ValueError(
                        f"segment {seg} ends at {extent[0] + extent[1]}, past the end of "
                        f"{self.path} ({self._file_size} bytes)"
                    )
            extents = sorted({**self._segments, **incoming}.values())
            for (b1, s1), (b2, _) in zip(extents, extents[1:], strict=False):
                if b1 + s1 > b2:
                    raise ValueError(f"segments overlap at offset {b2} of {self.path}")
            self._segments.update(incoming)
            end = max([hdr.HEADER_SIZE] + [b + s for b, s in extents])
            if self._attached or self._created_here:
                end = max(end, self._assigned_end)
            if end != self._assigned_end:
                self._set_word(hdr.ASSIGNED_END_OFFSET, end)
                self._assigned_end = end
            self._attached = True

    def _is_pool_path(self, path: str) -> bool:
        if os.path.abspath(path) == self.path:
            return True
        try:
            return os.path.samefile(path, self.path)
        except OSError:
            return False

    def create_segment(self, seg: int, min_bytes: int) -> tuple[int, str, int, int]:
        """Assign ``min_bytes`` (rounded up to 4 KiB) of unassigned pool space to ``seg``,
        growing the file when there is not enough; durable before it returns."""
        if min_bytes <= 0:
            raise ValueError("min_bytes must be positive")
        size = _align_up(min_bytes)
        with self._lock:
            self._check_open()
            if seg in self._segments:
                raise ValueError(f"segment {seg} already exists")
            base = self._assigned_end
            if base + size > self._file_size:
                self._grow(base + size)
            elif base + size > self._pool_size:
                # The file is longer than its header says: a crash between growing it and
                # recording that. Recorded now (its length durable first), or the header
                # would claim a segment past the pool's end and refuse the next opening.
                os.fsync(self._fd)
                self._set_word(hdr.POOL_SIZE_OFFSET, self._file_size)
                self._pool_size = self._file_size
            self._set_word(hdr.ASSIGNED_END_OFFSET, base + size)
            self._assigned_end = base + size
            self._segments[seg] = (base, size)
            self._created_here = True
        return seg, self.path, base, size

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"pool {self.path} is closed")

    def _extent(self, seg: int, offset: int, nbytes: int) -> int:
        self._check_open()
        try:
            base, size = self._segments[seg]
        except KeyError:
            raise KeyError(f"unknown segment {seg} in pool {self.path}") from None
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside segment {seg} ({size} B)")
        return base + offset

    def _run(
        self,
        nbytes: int,
        copy: Callable[[int, int], None],
        keep: Any,
        on_success: Callable[[], None] | None = None,
    ) -> Future[None]:
        """Run ``copy(a, b)`` over [0, nbytes) in parts; one Future for all of them.

        The Future settles only when every part has finished, even after a failure: the
        caller may free its buffer as soon as it does.
        """
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        if nbytes == 0:
            fut.set_result(None)
            return fut
        parts = _split(nbytes, self._threads)
        state: dict[str, Any] = {"left": len(parts), "error": None, "keep": keep}
        state_lock = threading.Lock()

        def part_done(part: Future[None]) -> None:
            exc = part.exception()
            with state_lock:
                if exc is not None and state["error"] is None:
                    state["error"] = exc
                state["left"] -= 1
                if state["left"]:
                    return
                state["keep"] = None
            if state["error"] is not None:
                fut.set_exception(state["error"])
                return
            if on_success is not None:
                on_success()
            fut.set_result(None)

        for a, b in parts:
            self._executor.submit(copy, a, b).add_done_callback(part_done)
        return fut

    def pread(self, seg: int, offset: int, buf: memoryview) -> Future[None]:
        """Fill ``buf`` from ``offset`` of ``seg``; the Future completes when it is full.

        A memory copy needs no alignment, so none is enforced here; the store aligns extents
        anyway, for the NVMe tier's O_DIRECT. Bounds are checked before anything is queued.
        """
        dst, nbytes, keep = buffer_address(buf, writable=True)
        with self._lock:
            start = self._extent(seg, offset, nbytes)
            m = self._mappings[-1]
            return self._run(nbytes, lambda a, b: m.read(start + a, dst + a, b - a), keep)

    def pwrite(self, seg: int, offset: int, buf: memoryview) -> Future[None]:
        """Copy ``buf`` to ``offset`` of ``seg``; durable only after ``sync([seg])``."""
        src, nbytes, keep = buffer_address(buf, writable=False)
        with self._lock:
            start = self._extent(seg, offset, nbytes)
            m = self._mappings[-1]

            return self._run(nbytes, lambda a, b: m.write(start + a, src + a, b - a), keep,
                             lambda: self._written(seg, start, nbytes))

    def _written(self, seg: int, start: int, nbytes: int) -> None:
        with self._dirty_lock:
            self._dirty.setdefault(seg, []).append((start, start + nbytes))

    def read(self, seg: int, offset: int, buf: memoryview) -> None:
        self._blocking(seg, offset, buf, write=False)

    def write(self, seg: int, offset: int, buf: memoryview) -> None:
        self._blocking(seg, offset, buf, write=True)

    def _blocking(self, seg: int, offset: int, buf: memoryview, *, write: bool) -> None:
        """A blocking copy: split across the pool's threads where ``_split`` splits it,
        otherwise on the calling thread (outside the pool's lock). Handing a buffer too small
        to split to a pool thread and waiting for it cost more than the copy: a 256 KiB write
        took about 85 us that way on the development VM, against 15 us to copy. The store
        calls the blocking copies from its chunk workers, which already run copies side by
        side."""
        addr, nbytes, _keep = buffer_address(buf, writable=not write)
        if nbytes and len(_split(nbytes, self._threads)) > 1:
            (self.pwrite if write else self.pread)(seg, offset, buf).result()
            return
        with self._lock:
            m, start = self._mappings[-1], self._extent(seg, offset, nbytes)
        if not nbytes:
            return
        if write:
            m.write(start, addr, nbytes)
            self._written(seg, start, nbytes)
        else:
            m.read(start, addr, nbytes)

    def sync(self, segs: Iterable[int]) -> None:
        """Make every completed ``pwrite`` to ``segs`` durable: a drain on DAX (each copy
        already flushed its lines), msync of the written ranges otherwise."""
        segs = list(segs)
        with self._lock:
            self._check_open()
            for seg in segs:
                if seg not in self._segments:
                    raise KeyError(f"unknown segment {seg} in pool {self.path}")
            # The newest mapping covers every segment; msync through it also writes back
            # pages dirtied through older mappings, since msync works on the file's pages.
            m = self._mappings[-1]
        with self._dirty_lock:
            ranges = [r for seg in segs for r in self._dirty.pop(seg, [])]
        try:
            m.sync_written(_merge(ranges))
        except BaseException:
            with self._dirty_lock:
                for seg in segs:
                    base, size = self._segments[seg]
                    mine = [r for r in ranges if base <= r[0] < base + size]
                    self._dirty.setdefault(seg, []).extend(mine)
            raise

    def view(self, seg: int, offset: int, nbytes: int) -> memoryview:
        """A read-only zero-copy view of ``nbytes`` at ``offset`` of ``seg``.

        It stays valid after the pool grows and even after ``close()`` (it keeps its mapping
        alive). ``torch.frombuffer`` accepts it but, as for any read-only buffer, warns that
        the tensor is writable; writing through such a tensor would bypass ``pwrite`` and
        ``sync`` and is not allowed. Wrap the call in ``warnings.catch_warnings()`` with a
        filter on ``UserWarning`` to silence it.
        """
        with self._lock:
            start = self._extent(seg, offset, nbytes)
            if nbytes == 0:
                return memoryview(b"")
            return self._mappings[-1].view(start, nbytes)

    def location(self, seg: int, offset: int) -> tuple[str, int]:
        """(pool file path, byte offset in the file) of ``offset`` in ``seg``."""
        with self._lock:
            return self.path, self._extent(seg, offset, 0)

    def close(self) -> None:
        """Wait for in-flight copies, unmap (views keep their own mapping) and unlock.

        Does not sync: durability is what ``sync`` is for. Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        self._release()

    def _release(self) -> None:
        # Dropping our references matters: a mapping that views still hold is unmapped
        # when the last of them goes, which needs the pool not to hold it too.
        mappings, self._mappings = self._mappings, []
        for m in mappings:
            m.release()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> PoolMedium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._segments)} segments"
        return f"PoolMedium({self.path!r}, {state}, {self._describe})"
