"""Asynchronous device prefetch queues: one per device, a priority heap, a byte budget.

A request names an entry and a priority (smaller is needed sooner; a number or a tuple of
numbers such as ``(step, layer)``). Requests for one entry share one transfer and one
:class:`~concurrent.futures.Future`. A transfer runs in two stages:

1. backing tier → host bytes, on the queue's small I/O thread pool (the store's
   ``_host_bytes``: a pinned host-cache slot or a freshly read, checksum-verified buffer);
2. host → device, on the queue's copy thread: on CUDA a ``non_blocking`` copy on a dedicated
   stream followed by an event; elsewhere (the CPU "device") a real copy into a freshly
   allocated tensor. The host bytes are released once the copy has landed.

Device memory is a budget of byte credits (Janus): a transfer takes its entry's bytes in
credits when it starts (an I/O thread picks it from the heap) and gives them back when the
device copy is released or cancelled. Only the head of the heap may start, so when credits
run out lower-priority work waits behind it instead of slipping past; a more urgent request
overtakes everything still queued but never preempts a transfer that has started.
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import StoreClosedError, StoreError
from .sizes import format_size, parse_size
from .tensors import dtype_from_name, from_bytes

Key = tuple[str, str]
# ``load(keys) -> ({key: (meta, raw bytes)}, handles to release)``: the store's _host_bytes.
Loader = Callable[[list[Key]], tuple[dict[Key, tuple[Any, Any]], list[Any]]]
SizeOf = Callable[[Key], int]

IO_THREADS = 2
DEFAULT_CPU_BUDGET = 1 << 30
DEFAULT_CUDA_FRACTION = 0.5  # of the device's memory, when no budget is configured

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
    tensor: torch.Tensor | None = None
    event: Any = None  # torch.cuda.Event recorded after the copy (CUDA only)
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
    """

    def __init__(
        self,
        device: torch.device,
        budget: int,
        load: Loader,
        size_of: SizeOf,
        *,
        io_threads: int = IO_THREADS,
    ) -> None:
        self.device = device
        self.budget = budget
        self.on_start: Callable[[Key, int], None] | None = None
        self._load = load
        self._size_of = size_of
        self._cv = threading.Condition()
        self._entries: dict[Key, _Entry] = {}
        self._heap: list[tuple[bool, tuple[float, ...], int, _Entry]] = []
        self._seq = itertools.count()
        self._in_use = 0
        self._closing = False
        self._stats = _Stats()
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._copies: queue.SimpleQueue[tuple[_Entry, Any, Any, list[Any]] | None] = (
            queue.SimpleQueue())
        name = f"tierstore-prefetch-{device}"
        self._io = [threading.Thread(target=self._io_loop, name=f"{name}-io{i}", daemon=True)
                    for i in range(io_threads)]
        self._copier = threading.Thread(target=self._copy_loop, name=f"{name}-copy", daemon=True)
        for t in (*self._io, self._copier):
            t.start()

    # -- requests -------------------------------------------------------------------
    def request(self, keys: Iterable[Key], priority: Any = 0) -> list[Future[torch.Tensor]]:
        """Futures of the device copies of ``keys``, queued at ``priority`` (or shared with
        an earlier request for the same entry, whose priority is raised if this one is more
        urgent)."""
        prio, layer = normalize_priority(priority), layer_of(priority)
        return [self._enter(key, prio, layer, urgent=False).future for key in keys]

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
        if nbytes > self.budget:
            return self._failed(key, prio, layer, StoreError(
                f"entry {key[0]!r} (kind {key[1]!r}) is {format_size(nbytes)}, more than the "
                f"whole prefetch budget of {self.device} ({format_size(self.budget)})"))
        with self._cv:
            found = self._join(key, prio, layer, urgent)
            if found is not None:
                return found
            entry = _Entry(key, nbytes, prio, layer, urgent=urgent)
            self._entries[key] = entry
            self._stats.requests += 1
            self._push(entry)
        entry.future.add_done_callback(lambda f, e=entry: self._on_done(e))
        return entry

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
        heapq.heappush(self._heap, (not entry.urgent, entry.priority, entry.seq, entry))
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
        if entry.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.event)
            # The bytes were allocated on the copy stream: keep the allocator from handing
            # them out again while work queued on this stream may still read them.
            tensor.record_stream(current)
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

    def _on_done(self, entry: _Entry) -> None:
        """A cancelled future (by :meth:`drop` or by its caller) cancels its entry."""
        if not entry.future.cancelled():
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
        """Give an entry's credits back (lock held)."""
        self._in_use -= entry.credited
        entry.credited = 0
        entry.state = _DONE

    # -- stage 1: backing tier -> host bytes ---------------------------------------------
    def _next(self) -> _Entry | None:
        """Wait for the head of the heap to fit the budget and take its credits; None once
        the queue closes."""
        with self._cv:
            while True:
                if self._closing:
                    return None
                while self._heap and (self._heap[0][3].state != _QUEUED
                                      or self._heap[0][2] != self._heap[0][3].seq):
                    heapq.heappop(self._heap)  # stale: cancelled, started or re-prioritised
                if self._heap and self._heap[0][3].nbytes <= self.budget - self._in_use:
                    entry = heapq.heappop(self._heap)[3]
                    entry.state, entry.credited = _LOADING, entry.nbytes
                    self._in_use += entry.nbytes
                    self._stats.peak_in_use_bytes = max(self._stats.peak_in_use_bytes,
                                                        self._in_use)
                    if self.on_start is not None:
                        self.on_start(entry.key, self._in_use)
                    return entry
                self._cv.wait()

    def _io_loop(self) -> None:
        while (entry := self._next()) is not None:
            try:
                found, handles = self._load([entry.key])
                meta, raw = found[entry.key]
            except Exception as e:
                self._fail(entry, e)
                continue
            if meta.nbytes != entry.nbytes:
                for h in handles:
                    h.release()
                self._resize(entry, meta.nbytes)
                continue
            with self._cv:
                entry.state = _COPYING
            self._copies.put((entry, meta, raw, handles))

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
        while (job := self._copies.get()) is not None:
            entry, meta, raw, handles = job
            tensor = None
            try:
                if not entry.dropped:
                    tensor = self._copy(entry, meta, raw)
            except Exception as e:
                self._fail(entry, e)
                continue
            finally:
                for h in handles:  # the copy has landed (or never ran): the bytes may go
                    h.release()
            self._landed(entry, tensor)

    def _copy(self, entry: _Entry, meta: Any, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The device copy of the host bytes, landed when this returns."""
        # Raw bytes, never typed values: bool and sub-byte dtypes have no copy kernels that
        # keep every bit pattern.
        src = (torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw)[: meta.nbytes]
        dtype, shape = dtype_from_name(meta.dtype), tuple(meta.shape)
        if self._cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                dst = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            dst = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
            # numpy's copy stays on this thread; torch's would start a second OpenMP pool
            # that competes with the caller's compute threads for the cores.
            np.copyto(dst.numpy(), src.numpy())
        tensor = (from_bytes(dst, dtype, shape) if meta.nbytes
                  else torch.empty(shape, dtype=dtype, device=self.device))
        if self._cuda:
            with self._cv:
                # Usable from now on: acquire() orders the caller's stream after the event,
                # so callers need not wait for the host to see the copy finish.
                entry.tensor, entry.event = tensor, event
                self._cv.notify_all()
            event.synchronize()  # before the pinned host bytes are released
        return tensor

    def _landed(self, entry: _Entry, tensor: torch.Tensor | None) -> None:
        """Stage 2 is over: the entry is resident (or, dropped meanwhile, gives its credits
        back). Its future resolves after that, outside the lock, where callbacks may run."""
        with self._cv:
            if tensor is not None:
                entry.tensor = tensor
                self._stats.transfers += 1
                self._stats.bytes_moved += entry.nbytes
            if entry.dropped:
                self._retire(entry)
            else:
                entry.state = _RESIDENT
            self._cv.notify_all()
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
        self._copier.join()
        with self._cv:
            for entry in self._entries.values():
                self._retire(entry)
            self._entries.clear()
            self._cv.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._cv:
            s = self._stats
            states = [e.state for e in self._entries.values()]
            return {
                "budget_bytes": self.budget,
                "in_use_bytes": self._in_use,
                "peak_in_use_bytes": s.peak_in_use_bytes,
                "queued": states.count(_QUEUED),
                "in_flight": states.count(_LOADING) + states.count(_COPYING),
                "resident": states.count(_RESIDENT),
                "requests": s.requests,
                "dedup_hits": s.dedup_hits,
                "transfers": s.transfers,
                "bytes_moved": s.bytes_moved,
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
    1 GiB on the CPU, half of its memory on CUDA.
    """

    def __init__(
        self,
        load: Loader,
        size_of: SizeOf,
        budget: int | str | Mapping[str, int | str] | None = None,
        *,
        io_threads: int = IO_THREADS,
    ) -> None:
        self._load = load
        self._size_of = size_of
        self._io_threads = io_threads
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
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise StoreError(f"cannot prefetch to {dev}: CUDA is not available")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        return dev

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
                                  io_threads=self._io_threads)
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
