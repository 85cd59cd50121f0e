"""Eviction and admission policies shared by the host cache and the trace simulator.

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
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

__all__ = [
    "CLOCKS",
    "POLICIES",
    "ArcPolicy",
    "BeladyPolicy",
    "LfuDecayPolicy",
    "LfuPolicy",
    "LruPolicy",
    "Policy",
    "SemoePolicy",
    "make_policy",
]

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


# Below this global scale the unscaled counts are folded back (see LfuDecayPolicy). 2**-900
# keeps unscaled counts (true count / scale) far below the float maximum of about 2**1024.
_RENORMALIZE_BELOW = 2.0**-900


#: The clocks ``LfuDecayPolicy`` can decay on (see its docstring); the first is the default.
CLOCKS: tuple[str, ...] = ("auto", "pass", "step", "access")

# LfuDecayPolicy's victim classes under a step clock, evicted in this order (see its docstring).
_PASSED, _THIS_STEP, _AHEAD = 0, 1, 2


class LfuDecayPolicy(_HeapPolicy):
    """LFU with exponential decay, a ghost table and an admission threshold (the default).

    Counts: every resident key has a decayed count c. A hit does c += 1; a missed key's
    count is its remembered (ghost) count plus 1 for this access, or 1 when it has none;
    every ``period`` ticks of the clock all counts, ghosts included, are multiplied by
    ``beta``.

    O(1) decay: counts are stored unscaled, u = c / scale, and a decay only does
    scale *= beta. A hit adds 1 / scale to u. Ordering by u is ordering by c because the
    scale is common to all keys, so decay never reorders the heap. When the scale drops
    below 2**-900 every u is multiplied by it and the scale reset to 1 (an O(n) pass every
    ~900 / log2(1 / beta) decays, so rarely that it does not show per access). With
    beta = 0.5 all of this is exact binary arithmetic.

    Clock (``clock``), i.e. what one tick is:

    - ``"step"``: only ``tick()`` advances it (the trainer calls ``Store.tick()`` once per
      training step; the simulator ticks where the trace's step changes).
    - ``"pass"``: a tick is one pass over the working set, detected without help: the
      clock ticks when an access repeats a key already accessed since the last tick. A
      routing trace touches each (layer, expert) at most once per training or decode step,
      so a pass is one step, however many accesses the step has; this is what makes one
      setting right for training (~100 accesses a step) and decoding (~16) alike. A pass
      also ends after ``pass_limit`` distinct keys, which bounds its bookkeeping.
    - ``"auto"`` (the default): ``"pass"`` until the first ``tick()``, then ``"step"``.
    - ``"access"``: every access (hit or miss) is a tick, taken at its start so the
      access's own +1 is never decayed by it.

    Ghost table: an LRU-bounded map (``ghost_size`` keys) from recently evicted or refused
    keys to their unscaled counts. A key that comes back resumes its decayed count.

    Victim: the evictable resident key with the smallest count, ties least recently used,
    taken first from the keys that have let their turn pass. A routing trace visits the
    layers in the same order every step, so a key used in the last step whose place in this
    step has gone by unused is not needed before the next step, while one whose place is
    still ahead may be needed within this step. Once a step clock ticks (``"step"``, or
    ``"auto"`` after its first ``tick()``), resident keys fall into three classes, each
    ordered by count: *passed* (not accessed for more than ``turn`` times the previous
    step's number of accesses), then *this step* (accessed since the last tick: their next
    use is a step away at best), then *ahead* (accessed in the last step, place still to
    come). Only when the cache holds less than about a step do the last two classes matter,
    and keeping the keys still ahead is then what Belady's optimum does too. ``turn`` is in
    steps; the 10 % over one step absorbs steps that route to a few more experts than the
    last, so a key whose place is just coming up is not taken for passed. Each class has
    its own heap: keys leave *ahead* (or *this step*) for *passed* in access order, one heap
    push each, and a tick relabels the *this step* heap as *ahead*, so the cost per access
    stays O(log n) amortised. A pass (``"pass"``) is known only when a key repeats, which
    can be several accesses late, so without ticks, and with ``turn = 0``, the victim is
    the smallest count alone (a caller that never ticks pays nothing for the classes).

    Admission: a missed key whose count (ghost + 1) is below ``theta`` is refused when any
    victim it would displace has a larger count. Its access is still remembered in the
    ghost table, so a key that keeps coming back earns admission. ``theta = 0`` admits all.

    Defaults (beta = 0.7, period = 1 tick, theta = 2, turn = 1.1, a pass or step clock)
    come from a sweep over synthetic and recorded training and decode traces (``python -m
    bench.cache_lab``; the results are in the README, "Host cache"). With a per-step clock the
    memory is about 1 / (1 - beta) ~ 3 steps: long enough to keep the experts a layer keeps
    routing to, short enough to follow popularity drift and bursts.
    """

    name = "lfu-decay"

    def __init__(
        self,
        beta: float = 0.7,
        period: int = 1,
        theta: float = 2.0,
        ghost_size: int = 65536,
        clock: str = "auto",
        auto_tick: bool | None = None,
        turn: float = 1.1,
    ) -> None:
        super().__init__()
        if not 0.0 < beta < 1.0:
            raise ValueError(f"beta must be in (0, 1), got {beta}")
        if int(period) < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        if theta < 0:
            raise ValueError(f"theta must be >= 0, got {theta}")
        if int(ghost_size) < 0:
            raise ValueError(f"ghost_size must be >= 0, got {ghost_size}")
        if turn != 0 and not turn >= 1:
            raise ValueError(f"turn must be 0 (off) or >= 1 step, got {turn}")
        if auto_tick is not None:  # the older spelling: True ticks per access, False per step
            clock = "access" if auto_tick else "step"
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
        self.beta = float(beta)
        self.period = int(period)
        self.theta = float(theta)
        self.ghost_size = int(ghost_size)
        self.clock = clock
        self._scale = 1.0
        self._until_decay = self.period
        self._ghost: OrderedDict[Key, float] = OrderedDict()
        self._pending: tuple[Key, float] | None = None  # the miss being decided
        self._pass: set[Key] = set()  # keys accessed since the last tick ("pass" clock)
        self.pass_limit = 1 << 16
        self._stepped = False  # tick() has been called ("auto" then counts steps only)
        # Turn-aware victim classes (see the class docstring); all keys are _PASSED, in
        # self._heap, until a step clock has ticked once.
        self.turn = float(turn)
        self._heaps = [self._heap, [], []]
        # Keys not _PASSED, by last access: key -> the number of that access. Their class
        # follows from it (this step's or the last), so a tick moves no key but the ones
        # whose turn came a whole step ago.
        self._young: OrderedDict[Key, int] = OrderedDict()
        self._access_no = 0  # number of the access in progress
        self._step_start = 1  # number of the first access since the last tick
        self._step_len = 0  # accesses in the previous step (0: no step seen yet)
        self._track_turns = bool(self.turn) and clock in ("auto", "step")

    @property
    def auto_tick(self) -> bool:
        """Whether every access ticks the clock (``clock == "access"``)."""
        return self.clock == "access"

    # clock
    def tick(self) -> None:
        """One external clock unit (a training step); under ``"auto"`` the first call
        switches the clock from passes to these ticks."""
        self._stepped = True
        self._pass.clear()
        self._track_turns = bool(self.turn) and self.clock in ("auto", "step")
        self._advance()

    def _advance(self) -> None:
        self._settle()
        if self._stepped and self._track_turns:
            self._end_step()
        self._until_decay -= 1
        if self._until_decay == 0:
            self._until_decay = self.period
            self._scale *= self.beta
            if self._scale < _RENORMALIZE_BELOW:
                self._renormalize()

    def _on_access(self, key: Key) -> None:
        """Advance the clock for the access to ``key`` that is starting (before its +1)."""
        self._access_no += 1
        clock = self.clock
        if clock == "access":
            self._advance()
        elif clock == "pass" or (clock == "auto" and not self._stepped):
            seen = self._pass
            if key in seen or len(seen) >= self.pass_limit:
                seen.clear()
                if self._track_turns:
                    # A pass ended before any tick: nobody ticks, so stop tracking turns.
                    self._track_turns = False
                    self._young.clear()
                self._advance()
            seen.add(key)

    def _renormalize(self) -> None:
        s = self._scale
        self._live = {k: (u * s, seq) for k, (u, seq) in self._live.items()}
        for k in self._ghost:
            self._ghost[k] *= s
        if self._pending is not None:
            self._pending = (self._pending[0], self._pending[1] * s)
        self._scale = 1.0
        self._rebuild()

    # victim classes
    def _class_of(self, key: Key) -> int:
        no = self._young.get(key)
        if no is None or not self._step_len:
            return _PASSED
        return _THIS_STEP if no >= self._step_start else _AHEAD

    def _end_step(self) -> None:
        """A tick: this step's keys become the ones ahead, last step's have passed."""
        n = self._access_no - self._step_start + 1
        young, heaps, live = self._young, self._heaps, self._live
        if not self._step_len:
            if n <= 0 or not young:  # (young is empty if turns were not tracked)
                self._step_start = self._access_no + 1
                return
            # The first step: its keys sit in the _PASSED heap until now.
            ahead = heaps[_AHEAD]
            for key in young:
                u, seq = live[key]
                ahead.append((u, seq, key))
            heapq.heapify(ahead)
        else:
            passed = heaps[_PASSED]
            while young:
                key, no = next(iter(young.items()))
                if no >= self._step_start:
                    break
                del young[key]
                u, seq = live[key]
                heapq.heappush(passed, (u, seq, key))
            # The keys of this step keep their heap items: the heap changes class.
            heaps[_AHEAD], heaps[_THIS_STEP] = heaps[_THIS_STEP], []
        if n > 0:
            self._step_len = n
        self._step_start = self._access_no + 1
        self._compact()

    def _age(self) -> None:
        """Keys not accessed for ``turn`` steps' worth of accesses have let their turn pass."""
        if not self._step_len:
            return
        oldest = self._access_no - self.turn * self._step_len
        young, live, passed = self._young, self._live, self._heaps[_PASSED]
        while young:
            key, no = next(iter(young.items()))
            if no >= oldest:
                break
            del young[key]
            u, seq = live[key]
            heapq.heappush(passed, (u, seq, key))
        self._compact()

    def _set(self, key: Key, priority: float) -> None:
        self._seq += 1
        self._live[key] = (priority, self._seq)
        if self._track_turns:
            # Recorded before the first tick too, so that tick can class the first step.
            self._young[key] = self._access_no
            self._young.move_to_end(key)
        cls = _THIS_STEP if self._step_len else _PASSED
        heapq.heappush(self._heaps[cls], (priority, self._seq, key))
        self._compact()

    def _compact(self) -> None:
        h = self._heaps
        if len(h[0]) + len(h[1]) + len(h[2]) > 2 * len(self._live) + 64:
            self._rebuild()

    def _drop(self, key: Key) -> tuple[float, int] | None:
        cls = self._class_of(key)
        state = self._live.pop(key, None)
        self._young.pop(key, None)
        heap = self._heaps[cls]
        while heap and not self._is_live_in(heap[0], cls):
            heapq.heappop(heap)
        return state

    def _rebuild(self) -> None:
        heaps: list[list[tuple[float, int, Key]]] = [[], [], []]
        for k, (p, s) in self._live.items():
            heaps[self._class_of(k)].append((p, s, k))
        for h in heaps:
            heapq.heapify(h)
        self._heaps = heaps
        self._heap = heaps[_PASSED]

    def _is_live_in(self, item: tuple[float, int, Key], cls: int) -> bool:
        key = item[2]
        state = self._live.get(key)
        if state is None or state[1] != item[1]:
            return False
        if not self._step_len:
            return cls == _PASSED
        no = self._young.get(key)
        if no is None:
            return cls == _PASSED
        return cls == (_THIS_STEP if no >= self._step_start else _AHEAD)

    def _is_live(self, item: tuple[float, int, Key]) -> bool:
        return self._is_live_in(item, _PASSED)

    def _clean_top(self) -> None:
        for cls, heap in enumerate(self._heaps if self._step_len else self._heaps[:1]):
            while heap and not self._is_live_in(heap[0], cls):
                heapq.heappop(heap)

    def _ordered(self, is_evictable: IsEvictable) -> Iterator[Key]:
        for cls, heap in enumerate(self._heaps if self._step_len else self._heaps[:1]):
            for item in heap_walk(heap):
                if self._is_live_in(item, cls) and is_evictable(item[2]):
                    yield item[2]

    def candidates(self, incoming: Key, is_evictable: IsEvictable = _always) -> Iterator[Key]:
        self._age()
        self._clean_top()
        return self._ordered(is_evictable)

    # accesses
    def record_hit(self, key: Key) -> None:
        self._settle()
        self._on_access(key)
        self._set(key, self._live[key][0] + 1.0 / self._scale)

    def record_hits(self, keys: Iterable[Key]) -> None:
        self._settle()  # the batch records no miss: nothing is pending after the first
        on_access, set_, live = self._on_access, self._set, self._live
        for key in keys:
            on_access(key)
            set_(key, live[key][0] + 1.0 / self._scale)

    def record_miss(self, key: Key, nbytes: int) -> None:
        self._settle()
        self._on_access(key)
        self._pending = (key, self._ghost.pop(key, 0.0) + 1.0 / self._scale)

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key]) -> bool:
        u = self._pending_count(key)
        if u * self._scale >= self.theta:
            return True
        return all(self._live[v][0] <= u for v in victims)

    def record_insert(self, key: Key, nbytes: int) -> None:
        u = self._pending_count(key)
        if self._pending is not None and self._pending[0] == key:
            self._pending = None
        self._ghost.pop(key, None)
        self._set(key, u)

    def record_remove(self, key: Key, evicted: bool = True) -> None:
        state = self._drop(key)
        if state is None:
            return
        if evicted:
            self._remember(key, state[0])
        else:
            self._ghost.pop(key, None)

    # helpers
    def _settle(self) -> None:
        """A miss that was not inserted (refused, or no room) is remembered as a ghost."""
        if self._pending is not None:
            key, u = self._pending
            self._pending = None
            self._remember(key, u)

    def _pending_count(self, key: Key) -> float:
        if self._pending is not None and self._pending[0] == key:
            return self._pending[1]
        return self._ghost.get(key, 0.0) or 1.0 / self._scale

    def _remember(self, key: Key, u: float) -> None:
        if self.ghost_size == 0:
            return
        self._ghost[key] = u
        self._ghost.move_to_end(key)
        while len(self._ghost) > self.ghost_size:
            self._ghost.popitem(last=False)

    def count(self, key: Key) -> float:
        """The decayed count of ``key``: resident, else remembered in the ghost table, else 0."""
        self._settle()
        state = self._live.get(key)
        if state is not None:
            return state[0] * self._scale
        return self._ghost.get(key, 0.0) * self._scale

    def ghost_keys(self) -> list[Key]:
        """Keys in the ghost table, least recently remembered first."""
        self._settle()
        return list(self._ghost)


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


_REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (LfuDecayPolicy, SemoePolicy, LruPolicy, LfuPolicy, ArcPolicy, BeladyPolicy)
}

#: Policy names ``make_policy`` accepts; the first is the default.
POLICIES: tuple[str, ...] = tuple(_REGISTRY)


def make_policy(name: str, **args: Any) -> Policy:
    """Build a policy by name; ``args`` go to its constructor (``belady`` needs ``future``)."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(**args)
