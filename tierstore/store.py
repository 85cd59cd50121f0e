"""The Store: tensors by (name, kind) on a backing medium, committed through the catalog.

Write path (copy-on-write): take free aligned extents, write the new bytes there, make them
durable (``Medium.sync``), then one LMDB transaction points the entries at the new extents
and frees the old ones. Until that commit nothing the catalog references has changed, so a
crash at any instant leaves every entry at its last committed version. With the host cache,
``put`` lands in a cache slot as a dirty entry and takes that path on eviction or
``flush()``; without it, ``put`` takes it before returning.

Read path: look the record up and lease its extent, read the extent in ``chunk``-sized
pieces in parallel, check each piece's crc32c as it lands, and raise
:class:`CorruptEntryError` on a mismatch.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import torch

from tierstore.cache import HostCache
from tierstore.cache.pinned import cuda_consumer
from tierstore.nvme import ENGINES, HANDOFF_MIN_BYTES, RecycledBuffers, StagingPool, aligned_empty

from .alloc import ExtentAllocator
from .catalog import Catalog, Gate, Record, entry_key
from .devices import bytes_to_device
from .errors import (
    CorruptEntryError,
    EntryNotFoundError,
    NotAStoreError,
    ShapeMismatchError,
    SnapshotError,
    StoreClosedError,
    StoreError,
    StoreFullError,
)
from .media import ALIGNMENT, Medium, align_up
from .opening import (
    CATALOG_DIR,
    LOCK,
    MARKER,
    check_host_cache,
    check_identity,
    init_dir,
    lock,
    read_marker,
)
from .prefetch import DeviceQueues
from .sizes import parse_size
from .tensors import as_bytes, dtype_from_name, dtype_name, element_size, from_bytes

KINDS = ("param", "grad", "exp_avg", "exp_avg_sq", "master")
_KIND = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_NAME_BYTES = 400  # LMDB keys are at most 511 bytes; snapshot keys add the tag
_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# A flush commits dirty entries in batches of about this many bytes, each its own commit:
# copy-on-write needs room for a batch's new bytes before its commit frees the old ones, so
# on a nearly full disk a flush still makes progress (and freeing space lets it finish).
FLUSH_BATCH_BYTES = 256 << 20
CATALOG_COPY = "catalog-snapshot.mdb"  # the catalog as the latest snapshot left it

Key = tuple[str, str]


@dataclass(frozen=True)
class EntryInfo:
    """What :meth:`Store.info` reports about one entry."""

    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    version: int
    checksum: str
    tier: str
    path: str | None
    offset: int | None


@dataclass
class _Meta:
    """What a cache slot (or a freshly read buffer) holds: the entry's dtype, shape, size
    and version."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int


def _slot_buffer(view: torch.Tensor, length: int) -> np.ndarray:
    """The cache slot under ``view`` widened to ``length`` bytes (the entry rounded up to
    4 KiB, as O_DIRECT reads need). Slots are 4 KiB-aligned powers of two, so the widened
    range stays inside the slot."""
    wide = torch.empty(0, dtype=torch.uint8)
    wide.set_(view.untyped_storage(), view.storage_offset(), (length,))
    return wide.numpy()


@dataclass(frozen=True)
class SnapshotInfo:
    tag: str
    created: float
    entries: int
    nbytes: int


@dataclass
class _TierStats:
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass
class FsckReport:
    """``problems`` make ``tierstore fsck`` exit 1; ``notes`` are harmless findings."""

    entries: int = 0
    nbytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise StoreError(f"entry names are non-empty strings, got {name!r}")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise StoreError(f"entry name {name[:60]!r} is not valid UTF-8") from None
    if "\0" in name or size > MAX_NAME_BYTES:
        raise StoreError(f"invalid entry name {name[:60]!r}: no NUL, at most {MAX_NAME_BYTES} bytes")


def check_kind(kind: str) -> None:
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise StoreError(
            f"invalid state kind {kind!r}: lowercase identifier such as {', '.join(KINDS)}"
        )


@functools.lru_cache(maxsize=1 << 16)
def _checked_key(name: str, kind: str) -> None:
    check_name(name)
    check_kind(kind)


def check_key(name: str, kind: str) -> None:
    """``check_name`` and ``check_kind``, remembered for keys that passed: the readers that
    ask for the same keys every pass (a ring, a trainer) pay for the checks once."""
    if type(name) is str and type(kind) is str:
        _checked_key(name, kind)  # an invalid key raises, and raising is not cached
    else:
        check_name(name)
        check_kind(kind)


def prefetch_keys(names: str | Iterable[str | Key], kind: str) -> list[Key]:
    """Validated ``(name, kind)`` keys from a name, or names and ``(name, kind)`` pairs."""
    keys = []
    for item in [names] if isinstance(names, str) else names:
        if isinstance(item, str):
            name, k = item, kind
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            name, k = item
        else:
            raise StoreError(f"expected a name or a (name, kind) pair, got {item!r}")
        check_name(name)
        check_kind(k)
        keys.append((name, k))
    return keys


def check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise SnapshotError(f"invalid snapshot tag {tag!r}: letters, digits, '.', '_', '-'")


class Borrowed:
    """Read-only views lent by :meth:`Store.borrow_many`; release once (or use ``with``).

    A released borrow may be :meth:`renew`-ed: a reader that takes the same entries again
    and again (a ring's layer, every token) pins them again at a fraction of a new borrow's
    cost, and keeps its tensors.
    """

    def __init__(self, tensors: dict[Any, torch.Tensor], release: Callable[[], None],
                 renew: Callable[[], bool] | None = None) -> None:
        self.tensors = tensors
        self._releaser = release
        self._release: Callable[[], None] | None = release
        self._renew = renew

    def release(self) -> None:
        """Unpin the views' slots: the views must not be read after this."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def renew(self) -> bool:
        """After :meth:`release`: pin the same entries again and return True if every one
        is still the cached version it was (same slot, dtype and shape; as a new borrow
        would, this counts as a cache hit), so ``tensors`` may be read again. False where
        any has changed, been evicted or was never cached (read into a buffer of its own):
        nothing is pinned and the caller borrows anew. Raises while the views are lent."""
        if self._release is not None:
            raise StoreError("renew() of a borrow that has not been released")
        if self._renew is None or not self._renew():
            return False
        self._release = self._releaser
        return True

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Staged:
    """New versions being written in place (:meth:`Store.stage_many`): fill ``tensors``,
    then :meth:`commit` (or :meth:`discard`). As a context manager, a block that raises
    discards and one that ends without committing discards too."""

    def __init__(self, store: Store, tensors: dict[Key, torch.Tensor],
                 handles: dict[Key, Any]) -> None:
        self.tensors = tensors
        self._store = store
        self._handles = handles
        self._open = True

    def commit(self) -> list[int]:
        """Make every staged tensor its entry's new version; returns the versions."""
        if not self._open:
            raise RuntimeError("this stage was already committed or discarded")
        self._open = False
        try:
            return self._store._commit_staged(self.tensors, self._handles)
        except BaseException:
            self._discard_slots()
            raise

    def discard(self) -> None:
        if self._open:
            self._open = False
            self._discard_slots()

    def _discard_slots(self) -> None:
        cache = self._store._cache
        for h in self._handles.values():
            if cache is not None:
                cache.discard_staged(h)  # a no-op for slots already committed

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


