"""What the parts of a local store share: its state, the key locks and the version counter.

:class:`tierstore.LocalStore` is put together from parts, one module each: the read path
(``reads.py``), the write and commit path (``writes.py``, over ``placing.py`` and
``write_jobs.py``), borrow and stage (``borrow.py``)
and snapshots (``snapshots.py``). Each part is a class whose methods run on the store itself,
so nothing is added between a call and its work; :class:`LocalState`, their common base,
names the state they share (``LocalStore.__init__`` sets it up) and holds the three
primitives every part uses.

How concurrent operations stay linearizable: every operation that changes entries or fills
the host cache holds the ``_ops`` gate shared, and ``restore()`` holds it alone. Writes,
deletes and cache fills of one entry take its key lock (:meth:`LocalState._key_locks`), and
with the host cache versions are given out under those locks, so two operations on a key are
ordered the same way by their versions and by the cache. A delete leaves a tombstone (its
version) that makes a write-back taken before it and committed after it drop out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tierstore.cache import HostCache
from tierstore.nvme import RecycledBuffers, StagingPool

from .alloc import ExtentAllocator
from .catalog import Catalog, Gate
from .errors import StoreClosedError
from .keys import Key
from .landing import on_workers
from .media import Medium


@dataclass
class TierStats:
    """Reads and writes of the backing tier since the store was opened."""

    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class LocalState:
    """The state a local store's parts share (see the module docstring)."""

    path: str
    _catalog: Catalog
    _medium: Medium
    _cache: HostCache | None  # None without a host cache, and once closed
    _alloc: ExtentAllocator  # free extents, and leases on extents being read
    _chunk: int  # bytes per checksummed chunk of a new entry
    _seg_lock: threading.Lock  # adding a segment
    _next_seg: int
    _grow_bytes: int
    _workers: ThreadPoolExecutor  # chunk jobs: copy, checksum, blocking I/O
    _io_threads: int
    _staging: StagingPool  # aligned buffers for chunk writes from unaligned memory
    _results: RecycledBuffers  # reused memory for uncached reads and copies out
    _ops: Gate
    _tombstones: dict[Key, int]  # key -> version of its delete
    _version: int  # the last version given out
    _version_lock: threading.Lock
    _locks: dict[Key, list[Any]]  # key -> [lock, holders and waiters]
    _locks_mutex: threading.Lock
    _stats_lock: threading.Lock
    _tier: TierStats
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    @contextlib.contextmanager
    def _key_locks(self, keys: Iterable[Key]) -> Iterator[None]:
        """Per-entry locks, taken in sorted order: a write and a cache fill of one entry
        never interleave (so a stale read can never be cached over a newer write)."""
        wanted = sorted(set(keys))
        locks, held = [], []
        with self._locks_mutex:
            for key in wanted:
                slot = self._locks.setdefault(key, [threading.Lock(), 0])
                slot[1] += 1
                locks.append(slot)
        try:
            for lock, _ in locks:
                lock.acquire()
                held.append(lock)
            yield
        finally:
            for lock in held:
                lock.release()
            with self._locks_mutex:
                for key, slot in zip(wanted, locks):
                    slot[1] -= 1
                    if slot[1] == 0:
                        del self._locks[key]

    def _batched(self) -> bool:
        """Whether a read or write goes as one batch of the engine (AIO), else on the chunk
        workers (:func:`tierstore.landing.on_workers`)."""
        return getattr(self._medium, "batched", False) and not on_workers()

    def _next_versions(self, n: int) -> list[int]:
        with self._version_lock:
            first = self._version + 1
            self._version += n
        return list(range(first, first + n))
