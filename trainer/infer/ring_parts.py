"""The ring's slots in memory of its own, for a host cache too small to hold the ring.

When the host cache cannot hold the K layers a ring needs, pinning them there would
either evict everything else or spill into buffers the store allocates per read; so the
ring reads into slots it owns instead. The unit is a *part*: a run of consecutive experts
of one MoE layer. The ring holds ``slots`` parts at once, each in a page-aligned arena
allocated once and reused, so the memory it holds is ``slots × part bytes``, never more,
however small the budget is (one expert per part at the least). Parts are read in ring
order by two threads with ``get_many(..., cache=False)``: entries the host cache holds are
copied out of it, the others are read straight into the slot (no copy, no cache slot
taken).

The model applies a layer's experts in ascending id order and looks each up once, so when
it asks for an expert of part ``p``, the parts of the layer before ``p`` are done: their
slots are given back and refilled with the parts that follow, ``slots`` positions ahead.
A layer's remaining parts are given back when the layer is done. Positions count parts
through the passes (``(pass · layers + layer index) · parts + part``); slot ``q mod slots``
holds position ``q``. A read into a slot waits for the slot's previous read to end, so a
part no token was routed to (given back while still landing) is never overwritten
mid-read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch
from torch import Tensor

import tierstore

from ..model import ExpertWeights
from .budget import too_small
from .ring_loans import Landing

ALIGN = 4096
# Entries at least this large start on a page, so O_DIRECT reads land in the slot itself;
# smaller ones are packed (their reads are copied in, which costs little at that size).
DIRECT_MIN_BYTES = 64 << 10


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _aligned_bytes(n: int) -> Tensor:
    """``n`` bytes starting on a page (O_DIRECT reads need that), on 2 MiB pages where the
    kernel has them (:func:`tierstore.read_buffer`), every page touched now: a read into
    memory never touched has the kernel fault in and zero each page as the read lands."""
    buf = tierstore.read_buffer(n)
    buf[::ALIGN] = 0
    return buf


class PartLayout:
    """Where each entry of a part sits in a slot's arena: ``(name, offset, dtype,
    shape, nbytes)`` per entry, and the arena's size."""

    def __init__(self, infos: Sequence[tierstore.EntryInfo]) -> None:
        self.entries: list[tuple[str, int, torch.dtype, tuple[int, ...], int]] = []
        off = end = 0
        for info in infos:
            if info.nbytes >= DIRECT_MIN_BYTES:
                off = _align(off, ALIGN)
                end = off + _align(info.nbytes, ALIGN)  # O_DIRECT reads whole pages
            else:
                off = _align(off, 64)
                end = off + info.nbytes
            self.entries.append((info.name, off, info.dtype, tuple(info.shape), info.nbytes))
            off = end
        self.nbytes = _align(max(end, 1), 64)

    def views(self, arena: Tensor) -> dict[str, Tensor]:
        return {name: arena[off:off + n].view(dtype).view(shape)
                for name, off, dtype, shape, n in self.entries}


