"""Python's cycle collector held off while a store call runs.

A put or get of many small entries makes tens of thousands of containers (records, chunk
lists, tuples, futures) that live for the whole call. The collector counts them, and in a
process that already holds a few hundred thousand objects (torch alone leaves about
200,000) they set off a full collection: on the development machine one of 85-95 ms about
once per GiB of 256 KiB entries, a quarter of a put's time, in the calling thread while
the disk waits. The call's containers form no cycles it leaves behind; what they hold is
freed by reference counting as the call returns.

So a call runs with the collector paused, and it is resumed when the last call running in
the process ends; what the calls made and still hold (their results) counts from then on,
so at most one collection follows. A process that had turned it off keeps it off.
``gc.collect()`` works throughout.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_running = 0  # store calls running in the process with the collector paused
_resume = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for the ``with`` block (or the decorated call)."""
    global _running, _resume
    with _lock:
        if _running == 0:
            _resume = gc.isenabled()
            gc.disable()
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0 and _resume:
                gc.enable()
