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
