"""Asynchronous device prefetch queues: one per device, a priority heap, a byte budget.

A request names an entry and a priority (smaller is needed sooner; a number or a tuple of
numbers such as ``(step, layer)``). Requests for one entry share one transfer and one
:class:`~concurrent.futures.Future`. A transfer runs in two stages:

1. backing tier → host bytes, on the queue's small I/O thread pool (the store's
   ``_host_bytes``: a pinned host-cache slot or a freshly read, checksum-verified buffer);
2. host → device. On CUDA (any asynchronous device: a :class:`~tierstore.devices.DeviceCopier`
   does the device's part), a ``non_blocking`` copy issued by the queue's copy thread on a
   dedicated stream, followed by an event. The copy thread keeps up to
   :data:`COPIES_IN_FLIGHT` copies in flight; each one's host bytes are released, and its
   future resolved, once its event has completed.
   On the CPU "device" a real copy into a freshly allocated tensor, unless the queue lends
   views (``zero_copy``, switched on by :meth:`PrefetchQueue.set_zero_copy`, which the
   inference sources do): the device memory *is* host memory, so stage 2 is then a pin, not
   a copy. The entry is a read-only view of its pinned host-cache slot, or the freshly read
   buffer itself where the cache did not take it. The
   slot stays pinned (never evicted, never reused) while the queue holds the entry and
   while any tensor over it is alive; the pin goes back once both are gone, so a view that
   was handed out stays valid after :meth:`PrefetchQueue.drop`. Never write into such a
   view: it is the cache's copy of the entry, which other readers share. The copy thread
   then only gives pins back (a tensor may die on any thread, holding any lock, so its
   last reference only queues the unpin).

Device memory is a budget of byte credits (Janus): a transfer takes its entry's bytes in
credits when it starts (an I/O thread picks it from the heap) and gives them back when the
device copy is released or cancelled; on the zero-copy path the budget bounds the bytes the
queue holds pinned. Only the head of the heap may start, so when credits run out
lower-priority work waits behind it instead of slipping past; a more urgent request
overtakes everything still queued but never preempts a transfer that has started. On the
zero-copy path an I/O thread starts the heads of one urgency and priority together (its
share of what is queued) and loads them in one call, so their reads run in parallel and
the per-entry cost of a whole layer's request is paid once.

Lifetimes on an asynchronous device. :meth:`PrefetchQueue.acquire` makes the caller's current
stream wait for the copy's event (the host never waits) and records that stream as a user
of the bytes. A future resolves only once its copy has completed, so its tensor may be used
on any stream. :meth:`PrefetchQueue.drop` (release or cancel) records an event on the
caller's current stream, after the work queued there so far, and records that stream as a
user too; the entry keeps its credits, and the queue its reference, until that event has
completed. So credits never come back while a consumer's kernels may still read the bytes,
and the device memory the queue is responsible for never exceeds the budget: a transfer that
needs the credits waits (on an I/O thread, never in ``acquire``) for the consumer to pass
its release point. The rule for callers: release (or cancel) on the stream that used the
tensor; a tensor also used on other streams needs ``record_stream`` for each of them, or
those streams synchronised before the release.

``stats()`` counts ``bytes_moved`` (every landed transfer, copied or pinned), ``bytes_read``
(the part read from the backing tier) and ``bytes_copied`` (0 on the zero-copy path).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import numbers
import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .devices import DeviceCopier, normalize_device
from .errors import StoreClosedError, StoreError
from .sizes import format_size, parse_size
from .tensors import dtype_from_name, from_bytes

Key = tuple[str, str]
# torch dtypes that numpy has too (same bytes, same layout)
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    dt: torch.empty(0, dtype=dt).numpy().dtype
    for dt in (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
               torch.complex128)}
# ``load(keys) -> ({key: (meta, raw bytes)}, handles to release)``: the store's _host_bytes.
Loader = Callable[[list[Key]], tuple[dict[Key, tuple[Any, Any]], list[Any]]]
SizeOf = Callable[[Key], int]

IO_THREADS = 2
DEFAULT_CPU_BUDGET = 1 << 30
# A zero-copy stage-1 batch: at most this many entries and bytes (more would make the
# first of them wait for the last).
MAX_BATCH = 32
MAX_BATCH_BYTES = 64 << 20
MAX_SIZES_KEPT = 1 << 20  # entry sizes a queue remembers (about 100 MiB at most)
# Of the device's memory, when no budget is configured. A ceiling rather than a guess of
# what a model needs: callers that know their working set (the store trainer does) pass it.
DEFAULT_CUDA_FRACTION = 0.5
# Device copies the copy thread keeps in flight; each holds its host bytes (a pinned cache
# slot) until it lands.
COPIES_IN_FLIGHT = 8

_QUEUED, _LOADING, _COPYING, _RESIDENT, _DONE = "queued", "loading", "copying", "resident", "done"


def _settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a future unless its caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # cancelled: the cancel callback has dropped the entry


def normalize_priority(priority: Any) -> tuple[float, ...]:
    """Priorities as tuples so that ``3`` and ``(0, 3)`` compare (lexicographically) in one
    heap instead of raising TypeError halfway through a heap operation."""
    items = tuple(priority) if isinstance(priority, (tuple, list)) else (priority,)
    if not items or not all(isinstance(p, numbers.Real) for p in items):
        raise StoreError(f"a priority is a number or a tuple of numbers, got {priority!r}")
    if any(isinstance(p, float) and math.isnan(p) for p in items):
        raise StoreError("a priority cannot be NaN")
    return items


def layer_of(priority: Any) -> Any:
    """The layer a request is for, for stall accounting: ``priority[1]`` of a
    ``(step, layer, ...)`` tuple, else the priority itself."""
    if isinstance(priority, (tuple, list)):
        return priority[1] if len(priority) >= 2 else priority[0]
    return priority


class _Pins:
    """The loader's handles on some host bytes (a slot's pin), given to ``unpin`` when the
    last zero-copy view over those bytes is gone (see :class:`_Pinned`)."""

    __slots__ = ("handles", "unpin")

    def __init__(self, handles: list[Any], unpin: Callable[[list[Any]], None]) -> None:
        self.handles, self.unpin = handles, unpin

    def __del__(self) -> None:
        handles, self.handles = self.handles, None
        if handles:
            self.unpin(handles)


class _Pinned:
    """The numpy base of a zero-copy view: numpy keeps the object that provides
    ``__array_interface__`` as the array's base and torch keeps that array, so this object
    lives exactly as long as any array or tensor over the bytes, and keeps their pins."""

    __slots__ = ("__array_interface__", "_bytes", "_pins")

    def __init__(self, raw: np.ndarray | torch.Tensor, pins: _Pins) -> None:
        arr = raw.numpy() if isinstance(raw, torch.Tensor) else raw
        self._bytes = arr  # keeps the memory under the interface alive
        self._pins = pins
        self.__array_interface__ = arr.__array_interface__


@dataclass(eq=False)
class _Entry:
    key: Key
    nbytes: int
    priority: tuple[float, ...]
    layer: Any
    future: Future[torch.Tensor] = field(default_factory=Future)
    urgent: bool = False  # someone waits in acquire(): ahead of every prefetch
    seq: int = -1  # of the entry's live heap item; older items for it are stale
    state: str = _QUEUED
    credited: int = 0  # credits this entry holds
    dropped: bool = False  # released or cancelled while in flight: discard once landed
    zero_copy: bool = False  # stage 2 is a pin (set when it starts)
    tensor: torch.Tensor | None = None
    event: Any = None  # recorded after the copy (asynchronous devices only)
    mark: Any = None  # recorded on the releasing caller's stream: credits wait for it
    error: BaseException | None = None

    @property
    def settled(self) -> bool:
        """Nothing more will happen to it: an acquire can stop waiting."""
        return self.tensor is not None or self.error is not None or self.state == _DONE


@dataclass
class _Stats:
    requests: int = 0
    dedup_hits: int = 0
    transfers: int = 0
    bytes_moved: int = 0
    bytes_read: int = 0
    bytes_copied: int = 0
    failures: int = 0
    cancels: int = 0
    releases: int = 0
    acquires: int = 0
    stalled_acquires: int = 0
    stall_s: float = 0.0
    peak_in_use_bytes: int = 0
    stall_s_by_layer: dict[Any, float] = field(default_factory=lambda: defaultdict(float))


class PrefetchQueue:
    """The prefetch queue of one device; see the module docstring.

    ``on_start(key, in_use_bytes)``, when set, is called (under the queue's lock) each time
    a transfer takes its credits: it lets tests watch the start order and the budget.
    ``zero_copy`` (CPU only; see :meth:`set_zero_copy`) makes stage 2 a pin instead of a
    copy. ``copier`` does an asynchronous device's part of stage 2 (default: a
    :class:`~tierstore.devices.CudaCopier` on CUDA, none on the CPU, whose copies are
    synchronous); tests pass a fake one to check the lifetime rules without a GPU.
    """

    def __init__(
        self,
        device: torch.device,
        budget: int,
        load: Loader,
        size_of: SizeOf,
        *,
        io_threads: int = IO_THREADS,
        zero_copy: bool = False,
        copier: DeviceCopier | None = None,
    ) -> None:
        self.device = device
        self.budget = budget
        self.on_start: Callable[[Key, int], None] | None = None
        self._load = load
        self._size_of = size_of
        self._cv = threading.Condition()
        self._entries: dict[Key, _Entry] = {}
        self._sizes: dict[Key, int] = {}  # known sizes of entries requested before
        # Items name their entry by key, so a stale item (cancelled, started, re-prioritised)
        # keeps nothing alive: a landed view's pin must go with its entry and its future.
        self._heap: list[tuple[bool, tuple[float, ...], int, Key]] = []
        self._seq = itertools.count()
        self._in_use = 0
        self._closing = False
        self._stats = _Stats()
        if copier is None and device.type == "cuda":
            from .devices import CudaCopier

            copier = CudaCopier(device)
        self._copier = copier
        self.zero_copy = False
        self.set_zero_copy(zero_copy)
        self._stream = getattr(copier, "stream", None)
        # Copies issued but not yet known to have landed (copy thread only), and released
        # entries whose consumers may still be using them (lock held), oldest first.
        self._inflight: collections.deque[tuple[_Entry, torch.Tensor, Any, list[Any]]] = (
            collections.deque())
        self._draining: collections.deque[_Entry] = collections.deque()
        # Copy jobs, and (zero-copy) lists of handles whose views have died: SimpleQueue.put
        # is reentrant, safe from a __del__ that runs wherever a tensor's last reference goes.
        self._copies: queue.SimpleQueue[tuple[_Entry, Any, Any, list[Any]] | list[Any] | None] = (
            queue.SimpleQueue())
        self._unpin_direct = False  # set once the copy thread is gone
        self._idle_io = 0  # I/O threads waiting for work
        name = f"tierstore-prefetch-{device}"
        self._io = [threading.Thread(target=self._io_loop, name=f"{name}-io{i}", daemon=True)
                    for i in range(io_threads)]
        self._copy_thread = threading.Thread(target=self._copy_loop, name=f"{name}-copy",
                                             daemon=True)
        for t in (*self._io, self._copy_thread):
            t.start()

    def set_zero_copy(self, on: bool = True) -> bool:
        """Lend views instead of copies from now on (``on``), or copy again; returns
        whether views are lent. Only the CPU "device" can: on CUDA stage 2 must copy into
        device memory, and asking for views there returns False. A caller that switches
        views on must never write into what :meth:`acquire` returns (it is the host cache's
        copy of the entry); transfers already started keep the mode they started with."""
        with self._cv:
            self.zero_copy = bool(on) and self._copier is None and self.device.type == "cpu"
            return self.zero_copy

    # -- requests -------------------------------------------------------------------
    def request(self, keys: Iterable[Key], priority: Any = 0) -> list[Future[torch.Tensor]]:
        """Futures of the device copies of ``keys``, queued at ``priority`` (or shared with
        an earlier request for the same entry, whose priority is raised if this one is more
        urgent)."""
        prio, layer = normalize_priority(priority), layer_of(priority)
        keys = list(keys)
        known: list[_Entry | None] = [None] * len(keys)
        made: list[_Entry] = []
        # One acquisition of the lock for every key whose size the queue already knows;
        # the others take the slow path (a catalog lookup, outside the lock).
        with self._cv:
            for i, key in enumerate(keys):
                entry = self._join(key, prio, layer, urgent=False)
                if entry is None:
                    nbytes = self._sizes.get(key)
                    if nbytes is None or nbytes > self.budget:
                        continue
                    entry = self._insert(key, nbytes, prio, layer, urgent=False)
                    made.append(entry)
                known[i] = entry
        for entry in made:
            self._watch(entry)
        return [(e if e is not None else self._enter(k, prio, layer, urgent=False)).future
                for k, e in zip(keys, known)]

    def _enter(self, key: Key, prio: tuple[float, ...], layer: Any, urgent: bool) -> _Entry:
        with self._cv:
            found = self._join(key, prio, layer, urgent)
        if found is not None:
            return found
        # A new entry: its size decides its credits. Look it up without holding the lock,
        # then insert it unless another thread did meanwhile.
        try:
            nbytes = self._size_of(key)
        except Exception as e:  # unknown entry, closed store: this request fails alone
            return self._failed(key, prio, layer, e)
        self._remember(key, nbytes)
        if nbytes > self.budget:
            return self._failed(key, prio, layer, StoreError(
                f"entry {key[0]!r} (kind {key[1]!r}) is {format_size(nbytes)}, more than the "
                f"whole prefetch budget of {self.device} ({format_size(self.budget)})"))
        with self._cv:
            found = self._join(key, prio, layer, urgent)
            if found is not None:
                return found
            entry = self._insert(key, nbytes, prio, layer, urgent)
        self._watch(entry)
        return entry

    def _insert(self, key: Key, nbytes: int, prio: tuple[float, ...], layer: Any,
                urgent: bool) -> _Entry:
        """A new entry, queued (lock held)."""
        entry = _Entry(key, nbytes, prio, layer, urgent=urgent)
        self._entries[key] = entry
        self._stats.requests += 1
        self._push(entry)
        return entry

    def _watch(self, entry: _Entry) -> None:
        """Cancel the entry when its future is cancelled (lock not held: the callback runs
        at once if it already is). A weak reference: the future must not keep its entry
        (and so, through the entry, itself and its result) alive in a cycle that only the
        garbage collector breaks."""
        entry.future.add_done_callback(lambda f, ref=weakref.ref(entry): self._on_done(ref))

    def _remember(self, key: Key, nbytes: int) -> None:
        """Keep an entry's size for its next request: the catalog lookup costs more than
        the rest of a request. A stale size is harmless: stage 1 sees the entry's real size
        and re-queues it at that size (:meth:`_resize`)."""
        if len(self._sizes) >= MAX_SIZES_KEPT:
            self._sizes.clear()
        self._sizes[key] = nbytes

    def _join(self, key: Key, prio: tuple[float, ...], layer: Any, urgent: bool) -> _Entry | None:
        """The live entry for ``key``, made more urgent if asked (lock held)."""
        if self._closing:
            raise StoreClosedError(f"the prefetch queue of {self.device} is closed")
        entry = self._entries.get(key)
        if entry is None:
            return None
        if not urgent:
            self._stats.dedup_hits += 1
        if entry.state == _QUEUED:
            if urgent and not entry.urgent:
                entry.urgent = True  # keeps its priority (and layer) among the urgent ones
                self._push(entry)
            elif not urgent and prio < entry.priority:
                entry.priority, entry.layer = prio, layer
                self._push(entry)
        return entry

    def _failed(self, key: Key, prio: tuple[float, ...], layer: Any, err: Exception) -> _Entry:
        entry = _Entry(key, 0, prio, layer, state=_DONE, error=err)
        entry.future.set_exception(err)
        with self._cv:
            self._stats.requests += 1
            self._stats.failures += 1
        return entry

    def _push(self, entry: _Entry) -> None:
        entry.seq = next(self._seq)
        # Urgent (False sorts first) before everything else, then priority, then FIFO.
        heapq.heappush(self._heap, (not entry.urgent, entry.priority, entry.seq, entry.key))
        self._cv.notify_all()

    # -- acquire, release, cancel ---------------------------------------------------
    def acquire(self, key: Key, timeout: float | None = None) -> torch.Tensor:
        """The device copy of ``key``, waiting only while its transfer is not done; an entry
        not requested before is fetched now, ahead of every queued prefetch. On CUDA the
        current stream is made to wait on the copy's event instead of the host."""
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        waited = False
        while True:
            entry = self._enter(key, (-math.inf,), None, urgent=True)
            with self._cv:
                while not entry.settled:
                    left = None if deadline is None else deadline - time.perf_counter()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"{key[0]!r} did not reach {self.device} in "
                                           f"{timeout} s (prefetch budget exhausted?)")
                    waited = True
                    self._cv.wait(left)
                if entry.tensor is not None or entry.error is not None:
                    self._account_acquire(entry, time.perf_counter() - start if waited else 0.0)
                    break
                if self._closing:
                    raise StoreClosedError(f"the prefetch queue of {self.device} is closed")
            # Cancelled (by another caller) before it started: ask again.
        if entry.error is not None:
            raise entry.error
        tensor = entry.tensor
        if entry.event is not None and self._copier is not None:
            self._copier.wait(entry.event, tensor)
        return tensor

    def _account_acquire(self, entry: _Entry, stall: float) -> None:
        s = self._stats
        s.acquires += 1
        if stall > 0:
            s.stalled_acquires += 1
            s.stall_s += stall
            s.stall_s_by_layer[entry.layer] += stall

    def drop(self, keys: Iterable[Key], *, release: bool) -> int:
        """Release (``release=True``) or cancel entries: a queued one is cancelled (its
        future too) before it takes any credit; one in flight has its future cancelled and
        its credits come back when its bytes have landed; a resident one gives its credits
        back now. Returns how many entries were dropped."""
        cancel: list[_Entry] = []
        with self._cv:
            n = 0
            for key in dict.fromkeys(keys):
                entry = self._entries.pop(key, None)
                if entry is None:
                    continue
                n += 1
                if entry.tensor is not None and self._copier is not None:
                    # Handed out (acquired, or its future resolved): the caller's stream may
                    # still have work reading it queued (see the module docstring).
                    entry.mark = self._copier.mark(entry.tensor)
                if entry.state == _RESIDENT:
                    self._retire(entry)
                    self._stats.releases += release
                    self._stats.cancels += not release
                else:
                    cancel.append(entry)
                    self._abandon(entry)
            self._cv.notify_all()
        for entry in cancel:  # outside the lock: done callbacks run here
            entry.future.cancel()
        return n

    def _abandon(self, entry: _Entry) -> None:
        """Forget a cancelled entry (lock held; it is already out of the table)."""
        self._stats.cancels += 1
        if entry.state == _QUEUED:
            entry.state = _DONE  # its heap item is now stale; it never took a credit
        elif entry.state == _RESIDENT:  # its future was cancelled just as it landed
            self._retire(entry)
        else:
            entry.dropped = True  # the credits come back once its bytes have landed

    def _on_done(self, ref: weakref.ref[_Entry]) -> None:
        """A cancelled future (by :meth:`drop` or by its caller) cancels its entry."""
        entry = ref()
        if entry is None or not entry.future.cancelled():
            return
        # Without this, concurrent.futures.wait() and as_completed() would never count the
        # future as done: they wait for the "notified" state that executors set.
        entry.future.set_running_or_notify_cancel()
        with self._cv:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                self._abandon(entry)
                self._cv.notify_all()

    def _retire(self, entry: _Entry) -> None:
        """Give an entry's credits back (lock held), or, if a consumer's release point has
        not been passed yet, once it has (:meth:`_reap`)."""
        entry.state = _DONE
        if entry.mark is not None and not entry.mark.query():
            if entry.credited:
                self._draining.append(entry)
            return
        self._in_use -= entry.credited
        entry.credited = 0
        if entry.tensor is not None and self._copier is not None:
            self._copier.retire(entry.tensor)

    def _reap(self, wait: bool = False) -> bool:
        """Give back the credits of drained entries whose consumers are done (lock held);
        with ``wait``, first wait (lock released meanwhile) for the oldest one's consumer.
        Returns whether any came back."""
        if wait and self._draining:
            mark = self._draining[0].mark
            self._cv.release()
            try:
                mark.synchronize()
            finally:
                self._cv.acquire()
        back = False
        while self._draining and self._draining[0].mark.query():
            entry = self._draining.popleft()
            entry.mark = None
            self._retire(entry)
            back = True
        if back:
            self._cv.notify_all()
        return back

    # -- stage 1: backing tier -> host bytes ---------------------------------------------
    def _head(self) -> _Entry | None:
        """The live entry at the head of the heap, stale items dropped (lock held)."""
        while self._heap:
            _, _, seq, key = self._heap[0]
            head = self._entries.get(key)
            if head is not None and head.state == _QUEUED and head.seq == seq:
                return head
            heapq.heappop(self._heap)  # stale: cancelled, started or re-prioritised
        return None

    def _next(self) -> list[_Entry] | None:
        """Wait for the head of the heap to fit the budget and take its credits; None once
        the queue closes. On the zero-copy path the heads right behind it of the same
        urgency and priority (one request, typically) come along while they fit, up to this
        thread's share of the queued items: one load of many keys costs one pass through the
        store (and reads them in parallel) instead of one each."""
        with self._cv:
            self._idle_io += 1
            try:
                while True:
                    if self._closing:
                        return None
                    head = self._head()
                    if head is not None and head.nbytes <= self.budget - self._in_use:
                        break
                    if head is not None and self._draining:
                        # Credits held only until a consumer's stream passes its release
                        # point: wait for that, not for a notification that may never come.
                        self._reap(wait=True)
                        continue
                    self._cv.wait()
                share = -(-len(self._heap) // self._idle_io) if self.zero_copy else 1
                limit, rank = min(share, MAX_BATCH), (head.urgent, head.priority)
                batch: list[_Entry] = []
                nbytes = 0
                while (head is not None and len(batch) < limit
                       and head.nbytes <= self.budget - self._in_use
                       and (not batch or ((head.urgent, head.priority) == rank
                                          and nbytes + head.nbytes <= MAX_BATCH_BYTES))):
                    heapq.heappop(self._heap)
                    head.zero_copy = self.zero_copy  # fixed for the whole batch
                    self._start(head)
                    batch.append(head)
                    nbytes += head.nbytes
                    head = self._head()
                return batch
            finally:
                self._idle_io -= 1

    def _start(self, entry: _Entry) -> None:
        """The entry takes its credits (lock held)."""
        entry.state, entry.credited = _LOADING, entry.nbytes
        self._in_use += entry.nbytes
        self._stats.peak_in_use_bytes = max(self._stats.peak_in_use_bytes, self._in_use)
        if self.on_start is not None:
            self.on_start(entry.key, self._in_use)

    def _io_loop(self) -> None:
        # One call per batch, so that nothing of it (a view holding a pin) stays referenced
        # by this thread's frame while it waits for the next.
        while self._stage1():
            pass

    def _stage1(self) -> bool:
        batch = self._next()
        if batch is None:
            return False
        try:
            self._land_batch(batch)
        except Exception as e:  # whatever went wrong fails its entries, not their waiters
            for entry in batch:
                if entry.state == _LOADING:
                    self._fail(entry, e)
        return True

    def _land_batch(self, batch: list[_Entry]) -> None:
        loaded = self._load_batch(batch)
        landed: list[tuple[_Entry, torch.Tensor | None]] = []
        read = 0
        for entry, got in zip(batch, loaded):
            if isinstance(got, BaseException):
                self._sizes.pop(entry.key, None)
                self._fail(entry, got)
                continue
            meta, raw, handles = got
            if meta.nbytes != entry.nbytes:
                self._remember(entry.key, meta.nbytes)
                if isinstance(handles, list):
                    for h in handles:
                        h.release()
                self._resize(entry, meta.nbytes)
                continue
            # A key with no handle was read into a buffer of its own, one with a new slot
            # was read into that slot: both came from the backing tier.
            hs = handles.handles if isinstance(handles, _Pins) else handles
            n = meta.nbytes if not hs or any(getattr(h, "new", False) for h in hs) else 0
            if entry.zero_copy:
                read += n
                landed.append((entry, self._view(entry, meta, raw, handles)))
                continue
            with self._cv:
                entry.state = _COPYING
                self._stats.bytes_read += n
            self._copies.put((entry, meta, raw, handles))
        if landed:
            with self._cv:
                self._stats.bytes_read += read
            self._landed_many(landed)

    def _load_batch(self, batch: list[_Entry]) -> list[Any]:
        """Stage 1 of a batch: per entry ``(meta, raw bytes, handles)`` or the exception
        its load raised. Handles are a list per key where the loader's handles name their
        keys (the store's cache handles), else (one lease over the whole load) a
        :class:`_Pins` that the batch's views share, released when the last one is gone."""
        keys = [e.key for e in batch]
        try:
            found, handles = self._load(keys)
        except Exception as e:
            if len(batch) == 1:
                return [e]
            # One bad entry (corrupt, deleted) must fail alone: load them one at a time.
            return [self._load_batch([entry])[0] for entry in batch]
        per_key: Mapping[Key, Any]
        wanted = set(keys)
        if len(batch) == 1:
            per_key = {keys[0]: handles}
        elif all(getattr(h, "key", None) in wanted for h in handles):
            mine: dict[Key, list[Any]] = {k: [] for k in keys}
            for h in handles:
                mine[h.key].append(h)
            per_key = mine
        else:
            shared = _Pins(handles, self._unpin)
            per_key = {k: shared for k in keys}
        return [(found[k][0], found[k][1], per_key[k]) for k in keys]

    def _view(self, entry: _Entry, meta: Any, raw: np.ndarray | torch.Tensor,
              handles: list[Any] | _Pins) -> torch.Tensor | None:
        """Zero-copy stage 2: the entry as a view of its host bytes, pinned for as long as
        the view (or anything over it) lives; a buffer with no handle is the entry's own.
        None for an entry dropped meanwhile (its pin goes back)."""
        pins = handles if isinstance(handles, _Pins) else (
            _Pins(handles, self._unpin) if handles else None)
        if entry.dropped:
            return None
        arr = np.asarray(_Pinned(raw, pins)) if pins is not None else raw
        dtype, shape = dtype_from_name(meta.dtype), tuple(meta.shape)
        np_dtype = _NUMPY_DTYPES.get(dtype)
        if np_dtype is None or not meta.nbytes or not isinstance(arr, np.ndarray):
            return from_bytes(arr, dtype, shape)
        # Typed in numpy, one torch call: a few microseconds less per entry than torch's
        # slicing and views, which counts when a ring pins a layer's entries every token.
        return torch.from_numpy(arr[: meta.nbytes].view(np_dtype).reshape(shape))

    def _unpin(self, handles: list[Any]) -> None:
        """Called by dying views: let the copy thread release their handles (a view may
        die on any thread, inside any lock, even the cache's own)."""
        if self._unpin_direct:
            for h in handles:
                h.release()
        else:
            self._copies.put(handles)

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        """The entry was rewritten with another size after it was queued: give the credits
        back and queue it again at its new size."""
        with self._cv:
            self._in_use -= entry.credited
            entry.credited, entry.nbytes = 0, nbytes
            if entry.dropped or self._closing:
                entry.state = _DONE
                self._cv.notify_all()
                return
            if nbytes <= self.budget:
                entry.state = _QUEUED
                self._push(entry)
                return
        self._fail(entry, StoreError(
            f"entry {entry.key[0]!r} (kind {entry.key[1]!r}) grew to {format_size(nbytes)}, "
            f"more than the whole prefetch budget of {self.device}"))

    # -- stage 2: host bytes -> device ------------------------------------------------
    def _copy_loop(self) -> None:
        while self._stage2():
            pass

    def _stage2(self) -> bool:
        """One job of the copy thread (a call of its own: see :meth:`_io_loop`)."""
        if self._inflight:
            try:
                job = self._copies.get_nowait()
            except queue.Empty:
                self._land_copy(wait=True)  # nothing new to issue: wait for the oldest
                return True
        else:
            job = self._copies.get()
        if job is None:
            while self._inflight:
                self._land_copy(wait=True)
            return False
        if isinstance(job, list):  # handles of zero-copy views that have died
            # Views die in bursts (a layer's at once): release all that are waiting.
            while True:
                for h in job:
                    h.release()
                try:
                    job = self._copies.get_nowait()
                except queue.Empty:
                    return True
                if not isinstance(job, list):
                    break
            if job is None:
                while self._inflight:
                    self._land_copy(wait=True)
                return False
        entry, meta, raw, handles = job
        del job
        if self._copier is not None:
            self._issue(entry, meta, raw, handles)
            return True
        tensor = None
        try:
            if not entry.dropped:
                tensor = self._copy(entry, meta, raw)
        except Exception as e:
            self._fail(entry, e)
            return True
        finally:
            for h in handles:  # the copy has landed (or never ran): the bytes may go
                h.release()
        self._landed(entry, tensor)
        return True

    def _copy(self, entry: _Entry, meta: Any, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The CPU "device"'s copy of the host bytes, landed when this returns."""
        # Raw bytes, never typed values: bool and sub-byte dtypes have no copy kernels that
        # keep every bit pattern.
        src = (torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw)[: meta.nbytes]
        dtype, shape = dtype_from_name(meta.dtype), tuple(meta.shape)
        dst = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        # numpy's copy stays on this thread; torch's would start a second OpenMP pool
        # that competes with the caller's compute threads for the cores.
        np.copyto(dst.numpy(), src.numpy())
        return (from_bytes(dst, dtype, shape) if meta.nbytes
                else torch.empty(shape, dtype=dtype, device=self.device))

    def _issue(self, entry: _Entry, meta: Any, raw: np.ndarray | torch.Tensor,
               handles: list[Any]) -> None:
        """Start an asynchronous device copy (raw bytes, as :meth:`_copy`); it lands in
        :meth:`_land_copy`, which releases the host bytes and resolves the future."""
        if entry.dropped:
            for h in handles:
                h.release()
            self._landed(entry, None)
            return
        assert self._copier is not None
        try:
            src = (torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw)[: meta.nbytes]
            dtype, shape = dtype_from_name(meta.dtype), tuple(meta.shape)
            dst = self._copier.empty(meta.nbytes)
            event = self._copier.copy(dst, src)
            tensor = (from_bytes(dst, dtype, shape) if meta.nbytes
                      else torch.empty(shape, dtype=dtype, device=self.device))
        except Exception as e:
            for h in handles:
                h.release()
            self._fail(entry, e)
            return
        with self._cv:
            # Usable from now on: acquire() orders the caller's stream after the event, so
            # callers need not wait for the host to see the copy finish.
            entry.tensor, entry.event = tensor, event
            self._cv.notify_all()
        self._inflight.append((entry, tensor, event, handles))
        while self._inflight and (len(self._inflight) > COPIES_IN_FLIGHT
                                  or self._inflight[0][2].query()):
            self._land_copy(wait=True)

    def _land_copy(self, wait: bool) -> None:
        """The oldest copy in flight has landed (waiting for it with ``wait``): its host
        bytes go back and its entry becomes resident."""
        entry, tensor, event, handles = self._inflight.popleft()
        try:
            if wait:
                event.synchronize()
        finally:
            for h in handles:
                h.release()
        self._landed(entry, tensor)

    def _landed(self, entry: _Entry, tensor: torch.Tensor | None) -> None:
        self._landed_many([(entry, tensor)])

    def _landed_many(self, landed: list[tuple[_Entry, torch.Tensor | None]]) -> None:
        """Stage 2 is over: the entries are resident (or, dropped meanwhile, give their
        credits back). Their futures resolve after that, outside the lock, where callbacks
        may run."""
        with self._cv:
            for entry, tensor in landed:
                if tensor is not None:
                    entry.tensor = tensor
                    self._stats.transfers += 1
                    self._stats.bytes_moved += entry.nbytes
                    self._stats.bytes_copied += 0 if entry.zero_copy else entry.nbytes
                if entry.dropped:
                    self._retire(entry)
                else:
                    entry.state = _RESIDENT
            self._cv.notify_all()
        for entry, tensor in landed:
            if tensor is not None:
                _settle(entry.future, tensor)

    def _fail(self, entry: _Entry, err: Exception) -> None:
        with self._cv:
            self._stats.failures += 1
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]  # a later request tries again
            self._retire(entry)
            entry.error = err
            self._cv.notify_all()
        _settle(entry.future, error=err)

    # -- lifecycle and figures -------------------------------------------------------
    def close(self) -> None:
        """Cancel queued requests, let running transfers finish, join the threads and give
        every credit back."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            queued = [e for e in self._entries.values() if e.state == _QUEUED]
            for entry in queued:
                del self._entries[entry.key]
                self._abandon(entry)
            self._heap.clear()
            self._cv.notify_all()
        for entry in queued:
            entry.future.cancel()
        for t in self._io:
            t.join()
        self._copies.put(None)
        self._copy_thread.join()
        with self._cv:
            for entry in self._entries.values():
                self._retire(entry)
            self._entries.clear()
            while self._draining:  # consumers finish what they queued before closing
                self._reap(wait=True)
            self._cv.notify_all()
        # Views that die from now on release their own pins; those queued meanwhile go now.
        self._unpin_direct = True
        while True:
            try:
                job = self._copies.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, list):
                for h in job:
                    h.release()

    def stats(self) -> dict[str, Any]:
        """The queue's figures. ``bytes_moved``: bytes of every transfer that landed on the
        device (copied, or on the zero-copy path pinned in place); ``bytes_read``: the part
        of them read from the backing tier rather than found in the host cache;
        ``bytes_copied``: the part copied into device memory (0 on the zero-copy path);
        ``draining``: released entries still holding credits until their consumers' streams
        pass the release point (asynchronous devices only)."""
        with self._cv:
            self._reap()
            s = self._stats
            states = [e.state for e in self._entries.values()]
            return {
                "budget_bytes": self.budget,
                "in_use_bytes": self._in_use,
                "draining": len(self._draining),
                "peak_in_use_bytes": s.peak_in_use_bytes,
                "queued": states.count(_QUEUED),
                "in_flight": states.count(_LOADING) + states.count(_COPYING),
                "resident": states.count(_RESIDENT),
                "requests": s.requests,
                "dedup_hits": s.dedup_hits,
                "transfers": s.transfers,
                "bytes_moved": s.bytes_moved,
                "bytes_read": s.bytes_read,
                "bytes_copied": s.bytes_copied,
                "zero_copy": self.zero_copy,
                "failures": s.failures,
                "cancels": s.cancels,
                "releases": s.releases,
                "acquires": s.acquires,
                "stalled_acquires": s.stalled_acquires,
                "stall_s": s.stall_s,
                "stall_s_by_layer": dict(s.stall_s_by_layer),
            }


class DeviceQueues:
    """The store's prefetch queues, one per device, made on first use.

    ``budget``: bytes (or a size string) for every device, or a mapping from a device
    (``"cpu"``, ``"cuda"``, ``"cuda:1"``) to its budget; a device with none configured gets
    1 GiB on the CPU, half of its memory on CUDA. ``zero_copy``: the CPU queue lends views
    from the start (see :meth:`PrefetchQueue.set_zero_copy`).
    """

    def __init__(
        self,
        load: Loader,
        size_of: SizeOf,
        budget: int | str | Mapping[str, int | str] | None = None,
        *,
        io_threads: int = IO_THREADS,
        zero_copy: bool = False,
    ) -> None:
        self._load = load
        self._size_of = size_of
        self._io_threads = io_threads
        self._zero_copy = zero_copy
        if budget is None or isinstance(budget, Mapping):
            self._default = None
            self._budgets = {str(k): parse_size(v) for k, v in (budget or {}).items()}
        else:
            self._default, self._budgets = parse_size(budget), {}
        self._lock = threading.Lock()
        self._queues: dict[torch.device, PrefetchQueue] | None = {}

    @staticmethod
    def device(device: str | torch.device | None) -> torch.device:
        dev = torch.device(device if device is not None else "cpu")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise StoreError(f"cannot prefetch to {dev}: CUDA is not available")
        # Queues are keyed by device: "cuda" and "cuda:0" must find the same one.
        return normalize_device(dev)

    def _budget(self, dev: torch.device) -> int:
        for name in (str(dev), dev.type):
            if name in self._budgets:
                return self._budgets[name]
        if self._default is not None:
            return self._default
        if dev.type == "cuda":
            total = torch.cuda.get_device_properties(dev).total_memory
            return int(total * DEFAULT_CUDA_FRACTION)
        return DEFAULT_CPU_BUDGET

    def get(self, device: str | torch.device | None) -> PrefetchQueue:
        dev = self.device(device)
        with self._lock:
            if self._queues is None:
                raise StoreClosedError("the store's prefetch queues are closed")
            q = self._queues.get(dev)
            if q is None:
                q = PrefetchQueue(dev, self._budget(dev), self._load, self._size_of,
                                  io_threads=self._io_threads,
                                  zero_copy=self._zero_copy and dev.type == "cpu")
                self._queues[dev] = q
            return q

    def close(self) -> None:
        with self._lock:
            queues, self._queues = list((self._queues or {}).values()), None
        for q in queues:
            q.close()

    def stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            queues = list((self._queues or {}).values())
        return {str(q.device): q.stats() for q in queues}
