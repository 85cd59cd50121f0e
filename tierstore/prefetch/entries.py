"""What a prefetch queue keeps per entry, how priorities compare, and the queues' limits."""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import StoreError
from ..sizes import format_size

Key = tuple[str, str]
# ``load(keys) -> ({key: (meta, raw bytes)}, handles to release)``: the store's _host_bytes.
Loader = Callable[[list[Key]], tuple[dict[Key, tuple[Any, Any]], list[Any]]]
SizeOf = Callable[[Key], int]

IO_THREADS = 2
DEFAULT_CPU_BUDGET = 1 << 30
# A stage-1 batch: at most this many entries and bytes (more would make the first of them
# wait for the last).
MAX_BATCH = 32
MAX_BATCH_BYTES = 64 << 20
# On the copy path, at most this many bytes: a batch's copies start once all of it has
# landed, so a batch must be small for the copies to overlap the reads behind it, and large
# enough that a load's fixed cost is not paid per small entry. Loaded one at a time, 256 KiB
# entries moved at about half of get_many's rate, while 2 MiB entries in batches of 8 MiB
# lost their copies' overlap (CPU copies, this project's virtio disk).
MAX_COPY_BATCH_BYTES = 4 << 20
MAX_SIZES_KEPT = 1 << 20  # entry sizes a queue remembers (about 100 MiB at most)
# Of the device's memory, when no budget is configured. A ceiling rather than a guess of
# what a model needs: callers that know their working set (the store trainer does) pass it.
DEFAULT_CUDA_FRACTION = 0.5
# Device copies the copy thread keeps in flight; each holds its host bytes (a pinned cache
# slot) until it lands.
COPIES_IN_FLIGHT = 8

QUEUED, LOADING, COPYING, RESIDENT, DONE = "queued", "loading", "copying", "resident", "done"



def settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a future unless its caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # cancelled: the cancel callback has dropped the entry

def over_budget(key: Key, nbytes: int, device: Any, budget: int) -> StoreError:
    """The error of a request for an entry larger than the whole budget."""
    return StoreError(f"entry {key[0]!r} (kind {key[1]!r}) is {format_size(nbytes)}, more "
                      f"than the whole prefetch budget of {device} ({format_size(budget)})")


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
class Entry:
    key: Key
    nbytes: int
    priority: tuple[float, ...]
    layer: Any
    future: Future[torch.Tensor] = field(default_factory=Future)
    urgent: bool = False  # someone waits in acquire(): ahead of every prefetch
    seq: int = -1  # of the entry's live heap item; older items for it are stale
    state: str = QUEUED
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
        return self.tensor is not None or self.error is not None or self.state == DONE


@dataclass
class QueueStats:
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
