"""Host arenas that are page-locked for CUDA exactly, and only once CUDA needs them.

``torch.empty(n, pin_memory=True)`` goes through PyTorch's caching host allocator, which
rounds every request up to a power of two (a 1 GiB cache plus its alignment page pinned
2 GiB) and keeps the block cached after the cache is gone; it also creates a CUDA context
whenever CUDA is present, even for a command that never touches a GPU. An arena here is an
anonymous ``mmap`` of exactly the bytes asked for (page-aligned by the kernel, so no extra
page either), advised for huge pages, and page-locking is ``cudaHostRegister`` on that
range: nothing is rounded.

Pinning waits for a CUDA consumer (:func:`cuda_consumer`): a device prefetch queue, a
trainer or a reader on a CUDA device announces itself, and every live arena that asked for
lazy pinning is registered then (arenas made afterwards are registered as they are made).
The registration lives exactly as long as the memory: the arena unregisters and unmaps when
the last tensor over it is gone, so a view that outlives its cache never points at memory
the driver has forgotten to unlock, nor at unmapped pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["HostArena", "arena_tensor", "cuda_consumer", "cuda_consumer_started",
           "pinned_bytes"]

_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_ANON_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

_lock = threading.Lock()
_lazy: weakref.WeakSet[HostArena] = weakref.WeakSet()
_consumer = False
_pinned_total = 0


def _register(ptr: int, nbytes: int) -> None:
    # cudaHostRegisterDefault (0): portable flags are not needed for one device.
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostArena:
    """``nbytes`` of anonymous, page-aligned host memory, page-locked on demand.

    Numpy keeps the object that provides ``__array_interface__`` as an array's base and
    torch keeps that array, so the arena lives as long as any tensor over it (see
    :func:`arena_tensor`) and its ``__del__`` runs only once none is left.
    """

    __slots__ = ("__array_interface__", "__weakref__", "_lock", "nbytes", "pinned", "ptr")

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        self.nbytes = nbytes
        self.pinned = False
        self._lock = threading.Lock()
        ptr = 0
        if nbytes:
            ptr = _libc.mmap(None, nbytes, _PROT_RW, _MAP_ANON_PRIVATE, -1, 0)
            if ptr is None or ptr == _MAP_FAILED:
                raise MemoryError(f"mmap of {nbytes} bytes failed "
                                  f"(errno {ctypes.get_errno()})")
            # On 2 MiB pages where the kernel allows, as the store's other buffers are:
            # O_DIRECT into 4 KiB pages reached the development VM's disk as many small
            # requests (tierstore.nvme.pages). Advice only: refused, the pages stay 4 KiB.
            _libc.madvise(ptr, nbytes, mmap.MADV_HUGEPAGE)
        self.ptr = ptr
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (ptr or _EMPTY_PTR, False)}

    def pin(self) -> bool:
        """Page-lock the arena for CUDA now (once); returns whether it is pinned."""
        global _pinned_total
        with self._lock:
            if not self.pinned and self.nbytes:
                _register(self.ptr, self.nbytes)
                self.pinned = True
                with _lock:
                    _pinned_total += self.nbytes
            return self.pinned

    def pin_lazily(self) -> None:
        """Pin once a CUDA consumer exists (now, if one does)."""
        with _lock:
            now = _consumer
            if not now:
                _lazy.add(self)
        if now:
            _pin_or_warn(self)

    def __del__(self) -> None:
        global _pinned_total
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if not ptr:
            return
        if self.pinned:
            try:
                _unregister(ptr)
            finally:
                with _lock:
                    _pinned_total -= self.nbytes
        _libc.munmap(ptr, self.nbytes)


# numpy refuses a NULL data pointer for an array interface; an empty arena points here.
_EMPTY = np.empty(1, dtype=np.uint8)
_EMPTY_PTR = _EMPTY.ctypes.data


def arena_tensor(nbytes: int, pin: bool | None = None) -> tuple[torch.Tensor, HostArena]:
    """A flat uint8 tensor over a new :class:`HostArena` of exactly ``nbytes``, and the
    arena. ``pin``: True pins now (CUDA must be present), False never, None once a CUDA
    consumer exists (:func:`cuda_consumer`). Nothing here touches CUDA unless it pins."""
    arena = HostArena(nbytes)
    tensor = torch.from_numpy(np.asarray(arena))
    if pin is True:
        arena.pin()
    elif pin is None:
        arena.pin_lazily()
    return tensor, arena


def cuda_consumer() -> None:
    """Say that this process now moves host bytes to a CUDA device: every arena waiting
    for one is pinned, and arenas made later are pinned as they are made."""
    global _consumer
    with _lock:
        _consumer = True
        waiting = list(_lazy)
        _lazy.clear()
    for arena in waiting:
        _pin_or_warn(arena)


def _pin_or_warn(arena: HostArena) -> None:
    """Pin an arena that asked to be pinned when it can be. Pinning is an optimisation
    there: where the driver refuses (a locked-memory limit, memory short), copies from the
    arena go through the device queue's pinned staging chunks instead, so the refusal is
    a warning, not the failure of the read that made the first CUDA consumer."""
    try:
        arena.pin()
    except RuntimeError as e:
        warnings.warn(f"a host arena of {arena.nbytes} bytes stays unpinned ({e}); copies "
                      "from it to the GPU are staged", RuntimeWarning, stacklevel=3)


def cuda_consumer_started() -> bool:
    return _consumer


def pinned_bytes() -> int:
    """Bytes this module holds page-locked right now."""
    return _pinned_total


def _reset_for_tests() -> Any:  # pragma: no cover - test helper
    """Forget that a CUDA consumer was seen (tests of lazy pinning start clean)."""
    global _consumer
    with _lock:
        was, _consumer = _consumer, False
    return was
