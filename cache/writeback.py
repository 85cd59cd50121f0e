"""Making room in a host cache: choosing victims, writing dirty ones back, flushing.

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .slab import PAGE, BuddyAllocator, Claim
from .slots import _EVICTING, _READY, Handle, Key, SlotCache, WriteBack, WriteBackMany, _Entry

__all__ = ["WriteBackCache"]


@dataclass
class _Pending:
    """An insert waiting for its victims' write-backs (see the module docstring)."""

    entry: _Entry
    order: int
    victims: list[_Entry]
    claim: Claim | None
    written: list[_Entry]
    ahead: list[tuple[_Entry, int]] = field(default_factory=list)  # (entry, gen), pinned


class WriteBackCache(SlotCache):
    """A ``SlotCache`` that evicts through its policy, writing dirty victims back without
    holding the lock (see the module docstring), and flushes dirty entries."""

    # inserts and evictions
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

    # flush
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
