"""The local store: a :class:`tierstore.Store` that owns its files, put together from its
parts (see ``local_state.py``): the read path, the write path, borrow and stage, snapshots.
This module holds what is left: setting the parts up, closing, the catalog queries and the
figures. Open one with :func:`tierstore.open` (``opening.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tierstore.cache import HostCache
from tierstore.nvme import IDLE_READ_BUFFER_BYTES, RecycledBuffers, StagingPool

from .alloc import ExtentAllocator
from .borrow import BorrowStage
from .catalog import Catalog, Gate, Record, entry_key
from .errors import EntryNotFoundError, StoreError, StoreFullError
from .fsck import check_store
from .interface import Capabilities, EntryInfo, FsckReport, Meta, Store, status_figures
from .keys import Key, as_key
from .local_state import TierStats
from .media import ALIGNMENT, Medium, missing_segments
from .prefetch import DeviceQueues
from .snapshots import SnapshotOps
from .tensors import dtype_from_name


class _OpsGate(Gate):
    """The store's operations gate (see ``local_state.py``), which also orders them against
    ``close()``: close holds it alone while the resources close, so an operation under way
    finishes first, and one that enters afterwards fails as on a closed store."""

    def __init__(self, store: LocalStore) -> None:
        super().__init__()
        self._store = store

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with super().shared():
            self._store._check_open()
            yield

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with super().exclusive():
            self._store._check_open()
            yield

    def closing(self) -> contextlib.AbstractContextManager[None]:
        """Alone, for close itself (no open check)."""
        return super().exclusive()


class LocalStore(BorrowStage, SnapshotOps, Store):
    """A store that owns its files. Open one with :func:`tierstore.open`; thread-safe."""

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
        # steady stream of reads does not fault fresh pages in for every entry. What sits
        # idle is part of the fixed overhead of the memory budget (docs/inference.md).
        self._results = RecycledBuffers(IDLE_READ_BUFFER_BYTES)
        self._seg_lock = threading.Lock()
        # Every operation that changes entries or fills the cache holds this shared;
        # restore() holds it alone, so no write-back or cache fill straddles a restore.
        self._ops: Gate = _OpsGate(self)
        # key -> version of its delete, written under the catalog's commit lock (delete())
        self._tombstones: dict[Key, int] = {}
        self._stats_lock = threading.Lock()
        self._tier = TierStats()
        self._closed = False
        with catalog.read() as txn:
            segments = catalog.segments(txn)
        try:
            medium.attach(segments)
        except ValueError as e:  # the backing tier's layout disagrees with the catalog
            raise StoreError(f"store {path}: {e}") from None
        missing = set(missing_segments(medium))
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

    # -- what the store is ------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        cached = self._cache is not None
        return Capabilities(zero_copy=cached, remote=False, backing=self._medium.kind,
                            host_cache=cached)

    @property
    def backing(self) -> str:
        return self._medium.kind

    def describe(self) -> str:
        """The backing tier and the engine or library that moves its bytes."""
        return f"{self._medium.kind}: {self._medium.describe()}"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def internals(self) -> StoreInternals:
        """Hooks for the daemon that serves this store (see :class:`StoreInternals`)."""
        return StoreInternals(self)

    # -- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        """Write back dirty entries and close the store.

        If the write-back fails (a full disk, say) the store stays open with every
        unflushed entry still in the host cache: free space and call ``close()`` (or
        ``flush()``) again.
        """
        if self._closed:
            return
        if self._cache is not None:
            self._flush_to_close(self.flush)
        try:
            # Queued transfers are cancelled and running ones land while the medium and
            # the chunk workers they read through are still open (they only read).
            self._queues.close()
        finally:
            # Operations under way (a read on another thread, say) end before the medium
            # closes under them; those that enter later raise StoreClosedError.
            with self._ops.closing():  # type: ignore[attr-defined]
                if not self._closed:
                    # What another thread put between the flush above and this point is
                    # written back now that no operation can start: nothing dirty is
                    # dropped. (The flush's own path takes no gate.)
                    if self._cache is not None and self._cache.stats().dirty_entries:
                        self._flush_to_close(self._flush)
                    self._closed = True
                    self._close_resources()

    def _flush_to_close(self, flush: Callable[[], None]) -> None:
        """``flush()``; if it fails, the store stays open, and the error says so."""
        try:
            flush()
        except StoreError as e:
            n = self._cache.stats().dirty_entries if self._cache is not None else 0
            raise type(e)(f"{e}; the store stays open and {n} unflushed entries stay in its "
                          "host cache: free space, then close() again") from e

    def _close_resources(self) -> None:
        self._cache = None  # its arena (and any pin on it) goes with the store, not later
        self._workers.shutdown(wait=True)
        self._results.close()
        self._medium.close()
        self._catalog.close()
        os.close(self._lock_fd)

    def tick(self) -> None:
        """Advance the cache policy's clock by one step (a training step, say)."""
        self._check_open()
        if self._cache is not None:
            self._cache.tick()

    # -- device prefetch ------------------------------------------------------------
    def _device_queues(self) -> DeviceQueues:
        self._check_open()
        return self._queues

    def _entry_nbytes(self, key: Key) -> int:
        """An entry's size, for the credits its transfer will take."""
        return self.info(*key).nbytes

    # -- catalog queries and figures ------------------------------------------------
    def __contains__(self, key: str | Key) -> bool:
        name, kind = as_key(key)
        self._check_open()
        if self._cache is not None and self._cache.peek((name, kind)) is not None:
            return True
        with self._catalog.read() as txn:
            return self._catalog.get_record(txn, name, kind) is not None

    def keys(self, prefix: str = "") -> list[Key]:
        """Every (name, kind) whose name starts with ``prefix``, sorted by name then kind
        (entries not yet written back from the host cache included)."""
        self._check_open()
        with self._catalog.read() as txn:
            found = {(n, k) for n, k, _ in self._catalog.iter_records(txn, prefix)}
        if self._cache is not None:
            found.update(key for key in self._cache.dirty_keys() if key[0].startswith(prefix))
        return sorted(found, key=lambda nk: entry_key(*nk))

    def _info(self, name: str, kind: str) -> EntryInfo:
        """dtype, shape, size, version, checksum and location. An entry whose newest
        version is still only in the host cache has tier ``"host"``, no path and no
        checksum yet."""
        cache = self._cache
        cached = cache.peek((name, kind)) if cache is not None else None
        if cache is not None and cached is None:
            # A miss settles under the key lock, after any delete in progress: a delete
            # takes the cached version before its commit, and until then the catalog
            # holds an older one (see ReadPath._host_bytes).
            with self._key_locks([(name, kind)]):
                return self._info_of(name, kind, cache.peek((name, kind)))
        return self._info_of(name, kind, cached)

    def _info_of(self, name: str, kind: str, cached: tuple[Meta, bool] | None) -> EntryInfo:
        """``info`` from the cache's (meta, dirty) for the key where the newest version is
        there only, else from the catalog."""
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

    def status(self) -> dict[str, Any]:
        """The store, its backing tier and, as the daemon's status reports them, its hit
        rate, bytes per tier and prefetch queue depths."""
        stats = self.stats()
        return {"pid": os.getpid(), "store": self.path, "backend": self.describe(),
                **status_figures(stats, self._medium.kind, stats["prefetch"].values())}

    # -- verification ---------------------------------------------------------------
    def fsck(self, progress: Callable[[int], None] | None = None, *,
             set_aside: Collection[str] = ()) -> FsckReport:
        """Flush, then verify the backing tier: every checksum (live and snapshot versions),
        the reference counts and the free map. If the flush fails for lack of space, the
        committed state is still verified and the report notes what is unflushed.
        ``progress`` is called with the bytes verified so far. ``set_aside``: files a
        repair is about to move away (:func:`tierstore.fsck.check_store`)."""
        self._check_open()
        unflushed = None
        try:
            self.flush()
        except StoreFullError as e:  # a full store must still be checkable
            unflushed = e
        with self._ops.shared():  # close() waits for the check; writes go on beside it
            report = check_store(self.path, self._catalog, self._medium,
                                 self._verify_record, progress, alloc=self._alloc,
                                 set_aside=set_aside)
        if unflushed is not None:
            dirty = self._cache.stats().dirty_entries if self._cache is not None else 0
            report.notes.append(f"{dirty} entries are only in the host cache: {unflushed}")
        return report


class StoreInternals:
    """What the daemon (``tierstore/daemon/server.py``) uses of a local store beyond the
    :class:`~tierstore.Store` interface: it hands its clients the host cache's slots, so it
    needs the cache itself and the pinned host bytes behind a get. Not for applications:
    these follow the store's layout, not the interface."""

    __slots__ = ("_store",)

    def __init__(self, store: LocalStore) -> None:
        self._store = store

    @property
    def cache(self) -> HostCache | None:
        """The host cache (None without one, and once the store is closed)."""
        return self._store._cache

    def host_bytes(self, keys: list[Key]
                   ) -> tuple[dict[Key, tuple[Meta, np.ndarray | torch.Tensor]], list[Any]]:
        """Every key's bytes in host memory, pinned until the returned handles are
        released: a cache slot (a tensor) or, where the cache took none, a buffer of its
        own (an array). The keys must be valid ones."""
        return self._store._host_bytes(keys)
