"""The NVMe backing medium: one preallocated slab file per segment.

Slabs are created whole with ``posix_fallocate`` so running out of disk shows up when a slab
is added (a clean error before any entry points at it), not halfway through an entry's
write. Slab files are named by segment number under ``<store>/slabs/``; the catalog records
them by path relative to the store, so a store directory can be moved.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future

from .engines import FileHandle, PosixEngine, make_engine

SLAB_DIR = "slabs"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
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
        self._lock = threading.Lock()
        os.makedirs(os.path.join(self.root, SLAB_DIR), exist_ok=True)

    def describe(self) -> str:
        return self.engine.describe()

    def _abspath(self, rel: str) -> str:
        return rel if os.path.isabs(rel) else os.path.join(self.root, rel)

    def attach(self, segments: Iterable[tuple[int, str, int, int]]) -> None:
        for seg, rel, _base, _size in segments:
            self._files[seg] = self.engine.open(self._abspath(rel))

    def create_segment(self, seg: int, min_bytes: int) -> tuple[int, str, int, int]:
        size = max(self.slab_bytes, -(-min_bytes // 4096) * 4096)
        rel = os.path.join(SLAB_DIR, f"slab-{seg:06d}.dat")
        path = self._abspath(rel)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a crash before the catalog committed this segment
        fh = self.engine.open(path, create=True)
        try:
            os.posix_fallocate(fh.fd, 0, size)
            os.fsync(fh.fd)
            _fsync_dir(os.path.dirname(path))
        except OSError:
            self.engine.close_file(fh)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        with self._lock:
            self._files[seg] = fh
        return seg, rel, 0, size

    def pread(self, seg: int, offset: int, buf: memoryview) -> Future[int]:
        return self.engine.pread(self._files[seg], buf, offset)

    def pwrite(self, seg: int, offset: int, buf: memoryview) -> Future[int]:
        return self.engine.pwrite(self._files[seg], buf, offset)

    def read(self, seg: int, offset: int, buf: memoryview) -> None:
        self.engine.read(self._files[seg], buf, offset)

    def write(self, seg: int, offset: int, buf: memoryview) -> None:
        self.engine.write(self._files[seg], buf, offset)

    def sync(self, segs: Iterable[int]) -> None:
        for seg in set(segs):
            os.fdatasync(self._files[seg].fd)

    def view(self, seg: int, offset: int, nbytes: int) -> memoryview | None:
        return None

    def location(self, seg: int, offset: int) -> tuple[str, int]:
        return self._files[seg].path, offset

    def orphans(self, known: Iterable[int]) -> list[str]:
        """Slab files no catalog segment names (a crash between creating and committing)."""
        names = {f"slab-{s:06d}.dat" for s in known}
        d = os.path.join(self.root, SLAB_DIR)
        return sorted(os.path.join(d, f) for f in os.listdir(d) if f not in names)

    def close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
        for fh in files.values():
            self.engine.close_file(fh)
        self.engine.close()
