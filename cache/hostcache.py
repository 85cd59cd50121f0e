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

Keeping a dirty victim's slot safe during write-back, without holding the lock:
1. Under the lock the policy picks victims and the allocator *claims* the block the new
   entry will occupy: the block's free fragments leave the free lists and the victims are
   marked EVICTING, which makes them unevictable, unpinnable and invisible to lookups
   (callers wait on them). Their slots stay allocated, so no other insert can be given them.
2. The lock is dropped and ``writeback(key, view, meta)`` runs for each dirty victim on its
   intact slot; other threads keep using the cache meanwhile.
3. Under the lock again the claim is committed: the victims' slots become the new entry's,
   and threads waiting on the victims wake up and miss.
If a write-back raises, step 3 is replaced by undoing step 1 (victims resident again, the
ones already written back marked clean) and the error reaches the inserting caller.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .pinned import HostArena, arena_tensor
from .policies import Policy, make_policy
from .slab import PAGE, BuddyAllocator, Claim

__all__ = ["CacheStats", "Handle", "HostCache", "WriteBack", "WriteBackMany"]

Key = Hashable
#: ``writeback(key, view, meta)``: persist ``view`` (the entry's bytes) to the backing tier.
WriteBack = Callable[[Key, torch.Tensor, Any], None]
#: ``many([(key, view, meta), ...])``: persist several entries at once (one commit).
WriteBackMany = Callable[[list[tuple[Key, torch.Tensor, Any]]], None]

_LOADING, _READY, _EVICTING = "loading", "ready", "evicting"


class _Entry:
    __slots__ = ("key", "nbytes", "start", "meta", "dirty", "gen", "pins", "state", "gone",
                 "staged", "watch", "memo", "slot_view")

    def __init__(self, key: Key, nbytes: int, meta: Any) -> None:
        self.key = key
        self.nbytes = nbytes
        self.start = -1  # page offset of the slot; -1 while the slot is being freed for it
        self.meta = meta
        self.dirty = False
        self.gen = 0  # bumped by mark_dirty, so a flush never cleans a newer write
        self.pins = 0
        self.state = _LOADING
        self.gone = False  # invalidated (or evicted): no longer in the index
        self.staged = False  # a slot for a next version, indexed only by commit_staged
        self.watch: Any = None  # the token of a watch() on it, until it retires
        self.memo: Any = None  # the caller's, for the entry's life (see Handle.memo)
        self.slot_view: torch.Tensor | None = None  # see HostCache._view


class Handle:
    """A pinned reference to a cached entry; ``view`` is its bytes as a uint8 tensor.

    ``new`` is true when ``insert`` allocated the slot: the caller fills ``view`` and then
    publishes (``publish`` or ``release``). Release exactly once.
    """

    __slots__ = ("_cache", "_entry", "view", "new", "_released")

    def __init__(self, cache: HostCache, entry: _Entry, view: torch.Tensor, new: bool) -> None:
        self._cache = cache
        self._entry = entry
        self.view = view
        self.new = new
        self._released = False

    @property
    def key(self) -> Key:
        return self._entry.key

    @property
    def memo(self) -> Any:
        """Whatever the caller stored with the entry (e.g. a typed view of its slot, which
        is valid as long as the entry: its slot never moves). None until set."""
        return self._entry.memo

    @memo.setter
    def memo(self, value: Any) -> None:
        self._entry.memo = value

    @property
    def nbytes(self) -> int:
        return self._entry.nbytes

    @property
    def meta(self) -> Any:
        return self._entry.meta

    def release(self) -> None:
        self._cache.release(self)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        return f"Handle({self.key!r}, nbytes={self.nbytes}, new={self.new})"


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters."""

    hits: int
    misses: int
    hit_rate: float
    evictions: int
    writebacks: int
    admissions_refused: int  # the policy declined a missed key
    no_room: int  # nothing evictable could make room (pinned, too large, claimed)
    entries: int
    dirty_entries: int
    bytes_resident: int  # sum of the cached entries' nbytes
    bytes_allocated: int  # sum of their slot sizes (>= bytes_resident, <= capacity)
    capacity_bytes: int


@dataclass
class _Pending:
    """An insert waiting for its victims' write-backs (see the module docstring)."""

    entry: _Entry
    order: int
    victims: list[_Entry]
    claim: Claim | None
    written: list[_Entry]
    ahead: list[tuple[_Entry, int]] = field(default_factory=list)  # (entry, gen), pinned


