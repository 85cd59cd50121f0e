"""One device's prefetch queue: requests, the priority heap, the byte budget, acquire and
release, and stage 1 (backing tier to host bytes); see the package docstring."""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from ..devices import DeviceCopier
from ..errors import StoreClosedError, StoreError
from ..sizes import format_size
from .device_stage import DeviceStage, _Pins, _Shared
from .entries import (
    COPYING,
    DONE,
    IO_THREADS,
    LOADING,
    MAX_BATCH,
    MAX_BATCH_BYTES,
    MAX_COPY_BATCH_BYTES,
    MAX_SIZES_KEPT,
    QUEUED,
    RESIDENT,
    Entry,
    Key,
    Loader,
    QueueStats,
    SizeOf,
    layer_of,
    normalize_priority,
    over_budget,
    settle,
)


class PrefetchQueue(DeviceStage):
    """The prefetch queue of one device; see the package docstring.

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
        self._entries: dict[Key, Entry] = {}
        self._sizes: dict[Key, int] = {}  # known sizes of entries requested before
        # Items name their entry by key, so a stale item (cancelled, started, re-prioritised)
        # keeps nothing alive: a landed view's pin must go with its entry and its future.
        self._heap: list[tuple[bool, tuple[float, ...], int, Key]] = []
        self._seq = itertools.count()
        self._in_use = 0
        self._closing = False
        self._stats = QueueStats()
        if copier is None and device.type == "cuda":
            from ..devices import CudaCopier

            copier = CudaCopier(device)
        self._copier = copier
        self.zero_copy = False
        self.set_zero_copy(zero_copy)
        self._stream = getattr(copier, "stream", None)
        # Copies issued but not yet known to have landed (copy thread only), and released
        # entries whose consumers may still be using them (lock held), oldest first.
        self._inflight: collections.deque[tuple[Entry, torch.Tensor, Any, list[Any]]] = (
            collections.deque())
        self._draining: collections.deque[Entry] = collections.deque()
        # Copy jobs, and (zero-copy) lists of handles whose views have died: SimpleQueue.put
        # is reentrant, safe from a __del__ that runs wherever a tensor's last reference goes.
        self._copies: queue.SimpleQueue[tuple[Entry, Any, Any, list[Any]] | list[Any] | None] = (
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

    def set_budget(self, nbytes: int | None = None) -> int:
        """The byte budget, set to ``nbytes`` first if given (Store.prefetch_budget)."""
        with self._cv:
            self.budget = self.budget if nbytes is None else max(0, int(nbytes))
            stuck = [e for e in self._entries.values()  # queued, but could never start now
                     if e.state == QUEUED and e.nbytes > self.budget]
            for e in stuck:
                e.state = LOADING  # its heap item is stale; _fail retires it
            self._cv.notify_all()
        for e in stuck:
            self._fail(e, over_budget(e.key, e.nbytes, self.device, self.budget))
        return self.budget

    # -- requests -------------------------------------------------------------------
    def request(self, keys: Iterable[Key], priority: Any = 0) -> list[Future[torch.Tensor]]:
        """Futures of the device copies of ``keys``, queued at ``priority`` (or shared with
        an earlier request for the same entry, whose priority is raised if this one is more
        urgent)."""
        prio, layer = normalize_priority(priority), layer_of(priority)
        keys = list(keys)
        known: list[Entry | None] = [None] * len(keys)
        made: list[Entry] = []
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

    def _enter(self, key: Key, prio: tuple[float, ...], layer: Any, urgent: bool) -> Entry:
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
            return self._failed(key, prio, layer, over_budget(key, nbytes, self.device, self.budget))
        with self._cv:
            found = self._join(key, prio, layer, urgent)
            if found is not None:
                return found
            entry = self._insert(key, nbytes, prio, layer, urgent)
        self._watch(entry)
        return entry

    def _insert(self, key: Key, nbytes: int, prio: tuple[float, ...], layer: Any,
                urgent: bool) -> Entry:
        """A new entry, queued (lock held)."""
        entry = Entry(key, nbytes, prio, layer, urgent=urgent)
        self._entries[key] = entry
        self._stats.requests += 1
        self._push(entry)
        return entry

    def _watch(self, entry: Entry) -> None:
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

    def _join(self, key: Key, prio: tuple[float, ...], layer: Any, urgent: bool) -> Entry | None:
        """The live entry for ``key``, made more urgent if asked (lock held)."""
        if self._closing:
            raise StoreClosedError(f"the prefetch queue of {self.device} is closed")
        entry = self._entries.get(key)
        if entry is None:
            return None
        if not urgent:
            self._stats.dedup_hits += 1
        if entry.state == QUEUED:
            if urgent and not entry.urgent:
                entry.urgent = True  # keeps its priority (and layer) among the urgent ones
                self._push(entry)
            elif not urgent and prio < entry.priority:
                entry.priority, entry.layer = prio, layer
                self._push(entry)
        return entry

    def _failed(self, key: Key, prio: tuple[float, ...], layer: Any, err: Exception) -> Entry:
        entry = Entry(key, 0, prio, layer, state=DONE, error=err)
        entry.future.set_exception(err)
        with self._cv:
            self._stats.requests += 1
            self._stats.failures += 1
        return entry

    def _push(self, entry: Entry) -> None:
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

    def _account_acquire(self, entry: Entry, stall: float) -> None:
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
        cancel: list[Entry] = []
        with self._cv:
            n = 0
            for key in dict.fromkeys(keys):
                entry = self._entries.pop(key, None)
                if entry is None:
                    continue
                n += 1
                if entry.tensor is not None and self._copier is not None:
                    # Handed out (acquired, or its future resolved): the caller's stream may
                    # still have work reading it queued (see the package docstring).
                    entry.mark = self._copier.mark(entry.tensor)
                if entry.state == RESIDENT:
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

    def _abandon(self, entry: Entry) -> None:
        """Forget a cancelled entry (lock held; it is already out of the table)."""
        self._stats.cancels += 1
        if entry.state == QUEUED:
            entry.state = DONE  # its heap item is now stale; it never took a credit
        elif entry.state == RESIDENT:  # its future was cancelled just as it landed
            self._retire(entry)
        else:
            entry.dropped = True  # the credits come back once its bytes have landed

    def _on_done(self, ref: weakref.ref[Entry]) -> None:
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

    def _retire(self, entry: Entry) -> None:
        """Give an entry's credits back (lock held), or, if a consumer's release point has
        not been passed yet, once it has (:meth:`_reap`)."""
        entry.state = DONE
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
    def _head(self) -> Entry | None:
        """The live entry at the head of the heap, stale items dropped (lock held)."""
        while self._heap:
            _, _, seq, key = self._heap[0]
            head = self._entries.get(key)
            if head is not None and head.state == QUEUED and head.seq == seq:
                return head
            heapq.heappop(self._heap)  # stale: cancelled, started or re-prioritised
        return None

    def _next(self) -> list[Entry] | None:
        """Wait for the head of the heap to fit the budget and take its credits; None once
        the queue closes. The heads right behind it of the same urgency and priority (one
        request, typically) come along while they fit, up to this thread's share of the
        queued items: one load of many keys costs one pass through the store instead of one
        each, and its reads go to the backing tier as one batch (loads of one key each
        would keep one request per I/O thread in flight)."""
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
                share = -(-len(self._heap) // self._idle_io)
                limit, rank = min(share, MAX_BATCH), (head.urgent, head.priority)
                cap = MAX_BATCH_BYTES if self.zero_copy else MAX_COPY_BATCH_BYTES
                batch: list[Entry] = []
                nbytes = 0
                while (head is not None and len(batch) < limit
                       and head.nbytes <= self.budget - self._in_use
                       and (not batch or ((head.urgent, head.priority) == rank
                                          and nbytes + head.nbytes <= cap))):
                    heapq.heappop(self._heap)
                    head.zero_copy = self.zero_copy  # fixed for the whole batch
                    self._start(head)
                    batch.append(head)
                    nbytes += head.nbytes
                    head = self._head()
                return batch
            finally:
                self._idle_io -= 1

    def _start(self, entry: Entry) -> None:
        """The entry takes its credits (lock held)."""
        entry.state, entry.credited = LOADING, entry.nbytes
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
                if entry.state == LOADING:
                    self._fail(entry, e)
        return True

    def _land_batch(self, batch: list[Entry]) -> None:
        loaded = self._load_batch(batch)
        landed: list[tuple[Entry, torch.Tensor | None]] = []
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
            hs = handles.handles if isinstance(handles, _Pins) else [
                u for h in handles for u in (h.handles if isinstance(h, _Shared) else (h,))]
            n = meta.nbytes if not hs or any(getattr(h, "new", False) for h in hs) else 0
            if entry.zero_copy:
                read += n
                landed.append((entry, self._view(entry, meta, raw, handles)))
                continue
            with self._cv:
                entry.state = COPYING
                self._stats.bytes_read += n
            self._copies.put((entry, meta, raw, handles))
        if landed:
            with self._cv:
                self._stats.bytes_read += read
            self._landed_many(landed)

    def _resize(self, entry: Entry, nbytes: int) -> None:
        """The entry was rewritten with another size after it was queued: give the credits
        back and queue it again at its new size."""
        with self._cv:
            self._in_use -= entry.credited
            entry.credited, entry.nbytes = 0, nbytes
            if entry.dropped or self._closing:
                entry.state = DONE
                self._cv.notify_all()
                return
            if nbytes <= self.budget:
                entry.state = QUEUED
                self._push(entry)
                return
        self._fail(entry, StoreError(
            f"entry {entry.key[0]!r} (kind {entry.key[1]!r}) grew to {format_size(nbytes)}, "
            f"more than the whole prefetch budget of {self.device}"))

    def _fail(self, entry: Entry, err: Exception) -> None:
        with self._cv:
            self._stats.failures += 1
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]  # a later request tries again
            self._retire(entry)
            entry.error = err
            self._cv.notify_all()
        settle(entry.future, error=err)

    # -- lifecycle and figures -------------------------------------------------------
    def close(self) -> None:
        """Cancel queued requests, let running transfers finish, join the threads and give
        every credit back."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            queued = [e for e in self._entries.values() if e.state == QUEUED]
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
                "queued": states.count(QUEUED),
                "in_flight": states.count(LOADING) + states.count(COPYING),
                "resident": states.count(RESIDENT),
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
