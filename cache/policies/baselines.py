"""The policies ``lfu-decay`` is measured against: LRU, plain LFU, SE-MoE's schedule, ARC and
Belady's offline optimum."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from .base import IsEvictable, Key, Policy, _always, _HeapPolicy, heap_walk

__all__ = ["ArcPolicy", "BeladyPolicy", "LfuPolicy", "LruPolicy", "SemoePolicy"]


class LruPolicy(Policy):
    """Least recently used: an ordered dict, oldest first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def record_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def record_miss(self, key: Key, nbytes: int) -> None:
        pass

    def candidates(self, incoming: Key, is_evictable: IsEvictable = _always) -> Iterator[Key]:
        return (k for k in self._order if is_evictable(k))

    def record_insert(self, key: Key, nbytes: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def record_remove(self, key: Key, evicted: bool = True) -> None:
        self._order.pop(key, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LfuPolicy(_HeapPolicy):
    """Plain in-cache LFU: integer hit counts, no decay, no memory of evicted keys.

    A new entry starts at 1; the victim is the smallest count, ties least recently used.
    """

    name = "lfu"

    def record_hit(self, key: Key) -> None:
        self._set(key, self._live[key][0] + 1)

    def record_miss(self, key: Key, nbytes: int) -> None:
        pass

    def record_insert(self, key: Key, nbytes: int) -> None:
        self._set(key, 1)

    def count(self, key: Key) -> int:
        """The hit count of a resident key (0 when not resident)."""
        state = self._live.get(key)
        return 0 if state is None else int(state[0])


class SemoePolicy(Policy):
    """SE-MoE Algorithm 1 (SparseSchedule, lines 4-22) as the paper states it, for comparison.

    What the pseudocode does, read literally, and what this class therefore does:

    - ``hits`` is a hash table of counts. A hit on a cached key does ``hits[p] += 1``; a
      cached key that has no entry yet gets one (0 + 1) and joins the end of the table.
    - While ``acc_caches + 1 < CPU_size`` a miss is cached with ``hits[p] = 1`` and
      ``acc_caches += 1``. ``acc_caches`` is never decremented, so once the cache has been
      full every later miss takes the eviction branch, even after evictions freed room.
      The paper leaves the unit undefined; here capacity is bytes and "room" is decided by
      the cache layer, so the one-entry slack of ``acc + 1 < size`` is not reproduced.
    - Eviction branch: ``foreach p_a in hits: if hits[p_a] >= threshold and
      min(hits.values()) == hits[p_a]: write back, delete p_a and hits[p_a], fetch p_s``.
      So nothing is evicted unless every tracked entry has reached the threshold; the loop
      does not stop after the first eviction, and because the minimum is re-evaluated as
      entries are deleted it goes on deleting: every entry with the minimum count, then,
      if all of those lay before it in table order, the entries with the next count that
      it meets later in the table, and so on (``evicts_all``). The fetch sits inside the
      loop, so the missed key is cached only if at least one entry was evicted; otherwise
      it is served uncached. Its repeated fetches are a single fetch here: a cache cannot
      hold two copies.
    - A key fetched in the eviction branch gets no ``hits`` entry, so until its next hit
      it is invisible to the eviction loop and cannot be evicted.
    - Every ``period`` (K) requests ``hits · beta`` is evaluated and discarded: counts never
      decay. ``beta`` and ``period`` are kept only to mirror the paper's parameters.

    The cascade is computed with per-count buckets, each holding its keys' table positions
    in two lazy heaps, so a miss costs O(log n) per evicted key instead of the paper's scan.
    """

    name = "semoe"
    evicts_all = True

    def __init__(self, threshold: int = 1, beta: float = 0.5, period: int = 1) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        self.threshold = threshold
        self.beta = float(beta)
        self.period = int(period)
        self.steps = 0  # the paper's cycle counter; its only effect is the discarded decay
        self._hits: dict[Key, int] = {}
        self._pos: dict[Key, int] = {}
        self._next_pos = 0
        self._buckets: dict[int, dict[Key, None]] = {}
        self._lo: dict[int, list[tuple[int, Key]]] = {}  # count -> heap of (pos, key)
        self._hi: dict[int, list[tuple[int, Key]]] = {}  # count -> heap of (-pos, key)
        self._counts: list[int] = []  # heap of counts that have a bucket (lazy)
        self._resident: set[Key] = set()
        self._full = False  # acc_caches has reached CPU_size (it never goes down)
        self._eviction_branch = False

    # the paper's table
    def _track(self, key: Key, count: int) -> None:
        old = self._hits.get(key)
        if old is None:
            self._pos[key] = self._next_pos
            self._next_pos += 1
        else:
            self._leave_bucket(key, old)
        self._hits[key] = count
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = {}
            self._lo[count], self._hi[count] = [], []
            heapq.heappush(self._counts, count)
            if len(self._counts) > 2 * len(self._buckets) + 16:
                self._counts = sorted(self._buckets)
        bucket[key] = None
        pos = self._pos[key]
        heapq.heappush(self._lo[count], (pos, key))
        heapq.heappush(self._hi[count], (-pos, key))
        if len(self._lo[count]) > 2 * len(bucket) + 16:
            self._lo[count] = sorted((self._pos[k], k) for k in bucket)
            self._hi[count] = sorted((-self._pos[k], k) for k in bucket)

    def _untrack(self, key: Key) -> None:
        count = self._hits.pop(key, None)
        if count is not None:
            self._leave_bucket(key, count)
            del self._pos[key]

    def _leave_bucket(self, key: Key, count: int) -> None:
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count], self._lo[count], self._hi[count]

    def _valid(self, key: Key, count: int, pos: int) -> bool:
        return self._hits.get(key) == count and self._pos.get(key) == pos

    def _min_pos(self, count: int) -> int:
        heap = self._lo[count]
        while not self._valid(heap[0][1], count, heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0]

    def _levels(self) -> Iterator[int]:
        last = None
        for count in heap_walk(self._counts):
            if count != last and count in self._buckets:
                last = count
                yield count

    def _after(self, count: int, pos: int) -> list[Key]:
        found = []
        for neg, key in heap_walk(self._hi[count]):
            if -neg <= pos:
                break
            if self._valid(key, count, -neg):
                found.append(key)
        found.reverse()
        return found

    # protocol
    def _step(self) -> None:
        self.steps += 1
        if self.steps == self.period:
            self.steps = 0  # line 22: `hits · β` is computed and never assigned back

    def record_hit(self, key: Key) -> None:
        self._track(key, self._hits.get(key, 0) + 1)
        self._step()

    def record_miss(self, key: Key, nbytes: int) -> None:
        self._step()

    def evict_first(self, fits: bool) -> bool:
        self._full = self._full or not fits
        self._eviction_branch = self._full
        return self._full

    def candidates(self, incoming: Key, is_evictable: IsEvictable = _always) -> Iterator[Key]:
        levels = self._levels()
        level = next(levels, None)
        if level is None or level < self.threshold:
            return
        passed = -1  # table position the loop has reached when `level` becomes the minimum
        while True:
            if self._min_pos(level) > passed:
                # Every key of this count lies ahead: the loop deletes each one it meets
                # while it is the minimum, which stays true until the last one is gone.
                keys = sorted(self._buckets[level], key=self._pos.__getitem__)
                blocked = False
                for key in keys:
                    if is_evictable(key):
                        yield key
                    else:
                        blocked = True  # it stays, so the minimum never rises past it
                if blocked:
                    return
                passed = self._pos[keys[-1]]
                level = next(levels, None)
                if level is None:
                    return
            else:
                # Keys of this count that the loop already passed survive and hold the
                # minimum here, so only the ones it still meets are deleted.
                for key in self._after(level, passed):
                    if is_evictable(key):
                        yield key
                return

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key]) -> bool:
        return bool(victims) if self._eviction_branch else True

    def record_insert(self, key: Key, nbytes: int) -> None:
        self._resident.add(key)
        if not self._eviction_branch:
            self._track(key, 1)
        self._eviction_branch = False

    def record_remove(self, key: Key, evicted: bool = True) -> None:
        self._resident.discard(key)
        self._untrack(key)

    def hits_table(self) -> dict[Key, int]:
        """A copy of the paper's ``hits`` table, in table order."""
        return {k: self._hits[k] for k in sorted(self._hits, key=self._pos.__getitem__)}

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident


