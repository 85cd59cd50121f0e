"""Page-aligned host buffers, as O_DIRECT and GPUDirect Storage require."""

from __future__ import annotations

import numpy as np

ALIGNMENT = 4096


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose address is a multiple of ``alignment``.

    numpy (like torch) only promises 64-byte alignment, so over-allocate and slice; the slice
    keeps the parent alive.
    """
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    skip = -raw.ctypes.data % alignment
    return raw[skip : skip + nbytes]


def is_aligned(buf: np.ndarray, alignment: int = ALIGNMENT) -> bool:
    return buf.ctypes.data % alignment == 0 and buf.nbytes % alignment == 0


class StagingPool:
    """Reusable aligned buffers of one size, for copying unaligned sources before O_DIRECT
    writes: fresh buffers would cost a page fault (and the kernel zeroing a page) for every
    4 KiB written. Holds at most ``keep`` idle buffers."""

    def __init__(self, nbytes: int, keep: int) -> None:
        import threading

        self.nbytes, self.keep = nbytes, keep
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return aligned_empty(self.nbytes)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buf)
