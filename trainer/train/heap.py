"""A training run's long-lived objects set aside from Python's cycle collector.

By the end of its first step a run holds for good nearly every object it will ever hold:
torch's modules and operators, the model, the optimizer and the store's bookkeeping (about
293,000 objects in a `small` run, steady from the first step to the 150th). Python's full
collection traverses them all each time: 114-135 ms, about every 50 steps of 0.1 s on the
development machine. :class:`SteadyHeap` sets them aside once the first step is done
(``gc.freeze``, as ``timeit`` turns the collector off while it times); what later steps
allocate is collected as before. A 150-step `small` run, two alternated pairs: steps summed
15.41 / 15.47 s against 15.97 / 16.34, the slowest step 115 ms against 233-263, each later
full collection 1 ms. The objects go back when the run ends (``gc.unfreeze``),
so a process that trains twice, or a test, does not keep one run's garbage out of reach.
Where something else has already frozen objects, nothing is done: freezing is not nested.
"""

from __future__ import annotations

import gc
from types import TracebackType


class SteadyHeap:
    """``with SteadyHeap() as heap:`` around a run's steps; ``heap.step_done()`` after each."""

    def __init__(self) -> None:
        self._aside = False
        self._mine = False

    def __enter__(self) -> SteadyHeap:
        self._mine = gc.get_freeze_count() == 0
        return self

    def step_done(self) -> None:
        if self._mine and not self._aside:
            gc.freeze()
            self._aside = True

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._aside:
            gc.unfreeze()
            self._aside = False
