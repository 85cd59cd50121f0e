"""The NVMe backing medium: one preallocated slab file per segment.

Slabs are created whole with ``posix_fallocate`` so running out of disk shows up when a slab
is added (a clean error before any entry points at it), not halfway through an entry's
write. Slab files are named by segment number under ``<store>/slabs/``; the catalog records
them by path relative to the store, so a store directory can be moved.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from .engines import FileHandle, PosixEngine, make_engine

SLAB_DIR = "slabs"


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a created, renamed or removed file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def orphan_slabs(root: str, known: Iterable[int]) -> list[str]:
    """Files under ``root``'s slab directory that none of the ``known`` segments names."""
    names = {f"slab-{s:06d}.dat" for s in known}
    d = os.path.join(root, SLAB_DIR)
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f not in names)


def holds_data(path: str, piece: int = 8 << 20) -> bool:
    """Whether any byte of the file is not zero. Holes are skipped where the file system
    reports them (an fallocated, never-written slab is all holes or unwritten extents)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # nothing but holes from here on
                    return False
                if e.errno != errno.EINVAL:
                    raise
            data = os.pread(fd, min(piece, size - pos), pos)
            if not data:
                return False
            if data.count(0) != len(data):
                return True
            pos += len(data)
        return False
    finally:
        os.close(fd)


class SlabMedium:
    """Segments are slab files of ``slab_bytes`` (or larger, for an entry that needs it)."""

    kind = "nvme"

    def __init__(
        self,
        root: str,
        *,
        slab_bytes: int = 1 << 30,
        engine: str | PosixEngine = "auto",
        threads: int = 8,
    ) -> None:
        self.root = os.path.abspath(root)
        self.slab_bytes = slab_bytes
        self.engine = make_engine(engine, threads) if isinstance(engine, str) else engine
        self._files: dict[int, FileHandle] = {}
        # Slab files the catalog names that are gone: their entries fail to read (naming the
        # file) while the rest of the store stays usable, so what survives can be got out.
        self._missing: dict[int, str] = {}
        self._lock = threading.Lock()
        self._align = self.engine.memory_alignment  # see memory_alignment
        os.makedirs(os.path.join(self.root, SLAB_DIR), exist_ok=True)
        # New slabs go into this directory wherever the store is moved while open (a store
        # renamed under its daemon keeps growing), as the catalog's copies do.
        self._dir_fd = os.open(os.path.join(self.root, SLAB_DIR),
                               os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def describe(self) -> str:
        return self.engine.describe()

    @property
    def memory_alignment(self) -> int:
        """The alignment of host memory that its slabs' I/O moves bytes into or out of
        directly: the most any slab file needs (:func:`~tierstore.nvme.engines.dio_alignment`;
        one directory, so one filesystem and device); before the first slab, what the
        engine says (a page with O_DIRECT)."""
        return self._align

    def _opened(self, seg: int, fh: FileHandle) -> None:
        with self._lock:
            # The first file replaces the engine's guess; files are only ever added.
            self._align = max(self._align, fh.align) if self._files else fh.align
            self._files[seg] = fh

    def _abspath(self, rel: str) -> str:
        return rel if os.path.isabs(rel) else os.path.join(self.root, rel)

    def attach(self, segments: Iterable[tuple[int, str, int, int]]) -> None:
        for seg, rel, _base, _size in segments:
            path = self._abspath(rel)
            try:
                self._opened(seg, self.engine.open(path))
            except FileNotFoundError:
                self._missing[seg] = path

    def missing(self) -> dict[int, str]:
        """Segments whose slab file was not found at open, by segment number."""
        return dict(self._missing)

    def _file(self, seg: int) -> FileHandle:
        fh = self._files.get(seg)
        if fh is None:
            path = self._missing.get(seg, f"segment {seg}")
            raise FileNotFoundError(errno.ENOENT, "slab file is missing", path)
        return fh

    def _slab_dir(self) -> str:
        """Where the slab directory is now: the path of the descriptor held on it."""
        try:
            return os.readlink(f"/proc/self/fd/{self._dir_fd}")
        except OSError:  # no /proc: where it was opened
            return os.path.join(self.root, SLAB_DIR)

    def create_segment(self, seg: int, min_bytes: int) -> tuple[int, str, int, int]:
        size = max(self.slab_bytes, -(-min_bytes // 4096) * 4096)
        name = f"slab-{seg:06d}.dat"
        rel = os.path.join(SLAB_DIR, name)
        path = os.path.join(self._slab_dir(), name)
        if os.path.exists(path):
            # No catalog segment names this file. A crash between creating a slab and
            # committing it leaves one that was never written (all zeros): safe to redo.
            # One holding data is somebody's data: never reuse it.
            if holds_data(path):
                raise FileExistsError(
                    errno.EEXIST, "slab file holds data but the catalog does not name it; "
                    "move it away (`tierstore fsck` lists such files)", path)
            os.unlink(path)
        fh = self.engine.open(path, create=True)
        try:
            os.posix_fallocate(fh.fd, 0, size)
            os.fsync(fh.fd)
            fsync_dir(os.path.dirname(path))
        except OSError:
            self.engine.close_file(fh)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._opened(seg, fh)
        return seg, rel, 0, size

    def pread(self, seg: int, offset: int, buf: memoryview) -> Future[int]:
        return self.engine.pread(self._file(seg), buf, offset)

    def pwrite(self, seg: int, offset: int, buf: memoryview) -> Future[int]:
        return self.engine.pwrite(self._file(seg), buf, offset)

    @property
    def batched(self) -> bool:
        """Whether :meth:`run` takes whole batches (the AIO engine) rather than the store
        issuing requests one by one on its own threads."""
        return hasattr(self.engine, "run")

    def run(self, requests: Iterable[tuple[int, int, int, int, bool]],
            done: Callable[[int], object] | None = None, count: int | None = None,
            window: Callable[[int], int] | None = None) -> int:
        """Carry out ``(seg, offset, address, nbytes, write)`` requests as one batch (see
        :meth:`nvme.aio.AioEngine.run`, and ``count`` and ``window`` there); only where
        :attr:`batched`."""
        files = self._file
        return self.engine.run(  # type: ignore[attr-defined]
            ((files(seg), addr, nbytes, offset, write)
             for seg, offset, addr, nbytes, write in requests), done, count, window)

    def read(self, seg: int, offset: int, buf: memoryview) -> None:
        self.engine.read(self._file(seg), buf, offset)

    def write(self, seg: int, offset: int, buf: memoryview) -> None:
        self.engine.write(self._file(seg), buf, offset)

    def sync(self, segs: Iterable[int]) -> None:
        for seg in set(segs):
            os.fdatasync(self._file(seg).fd)

    def view(self, seg: int, offset: int, nbytes: int) -> memoryview | None:
        return None

    def location(self, seg: int, offset: int) -> tuple[str, int]:
        fh = self._files.get(seg)
        return (fh.path if fh is not None else self._missing.get(seg, "?")), offset

    def orphans(self, known: Iterable[int]) -> list[str]:
        """Files under the slab directory that no catalog segment names."""
        return orphan_slabs(self.root, known)

    def close(self) -> None:
        # The engine first: it waits for requests in flight, so no request is ever made
        # on a closed (or reused) file descriptor.
        self.engine.close()
        with self._lock:
            files, self._files = self._files, {}
        for fh in files.values():
            self.engine.close_file(fh)
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
