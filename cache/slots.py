"""The state of a host cache: its arena, the entries and their slots, pins and counters.

``HostCache`` is built in three layers, each a class extending the one before:
``SlotCache`` here (the arena and its allocator, the index of entries, the counters and the
bookkeeping every operation shares: pinning, slot views, unindexing, freeing a slot),
``writeback.WriteBackCache`` (making room: victims, their write-backs, flush) and
``hostcache.HostCache`` (the operations callers use). All of them guard that state with
the one lock, ``_cond``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .pinned import HostArena, arena_tensor
from .policies import Policy, make_policy
from .slab import PAGE, BuddyAllocator

if TYPE_CHECKING:
    from .hostcache import HostCache

__all__ = ["CacheStats", "Handle", "Key", "SlotCache", "WriteBack", "WriteBackMany"]

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
        self.slot_view: torch.Tensor | None = None  # see SlotCache._view


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


class SlotCache:
    """The arena, the index of entries and the counters of a ``HostCache`` (whose docstring
    gives the constructor's arguments), with the slot and pin bookkeeping its layers share."""

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

    # index, pins and slots
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

    def _let_go(self, entry: _Entry) -> None:
        """An entry is no longer any key's version: its bytes stop counting, and its slot
        is freed now, or by the last unpin."""
        entry.gone = True
        self._bytes_resident -= entry.nbytes
        if entry.pins == 0:
            self._free_slot(entry)

    def _unpin(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.gone and entry.pins == 0:
            self._free_slot(entry)
        self._cond.notify_all()

    def _free_slot(self, entry: _Entry) -> None:
        self._retire(entry)
        if entry.start >= 0 and self._by_start.get(entry.start) is entry:
            del self._by_start[entry.start]
            self._alloc.free(entry.start)

    def _retire(self, entry: _Entry) -> None:
        if entry.watch is not None:
            token, entry.watch = entry.watch, None
            if self._on_retire is not None:
                self._on_retire(token)


def _check_arena(arena: torch.Tensor, capacity: int) -> torch.Tensor:
    """A caller-supplied arena: flat, contiguous uint8 CPU memory, page-aligned, big enough."""
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        raise ValueError("arena must be a flat, contiguous uint8 tensor")
    if arena.device.type != "cpu" or arena.data_ptr() % PAGE:
        raise ValueError(f"arena must be CPU memory aligned to {PAGE} bytes")
    if arena.numel() < capacity:
        raise ValueError(f"arena holds {arena.numel()} bytes, the cache needs {capacity}")
    return arena[:capacity]