class HostCache:
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

    def __init__(
        self,
        capacity_bytes: int,
        policy: str | Policy = "lfu-decay",
        policy_args: dict[str, Any] | None = None,
        writeback: WriteBack | None = None,
        pin_memory: bool | None = None,
        arena: torch.Tensor | None = None,
        writeback_many: WriteBackMany | None = None,
        writeback_batch: int = 64 << 20,
    ) -> None:
        self._alloc = BuddyAllocator(capacity_bytes)
        self.capacity_bytes = self._alloc.pages * PAGE
        self._host: HostArena | None = None
        if arena is not None:
            # Memory the caller owns (a shared-memory mapping that other processes read).
            self._arena = _check_arena(arena, self.capacity_bytes)
        else:
            # Exactly capacity_bytes, page-aligned (O_DIRECT and GDS read straight into a
            # slot), page-locked by cudaHostRegister only once a CUDA consumer exists: see
            # cache.pinned for why not torch's pinned allocator.
            self._arena, self._host = arena_tensor(self.capacity_bytes, pin_memory)
        if isinstance(policy, Policy):
            if policy_args:
                raise ValueError("policy_args apply only when the policy is given by name")
            self._policy = policy
        else:
            self._policy = make_policy(policy, **(policy_args or {}))
        self._policy.attach(self.capacity_bytes)
        self._writeback = writeback
        # With a batch callback, an eviction that must write a dirty victim also cleans the
        # next dirty entries in eviction order, up to this many bytes, in the same call (one
        # commit): later evictions then find clean victims instead of each paying a commit.
        self._writeback_many = writeback_many if writeback is not None else None
        self._writeback_batch = max(0, int(writeback_batch))
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[Key, _Entry] = {}
        self._by_start: dict[int, _Entry] = {}
        self._hits = self._misses = self._evictions = self._writebacks = 0
        self._refused = self._no_room = 0
        self._bytes_resident = 0
        # Kept up to date as entries change, so stats() costs O(1) under the lock.
        self._n_dirty = self._n_evicting = 0
        self._captures = 0  # write-backs that hold entries and have not finished
        self._on_retire: Callable[[Any], None] | None = None

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked for CUDA (so far: lazily pinned arenas become
        pinned when a CUDA consumer appears)."""
        return self._host is not None and self._host.pinned

    @property
    def arena(self) -> torch.Tensor:
        """The whole slot arena (uint8): a slot's offset is its view's distance from it."""
        return self._arena

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

    def _wait_settled(self, key: Key) -> _Entry | None:
        """The READY entry for ``key`` once nothing is in flight for it; None if absent."""
        while True:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.state == _READY:
                return entry
            self._cond.wait()

    def _pin(self, entry: _Entry, new: bool) -> Handle:
        entry.pins += 1
        return Handle(self, entry, self._view(entry), new)

    def _view(self, entry: _Entry) -> torch.Tensor:
        # Made once per slot: slicing the arena costs more than the rest of a hit.
        view = entry.slot_view
        if view is None:
            offset = entry.start * PAGE
            view = self._arena[offset : offset + entry.nbytes]
            if entry.start >= 0:  # an entry's slot, once given, never moves
                entry.slot_view = view
        return view

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

    def _begin_insert(self, key: Key, nbytes: int, meta: Any,
                      staged: bool = False) -> Handle | _Pending | None:
        policy = self._policy
        if staged:
            # A next version of a resident key needs no admission: the key is cached
            # already and commit_staged swaps the slots.
            resident = key in self._entries
        else:
            existing = self._wait_settled(key)
            if existing is not None:
                policy.record_hit(key)
                return self._pin(existing, new=False)
            resident = False
        if not resident:
            policy.record_miss(key, nbytes)
        order = BuddyAllocator.order_for(nbytes)
        if order > self._alloc.max_order:
            self._no_room += 1
            return None
        plan = self._plan(key, order)
        if plan is None:
            self._no_room += 1
            return None
        victims, block = plan
        if not resident and not policy.admit(key, nbytes, [v.key for v in victims]):
            self._refused += 1
            return None
        claim = self._alloc.claim(*block) if block is not None else None
        entry = _Entry(key, nbytes, meta)
        entry.pins = 1
        if claim is None:
            start = self._alloc.alloc(order)
            if start is None:  # only when a forced-eviction policy gave no usable block
                self._no_room += 1
                return None
            entry.start = start
            self._by_start[start] = entry
        for victim in victims:
            policy.record_remove(victim.key, evicted=True)
            victim.state = _EVICTING
            self._n_evicting += 1
        if staged:
            entry.staged = True
        else:
            policy.record_insert(key, nbytes)
            self._entries[key] = entry
        self._bytes_resident += nbytes
        pending = _Pending(entry, order, victims, claim, [])
        if any(v.dirty for v in victims):
            if self._writeback_many is not None:
                pending.ahead = self._clean_ahead(victims)
            self._captures += 1  # until _write_back_victims ends
            return pending
        return self._complete(pending)

    def _plan(self, key: Key, order: int) -> tuple[list[_Entry], tuple[int, int] | None] | None:
        """Victims to evict and the block they free for an ``order`` slot (None: allocate)."""
        fits = self._alloc.can_alloc(order)
        policy = self._policy
        if not policy.evict_first(fits):
            return [], None
        candidates = policy.candidates(key, self._evictable)
        if policy.evicts_all:
            victims = [self._entries[k] for k in candidates]
            starts = {v.start for v in victims}
            for victim in victims:
                block = self._alloc.anchor(victim.start, order)
                occupants = self._alloc.occupants(*block) if block is not None else None
                if occupants is not None and starts.issuperset(occupants):
                    return victims, block
            return (victims, None) if fits else None
        for k in candidates:
            victim = self._entries[k]
            block = self._alloc.anchor(victim.start, order)
            if block is None:
                continue
            occupants = self._alloc.occupants(*block)
            if occupants is None:
                continue
            others = [self._by_start[s] for s in occupants if s != victim.start]
            if all(self._entry_evictable(o) for o in others):
                return [victim, *others], block
        return None

    def _evictable(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and self._entry_evictable(entry)

    def _entry_evictable(self, entry: _Entry) -> bool:
        return (
            entry.state == _READY
            and entry.pins == 0
            and not entry.gone
            and (not entry.dirty or self._writeback is not None)
        )

    def _clean_ahead(self, victims: list[_Entry], scan: int = 512) -> list[tuple[_Entry, int]]:
        """Dirty entries next in eviction order (at most ``scan`` looked at) whose bytes fit
        the write-back batch besides the victims'; pinned, with their generation."""
        budget = self._writeback_batch - sum(v.nbytes for v in victims if v.dirty)
        taken: list[tuple[_Entry, int]] = []
        if budget <= 0:
            return taken
        for key in itertools.islice(self._policy.candidates(None, self._evictable), scan):
            entry = self._entries[key]
            if not entry.dirty or entry.nbytes > budget:
                continue
            entry.pins += 1
            taken.append((entry, entry.gen))
            budget -= entry.nbytes
            if budget < PAGE:
                break
        return taken

    def _write_back_victims(self, pending: _Pending) -> Handle:
        """Run the dirty victims' write-backs without the lock, then finish the insert."""
        writeback = self._writeback
        assert writeback is not None  # dirty entries are evictable only with a callback
        try:
            dirty = [v for v in pending.victims if v.dirty]
            if self._writeback_many is not None:
                self._writeback_many(
                    [(e.key, self._view(e), e.meta) for e in dirty]
                    + [(e.key, self._view(e), e.meta) for e, _ in pending.ahead])
                pending.written.extend(dirty)
            else:
                for victim in dirty:
                    writeback(victim.key, self._view(victim), victim.meta)
                    pending.written.append(victim)
        except BaseException:
            with self._cond:
                for entry, _ in pending.ahead:
                    self._unpin(entry)
                self._abort(pending)
                self._captures -= 1
            raise
        if pending.ahead:
            self._cleaned(pending.ahead)
        with self._cond:
            self._captures -= 1
            return self._complete(pending)

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

    def writebacks_in_flight(self) -> bool:
        """Whether any write-back has taken entries and not yet finished (a flush, or an
        eviction's): while none has, no entry's old bytes can still reach the backing tier."""
        with self._cond:
            return self._captures > 0

    def _complete(self, pending: _Pending) -> Handle:
        entry, claim = pending.entry, pending.claim
        for victim in pending.victims:
            if self._entries.get(victim.key) is victim:
                self._unindex(victim)
            victim.gone = True
            self._retire(victim)
            self._bytes_resident -= victim.nbytes
            del self._by_start[victim.start]
            inside = claim is not None and (
                claim.start <= victim.start < claim.start + (1 << claim.order)
            )
            if not inside:
                self._alloc.free(victim.start)
        if claim is not None:
            entry.start = self._alloc.commit(claim, pending.order)
            self._by_start[entry.start] = entry
        self._evictions += len(pending.victims)
        self._writebacks += len(pending.written)
        self._cond.notify_all()
        return Handle(self, entry, self._view(entry), new=True)

    def _abort(self, pending: _Pending) -> None:
        entry = pending.entry
        for victim in pending.victims:
            victim.state = _READY
            self._n_evicting -= 1
            self._policy.record_insert(victim.key, victim.nbytes)
        for victim in pending.written:
            self._set_dirty(victim, False)
        self._writebacks += len(pending.written)
        if pending.claim is not None:
            self._alloc.cancel(pending.claim)
        self._free_slot(entry)  # a slot it was given up front (no claim), if any
        if self._entries.get(entry.key) is entry:
            self._unindex(entry)
            self._policy.record_remove(entry.key, evicted=True)
            self._bytes_resident -= entry.nbytes
        elif entry.staged:
            self._bytes_resident -= entry.nbytes
        entry.gone = True
        self._cond.notify_all()

    # staged versions
    def stage(self, key: Key, nbytes: int) -> Handle | None:
        """A fresh slot for the next version of ``key``, invisible to lookups until
        :meth:`commit_staged` (``None``: not cached, as for :meth:`insert`).

        The caller writes the new bytes straight into ``handle.view`` (no copy through a
        buffer of its own), then commits or discards. Until the commit, readers keep
        seeing the current version, so a writer that fails half-way leaves nothing behind.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._cond:
            outcome = self._begin_insert(key, nbytes, None, staged=True)
        if isinstance(outcome, _Pending):
            outcome = self._write_back_victims(outcome)
        return outcome

    def stage_many(self, items: list[tuple[Key, int]]) -> list[Handle | None]:
        """:meth:`stage` of several ``(key, nbytes)`` at once: one acquisition of the lock
        for all of them, unless making room means writing dirty victims back."""
        with self._cond:
            outcomes = [self._begin_insert(key, int(nbytes), None, staged=True)
                        for key, nbytes in items]
        return self._write_back_pendings(outcomes)

    def commit_staged(self, handle: Handle, meta: Any = None) -> None:
        """Make a staged slot ``key``'s current, dirty version (``meta`` its metadata).

        The version it replaces leaves the index at once; readers still holding it keep its
        slot until they release it. A same-sized replacement counts as an access to the
        key (its frequency history stays); otherwise the key is removed and re-inserted.
        """
        with self._cond:
            self._commit_staged_locked(handle, meta)

    def commit_staged_many(self, pairs: list[tuple[Handle, Any]]) -> None:
        """:meth:`commit_staged` of several ``(handle, meta)`` under one lock acquisition."""
        with self._cond:
            for handle, meta in pairs:
                self._commit_staged_locked(handle, meta)

    def _commit_staged_locked(self, handle: Handle, meta: Any) -> None:
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
        self._set_dirty(entry, True)
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

    def _let_go(self, entry: _Entry) -> None:
        """An entry is no longer any key's version: its bytes stop counting, and its slot
        is freed now, or by the last unpin."""
        entry.gone = True
        self._bytes_resident -= entry.nbytes
        if entry.pins == 0:
            self._free_slot(entry)

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

    def _free_slot(self, entry: _Entry) -> None:
        self._retire(entry)
        if entry.start >= 0 and self._by_start.get(entry.start) is entry:
            del self._by_start[entry.start]
            self._alloc.free(entry.start)

    # dirty state
    def overwrite(self, key: Key, data: Any, meta: Any = None) -> bool:
        """Replace a resident entry's bytes in its own slot and mark it dirty; False (nothing
        done) unless the entry is resident, settled, unpinned and of the same size.

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
            self._set_dirty(entry, True)
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

    def _set_dirty(self, entry: _Entry, dirty: bool) -> None:
        """Change an entry's dirty flag, counting it while the entry is indexed."""
        if entry.dirty != dirty and self._entries.get(entry.key) is entry:
            self._n_dirty += 1 if dirty else -1
        entry.dirty = dirty

    def _unindex(self, entry: _Entry) -> None:
        """Take an entry out of the index (its flags stop counting)."""
        del self._entries[entry.key]
        self._n_dirty -= entry.dirty
        self._n_evicting -= entry.state == _EVICTING
        self._retire(entry)

    def dirty_keys(self) -> list[Key]:
        with self._cond:
            return [k for k, e in self._entries.items() if e.dirty]

    def flush(
        self, writeback: WriteBack | None = None, *, many: WriteBackMany | None = None,
        batch_bytes: int | None = None,
    ) -> int:
        """Write every dirty entry back; returns how many were written by this call.

        With ``many`` the dirty entries go to it in batches of at most ``batch_bytes``
        (all in one call if None; an entry larger than that is a batch of its own), so a
        store can make each batch durable with one commit; otherwise ``writeback`` gets
        them one at a time. A batch that fails leaves it and the later ones dirty. Entries
        are pinned during their write-back and cleaned only if not re-dirtied meanwhile.
        So that when this returns everything dirty at the call has been written back, the
        entries dirty at the call that are busy are waited for first: an eviction's
        write-back in flight (it commits, or fails and leaves the entry dirty for this
        flush) and an in-place rewrite (its newer bytes are written instead). Entries still
        being loaded by their inserter (unpublished) are clean and skipped.
        """
        writeback = writeback or self._writeback
        if writeback is None and many is None:
            raise ValueError("flush needs a writeback callable")
        with self._cond:
            watched = [e for e in self._entries.values() if e.dirty]
            while any(e.state != _READY and self._entries.get(e.key) is e for e in watched):
                self._cond.wait()
            targets = []
            for entry in watched:
                if entry.dirty and entry.state == _READY and self._entries.get(entry.key) is entry:
                    entry.pins += 1
                    targets.append((entry, entry.gen))
            self._captures += 1
        done = 0
        try:
            if many is not None:
                for batch in _batches(targets, batch_bytes):
                    many([(e.key, self._view(e), e.meta) for e, _ in batch])
                    self._cleaned(batch)
                    done += len(batch)
            else:
                for i, (entry, gen) in enumerate(targets):
                    writeback(entry.key, self._view(entry), entry.meta)
                    self._cleaned([(entry, gen)])
                    done = i + 1
        finally:
            with self._cond:
                for entry, _ in targets[done:]:
                    self._unpin(entry)
                self._captures -= 1
        return done

    def _cleaned(self, written: list[tuple[_Entry, int]]) -> None:
        with self._cond:
            for entry, gen in written:
                if entry.gen == gen:
                    self._set_dirty(entry, False)
                self._unpin(entry)
                self._writebacks += 1

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

    def _unpin(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.gone and entry.pins == 0:
            self._free_slot(entry)
        self._cond.notify_all()

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

    def _retire(self, entry: _Entry) -> None:
        if entry.watch is not None:
            token, entry.watch = entry.watch, None
            if self._on_retire is not None:
                self._on_retire(token)

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


def _batches(targets: list[tuple[_Entry, int]], limit: int | None
             ) -> Iterator[list[tuple[_Entry, int]]]:
    """``targets`` in order, cut into runs of at most ``limit`` bytes (one run if None)."""
    if limit is None:
        if targets:
            yield targets
        return
    run: list[tuple[_Entry, int]] = []
    size = 0
    for item in targets:
        if run and size + item[0].nbytes > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += item[0].nbytes
    if run:
        yield run


def _check_arena(arena: torch.Tensor, capacity: int) -> torch.Tensor:
    """A caller-supplied arena: flat, contiguous uint8 CPU memory, page-aligned, big enough."""
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        raise ValueError("arena must be a flat, contiguous uint8 tensor")
    if arena.device.type != "cpu" or arena.data_ptr() % PAGE:
        raise ValueError(f"arena must be CPU memory aligned to {PAGE} bytes")
    if arena.numel() < capacity:
        raise ValueError(f"arena holds {arena.numel()} bytes, the cache needs {capacity}")
    return arena[:capacity]


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