class Store:
    """A tiered tensor store. Open one with :func:`tierstore.open`; thread-safe."""

    def __init__(
        self,
        path: str,
        catalog: Catalog,
        medium: Medium,
        *,
        chunk_bytes: int,
        lock_fd: int,
        io_threads: int = 8,
        host_cache: int = 0,
        policy: str = "lfu-decay",
        policy_args: dict[str, Any] | None = None,
        device_budget: int | str | Mapping[str, int | str] | None = None,
        cache_arena: torch.Tensor | None = None,
    ) -> None:
        # Device prefetch queues; first, so a bad budget fails before the store starts.
        # Their threads start with a device's first request.
        # Looked up at call time (not bound now) so an instrumented or patched store's
        # methods are the ones the queues call.
        self._queues = DeviceQueues(lambda keys: self._host_bytes(keys),
                                    lambda key: self._entry_nbytes(key), device_budget)
        self.path = path
        self._catalog = catalog
        self._medium = medium
        self._chunk = chunk_bytes
        self._lock_fd = lock_fd
        self._alloc = ExtentAllocator(ALIGNMENT)
        # Chunk jobs (copy, checksum, and the medium's blocking I/O call, made on the job's
        # own thread for small chunks) run here, so the CPU work of one chunk overlaps the
        # I/O of the others.
        # Twice the I/O threads, so while io_threads requests are in flight (the engine
        # bounds them) as many workers checksum or copy landed chunks: with one I/O thread,
        # the checksum would otherwise stall the next read.
        self._workers = ThreadPoolExecutor(2 * io_threads, thread_name_prefix="tierstore-chunk")
        self._io_threads = io_threads
        self._staging = StagingPool(chunk_bytes, keep=2 * io_threads)
        # Uncached reads land in reused memory once callers drop earlier results, so a
        # steady stream of reads does not fault fresh pages in for every entry.
        self._results = RecycledBuffers(max(256 << 20, 4 * io_threads * chunk_bytes))
        self._seg_lock = threading.Lock()
        # Every operation that changes entries or fills the cache holds this shared;
        # restore() holds it alone, so no write-back or cache fill straddles a restore.
        self._ops = Gate()
        # key -> version of its delete, written under the catalog's commit lock (delete())
        self._tombstones: dict[Key, int] = {}
        self._stats_lock = threading.Lock()
        self._tier = _TierStats()
        self._closed = False
        with catalog.read() as txn:
            segments = catalog.segments(txn)
        try:
            medium.attach(segments)
        except ValueError as e:  # the backing tier's layout disagrees with the catalog
            raise StoreError(f"store {path}: {e}") from None
        missing = set(getattr(medium, "missing", dict)())
        with catalog.read() as txn:
            # Nothing new is written into a segment whose file is gone.
            self._alloc.load(e for e in catalog.free_extents(txn) if e[0] not in missing)
            # A medium grows by at least this much at a time, so growth is rare (NVMe slabs
            # are sized by the medium itself).
            self._grow_bytes = int(catalog.get_meta(txn, "backing", {}).get("grow_bytes", 0))
            self._version = catalog.get_meta(txn, "version", 0)
        self._next_seg = max((s[0] for s in segments), default=-1) + 1
        self._version_lock = threading.Lock()
        self._locks: dict[Key, list[Any]] = {}
        self._locks_mutex = threading.Lock()
        self._cache: HostCache | None = None
        if host_cache:
            self._cache = HostCache(host_cache, policy=policy, policy_args=policy_args,
                                    writeback=self._write_back_one, arena=cache_arena,
                                    writeback_many=self._write_back)

    # -- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Write back dirty entries and close the store.

        If the write-back fails (a full disk, say) the store stays open with every
        unflushed entry still in the host cache: free space and call ``close()`` (or
        ``flush()``) again.
        """
        if self._closed:
            return
        if self._cache is not None:
            try:
                self.flush()
            except StoreError as e:
                n = self._cache.stats().dirty_entries
                raise type(e)(f"{e}; the store stays open and {n} unflushed entries stay in "
                              "its host cache: free space, then close() again") from e
        try:
            # Queued transfers are cancelled and running ones land while the medium and
            # the chunk workers they read through are still open (they only read).
            self._queues.close()
        finally:
            self._closed = True
            self._close_resources()

    def _close_resources(self) -> None:
        self._cache = None  # its arena (and any pin on it) goes with the store, not later
        self._workers.shutdown(wait=True)
        self._results.close()
        self._medium.close()
        self._catalog.close()
        os.close(self._lock_fd)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def flush(self) -> None:
        """Make every earlier ``put`` durable: dirty cache entries are written back
        copy-on-write and committed in batches of about ``FLUSH_BATCH_BYTES``, each batch
        one transaction. If it fails, the batches committed so far are durable and the
        rest stay dirty in the cache, so a later ``flush()`` retries them."""
        self._check_open()
        with self._ops.shared():
            self._flush()

    def _flush(self) -> None:
        if self._cache is not None:
            self._cache.flush(many=self._write_back, batch_bytes=FLUSH_BATCH_BYTES)
        self._catalog.env.sync(True)

    def tick(self) -> None:
        """Advance the cache policy's clock by one step (a training step, say)."""
        if self._cache is not None:
            self._cache.tick()

    @property
    def backing(self) -> str:
        return self._medium.kind

    def describe(self) -> str:
        """The backing tier and the engine or library that moves its bytes."""
        return f"{self._medium.kind}: {self._medium.describe()}"

    # -- writes ---------------------------------------------------------------------
    def put(self, name: str, tensor: torch.Tensor, kind: str = "param") -> int:
        """Store ``tensor`` as (name, kind); returns its new version.

        With a host cache (the default) the entry lands there dirty and reaches the backing
        tier on eviction, ``flush()``, ``snapshot()`` or ``close()``; without one
        (``host_cache=0``) it is committed before ``put`` returns. Either way ``flush()``
        returning means every earlier ``put`` is durable.
        """
        return self.put_many([(name, kind, tensor)])[0]

    def put_many(
        self,
        items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor] | tuple[str, str, torch.Tensor]],
        kind: str = "param",
    ) -> list[int]:
        """Store several tensors; returns their versions.

        ``items`` maps names to tensors, or yields ``(name, tensor)`` or
        ``(name, kind, tensor)``. What bypasses the cache is written with overlapped I/O
        and committed in ONE transaction: all of it or none of it.
        """
        self._check_open()
        batch = [
            (name, k, as_bytes(t), _Meta(dtype_name(t.dtype), tuple(t.shape), 0, 0))
            for name, k, t in self._normalize(items, kind)
        ]
        cached = self._cache is not None
        # With the cache, versions are given out under the key locks, so two operations on
        # one key are ordered the same way by their versions and by the cache.
        with self._ops.shared(), self._key_locks([(n, k) for n, k, _, _ in batch] if cached else []):
            versions = self._next_versions(len(batch))
            for (_, _, src, meta), v in zip(batch, versions):
                meta.nbytes, meta.version = src.nbytes, v
            if cached:
                self._land(batch)
            else:
                self._write_through(batch)
        return versions

    def _land(self, batch: list[tuple[str, str, np.ndarray, _Meta]]) -> None:
        """New versions into the host cache as dirty entries; what it does not take is
        written through in one commit. The caller holds the entries' key locks."""
        assert self._cache is not None
        through = []
        for name, k, src, meta in batch:
            # In place when nobody holds the old bytes; otherwise a new slot, so readers
            # still copying the old bytes keep them.
            if meta.nbytes and self._cache.overwrite((name, k), src, meta):
                continue
            self._cache.invalidate((name, k))
            h = self._cache.insert((name, k), meta.nbytes, meta, data=src) if meta.nbytes else None
            if h is None:
                through.append((name, k, src, meta))
                continue
            self._cache.mark_dirty((name, k), meta)
            h.release()
        if through:
            self._write_through(through)

    def _next_versions(self, n: int) -> list[int]:
        with self._version_lock:
            first = self._version + 1
            self._version += n
        return list(range(first, first + n))

    def _normalize(self, items: Any, kind: str) -> Iterator[tuple[str, str, torch.Tensor]]:
        if isinstance(items, Mapping):
            items = items.items()
        for item in items:
            if len(item) == 3:
                name, k, tensor = item
            else:
                (name, tensor), k = item, kind
            check_name(name)
            check_kind(k)
            yield name, k, tensor

    def _write_back_one(self, key: Key, view: torch.Tensor, meta: _Meta) -> None:
        self._write_back([(key, view, meta)])

    def _write_back(self, items: list[tuple[Key, torch.Tensor, _Meta]]) -> None:
        """The cache's write-back: dirty slots to the backing tier, one commit."""
        self._write_through([(n, k, view.numpy(), meta) for (n, k), view, meta in items])

    def _write_through(self, batch: list[tuple[str, str, np.ndarray, _Meta]]) -> None:
        """Copy-on-write: fresh extents, parallel chunk writes, sync, then one commit."""
        taken: list[tuple[int, int, int]] = []
        records: list[tuple[str, str, Record]] = []
        started: list[list[Future[int]]] = []
        try:
            for name, k, src, meta in batch:
                rec, futs = self._write_bytes(src, meta, taken)
                records.append((name, k, rec))
                started.append(futs)
            for (_, _, rec), futs in zip(records, started):
                rec.crc = rec.crc or [f.result() for f in futs]
            self._medium.sync({seg for seg, _, length in taken if length})
            freed = self._catalog.write(lambda txn: self._commit(txn, records))
        except BaseException as e:
            # A write still in flight must land before its extent can be handed out again.
            wait([f for futs in started for f in futs])
            self._alloc.release(taken)
            if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
                raise StoreFullError(f"no space to write to {self.path}: {e}") from e
            raise
        self._alloc.release(freed)
        with self._stats_lock:
            self._tier.writes += len(records)
            self._tier.bytes_written += sum(r.nbytes for _, _, r in records)

    def _write_bytes(
        self, src: np.ndarray, meta: _Meta, taken: list[tuple[int, int, int]]
    ) -> tuple[Record, list[Future[int]]]:
        """Start writing ``src`` to fresh extents; the futures give each chunk's crc32c."""
        nbytes = src.nbytes
        rec = Record(
            dtype=meta.dtype, shape=list(meta.shape), nbytes=nbytes, crc=[],
            chunk=self._chunk, version=meta.version, seg=-1, off=0, length=0,
        )
        if nbytes == 0:
            rec.crc = [0]
            return rec, []
        length = align_up(nbytes)
        seg, off = self._allocate(length)
        taken.append((seg, off, length))
        rec.seg, rec.off, rec.length = seg, off, length
        # O_DIRECT and GDS need page-aligned memory (cache slots are). Otherwise each chunk
        # is copied into an aligned staging buffer by a worker just before its write, so
        # copies, checksums and writes of different chunks overlap.
        aligned = src.ctypes.data % ALIGNMENT == 0

        def chunk_job(start: int) -> int:
            end = min(start + self._chunk, length)
            stop = min(end, nbytes)
            crc = crc32c.crc32c(src[start:stop])
            if aligned and end <= nbytes:
                self._medium.write(seg, off + start, memoryview(src[start:end]))
                return crc
            stage = self._staging.take()  # reused, so no page faults on the hot path
            try:
                stage[: stop - start] = src[start:stop]
                stage[stop - start : end - start] = 0
                self._medium.write(seg, off + start, memoryview(stage[: end - start]))
            finally:
                self._staging.give(stage)
            return crc

        return rec, [self._workers.submit(chunk_job, start) for start in range(0, length, self._chunk)]

    def _allocate(self, length: int) -> tuple[int, int]:
        got = self._alloc.allocate(length)
        while got is None:
            with self._seg_lock:
                got = self._alloc.allocate(length)  # another thread may have added a slab
                if got is not None:
                    break
                seg = self._next_seg
                try:
                    new = self._medium.create_segment(seg, max(length, self._grow_bytes))
                except FileExistsError as e:
                    raise StoreError(f"{e.filename}: {e.strerror}") from None
                self._catalog.write(lambda txn, new=new: self._catalog.add_segment(txn, *new))
                seg, _, _, size = new
                self._next_seg = seg + 1
                self._alloc.add(seg, 0, size)
            got = self._alloc.allocate(length)
        return got

    def _commit(
        self, txn: Any, records: list[tuple[str, str, Record]]
    ) -> list[tuple[int, int, int]]:
        """Point entries at their new extents; returns extents to hand back to the allocator.

        Versions are given out when ``put`` is called, so a record older than the one the
        catalog holds (a slow write-back overtaken by a newer write) is dropped: the newest
        version wins whatever order commits land in. So is one older than a delete of its
        key (a write-back that took the entry before the delete and commits after it: see
        ``delete``).
        """
        cat = self._catalog
        top = cat.get_meta(txn, "version", 0)
        live = cat.get_meta(txn, "live_bytes", 0)
        freed = []
        for name, kind, rec in records:
            old = cat.get_record(txn, name, kind)
            dead = self._tombstones.get((name, kind))
            if (old is not None and old.version > rec.version) or (
                    dead is not None and dead > rec.version):
                if rec.seg >= 0:
                    freed.append(rec.extent)  # taken in memory only, never carved
                continue
            cat.incref(txn, rec)
            if old is not None:
                live -= old.nbytes
                ext = cat.decref(txn, old)
                if ext:
                    freed.append(ext)
            live += rec.nbytes
            top = max(top, rec.version)
            txn.put(entry_key(name, kind), rec.encode(), db=cat.db["entries"])
        cat.put_meta(txn, "version", top)
        cat.put_meta(txn, "live_bytes", live)
        return freed

    def delete(self, name: str, kind: str = "param", *, missing_ok: bool = False) -> bool:
        """Remove an entry; its space is reused once no snapshot holds it."""
        self._check_open()
        check_name(name)
        check_kind(kind)

        cache = self._cache
        dead = 0

        def txn_delete(txn: Any) -> tuple[int, int, int] | None | bool:
            if cache is not None:
                # A write-back that took the entry before it left the cache may commit
                # after this one: the tombstone, set in this commit (so a crash never shows
                # the delete's effect before it is durable), makes that commit drop it.
                # Tombstones matter only while such a write-back can exist.
                if not cache.writebacks_in_flight():
                    self._tombstones.clear()
                self._tombstones[(name, kind)] = dead
            old = self._catalog.get_record(txn, name, kind)
            if old is None:
                return False
            txn.delete(entry_key(name, kind), db=self._catalog.db["entries"])
            live = self._catalog.get_meta(txn, "live_bytes", 0)
            self._catalog.put_meta(txn, "live_bytes", live - old.nbytes)
            return self._catalog.decref(txn, old)

        with self._ops.shared(), self._key_locks([(name, kind)]):
            cached = False
            if cache is not None:
                # Above every earlier put of the key (the key lock orders them).
                (dead,) = self._next_versions(1)
                cached = cache.invalidate((name, kind))
            freed = self._catalog.write(txn_delete)
        if freed is False and not cached:
            if missing_ok:
                return False
            raise EntryNotFoundError(name, kind)
        if freed:
            self._alloc.release([freed])
        return True

    # -- reads ----------------------------------------------------------------------
    def get(
        self,
        name: str,
        kind: str = "param",
        *,
        device: str | torch.device | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The stored tensor: from the host cache, or read from the backing tier with every
        chunk's crc32c verified. ``out`` receives it in place (same dtype and shape, any
        device); ``device`` puts the result there."""
        return self._read([(name, kind)], device=device, outs=[out])[0]

    def get_many(
        self,
        names: Iterable[str | Key],
        kind: str = "param",
        *,
        device: str | torch.device | None = None,
        out: Mapping[str | Key, torch.Tensor] | None = None,
    ) -> dict[str | Key, torch.Tensor]:
        """Several tensors with their reads overlapped, keyed as asked (name or (name, kind)).

        ``out`` maps some of those keys to tensors that receive the values in place (as
        ``get``'s ``out=``): a caller that reads the same shapes every step reuses its
        buffers instead of paying for fresh allocations.
        """
        asked = list(names)
        keys = [(a, kind) if isinstance(a, str) else tuple(a) for a in asked]
        outs = [None] * len(keys) if not out else [out.get(a) for a in asked]
        return dict(zip(asked, self._read(keys, device=device, outs=outs)))

    def borrow_many(self, names: Iterable[str | Key], kind: str = "param") -> Borrowed:
        """Read-only views of several entries' host bytes, without copying them out.

        Hits are views of the pinned cache slots; misses are read from the backing tier
        (crc32c-verified) into cache slots, or into buffers of their own where the cache
        does not take them. The slots stay pinned (not evicted, not reused) until the
        returned :class:`Borrowed` is released; ``with store.borrow_many(keys) as b:``
        releases it at the end of the block. Never write into the views: they are the
        cache's copy of the entry, which other readers share. A ``put`` of a borrowed
        entry makes a new version in a new slot; the views keep showing the old one.
        """
        self._check_open()
        asked = list(names)
        keys = [(a, kind) if isinstance(a, str) else tuple(a) for a in asked]
        for name, k in keys:
            check_key(name, k)
        found, handles = self._host_bytes(keys)
        slots = {h.key: h for h in handles}
        tensors = {}
        for a, key in zip(asked, keys):
            meta, raw = found[key]
            h = slots.get(key)
            memo = h.memo if h is not None else None
            if memo is not None and memo[0] is meta:
                typed = memo[1]
            else:
                typed = from_bytes(raw, dtype_from_name(meta.dtype), meta.shape)
                if h is not None:
                    # The slot never moves: one typed view per entry and meta (an
                    # overwrite in place brings a new meta).
                    h.memo = (meta, typed)
            # A fresh alias each time, so that nothing one borrower sets on its tensor
            # (requires_grad, say) reaches the next.
            tensors[a] = typed.detach()
        renew = None
        if self._cache is not None and len(handles) == len(found):  # every one cached
            hs = [slots[key] for key in found]
            metas = [found[key][0] for key in found]
            renew = functools.partial(self._cache.renew_many, hs, metas)
        return Borrowed(tensors, functools.partial(self._release_handles, handles), renew)

    def stage_many(
        self, items: Iterable[tuple[str, str, torch.dtype, Sequence[int]]]
    ) -> Staged:
        """Room for new versions of several entries, to be written in place and committed.

        ``items`` are ``(name, kind, dtype, shape)``. The returned :class:`Staged` holds a
        writable tensor per entry (``staged.tensors[(name, kind)]``): a fresh host-cache
        slot where the cache has room, else a plain tensor. Fill them, then
        ``staged.commit()`` does what ``put_many`` of those tensors would do (new versions,
        dirty cache entries written back later, or written through), without copying them.
        Until the commit readers see the current versions; a discarded (or, in a ``with``
        block, failed) stage leaves no trace.
        """
        self._check_open()
        entries = []
        for name, k, dtype, shape in items:
            check_name(name)
            check_kind(k)
            dtype_name(dtype)  # refuses what the store cannot hold
            shape = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in shape {shape} of {name!r}")
            nbytes = element_size(dtype) * math.prod(shape)
            entries.append(((name, k), dtype, shape, nbytes))
        handles: dict[Key, Any] = {}
        tensors: dict[Key, torch.Tensor] = {}
        cached = [(key, nbytes) for key, _, _, nbytes in entries if nbytes]
        with self._ops.shared():  # making room may write dirty victims back
            slots = (dict(zip((k for k, _ in cached), self._cache.stage_many(cached)))
                     if self._cache is not None and cached else {})
        for key, dtype, shape, _ in entries:
            h = slots.get(key)
            if h is not None:
                handles[key] = h
                tensors[key] = from_bytes(h.view, dtype, shape)
            else:
                tensors[key] = torch.empty(shape, dtype=dtype)
        return Staged(self, tensors, handles)

    def _commit_staged(self, tensors: dict[Key, torch.Tensor], handles: dict[Key, Any]) -> list[int]:
        """``Staged.commit``: the staged slots become the entries' new versions."""
        self._check_open()
        keys = list(tensors)
        plain = []
        with self._ops.shared(), self._key_locks(keys if self._cache is not None else []):
            versions = self._next_versions(len(keys))  # under the locks, as in put_many
            swaps = []
            for (name, k), v in zip(keys, versions):
                t = tensors[(name, k)]
                meta = _Meta(dtype_name(t.dtype), tuple(t.shape), t.nbytes, v)
                h = handles.get((name, k))
                if h is None:  # the cache had no slot to stage it in: a plain put
                    plain.append((name, k, as_bytes(t), meta))
                else:
                    swaps.append((h, meta))
            if swaps:
                self._cache.commit_staged_many(swaps)
            if plain and self._cache is not None:
                self._land(plain)
            elif plain:
                self._write_through(plain)
        return versions

    def _lookup(self, keys: list[Key]) -> list[Record]:
        """Records of ``keys`` with their extents leased (release with ``_unlease``)."""
        recs: list[Record] = []
        try:
            with self._alloc.lock, self._catalog.read() as txn:
                for name, kind in keys:
                    rec = self._catalog.get_record(txn, name, kind)
                    if rec is None:
                        raise EntryNotFoundError(name, kind)
                    if rec.seg >= 0:
                        self._alloc.lease_locked(rec.seg, rec.off)
                    recs.append(rec)
        except BaseException:
            self._unlease(recs)
            raise
        return recs

    def _unlease(self, recs: Iterable[Record]) -> None:
        for rec in recs:
            if rec.seg >= 0:
                self._alloc.unlease(rec.seg, rec.off)

    def _read(
        self,
        keys: list[Key],
        *,
        device: str | torch.device | None,
        outs: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        self._check_open()
        for name, kind in keys:
            check_key(name, kind)
        found, handles = self._host_bytes(keys)
        try:
            return [
                self._deliver(key, *found[key], out, device) for key, out in zip(keys, outs)
            ]
        finally:
            self._release_handles(handles)

    def _host_bytes(
        self, keys: list[Key]
    ) -> tuple[dict[Key, tuple[_Meta, np.ndarray | torch.Tensor]], list[Any]]:
        """Every key's bytes in host memory, without a copy: a pinned cache slot (hit, or
        filled from the backing tier) or, where the cache holds no slot for it, a freshly
        read buffer. Release the returned handles when done with the bytes."""
        found: dict[Key, tuple[_Meta, np.ndarray | torch.Tensor]] = {}
        handles: list[Any] = []
        try:
            if self._cache is None:
                misses = list(dict.fromkeys(keys))
            else:
                misses = []
                unique = list(dict.fromkeys(keys))
                for key, h in zip(unique, self._cache.lookup_many(unique)):
                    if h is None:
                        misses.append(key)
                    else:
                        handles.append(h)
                        found[key] = (h.meta, h.view)
            if misses:
                with self._ops.shared(), \
                        self._key_locks(misses if self._cache is not None else []):
                    self._load(misses, found, handles)
            with self._stats_lock:
                self._tier.reads += len(misses)
        except BaseException:
            self._release_handles(handles)
            raise
        return found, handles

    def _release_handles(self, handles: list[Any]) -> None:
        if handles:
            assert self._cache is not None
            self._cache.release_many(handles)

    def _load(
        self, keys: list[Key], found: dict[Key, Any], handles: list[Any]
    ) -> None:
        """Read missed entries from the backing tier, into cache slots where admitted."""
        recs = self._lookup(keys)
        try:
            todo_keys, todo_recs, bufs, new = [], [], [], []
            for key, rec in zip(keys, recs):
                meta = _Meta(rec.dtype, tuple(rec.shape), rec.nbytes, rec.version)
                h = None
                if self._cache is not None and rec.nbytes:
                    try:
                        h = self._cache.insert(key, rec.nbytes, meta)
                    except StoreFullError:
                        h = None  # a victim's write-back found no space: serve uncached
                if h is not None:
                    handles.append(h)
                    found[key] = (h.meta, h.view)
                    if not h.new:
                        continue  # loaded by another thread meanwhile
                    new.append(h)
                    buf = _slot_buffer(h.view, rec.length)
                else:
                    buf = self._results.take(rec.length)
                    found[key] = (meta, buf)
                todo_keys.append(key)
                todo_recs.append(rec)
                bufs.append(buf)
            try:
                self._fetch(todo_keys, todo_recs, bufs)
            except BaseException:
                for h in new:  # never publish unverified bytes
                    self._cache.invalidate(h.key)
                raise
            for h in new:
                self._cache.publish(h)
            with self._stats_lock:
                self._tier.bytes_read += sum(r.nbytes for r in todo_recs)
        finally:
            self._unlease(recs)

    def _deliver(
        self, key: Key, meta: _Meta, raw: np.ndarray | torch.Tensor,
        out: torch.Tensor | None, device: str | torch.device | None,
    ) -> torch.Tensor:
        """The caller's own tensor: a copy out of a cache slot, or the freshly read buffer."""
        if out is not None:
            self._check_out(key, meta, out)
        target = out.device if out is not None else torch.device(device or "cpu")
        if target.type != "cpu":
            if target.type == "cuda":
                cuda_consumer()  # the first device read pins the cache arena
            # Raw bytes, as on the CPU (see there); synchronous, so the slot may go after.
            return bytes_to_device(raw, meta.nbytes, dtype_from_name(meta.dtype),
                                   tuple(meta.shape), target, out=out)
        if out is None and isinstance(raw, torch.Tensor):
            # A cache slot: copy the raw bytes out (typed copies have no kernel for some
            # dtypes and would canonicalise others, e.g. bool bytes other than 0/1). Into
            # reused memory: faulting fresh pages in costs more than the copy. A plain memcpy
            # on this thread: torch's copy splits across its intra-op threads and, with the
            # cores busy, waits a scheduler tick for the other half.
            buf = self._results.take(raw.numel())
            np.copyto(buf, raw.numpy())
            raw = buf
        if (out is not None and out.device.type == "cpu" and out.is_contiguous()
                and out.numel() and not out.requires_grad):
            # Bytes straight into the caller's tensor with a memcpy (see above).
            src = raw.numpy() if isinstance(raw, torch.Tensor) else raw
            np.copyto(out.view(-1).view(torch.uint8).numpy(), src[: meta.nbytes])
            return out
        t = from_bytes(raw, dtype_from_name(meta.dtype), meta.shape)
        if out is not None:
            return out.copy_(t)
        return t

    def _fetch(
        self, keys: list[Key], recs: list[Record], bufs: list[np.ndarray] | None = None
    ) -> list[np.ndarray]:
        """Read the records' extents in parallel chunks, verifying each chunk's crc32c."""
        if bufs is None:
            bufs = [aligned_empty(rec.length) for rec in recs]

        def chunk_job(i: int, c: int) -> None:
            rec, buf, start = recs[i], bufs[i], c * recs[i].chunk
            end = min(start + rec.chunk, rec.length)
            try:
                self._medium.read(rec.seg, rec.off + start, memoryview(buf[start:end]))
            except OSError as e:
                where = self._medium.location(rec.seg, rec.off + start)[0]
                raise CorruptEntryError(
                    *keys[i], f"bytes {start}..{end} cannot be read from {where} "
                    f"({e.strerror or e}); restore the file, or the entry from a snapshot",
                ) from e
            stop = min(end, rec.nbytes)
            got = crc32c.crc32c(buf[start:stop])
            if got != rec.crc[c]:
                name, kind = keys[i]
                raise CorruptEntryError(
                    name, kind,
                    f"crc32c of bytes {start}..{stop} is {got:08x}, the catalog says "
                    f"{rec.crc[c]:08x} (version {rec.version}, "
                    f"{self._medium.location(rec.seg, rec.off + start)[0]})",
                )

        work = [(i, c) for i, rec in enumerate(recs)
                for c in range(len(range(0, rec.length, rec.chunk)))]
        if len(work) == 1:  # nothing to overlap: no hand-off
            chunk_job(*work[0])
            return bufs
        # A few workers take the chunks in turn, rather than a job (a future, a queue item
        # and a thread wake-up) per chunk: a layer of 512 KiB entries is a hundred chunks.
        # Requests under HANDOFF_MIN_BYTES are issued by the worker itself, io_threads at a
        # time, and more workers would only queue for those slots: one more, to issue the
        # next request while another worker checksums. Larger requests wait on the engine's
        # pool, whose queue must not run dry: the whole of this pool for those.
        big = any(min(rec.chunk, rec.length) >= HANDOFF_MIN_BYTES for rec in recs)
        fetchers = self._io_threads + (self._io_threads if big else 1)
        todo = iter(enumerate(work))
        take = threading.Lock()
        failed: list[tuple[int, BaseException]] = []

        def drain() -> None:
            while not failed:
                with take:
                    item = next(todo, None)
                if item is None:
                    return
                n, (i, c) = item
                try:
                    chunk_job(i, c)
                except BaseException as e:  # noqa: BLE001 (raised by the caller below)
                    failed.append((n, e))

        jobs = [self._workers.submit(drain) for _ in range(min(len(work), fetchers))]
        try:
            for f in jobs:
                f.result()
        finally:
            if not all(f.done() for f in jobs):  # interrupted: stop taking chunks
                failed.append((len(work), StoreError("fetch interrupted")))
            # Never let a read land in a buffer after its extent's lease has ended.
            for f in jobs:
                if not f.cancel():
                    f.exception()
        if failed:
            raise min(failed, key=lambda x: x[0])[1]
        return bufs

    def _verify_record(self, name: str, kind: str, rec: Record) -> None:
        self._fetch([(name, kind)], [rec])

    @staticmethod
    def _check_out(key: Key, meta: _Meta, out: torch.Tensor) -> None:
        dtype = dtype_from_name(meta.dtype)
        if out.dtype != dtype or tuple(out.shape) != tuple(meta.shape):
            raise ShapeMismatchError(
                f"out= for {key[0]!r} (kind {key[1]!r}) is {out.dtype} {tuple(out.shape)}, "
                f"the entry is {dtype} {tuple(meta.shape)}"
            )

    def view(self, name: str, kind: str = "param") -> torch.Tensor:
        """A read-only zero-copy tensor over the stored bytes, where the medium is byte
        addressable (PMem); a checksum-verified copy elsewhere, or while the host cache
        holds a newer version than the backing tier.

        The entry's space stays reserved (not reused by later writes) while the returned
        tensor object is alive. Do not write into it.
        """
        self._check_open()
        if self._cache is not None and self._cache.peek((name, kind)) is not None:
            return self.get(name, kind)
        rec = self._lookup([(name, kind)])[0]
        try:
            mv = self._medium.view(rec.seg, rec.off, rec.nbytes) if rec.seg >= 0 else None
            if mv is None:
                self._unlease([rec])
                return self.get(name, kind)
            arr = np.frombuffer(mv, dtype=np.uint8)
            for c, start in enumerate(range(0, rec.nbytes, rec.chunk)):
                got = crc32c.crc32c(arr[start : start + rec.chunk])
                if got != rec.crc[c]:
                    raise CorruptEntryError(name, kind, f"crc32c {got:08x} != {rec.crc[c]:08x}")
            with warnings.catch_warnings():  # read-only on purpose: writes must go through put
                warnings.simplefilter("ignore", UserWarning)
                u8 = torch.frombuffer(mv, dtype=torch.uint8)
            t = from_bytes(u8, dtype_from_name(rec.dtype), tuple(rec.shape))
        except BaseException:
            self._unlease([rec])
            raise
        weakref.finalize(t, self._alloc.unlease, rec.seg, rec.off)
        return t

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

    # -- device prefetch ------------------------------------------------------------
    def prefetch(
        self,
        names: str | Iterable[str | Key],
        *,
        device: str | torch.device | None = None,
        priority: float | tuple[float, ...] = 0,
        kind: str = "param",
    ) -> list[Future[torch.Tensor]]:
        """Start moving entries to ``device`` (None: the CPU "device") and return one future
        per name, resolved with the device copy once it has landed.

        ``names`` holds names (of ``kind``) or ``(name, kind)`` pairs. ``priority`` says
        when they are needed, smaller is sooner: a number or a tuple such as
        ``(step, layer)``. A request for an entry already queued, in flight or resident
        shares its transfer and future (and raises its priority if this one is sooner).
        Transfers take the entry's bytes from the device's budget when they start and give
        them back on :meth:`release` or :meth:`cancel`. A failed read fails its future only.
        On the CPU "device", after :meth:`prefetch_views`, nothing is copied: the result is
        a read-only view (see there).
        """
        self._check_open()
        return self._queues.get(device).request(prefetch_keys(names, kind), priority)

    def acquire(
        self,
        name: str,
        *,
        device: str | torch.device | None = None,
        kind: str = "param",
        timeout: float | None = None,
    ) -> torch.Tensor:
        """The entry's copy on ``device``, waiting only while its transfer has not landed;
        an entry never prefetched is fetched now, ahead of every queued request. The time
        spent waiting is the stall reported in ``stats()["prefetch"]``. On CUDA the current
        stream waits on the copy's event, not the host. The copy holds its budget until
        :meth:`release`. ``timeout`` (seconds) raises TimeoutError rather than waiting for
        a budget that nothing releases. After :meth:`prefetch_views` on the CPU it is a
        read-only view, not a copy."""
        self._check_open()
        (key,) = prefetch_keys([(name, kind)], kind)
        return self._queues.get(device).acquire(key, timeout)

    def release(
        self, name: str, *, device: str | torch.device | None = None, kind: str = "param"
    ) -> bool:
        """Drop the device copy of an entry and give its bytes back to the budget (a queued
        or in-flight request is cancelled instead). Tensors already handed out stay valid;
        a later :meth:`acquire` transfers the entry again. Returns whether there was one."""
        self._check_open()
        (key,) = prefetch_keys([(name, kind)], kind)
        return self._queues.get(device).drop([key], release=True) == 1

    def cancel(
        self,
        names: str | Iterable[str | Key],
        *,
        device: str | torch.device | None = None,
        kind: str = "param",
    ) -> int:
        """Cancel requests: a queued one never takes budget and its future is cancelled; an
        in-flight one is cancelled and its budget comes back once its bytes have landed; a
        resident copy is dropped as by :meth:`release`. Returns how many were found."""
        self._check_open()
        return self._queues.get(device).drop(prefetch_keys(names, kind), release=False)

    def prefetch_views(self, device: str | torch.device | None = None,
                       enabled: bool = True) -> bool:
        """Make the prefetch queue of ``device`` lend read-only views instead of copies (or,
        ``enabled=False``, copy again); returns whether it lends views. Only the CPU
        "device" can, where device memory is host memory: a prefetched entry is then a view
        of its pinned host-cache slot (or of the buffer it was read into, where the cache
        did not take it), pinned while the queue holds it and while any tensor over it
        lives. It applies to every user of that queue, and none may write into what
        :meth:`acquire` returns. On CUDA stage 2 always copies: returns False."""
        self._check_open()
        return self._queues.get(device).set_zero_copy(enabled)

    def _entry_nbytes(self, key: Key) -> int:
        """An entry's size, for the credits its transfer will take."""
        return self.info(*key).nbytes

    # -- catalog queries ------------------------------------------------------------
    def __contains__(self, key: str | Key) -> bool:
        name, kind = (key, "param") if isinstance(key, str) else key
        self._check_open()
        if self._cache is not None and self._cache.peek((name, kind)) is not None:
            return True
        with self._catalog.read() as txn:
            return self._catalog.get_record(txn, name, kind) is not None

    def names(self, prefix: str = "", kind: str | None = None) -> list[str]:
        """Sorted distinct names starting with ``prefix`` (of one kind, if given)."""
        return list(dict.fromkeys(n for n, k in self.keys(prefix) if kind is None or k == kind))

    def keys(self, prefix: str = "") -> list[Key]:
        """Every (name, kind) whose name starts with ``prefix``, sorted by name then kind
        (entries not yet written back from the host cache included)."""
        self._check_open()
        with self._catalog.read() as txn:
            found = {(n, k) for n, k, _ in self._catalog.iter_records(txn, prefix)}
        if self._cache is not None:
            found.update(key for key in self._cache.dirty_keys() if key[0].startswith(prefix))
        return sorted(found, key=lambda nk: entry_key(*nk))

    def info(self, name: str, kind: str = "param") -> EntryInfo:
        """dtype, shape, size, version, checksum and location. An entry whose newest
        version is still only in the host cache has tier ``"host"``, no path and no
        checksum yet."""
        self._check_open()
        cached = self._cache.peek((name, kind)) if self._cache is not None else None
        if cached is not None and cached[1]:
            meta = cached[0]
            return EntryInfo(
                name=name, kind=kind, dtype=dtype_from_name(meta.dtype), shape=tuple(meta.shape),
                nbytes=meta.nbytes, version=meta.version, checksum="", tier="host", path=None,
                offset=None,
            )
        with self._catalog.read() as txn:
            rec = self._catalog.get_record(txn, name, kind)
        if rec is None:
            raise EntryNotFoundError(name, kind)
        return self._entry_info(name, kind, rec)

    def _entry_info(self, name: str, kind: str, rec: Record) -> EntryInfo:
        path, offset = self._medium.location(rec.seg, rec.off) if rec.seg >= 0 else (None, None)
        return EntryInfo(
            name=name, kind=kind, dtype=dtype_from_name(rec.dtype), shape=tuple(rec.shape),
            nbytes=rec.nbytes, version=rec.version, checksum=rec.checksum(),
            tier=self._medium.kind, path=path, offset=offset,
        )

    def stats(self) -> dict[str, Any]:
        """Entries and bytes committed to the backing tier, reads/writes per tier since the
        store was opened, and the host cache's hits, misses, hit rate, evictions,
        write-backs and refused admissions."""
        self._check_open()
        with self._catalog.read() as txn:
            n = txn.stat(self._catalog.db["entries"])["entries"]
            live = self._catalog.get_meta(txn, "live_bytes", 0)
            nsnap = txn.stat(self._catalog.db["snapshots"])["entries"]
            capacity = sum(s[3] for s in self._catalog.segments(txn))
        with self._stats_lock:
            tier = dict(vars(self._tier))
        return {
            "entries": n,
            "bytes_stored": live,
            "snapshots": nsnap,
            "capacity_bytes": capacity,
            "free_bytes": self._alloc.free_bytes(),
            "catalog_map_bytes": self._catalog.map_size(),
            "tiers": {self._medium.kind: tier},
            "cache": None if self._cache is None else {
                "policy": self._cache.policy.name, **vars(self._cache.stats())},
            "prefetch": self._queues.stats(),
        }

    # -- snapshots ------------------------------------------------------------------
    def snapshot(self, tag: str) -> SnapshotInfo:
        """Atomically record the current version of every entry under ``tag``."""
        self._check_open()
        check_tag(tag)
        cat = self._catalog

        def txn_snap(txn: Any) -> SnapshotInfo:
            if txn.get(tag.encode(), db=cat.db["snapshots"]) is not None:
                raise SnapshotError(f"snapshot {tag!r} exists; drop it first")
            n = nbytes = 0
            for name, kind, rec in list(cat.iter_records(txn)):
                cat.incref(txn, rec)
                txn.put(tag.encode() + b"\0" + entry_key(name, kind), rec.encode(),
                        db=cat.db["snapentries"])
                n, nbytes = n + 1, nbytes + rec.nbytes
            info = SnapshotInfo(tag, time.time(), n, nbytes)
            txn.put(tag.encode(), json.dumps(vars(info)).encode(), db=cat.db["snapshots"])
            return info

        with self._ops.shared():
            self._flush()
            # A copy of the catalog as this commit left it: `tierstore fsck --repair` comes
            # back to it if the live catalog is lost (snapshots keep its extents in place).
            return cat.write(txn_snap, copy_to=os.path.join(self.path, CATALOG_COPY))

    def snapshots(self) -> list[SnapshotInfo]:
        self._check_open()
        with self._catalog.read() as txn:
            return [
                SnapshotInfo(**json.loads(raw))
                for _, raw in txn.cursor(db=self._catalog.db["snapshots"])
            ]

    def restore(self, tag: str) -> SnapshotInfo:
        """Make the live entries exactly the snapshot's (entries made since are removed).

        Unflushed puts are discarded with the rest of the live state, so nothing is
        written back first. It runs alone: operations that change entries or fill the
        cache wait for it, and it waits for those already running.
        """
        self._check_open()
        check_tag(tag)
        cat = self._catalog

        def txn_restore(txn: Any) -> tuple[list[tuple[int, int, int]], SnapshotInfo]:
            raw = txn.get(tag.encode(), db=cat.db["snapshots"])
            if raw is None:
                raise SnapshotError(f"no snapshot {tag!r}")
            saved = list(cat.iter_records(txn, db="snapentries", tag=tag))
            for _, _, rec in saved:  # take the snapshot's references before dropping the live ones
                cat.incref(txn, rec)
            freed = []
            for name, kind, rec in list(cat.iter_records(txn)):
                ext = cat.decref(txn, rec)
                if ext:
                    freed.append(ext)
                txn.delete(entry_key(name, kind), db=cat.db["entries"])
            for name, kind, rec in saved:
                txn.put(entry_key(name, kind), rec.encode(), db=cat.db["entries"])
            cat.put_meta(txn, "live_bytes", sum(r.nbytes for _, _, r in saved))
            return freed, SnapshotInfo(**json.loads(raw))

        with self._ops.exclusive():  # so no write-back is in flight
            self._tombstones.clear()
            freed, info = cat.write(txn_restore)
            self._alloc.release(freed)
            if self._cache is not None:  # cached copies are of versions the restore replaced
                for key in list(self._cache):
                    self._cache.invalidate(key)
        return info

    def drop_snapshot(self, tag: str) -> None:
        """Forget a snapshot; space only it held becomes free."""
        self._check_open()
        cat = self._catalog

        def txn_drop(txn: Any) -> list[tuple[int, int, int]]:
            if not txn.delete(tag.encode(), db=cat.db["snapshots"]):
                raise SnapshotError(f"no snapshot {tag!r}")
            freed = []
            for name, kind, rec in list(cat.iter_records(txn, db="snapentries", tag=tag)):
                ext = cat.decref(txn, rec)
                if ext:
                    freed.append(ext)
                txn.delete(tag.encode() + b"\0" + entry_key(name, kind), db=cat.db["snapentries"])
            return freed

        copy = os.path.join(self.path, CATALOG_COPY)
        # The copy is refreshed so it never lists a snapshot whose space may be reused.
        with self._ops.shared():
            self._alloc.release(cat.write(txn_drop, copy_to=copy if os.path.exists(copy) else None))

    # -- verification ---------------------------------------------------------------
    def fsck(self, progress: Callable[[int], None] | None = None) -> FsckReport:
        """Flush, then verify the backing tier: every checksum (live and snapshot versions),
        the reference counts and the free map. If the flush fails for lack of space, the
        committed state is still verified and the report notes what is unflushed. ``progress`` is called with the bytes verified so far."""
        from .fsck import check_store

        self._check_open()
        unflushed = None
        try:
            self.flush()
        except StoreFullError as e:  # a full store must still be checkable
            unflushed = e
        report = check_store(self, progress)
        if unflushed is not None:
            dirty = self._cache.stats().dirty_entries if self._cache is not None else 0
            report.notes.append(f"{dirty} entries are only in the host cache: {unflushed}")
        return report


# -- opening --------------------------------------------------------------------------
def _make_medium(path: str, backing: dict[str, Any], engine: str, io_threads: int,
                 fresh: bool) -> Medium:
    """The backing tier; ``fresh`` (no segment committed yet) lets a pmem pool be made."""
    kind = backing.get("kind", "nvme")
    if kind == "nvme":
        from tierstore.nvme import SlabMedium

        return SlabMedium(path, slab_bytes=backing["slab_bytes"], engine=engine, threads=io_threads)
    if kind == "pmem":
        from tierstore.pmem import PoolMedium

        exists = os.path.exists(backing["pool"])
        if not exists and not fresh:
            raise StoreError(f"pmem pool {backing['pool']} of store {path} is missing; the "
                             "store's data is there: restore the file (or mount its device)")
        return PoolMedium(backing["pool"], create=not exists, size=backing.get("pool_bytes"),
                          threads=io_threads)
    raise NotAStoreError(f"store {path} names an unknown backing tier {kind!r}")


def open_store(
    path: str | os.PathLike[str],
    *,
    create: bool = False,
    backing: str | None = None,
    slab_size: int | str = "1GiB",
    pmem_path: str | os.PathLike[str] | None = None,
    pmem_size: int | str | None = None,
    engine: str = "auto",
    io_threads: int = 8,
    chunk_size: int | str = "8MiB",
    map_size: int | str = "1GiB",
    host_cache: int | str | None = "1GiB",
    policy: str = "lfu-decay",
    policy_args: dict[str, Any] | None = None,
    device_budget: int | str | Mapping[str, int | str] | None = None,
    cache_arena: torch.Tensor | None = None,
) -> Store:
    """Open the store at ``path`` (``create=True`` makes it if missing).

    ``backing`` is ``"nvme"`` (slab files under the store directory, the default) or
    ``"pmem"`` (a libpmem pool at ``pmem_path`` of ``pmem_size``); it is recorded at
    creation, so reopening needs only the path. ``engine`` picks the NVMe I/O engine
    (``auto``: POSIX O_DIRECT; kvikio only when named, as it is unmeasured). ``host_cache`` is the host-memory
    cache's capacity (0 or None: no cache, every ``put`` is committed before it returns);
    ``policy`` names its eviction policy (``lfu-decay``, ``lru``, ``lfu``, ``arc``,
    ``semoe``) and ``policy_args`` its parameters. ``device_budget`` is the byte budget of
    the prefetch queues (:meth:`Store.prefetch`): one size for every device, or a mapping
    from a device (``"cpu"``, ``"cuda"``, ``"cuda:1"``) to its size; unset, it is 1 GiB on
    the CPU and half of a GPU's memory. Sizes take bytes or strings such as ``"2GiB"``.
    ``cache_arena`` is memory for the host cache's slots instead of a fresh allocation (a
    page-aligned flat uint8 tensor of at least ``host_cache`` bytes): the daemon passes a
    shared-memory mapping that its clients read.
    """
    path = os.path.abspath(os.fspath(path))
    marker = os.path.join(path, MARKER)
    chunk = parse_size(chunk_size)
    if chunk < ALIGNMENT or chunk % ALIGNMENT:
        raise StoreError(f"chunk_size must be a positive multiple of {ALIGNMENT}, got {chunk}")
    if engine not in ENGINES:  # checked for every backing: a typo is never ignored
        raise StoreError(f"unknown I/O engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if io_threads < 1:
        raise StoreError("io_threads must be >= 1")
    cache_bytes = parse_size(host_cache or 0)
    check_host_cache(cache_bytes)  # before anything is made or opened
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotAStoreError(f"{path} is a file, not a store directory")
    if not os.path.exists(marker):
        if not create:
            what = "does not exist" if not os.path.exists(path) else "is not a tierstore store"
            raise NotAStoreError(f"{path} {what} (create it with `tierstore init {path}`)")
        leftovers = set(os.listdir(path)) if os.path.isdir(path) else set()
        if leftovers - {CATALOG_DIR, LOCK, "slabs", MARKER + ".tmp"}:
            raise NotAStoreError(f"{path} is a non-empty directory that is not a store")
        init_dir(path, backing or "nvme", slab_size, pmem_path, pmem_size, map_size)
    meta = read_marker(path)
    if backing is not None and backing != meta["backing"]["kind"]:
        raise StoreError(f"store {path} is backed by {meta['backing']['kind']}, not {backing}")
    lock_fd = lock(path)
    catalog = medium = None
    try:
        catalog = Catalog(os.path.join(path, CATALOG_DIR), map_size=parse_size(map_size))
        check_identity(path, meta, catalog)
        with catalog.read() as txn:
            fresh = not catalog.segments(txn)
        medium = _make_medium(path, meta["backing"], engine, io_threads, fresh)
        return Store(path, catalog, medium, chunk_bytes=chunk, lock_fd=lock_fd,
                     io_threads=io_threads, host_cache=cache_bytes,
                     policy=policy, policy_args=policy_args, device_budget=device_budget,
                     cache_arena=cache_arena)
    except BaseException as e:
        if medium is not None:
            medium.close()
        if catalog is not None:
            catalog.close()
        os.close(lock_fd)
        if isinstance(e, PermissionError):
            raise StoreError(f"{e.filename or path}: permission denied; open the store as the "
                             "user who owns it, or make its files writable") from None
        raise


