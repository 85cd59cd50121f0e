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
overtakes everything still queued but never preempts a transfer that has started. An I/O
thread starts the heads of one urgency and priority together (its share of what is queued,
at most :data:`MAX_BATCH` entries) and loads them in one call, so their reads go to the
backing tier as one batch and the per-entry cost of a layer's request is paid once per
batch. A batch holds up to :data:`MAX_BATCH_BYTES` on the zero-copy path; on the copy path,
where a batch's copies start only once all of it has landed, up to
:data:`MAX_COPY_BATCH_BYTES`, so that copies overlap the reads behind them. Each entry of a
batch still takes its own credits, lands, and resolves its own future; an entry whose read
fails fails alone (the batch is loaded again one entry at a time).

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

The package: ``entries.py`` (what a queue tracks per entry, priorities, the constants),
``queue.py`` (:class:`PrefetchQueue`: requests, the heap and the budget, acquire and
release, stage 1), ``device_stage.py`` (stage 2: device copies and zero-copy pins) and
``per_device.py`` (:class:`DeviceQueues`: a store's queues, one per device).
"""

from .entries import (
    COPIES_IN_FLIGHT,
    DEFAULT_CPU_BUDGET,
    DEFAULT_CUDA_FRACTION,
    IO_THREADS,
    MAX_BATCH,
    MAX_BATCH_BYTES,
    MAX_COPY_BATCH_BYTES,
    Loader,
    SizeOf,
    layer_of,
    normalize_priority,
)
from .per_device import DeviceQueues
from .queue import PrefetchQueue

__all__ = [
    "COPIES_IN_FLIGHT",
    "DEFAULT_CPU_BUDGET",
    "DEFAULT_CUDA_FRACTION",
    "IO_THREADS",
    "MAX_BATCH",
    "MAX_BATCH_BYTES",
    "MAX_COPY_BATCH_BYTES",
    "DeviceQueues",
    "Loader",
    "PrefetchQueue",
    "SizeOf",
    "layer_of",
    "normalize_priority",
]
