"""Devices as keys, and the asynchronous host-to-device copies of the prefetch queues.

``torch.device("cuda")`` and ``torch.device("cuda:0")`` name the same GPU but are not equal
(pytorch#115405), and a tensor always reports the indexed form. Anything that keys or
compares by device goes through :func:`normalize_device` first, or a cache keyed by the
caller's ``"cuda"`` never finds what a tensor's ``cuda:0`` put there.

:class:`CudaCopier` is the CUDA side of a prefetch queue (see :mod:`tierstore.prefetch`,
which defines what a copier must do and runs a fake one in the CPU tests). It is kept thin
on purpose: nothing of it can run without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

# Device types whose tensors never carry an index (a CPU tensor's device is "cpu").
_UNINDEXED = frozenset({"cpu", "meta"})

#: Bytes per pinned staging chunk for copies out of pageable memory, and how many chunks:
#: while one chunk's bytes cross the bus the host fills the next.
STAGING_CHUNK = 8 << 20
STAGING_CHUNKS = 4


def _current_index(device_type: str) -> int:
    module = getattr(torch, device_type, None)
    current = getattr(module, "current_device", None)
    return int(current()) if current is not None else 0


def normalize_device(device: str | torch.device | None,
                     current_index: Callable[[str], int] | None = None) -> torch.device:
    """``device`` in the form a tensor on it reports: ``"cuda"`` becomes ``cuda:N`` with N
    the current device, ``cpu:0`` becomes ``cpu``; ``None`` is the CPU.
    ``current_index(type)`` replaces the runtime's current-device query (tests pass one so
    that normalising ``"cuda"`` needs no GPU)."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type in _UNINDEXED:
        return torch.device(dev.type)
    if dev.index is None:
        index = (current_index or _current_index)(dev.type)
        return torch.device(dev.type, index)
    return dev


def bytes_to_device(src: np.ndarray | torch.Tensor, nbytes: int, dtype: torch.dtype,
                    shape: tuple[int, ...], device: str | torch.device | None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Host bytes (a flat uint8 array or tensor) as a ``dtype`` tensor of ``shape`` on
    ``device`` (or in ``out``, wherever it lives), copied as raw bytes.

    A typed ``.to(device)`` / ``copy_`` runs a conversion kernel: some dtypes have none
    (sub-byte, bit types) and bool's canonicalises bytes other than 0 and 1, so the CPU path
    copies bytes and so must this. The copy is synchronous with the host (the caller may
    release ``src`` as soon as this returns) and runs on the current stream.
    """
    u8 = (torch.from_numpy(src) if isinstance(src, np.ndarray) else src).reshape(-1)[:nbytes]
    if out is not None and out.is_contiguous():
        if nbytes:
            with torch.no_grad():  # filling a leaf that requires grad is not a step of autograd
                out.reshape(-1).view(torch.uint8).copy_(u8)
        return out
    target = out.device if out is not None else normalize_device(device)
    if not nbytes:
        t = torch.empty(shape, dtype=dtype, device=target)
    else:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=target)
        dst.copy_(u8)
        t = dst.view(dtype).view(shape)
    if out is not None:
        # A strided destination needs an element-wise copy; device to device, same dtype.
        with torch.no_grad():
            return out.copy_(t)
    return t


class DeviceEvent(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class DeviceCopier(Protocol):
    """How a prefetch queue moves bytes to an asynchronous device and tracks who uses them.

    - ``empty(n)``: ``n`` bytes of device memory for a copy (allocated for the copy stream).
    - ``copy(dst, src)``: start copying host bytes ``src`` into ``dst``; returns the event
      after which ``dst`` holds them and ``src`` may be reused.
    - ``wait(event, tensor)``: the calling thread's current stream waits for ``event`` and
      is recorded as a user of ``tensor`` (the allocator will not reuse it under that
      stream's queued work).
    - ``mark(tensor)``: an event on the calling thread's current stream, after everything it
      has queued so far (the point where the caller let go of ``tensor``); also records the
      stream as a user.
    - ``retire(tensor)``: the queue lets go of ``tensor`` and of its budget.
    """

    device: torch.device

    def empty(self, nbytes: int) -> torch.Tensor: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> DeviceEvent: ...
    def wait(self, event: DeviceEvent, tensor: torch.Tensor) -> None: ...
    def mark(self, tensor: torch.Tensor) -> DeviceEvent: ...
    def retire(self, tensor: torch.Tensor) -> None: ...


class CudaCopier:
    """Copies on a stream of their own; pageable sources staged through pinned chunks.

    A ``non_blocking`` copy out of pageable memory is synchronous (the driver stages it
    itself and returns when the source has been read), which would keep one copy in flight
    and hold the copy thread for its whole duration. Sources that are not page-locked (an
    uncached read's buffer, a cache whose arena is not pinned) are copied chunk by chunk
    through a small pinned staging arena instead: the host fills one chunk while the
    previous one crosses the bus.
    """

    def __init__(self, device: torch.device) -> None:
        from tierstore.cache.pinned import arena_tensor, cuda_consumer

        self.device = device
        cuda_consumer()  # host caches now page-lock their arenas (cache.pinned)
        self.stream = torch.cuda.Stream(device)
        self._arena_tensor = arena_tensor
        self._staging: torch.Tensor | None = None
        self._staging_arena: Any = None
        self._chunk_events: list[Any] = [None] * STAGING_CHUNKS
        self._next_chunk = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if not src.numel() or src.is_pinned():
                dst.copy_(src, non_blocking=True)
            else:
                self._staged(dst, src)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def _staged(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._staging is None:
            self._staging, self._staging_arena = self._arena_tensor(
                STAGING_CHUNK * STAGING_CHUNKS, pin=True)
        host = src.numpy()
        for start in range(0, src.numel(), STAGING_CHUNK):
            n = min(STAGING_CHUNK, src.numel() - start)
            i = self._next_chunk
            self._next_chunk = (i + 1) % STAGING_CHUNKS
            if self._chunk_events[i] is not None:
                self._chunk_events[i].synchronize()  # its last copy has left the chunk
            chunk = self._staging[i * STAGING_CHUNK : i * STAGING_CHUNK + n]
            np.copyto(chunk.numpy(), host[start : start + n])
            dst[start : start + n].copy_(chunk, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
            self._chunk_events[i] = event

    def wait(self, event: Any, tensor: torch.Tensor) -> None:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        # Allocated on the copy stream: without this the allocator could hand the bytes
        # out again while work queued on the consumer's stream still reads them.
        tensor.record_stream(current)

    def mark(self, tensor: torch.Tensor) -> Any:
        current = torch.cuda.current_stream(self.device)
        tensor.record_stream(current)
        event = torch.cuda.Event()
        event.record(current)
        return event

    def retire(self, tensor: torch.Tensor) -> None:
        pass  # dropping the reference is enough: record_stream guards the reuse
