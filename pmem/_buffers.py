"""Raw addresses of Python buffers, for copies that run outside the GIL."""

from __future__ import annotations

from typing import Any

import numpy as np


def buffer_address(buf: Any, *, writable: bool) -> tuple[int, int, np.ndarray]:
    """(address, nbytes, keepalive) of a C-contiguous buffer.

    numpy is used because ctypes can only take the address of *writable* buffers, and a
    pwrite source may well be ``bytes`` or a read-only view. The returned array holds the
    buffer export, so the memory cannot move or be freed while the copy runs; keep it
    referenced until then.
    """
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and mv.readonly:
        raise TypeError("destination buffer is read-only")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    arr = np.frombuffer(mv, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes, arr
