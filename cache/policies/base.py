"""The eviction-policy interface and the heap machinery the count-based policies share.

A policy owns no memory: it watches the access stream and answers two questions, which
resident keys to evict (in which order) and whether a missed key should be cached at all.
The cache layer (``HostCache`` or the simulator) owns the bytes and drives every policy
through the same protocol, once per access:

    hit:   policy.record_hit(key)
    miss:  policy.record_miss(key, nbytes)
           if policy.evict_first(fits):          # fits: room exists without evicting
               victims = evictable keys from policy.candidates(key, is_evictable), taken in
                         order until the entry fits (all of them when policy.evicts_all)
           if policy.admit(key, nbytes, victims):
               policy.record_remove(v, evicted=True) for each victim
               policy.record_insert(key, nbytes)
    invalidation: policy.record_remove(key, evicted=False)
    external clock (a training step): policy.tick()

``candidates`` is a lazy, read-only iterator: the caller consumes or drops it before it
calls any ``record_*`` method again. It yields only keys for which ``is_evictable`` is true,
so pinned entries are skipped without being evicted. Every policy keeps its per-access
cost independent of the number of entries: O(1) for the list-based ones, amortised
O(log n) for the heap-based ones (a heap with lazy invalidation, compacted once it holds
twice as many items as live keys, walked in order without being modified).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

__all__ = ["IsEvictable", "Key", "Policy", "admit_miss", "heap_walk"]

Key = Hashable
IsEvictable = Callable[[Key], bool]


def _always(_key: Key) -> bool:
    return True


def heap_walk(heap: list) -> Iterator[Any]:
    """Yield the items of a binary heap in ascending order without modifying it.

    A second, small heap holds the frontier of the tree walked so far, so taking the k
    smallest items costs O(k log k) however large ``heap`` is. This is what lets a policy
    offer "the next victim after the pinned ones" without popping and re-pushing.
    """
    if not heap:
        return
    frontier = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        item, i = heapq.heappop(frontier)
        yield item
        left = 2 * i + 1
        if left < size:
            heapq.heappush(frontier, (heap[left], left))
            if left + 1 < size:
                heapq.heappush(frontier, (heap[left + 1], left + 1))


class Policy(ABC):
    """The interface every eviction policy implements (see the module docstring)."""

    name: ClassVar[str] = ""
    #: True when the policy evicts every candidate it offers, not just enough to fit.
    evicts_all: ClassVar[bool] = False

    def attach(self, capacity_bytes: int) -> None:  # noqa: B027 - optional hook
        """Tell the policy the byte capacity of the cache it serves (ARC sizes its lists)."""

    @abstractmethod
    def record_hit(self, key: Key) -> None:
        """``key`` is resident and was accessed."""

    def record_hits(self, keys: Iterable[Key]) -> None:
        """:meth:`record_hit` of each key in turn (a batch: one call per lookup)."""
        for key in keys:
            self.record_hit(key)

    @abstractmethod
    def record_miss(self, key: Key, nbytes: int) -> None:
        """``key`` (``nbytes`` long) was accessed and is not resident."""

    def evict_first(self, fits: bool) -> bool:
        """Whether the miss just recorded must go through eviction; ``fits`` says if it fits."""
        return not fits

    @abstractmethod
    def candidates(self, incoming: Key, is_evictable: IsEvictable = _always) -> Iterator[Key]:
        """Resident keys in eviction order for making room for ``incoming``."""

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key]) -> bool:
        """Whether the missed ``key`` should be cached at the price of evicting ``victims``."""
        return True

    @abstractmethod
    def record_insert(self, key: Key, nbytes: int) -> None:
        """``key`` became resident (after ``admit`` said yes)."""

    @abstractmethod
    def record_remove(self, key: Key, evicted: bool = True) -> None:
        """``key`` left the cache: evicted (True) or invalidated (False, forget it)."""

    def tick(self) -> None:  # noqa: B027 - optional hook
        """Advance an external clock by one unit (for example one training step)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys the policy tracks."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident as far as the policy knows."""

    def victim(self, incoming: Key = None, is_evictable: IsEvictable = _always) -> Key | None:
        """The first eviction candidate, or None when nothing is evictable."""
        return next(self.candidates(incoming, is_evictable), None)


def admit_miss(policy: Policy, key: Key, nbytes: int, free: int,
               size_of: Callable[[Key], int],
               is_evictable: IsEvictable = _always) -> list[Key] | None:
    """The miss half of the protocol (after ``record_miss``) for a cache whose bytes are
    one pool: the victims that make room for ``key`` (``free`` bytes free now, each
    victim's size from ``size_of``), or None when it is not to be cached (nothing
    evictable makes room, or ``admit`` refuses). The caller evicts the victims, calling
    ``record_remove`` for each, then ``record_insert(key)``."""
    victims: list[Key] = []
    if policy.evict_first(free >= nbytes):
        for v in policy.candidates(key, is_evictable):
            victims.append(v)
            free += size_of(v)
            if free >= nbytes and not policy.evicts_all:
                break
        if free < nbytes:
            return None
    return victims if policy.admit(key, nbytes, victims) else None


class _HeapPolicy(Policy):
    """Base for policies that evict the key with the smallest priority.

    Each resident key has (priority, seq), seq being the number of the access that last set
    it; heap items are (priority, seq, key) and an item is live only while its seq is the
    key's current one, so updates push a new item and leave the old one to be skipped.
    Ties on priority go to the smaller seq: least recently used first.
    """

    def __init__(self) -> None:
        self._live: dict[Key, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, Key]] = []
        self._seq = 0

    def _set(self, key: Key, priority: float) -> None:
        self._seq += 1
        self._live[key] = (priority, self._seq)
        heapq.heappush(self._heap, (priority, self._seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._rebuild()

    def _drop(self, key: Key) -> tuple[float, int] | None:
        state = self._live.pop(key, None)
        self._clean_top()
        return state

    def _rebuild(self) -> None:
        self._heap = [(p, s, k) for k, (p, s) in self._live.items()]
        heapq.heapify(self._heap)

    def _is_live(self, item: tuple[float, int, Key]) -> bool:
        state = self._live.get(item[2])
        return state is not None and state[1] == item[1]

    def _clean_top(self) -> None:
        heap = self._heap
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)

    def _ordered(self, is_evictable: IsEvictable) -> Iterator[Key]:
        for item in heap_walk(self._heap):
            if self._is_live(item) and is_evictable(item[2]):
                yield item[2]

    def candidates(self, incoming: Key, is_evictable: IsEvictable = _always) -> Iterator[Key]:
        return self._ordered(is_evictable)

    def record_remove(self, key: Key, evicted: bool = True) -> None:
        self._drop(key)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live
