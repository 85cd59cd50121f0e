"""A store's prefetch queues: one :class:`PrefetchQueue` per device, made on first use."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from ..devices import normalize_device
from ..errors import StoreClosedError, StoreError
from ..sizes import parse_size
from .entries import DEFAULT_CPU_BUDGET, DEFAULT_CUDA_FRACTION, IO_THREADS, Loader, SizeOf
from .queue import PrefetchQueue


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
