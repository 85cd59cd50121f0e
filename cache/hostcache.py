"""A byte-capacity host-memory cache over one (pinned) allocation.

Life of an entry:

    h = cache.lookup(key)                 # hit: a pinned handle; miss: None
    if h is None:
        h = cache.insert(key, nbytes, meta)   # None: not cached (refused, or no room)
        if h is not None and h.new:
            read the bytes into h.view        # h.view is the slot, a uint8 tensor
            cache.publish(h)                  # now other threads can see it
    ... use h.view; after changing it: cache.mark_dirty(key, meta)
    cache.release(h)                      # or `with h:`; unpinned entries may be evicted

Pinning is a reference count: an entry with pins is never evicted. A lookup of an entry that
another thread is still loading waits until it is published (so one read from the backing
tier serves every thread), and a lookup of an entry being evicted waits until its write-back
is done and then misses, so the caller reads what was just written back, not stale bytes.
So a thread must publish (or release) a new handle before it looks up or inserts that same
key again, or it would wait on itself.

An insert that must evict dirty entries writes them back without holding the cache's lock;
``writeback`` explains how their slots stay safe meanwhile. ``slots`` holds the cache's
state and the records it hands out (``Handle``, ``CacheStats``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from .slab import PAGE
from .slots import (
    _EVICTING,
    _LOADING,
    _READY,
    CacheStats,
    Handle,
    Key,
    WriteBack,
    WriteBackMany,
    _Entry,
)
from .writeback import WriteBackCache, _Pending

__all__ = ["CacheStats", "Handle", "HostCache", "WriteBack", "WriteBackMany"]


class HostCache(WriteBackCache):
    """A thread-safe byte-capacity cache of entries in one host allocation.

    ``policy`` is a name from ``cache.POLICIES`` (built with ``policy_args``) or a ``Policy``
    instance. ``writeback`` persists dirty victims; without it dirty entries are never
    evicted (only ``flush`` with an explicit callback writes them). ``pin_memory``: True
    page-locks the arena now, False never, None (the default) once a CUDA consumer exists
    (:func:`cache.pinned.cuda_consumer`). The arena is ``capacity_bytes`` rounded down to 4 KiB
    and exactly that much is allocated and pinned;
    ``arena``, if given, is the memory to use instead of a fresh allocation (a page-aligned
    flat uint8 tensor, e.g. over a shared-memory mapping; it is not pinned).
    """

    # lookups
    def lookup(self, key: Key) -> Handle | None:
        """A pinned handle on a hit (waiting for a loading entry), None on a miss."""
        with self._cond:
            entry = self._wait_settled(key)
            if entry is None:
                self._misses += 1
                return None
            self._hits += 1
            self._policy.record_hit(key)
            return self._pin(entry, new=False)

    def lookup_many(self, keys: list[Key]) -> list[Handle | None]:
        """:meth:`lookup` of several keys under one acquisition of the lock."""
        out: list[Handle | None] = []
        hit: list[Key] = []
        entries = self._entries
        with self._cond:
            for key in keys:
                entry = entries.get(key)
                if entry is not None and entry.state != _READY:
                    # Waiting lets other threads in (an invalidate, say): the hits so far
                    # are recorded first, while their keys are surely in the policy.
                    self._policy.record_hits(hit)
                    self._hits += len(hit)
                    hit.clear()
                    entry = self._wait_settled(key)
                if entry is None:
                    self._misses += 1
                    out.append(None)
                    continue
                hit.append(key)
                entry.pins += 1
                out.append(Handle(self, entry, self._view(entry), False))
            self._hits += len(hit)
            self._policy.record_hits(hit)
        return out

    def renew_many(self, handles: list[Handle], metas: list[Any]) -> bool:
        """Pin released handles again, as a lookup of their keys would, if each entry is
        still the cached one with ``metas``' meta (same slot, same layout); else pin none
        and return False. Cheaper than a lookup for a reader that takes the same entries
        again and again (a ring's layer): no new handles, the views it holds stay valid."""
        entries = self._entries
        with self._cond:
            for h, meta in zip(handles, metas, strict=True):
                entry = h._entry
                # Still indexed means not invalidated or evicted (both unindex first).
                if (not h._released or entry.state != _READY or entry.meta is not meta
                        or entries.get(entry.key) is not entry):
                    return False
            keys = []
            for h in handles:
                h._entry.pins += 1
                h._released = False
                h.new = False
                keys.append(h._entry.key)
            self._hits += len(keys)
            self._policy.record_hits(keys)
        return True

    def __contains__(self, key: object) -> bool:
        with self._cond:
            entry = self._entries.get(key)
            return entry is not None and entry.state != _EVICTING

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    # inserts
    def insert(self, key: Key, nbytes: int, meta: Any = None, *, data: Any = None) -> Handle | None:
        """Make room for ``key`` and return a pinned handle on its slot, or None.

        None means the entry is not cached: the policy refused it, or no evictable entries
        could free a slot (all pinned, or ``nbytes`` exceeds the largest slot). If ``key`` is
        already cached, its existing entry is returned (``new`` false; do not refill it).
        With ``data`` (bytes-like or a tensor of ``nbytes`` bytes) a new slot is filled and
        published before returning; ``data`` for a key that is already cached is an error
        (``invalidate`` or ``overwrite`` it), never silently dropped.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._cond:
            outcome = self._begin_insert(key, nbytes, meta)
        if isinstance(outcome, _Pending):
            outcome = self._write_back_victims(outcome)
        if outcome is not None and not outcome.new and data is not None:
            outcome.release()
            raise ValueError(f"{key!r} is already cached: invalidate or overwrite it to "
                             "store new bytes")
        if outcome is not None and outcome.new and data is not None:
            try:
                _fill(outcome.view, data)
            except BaseException:
                self.invalidate(key)
                outcome.release()
                raise
            self.publish(outcome)
        return outcome

    # staged versions
    def stage(self, key: Key, nbytes: int, *, data: Any = None) -> Handle | None:
        """A fresh slot for the next version of ``key``, invisible to lookups until
        :meth:`commit_staged` (``None``: not cached, as for :meth:`insert`).

        The caller writes the new bytes straight into ``handle.view`` (no copy through a
        buffer of its own), or passes them as ``data`` (copied in here), then commits or
        discards. Until the commit, readers keep seeing the current version, so a writer
        that fails half-way leaves nothing behind; the commit swaps the versions in one
        step, so the key is never missing from the cache meanwhile.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._cond:
            outcome = self._begin_insert(key, nbytes, None, staged=True)
        if isinstance(outcome, _Pending):
            outcome = self._write_back_victims(outcome)
        if outcome is not None and data is not None:
            try:
                _fill(outcome.view, data)
            except BaseException:
                self.discard_staged(outcome)
                raise
        return outcome

    def stage_many(self, items: list[tuple[Key, int]]) -> list[Handle | None]:
        """:meth:`stage` of several ``(key, nbytes)`` at once: one acquisition of the lock
        for all of them, unless making room means writing dirty victims back."""
        with self._cond:
            outcomes = [self._begin_insert(key, int(nbytes), None, staged=True)
                        for key, nbytes in items]
        return self._write_back_pendings(outcomes)

    def _write_back_pendings(self, outcomes: list[Any]) -> list[Handle | None]:
        """Finish each outcome of ``_begin_insert``; if one write-back fails, the pendings
        after it are aborted too (never left evicting) before the error is raised."""
        out: list[Handle | None] = []
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, _Pending):
                try:
                    outcome = self._write_back_victims(outcome)
                except BaseException:
                    with self._cond:
                        for rest in outcomes[i + 1:]:
                            if isinstance(rest, _Pending):
                                for entry, _ in rest.ahead:
                                    self._unpin(entry)
                                self._abort(rest)
                                self._captures -= 1
                    for handle in out + outcomes[i + 1:]:
                        if isinstance(handle, Handle):
                            self.discard_staged(handle)
                    raise
            out.append(outcome)
        return out

    def commit_staged(self, handle: Handle, meta: Any = None, *, dirty: bool = True) -> None:
        """Make a staged slot ``key``'s current, dirty version (``meta`` its metadata;
        clean with ``dirty=False``: bytes the backing tier holds already).

        The version it replaces leaves the index at once; readers still holding it keep its
        slot until they release it. A same-sized replacement counts as an access to the
        key (its frequency history stays); otherwise the key is removed and re-inserted.
        """
        with self._cond:
            self._commit_staged_locked(handle, meta, dirty)

    def commit_staged_many(self, pairs: list[tuple[Handle, Any]]) -> None:
        """:meth:`commit_staged` of several ``(handle, meta)`` under one lock acquisition."""
        with self._cond:
            for handle, meta in pairs:
                self._commit_staged_locked(handle, meta, True)

    def _commit_staged_locked(self, handle: Handle, meta: Any, dirty: bool) -> None:
        entry = handle._entry
        if not entry.staged or handle._released:
            raise RuntimeError(f"{handle!r} is not a staged, unreleased slot")
        key = entry.key
        old = self._wait_settled(key)
        if old is not None:
            self._unindex(old)
            self._let_go(old)
            if old.nbytes == entry.nbytes:
                self._policy.record_hit(key)
            else:
                self._policy.record_remove(key, evicted=False)
                self._policy.record_insert(key, entry.nbytes)
        else:
            self._policy.record_insert(key, entry.nbytes)
        entry.staged = False
        entry.state = _READY
        self._entries[key] = entry
        self._set_dirty(entry, dirty)
        entry.gen += 1
        entry.meta = meta
        handle._released = True
        entry.pins -= 1
        self._cond.notify_all()

    def discard_staged(self, handle: Handle) -> None:
        """Give a staged slot back without making it a version of anything."""
        entry = handle._entry
        with self._cond:
            if handle._released:
                return
            if not entry.staged:
                raise RuntimeError(f"{handle!r} is not a staged slot")
            handle._released = True
            self._drop_staged(entry)

    def _drop_staged(self, entry: _Entry) -> None:
        entry.pins -= 1
        entry.staged = False
        self._let_go(entry)
        self._cond.notify_all()

    # handles
    def publish(self, handle: Handle) -> None:
        """Make a new entry visible to lookups (its bytes are in place)."""
        with self._cond:
            if handle._entry.state == _LOADING:
                handle._entry.state = _READY
                self._cond.notify_all()

    def release(self, handle: Handle) -> None:
        """Unpin; releasing a new, unpublished handle publishes it."""
        with self._cond:
            self._release_locked(handle)
            self._cond.notify_all()

    def _release_locked(self, handle: Handle) -> None:
        if handle._released:
            raise RuntimeError(f"handle for {handle.key!r} released twice")
        handle._released = True
        entry = handle._entry
        if entry.staged:  # released instead of committed: the slot was never a version
            self._drop_staged(entry)
            return
        entry.pins -= 1
        if entry.state == _LOADING and handle.new:
            entry.state = _READY
        if entry.gone and entry.pins == 0:
            self._free_slot(entry)

    def release_many(self, handles: list[Handle]) -> None:
        """:meth:`release` of several handles under one acquisition of the lock."""
        with self._cond:
            for handle in handles:
                self._release_locked(handle)
            self._cond.notify_all()

    # dirty state
    def overwrite(self, key: Key, data: Any, meta: Any = None, *, dirty: bool = True) -> bool:
        """Replace a resident entry's bytes in its own slot and mark it dirty (clean with
        ``dirty=False``: bytes the backing tier holds already); False (nothing done) unless
        the entry is resident, settled, unpinned and of the same size.

        Cheaper than ``invalidate`` + ``insert`` (no slot changes hands) and it counts as an
        access, so a rewritten entry keeps its frequency history. Nobody holds the old bytes
        (no pins), and the entry is hidden from lookups while it is refilled, so no reader
        can see a mix of old and new bytes.
        """
        with self._cond:
            entry = self._entries.get(key)
            if (entry is None or entry.state != _READY or entry.pins
                    or entry.nbytes != _nbytes_of(data)):
                return False
            self._retire(entry)  # before a byte changes
            entry.state = _LOADING
            entry.pins = 1
            self._policy.record_hit(key)
        try:
            _fill(self._view(entry), data)
        except BaseException:
            with self._cond:  # bytes are half old, half new: drop them
                entry.state = _READY
                entry.pins -= 1
            self.invalidate(key)
            raise
        with self._cond:
            entry.state = _READY
            entry.pins -= 1
            self._set_dirty(entry, dirty)
            entry.gen += 1
            if meta is not None:
                entry.meta = meta
            self._cond.notify_all()
        return True

    def mark_dirty(self, key: Key, meta: Any = None) -> None:
        """Record that ``key``'s bytes changed (``meta``, if given, replaces its metadata)."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is None or entry.state == _EVICTING:
                raise KeyError(key)
            self._retire(entry)
            self._set_dirty(entry, True)
            entry.gen += 1
            if meta is not None:
                entry.meta = meta

    def clean(self, key: Key) -> None:
        """Record that ``key`` was written back by the caller (no-op if not cached)."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                self._set_dirty(entry, False)

    def dirty_keys(self) -> list[Key]:
        with self._cond:
            return [k for k, e in self._entries.items() if e.dirty]

    def peek(self, key: Key) -> tuple[Any, bool] | None:
        """(meta, dirty) of a resident entry without counting an access; None if absent.

        An entry being evicted is waited for: until its write-back has committed, neither
        the cache nor the backing tier would otherwise answer for it.
        """
        with self._cond:
            while True:
                entry = self._entries.get(key)
                if entry is None:
                    return None
                if entry.state != _EVICTING:
                    return entry.meta, entry.dirty
                self._cond.wait()

    def invalidate(self, key: Key) -> bool:
        """Drop ``key`` without writing it back; its slot is freed once unpinned."""
        with self._cond:
            while True:
                entry = self._entries.get(key)
                if entry is None:
                    return False
                if entry.state != _EVICTING:
                    break
                self._cond.wait()
            self._unindex(entry)
            self._policy.record_remove(key, evicted=False)
            entry.dirty = False
            self._let_go(entry)
            self._cond.notify_all()
            return True

    # watching entries from outside (the daemon's lock-free index)
    def on_retire(self, callback: Callable[[Any], None] | None) -> None:
        """Call ``callback(token)``, under the cache's lock, when a watched entry retires:
        when it stops being its key's current version or before its bytes can change
        (eviction, invalidation, a newer version, an in-place overwrite, a freed slot)."""
        with self._cond:
            self._on_retire = callback

    def watch(self, handle: Handle, publish: Callable[[int, int], Any]) -> Any:
        """Watch ``handle``'s entry: ``publish(offset, nbytes)`` runs under the lock and its
        result is the token ``on_retire`` will get. Returns the entry's token (the one from
        an earlier watch if it has one), or None if the entry is not the current, settled
        version of its key (nothing is published then)."""
        entry = handle._entry
        with self._cond:
            if (self._on_retire is None or entry.gone or entry.staged or entry.state != _READY
                    or self._entries.get(entry.key) is not entry):
                return None
            if entry.watch is None:
                entry.watch = publish(entry.start * PAGE, entry.nbytes)
            return entry.watch

    def record_hits(self, keys: Iterable[Key]) -> int:
        """Count hits served without a lookup (readers of watched entries); keys no longer
        resident are skipped. Returns the number counted."""
        n = 0
        with self._cond:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.state == _READY:
                    self._hits += 1
                    self._policy.record_hit(key)
                    n += 1
        return n

    # clock and counters
    def tick(self) -> None:
        """Advance the policy's external clock (one training step, say)."""
        with self._cond:
            self._policy.tick()

    def keys(self) -> list[Key]:
        """The cached keys (a snapshot)."""
        with self._cond:
            return [k for k, e in self._entries.items() if e.state != _EVICTING]

    def __iter__(self) -> Iterator[Key]:
        return iter(self.keys())

    def stats(self) -> CacheStats:
        with self._cond:
            accesses = self._hits + self._misses
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                hit_rate=self._hits / accesses if accesses else 0.0,
                evictions=self._evictions,
                writebacks=self._writebacks,
                admissions_refused=self._refused,
                no_room=self._no_room,
                entries=len(self._entries) - self._n_evicting,
                dirty_entries=self._n_dirty,
                bytes_resident=self._bytes_resident,
                bytes_allocated=self._alloc.allocated_pages * PAGE,
                capacity_bytes=self.capacity_bytes,
            )


def _fill(view: torch.Tensor, data: Any) -> None:
    """Copy ``data`` (a tensor or a bytes-like object) into a slot view of the same size."""
    if isinstance(data, torch.Tensor):
        src = data.detach().contiguous().view(torch.uint8).reshape(-1)
        if src.numel() != view.numel():
            raise ValueError(f"data has {src.numel()} bytes, the entry {view.numel()}")
        view.copy_(src)
        return
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        src = data
    else:
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if src.size != view.numel():
        raise ValueError(f"data has {src.size} bytes, the entry {view.numel()}")
    view.numpy()[:] = src


def _nbytes_of(data: Any) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return memoryview(data).nbytes
