"""``lfu-decay``, the host cache's default policy: LFU with decay, ghosts and admission."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from .base import IsEvictable, Key, _always, _HeapPolicy, heap_walk

__all__ = ["CLOCKS", "LfuDecayPolicy"]

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
        if not 0 <= theta < math.inf:  # false for nan too
            raise ValueError(f"theta must be a finite number >= 0, got {theta}")
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
