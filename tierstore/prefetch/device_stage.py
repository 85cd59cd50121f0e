"""Stage 2 of a prefetch queue: host bytes onto the device.

On an asynchronous device the copy thread issues ``non_blocking`` copies through the
queue's :class:`~tierstore.devices.DeviceCopier` and keeps up to :data:`COPIES_IN_FLIGHT`
in flight; each one's host bytes go back, and its future resolves, once its event has
completed. On the CPU it copies into a fresh tensor, or (``zero_copy``) lends a view of the
host bytes instead, pinned for as long as any tensor over them lives; the copy thread then
only gives pins back.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..devices import DeviceCopier
from ..tensors import dtype_from_name, from_bytes
from .entries import COPIES_IN_FLIGHT, RESIDENT, Entry, Key, Loader, QueueStats, settle

# torch dtypes that numpy has too (same bytes, same layout)
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    dt: torch.empty(0, dtype=dt).numpy().dtype
    for dt in (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
               torch.complex128)}


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


class _Shared:
    """The loader's handles on a whole batch (one lease that names no key), on the copy
    path: each entry of the batch holds one part and releases it once its copy has landed
    or been given up; the handles go back with the last part."""

    __slots__ = ("handles", "_left", "_lock")

    def __init__(self, handles: list[Any], parts: int) -> None:
        self.handles, self._left = handles, parts
        self._lock = threading.Lock()  # parts go back on the copy and the I/O threads

    def release(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
            handles, self.handles = self.handles, []
        for h in handles:
            h.release()


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


class DeviceStage:
    """Stage 2 of :class:`~tierstore.prefetch.PrefetchQueue`, and the shape of what stage 1
    hands it (:meth:`_load_batch`). The queue sets up the state below and gives the two
    calls this stage makes back into it: ``_retire`` (an entry's credits go back) and
    ``_fail`` (an entry's transfer failed)."""

    device: torch.device
    _cv: threading.Condition
    _stats: QueueStats
    _copier: DeviceCopier | None
    # Copies issued but not yet known to have landed (copy thread only).
    _inflight: collections.deque[tuple[Entry, torch.Tensor, Any, list[Any]]]
    # Copy jobs, and (zero-copy) lists of handles whose views have died.
    _copies: queue.SimpleQueue[tuple[Entry, Any, Any, list[Any]] | list[Any] | None]
    _unpin_direct: bool  # set once the copy thread is gone
    _load: Loader  # stage 1's loader (the store's ``_host_bytes``, or the daemon client's)

    def _load_batch(self, batch: list[Entry]) -> list[Any]:
        """Stage 1 of a batch: per entry ``(meta, raw bytes, handles)`` or the exception
        its load raised. Handles are a list per key where the loader's handles name their
        keys (the store's cache handles), else (one lease over the whole load) a
        :class:`_Pins` that the batch's views share, released when the last one is gone,
        or on the copy path a :class:`_Shared` of which each entry releases its part."""
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
        elif batch[0].zero_copy:  # fixed for the whole batch
            pins = _Pins(handles, self._unpin)
            per_key = {k: pins for k in keys}
        else:
            shared = _Shared(handles, len(keys))
            per_key = {k: [shared] for k in keys}
        return [(found[k][0], found[k][1], per_key[k]) for k in keys]

    def _view(self, entry: Entry, meta: Any, raw: np.ndarray | torch.Tensor,
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

    def _copy(self, entry: Entry, meta: Any, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
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

    def _issue(self, entry: Entry, meta: Any, raw: np.ndarray | torch.Tensor,
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

    def _landed(self, entry: Entry, tensor: torch.Tensor | None) -> None:
        self._landed_many([(entry, tensor)])

    def _landed_many(self, landed: list[tuple[Entry, torch.Tensor | None]]) -> None:
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
                    entry.state = RESIDENT
            self._cv.notify_all()
        for entry, tensor in landed:
            if tensor is not None:
                settle(entry.future, tensor)