def plan_parts(part_of: Any, n_experts: int, budget: int, per_part: int) -> tuple[int, int]:
    """``(experts per part, slots)``: parts of ``per_part`` experts (fewer where the budget
    does not hold two of them, down to one expert) and as many slots as the budget holds.
    ``part_of(k)`` is the arena bytes of the largest part of ``k`` experts. A budget that
    cannot hold one expert raises, naming what it needs."""
    k = max(1, min(per_part, n_experts))
    while k > 1 and budget // part_of(k) < 2:
        k = max(1, k // 2)
    slots = budget // part_of(k)
    if slots < 1:
        raise too_small("one expert (the ring's smallest slot)", part_of(1), budget)
    return k, slots


class PartRing:
    """The parts machinery of :class:`trainer.infer.ring.RingSource` (see the module
    docstring). ``layers``: the MoE layers in order; ``budget``: bytes the slots may take;
    ``per_part``: experts per part at most; ``layers_held``: at most this many layers' parts
    at once (None: as many parts as the budget holds)."""

    def __init__(self, store: tierstore.Store, layers: Sequence[int], n_experts: int,
                 budget: int, *, per_part: int, names: Callable[[int, int], Sequence[str]],
                 layers_held: int | None = None) -> None:
        self.store = store
        self.layers = list(layers)
        self.n_experts = n_experts
        infos = {layer: [[store.info(n) for n in names(layer, e)]
                         for e in range(n_experts)] for layer in self.layers}

        def part_of(k: int) -> int:
            return max(PartLayout([i for one in experts[s:s + k] for i in one]).nbytes
                       for experts in infos.values() for s in range(0, n_experts, k))

        self.per_part, cap = plan_parts(part_of, n_experts, budget, per_part)
        self.n_parts = -(-n_experts // self.per_part)
        total = len(self.layers) * self.n_parts
        held = cap if layers_held is None else layers_held * self.n_parts
        self.slots = max(1, min(cap, held, total))
        self.layouts = {(layer, p): PartLayout([i for one in infos[layer][s:s + self.per_part]
                                                for i in one])
                        for layer in self.layers
                        for p, s in enumerate(range(0, n_experts, self.per_part))}
        self.part_bytes = max(lay.nbytes for lay in self.layouts.values())
        # Made now, not at a slot's first read: the memory the budget allows is taken when
        # the ring is built (before the first pass, see RingSource.prepare).
        self._arenas: list[Tensor] = [_aligned_bytes(self.part_bytes)
                                      for _ in range(self.slots)]
        self._holds: list[tuple[int, int] | None] = [None] * self.slots  # landed content
        self._last: list[Future[Any] | None] = [None] * self.slots  # the slot's last read
        self._futures: dict[int, Future[dict[str, Tensor]]] = {}  # position -> its read
        self._next = 0  # first position not requested yet
        self._freed = 0  # positions below this have given their slots back
        self._worker: ThreadPoolExecutor | None = None
        self.closed = False  # restart before the next pass
        # Where every part fits at once, a slot keeps its part from pass to pass: it is
        # read again only if one of its entries has a newer version than the one read.
        self._keeps = self.slots == total
        self._versions: dict[tuple[int, int], list[int]] = {}
        self._lock = threading.Lock()  # read_s, appended to by the reading threads
        self.bytes_moved = 0  # bytes of the parts read into slots (or copied from the cache)
        self.read_s: list[float] = []  # seconds of each part's read

    # -- positions --------------------------------------------------------------------
    def position(self, ring_pos: int, part: int = 0) -> int:
        """The position of part ``part`` of the layer at ring position ``ring_pos``."""
        return ring_pos * self.n_parts + part

    def _where(self, q: int) -> tuple[int, int]:
        ring_pos, part = divmod(q, self.n_parts)
        return self.layers[ring_pos % len(self.layers)], part

    def top_up(self, end: int) -> None:
        """Request every position before ``end`` that has a free slot."""
        end = min(end, self._freed + self.slots)
        while self._next < end:
            self._request(self._next)
            self._next += 1

    def _request(self, q: int) -> None:
        s = q % self.slots
        where = self._where(q)
        lay = self.layouts[where]
        views = lay.views(self._arenas[s])
        last = self._last[s]
        if self._keeps:
            versions = [self.store.info(n).version for n in views]
            if self._holds[s] == where and last is not None \
                    and self._versions.get(where) == versions:
                self._futures[q] = last  # still there, unchanged
                return
            self._versions[where] = versions  # read no earlier than these versions
        self._holds[s] = None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(2, thread_name_prefix="tierstore-ring")
        fut = self._worker.submit(self._read, last, views)
        fut.add_done_callback(lambda f, s=s, where=where: self._landed(f, s, where))
        self._last[s] = fut
        self._futures[q] = fut
        # Counted as the read is issued (and taken back if it is cancelled before it
        # starts), so the figure does not depend on when the reading thread finishes.
        self.bytes_moved += self._entry_bytes(where)

    def _read(self, prev: Future[Any] | None, views: dict[str, Tensor]) -> dict[str, Tensor]:
        if prev is not None:  # never write a slot that a read still fills
            futures_wait([prev])  # its outcome is its own reader's to see
        t0 = time.perf_counter()
        self.store.get_many(list(views), out=views, cache=False)
        dt = time.perf_counter() - t0
        with self._lock:
            self.read_s.append(dt)
        return views

    def _entry_bytes(self, where: tuple[int, int]) -> int:
        return sum(e[4] for e in self.layouts[where].entries)

    def _landed(self, fut: Future[Any], slot: int, where: tuple[int, int]) -> None:
        if not fut.cancelled() and fut.exception() is None and self._last[slot] is fut:
            self._holds[slot] = where

    def release_below(self, q: int) -> None:
        """Positions before ``q`` are done: their slots may be refilled."""
        if q > self._freed:
            for p in range(self._freed, q):
                self._futures.pop(p, None)
            self._freed = q

    def part(self, q: int) -> Future[dict[str, Tensor]]:
        """The read of position ``q``, which must not have been given back; the positions
        before it are given back first, so that it has a slot."""
        if q < self._freed:
            raise RuntimeError(f"part position {q} was already given back")
        self.release_below(q)
        self.top_up(q + 1)
        return self._futures[q]

    def restart(self, q: int) -> None:
        """Forget every request and go on from position ``q`` (after :meth:`close`, or a
        pass that stopped part way). Reads still running end on their own; a slot's next
        read waits for them."""
        for p, f in self._futures.items():
            if f.cancel():  # never started: nothing moved (a reused part has landed)
                self.bytes_moved -= self._entry_bytes(self._where(p))
        self._futures.clear()
        self._holds = [None] * self.slots
        self._next = self._freed = q
        self.closed = False

    def close(self) -> None:
        """Forget every request and end the reading threads once their reads end."""
        self.restart(self._next)
        self.closed = True
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

    @property
    def freed(self) -> int:
        """Positions below this have given their slots back."""
        return self._freed

    @property
    def arena_bytes(self) -> int:
        """Bytes of the slots' arenas."""
        return self.part_bytes * len(self._arenas)


class PartsOfLayer(Landing):
    """A layer's routed experts from the ring's own slots: looking an expert up gives the
    parts of the layer before its own back to the ring and waits for its own part only."""

    def __init__(self, ring: Any, base: int, names: list[tuple[str, ...]],
                 ids: Sequence[int], held: dict[int, ExpertWeights]) -> None:
        self._base = base
        super().__init__(ring, held, names, ids)

    def _part(self, e: int) -> Future[dict[str, Tensor]]:
        parts: PartRing = self._ring._parts_ring
        q = self._base + e // parts.per_part
        parts.release_below(q)
        parts.top_up(self._ring._parts_end())
        return parts.part(q)  # top_up stops at the pass's end, never before q
