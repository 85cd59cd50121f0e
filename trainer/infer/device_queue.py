"""The store's device prefetch queue as the expert sources use it: its byte budget, views
instead of copies on the CPU, the bytes it has moved, and a clock on the device's work."""

from __future__ import annotations

import time
from typing import Any

import torch

import tierstore


class DeviceClock:
    """Time points on the device's work, not the host's: kernels on CUDA are queued, so the
    host's clock at the end of a pass says when the pass was *queued*, which would make
    ``t_compute`` (and so the ring size K) and the stall figures meaningless. On CUDA a point
    is an event recorded on the device's current stream and a span is read once its end has
    completed; on the CPU the work runs as the host issues it and ``perf_counter`` is right.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        # On the model's device's stream, which need not be the current device's.
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` (waits for ``end`` on CUDA)."""
        if not self.cuda:
            return float(end - start)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


def queue_budget(store: tierstore.Store, device: torch.device) -> int:
    """The byte budget of the store's prefetch queue for ``device`` (made on first use)."""
    store.prefetch([], device=device)
    dev = device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    stats = (store.stats().get("prefetch") or {}).get(str(dev))
    if stats is None:
        raise tierstore.StoreError(f"the store reports no prefetch queue for {dev}")
    return int(stats["budget_bytes"])


def lend_views(store: tierstore.Store, device: torch.device) -> bool:
    """On the CPU, have the store's prefetch queue lend views of the experts' host bytes
    instead of copying them (the sources only read experts, and their ``_convert`` makes a new
    tensor rather than writing into one); whether it does. Another device keeps copying."""
    return bool(store.prefetch_views(device)) if device.type == "cpu" else False


def queue_bytes_moved(store: tierstore.Store, device: torch.device,
                      counter: str = "bytes_moved") -> int:
    """Bytes the store's prefetch queue for ``device`` has moved so far (landed on the
    device, copied or pinned); ``counter="bytes_read"``: the part read from the backing
    tier."""
    dev = device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    stats = (store.stats().get("prefetch") or {}).get(str(dev)) or {}
    return int(stats.get(counter, 0))


def host_cache_bytes(store: tierstore.Store) -> int:
    """The capacity of the host cache the store reads through (0 without one)."""
    cache = store.stats().get("cache") or {}
    return int(cache.get("capacity_bytes", 0))