class ArcPolicy(Policy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03), measured in bytes.

    T1 (seen once recently) and T2 (seen at least twice) are the resident lists, B1 and B2
    their ghosts. Sizes, the target p for T1 and the ghost bounds (|T1|+|B1| <= c and
    |T1|+|T2|+|B1|+|B2| <= 2c) are in bytes, and a ghost hit moves p by the missed entry's
    size times the usual ratio; with equal entry sizes this is exactly the entry-based
    algorithm with c = capacity / size. Ghost lists are trimmed after each insertion, which
    deletes the same ghosts as the paper's case IV does before REPLACE. ``candidates`` plays
    REPLACE repeatedly, so the cache can evict until a large entry fits. Without ``attach``
    the capacity is taken to be the resident bytes.
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[Key, int] = OrderedDict()
        self._t2: OrderedDict[Key, int] = OrderedDict()
        self._b1: OrderedDict[Key, int] = OrderedDict()
        self._b2: OrderedDict[Key, int] = OrderedDict()
        self._size = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self.p = 0.0
        self._capacity: int | None = None

    def attach(self, capacity_bytes: int) -> None:
        self._capacity = int(capacity_bytes)

    @property
    def capacity(self) -> int:
        if self._capacity is not None:
            return self._capacity
        return self._size["t1"] + self._size["t2"]

    def _lists(self) -> dict[str, OrderedDict[Key, int]]:
        return {"t1": self._t1, "t2": self._t2, "b1": self._b1, "b2": self._b2}

    def _pop(self, name: str, key: Key) -> int | None:
        nbytes = self._lists()[name].pop(key, None)
        if nbytes is not None:
            self._size[name] -= nbytes
        return nbytes

    def _push(self, name: str, key: Key, nbytes: int) -> None:
        self._lists()[name][key] = nbytes
        self._size[name] += nbytes

    def record_hit(self, key: Key) -> None:
        if key in self._t2:
            self._t2.move_to_end(key)
        else:
            self._push("t2", key, self._pop("t1", key))

    def record_miss(self, key: Key, nbytes: int) -> None:
        b1, b2 = self._size["b1"], self._size["b2"]
        if key in self._b1:
            ratio = b2 / b1 if b1 else 1.0
            self.p = min(float(self.capacity), self.p + nbytes * max(1.0, ratio))
        elif key in self._b2:
            ratio = b1 / b2 if b2 else 1.0
            self.p = max(0.0, self.p - nbytes * max(1.0, ratio))

    def candidates(self, incoming: Key, is_evictable: IsEvictable = _always) -> Iterator[Key]:
        in_b2 = incoming in self._b2
        t1_bytes = self._size["t1"]
        it1 = (k for k in self._t1 if is_evictable(k))
        it2 = (k for k in self._t2 if is_evictable(k))
        next1, next2 = next(it1, None), next(it2, None)
        while next1 is not None or next2 is not None:
            from_t1 = next1 is not None and (
                next2 is None or t1_bytes > self.p or (in_b2 and t1_bytes == self.p)
            )
            if from_t1:
                yield next1
                t1_bytes -= self._t1[next1]
                next1 = next(it1, None)
            else:
                yield next2
                next2 = next(it2, None)

    def record_insert(self, key: Key, nbytes: int) -> None:
        if self._pop("b1", key) is not None or self._pop("b2", key) is not None:
            self._push("t2", key, nbytes)
        else:
            self._push("t1", key, nbytes)
        self._trim_ghosts()

    def record_remove(self, key: Key, evicted: bool = True) -> None:
        for resident, ghost in (("t1", "b1"), ("t2", "b2")):
            nbytes = self._pop(resident, key)
            if nbytes is not None:
                if evicted:
                    self._push(ghost, key, nbytes)
                break
        if not evicted:
            self._pop("b1", key)
            self._pop("b2", key)
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        size = self._size
        while self._b1 and size["t1"] + size["b1"] > c:
            self._pop("b1", next(iter(self._b1)))
        while (self._b1 or self._b2) and sum(size.values()) > 2 * c:
            name = "b2" if self._b2 else "b1"
            self._pop(name, next(iter(self._lists()[name])))

    def lists(self) -> dict[str, list[Key]]:
        """The four lists, each least recently used first (for inspection and tests)."""
        return {name: list(lst) for name, lst in self._lists().items()}

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


class BeladyPolicy(_HeapPolicy):
    """Belady's offline optimum: evict the resident key whose next use is farthest away.

    ``future`` is the whole access sequence the policy will see, one key per access, in
    order; next-use indices are precomputed, so each access is one heap push. Keys never
    used again are evicted first (least recently used among them). With ``bypass`` a missed
    key is not cached when every victim it would displace is needed sooner than it is,
    which is the optimum for equal-sized entries when a miss may be served uncached (the
    setting of lfu-decay's admission threshold); without it, this is the classic MIN.
    With unequal sizes farthest-next-use is a heuristic, not the optimum.
    """

    name = "belady"

    def __init__(self, future: Sequence[Key], bypass: bool = True) -> None:
        super().__init__()
        self._future = list(future)
        never = len(self._future)
        self._next = [never] * never
        seen: dict[Key, int] = {}
        for i in range(never - 1, -1, -1):
            key = self._future[i]
            self._next[i] = seen.get(key, never)
            seen[key] = i
        self.bypass = bool(bypass)
        self._position = 0
        self._incoming_next = never

    def _advance(self, key: Key) -> int:
        i = self._position
        if i >= len(self._future) or self._future[i] != key:
            expected = self._future[i] if i < len(self._future) else "end of the future"
            raise ValueError(f"access {i} is {key!r}, but the future says {expected!r}")
        self._position += 1
        return self._next[i]

    def record_hit(self, key: Key) -> None:
        self._set(key, -self._advance(key))

    def record_miss(self, key: Key, nbytes: int) -> None:
        self._incoming_next = self._advance(key)

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key]) -> bool:
        if not self.bypass:
            return True
        return all(-self._live[v][0] > self._incoming_next for v in victims)

    def record_insert(self, key: Key, nbytes: int) -> None:
        self._set(key, -self._incoming_next)

    def next_use(self, key: Key) -> int | None:
        """Index of the resident key's next access (len(future) if never), None if absent."""
        state = self._live.get(key)
        return None if state is None else int(-state[0])
