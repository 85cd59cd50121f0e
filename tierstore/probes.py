"""Ceilings that benchmarks compare the tiers with, measured on this machine, now.

They live here so that ``bench/`` needs nothing but tierstore's public API.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tierstore.nvme import aligned_empty


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_gbps(nbytes: int = 256 << 20, threads: int = 1, repeat: int = 3) -> float:
    """Host memcpy bandwidth (GB/s): ``threads`` workers copying disjoint parts."""
    src, dst = aligned_empty(nbytes), aligned_empty(nbytes)
    src[:] = 1
    dst[:] = 0  # fault the pages in before timing
    parts = _split(nbytes, threads)
    with ThreadPoolExecutor(threads) as pool:
        secs = _best(lambda: list(pool.map(lambda p: np.copyto(dst[p[0]:p[1]], src[p[0]:p[1]]),
                                           parts)), repeat)
    return nbytes / secs / 1e9


def pmem_memcpy_persist_gbps(
    path: str, nbytes: int = 256 << 20, threads: int = 1, repeat: int = 3
) -> float | None:
    """``pmem_memcpy_persist`` bandwidth (GB/s) into a scratch file at ``path`` (removed
    afterwards), or None where libpmem is not installed. On a file that is not DAX this is
    a cache-flushing copy into the page cache, not a durable write."""
    from tierstore.pmem.libpmem import PMEM_FILE_CREATE, load

    lib = load()
    if lib is None:
        return None
    src = aligned_empty(nbytes)
    src[:] = 1
    addr, mapped, _ = lib.map_file(path, nbytes, PMEM_FILE_CREATE, 0o600)
    try:
        lib.memcpy_persist(addr, src.ctypes.data, nbytes)  # fault the pages in
        parts = _split(nbytes, threads)
        with ThreadPoolExecutor(threads) as pool:
            secs = _best(lambda: list(pool.map(
                lambda p: lib.memcpy_persist(addr + p[0], src.ctypes.data + p[0], p[1] - p[0]),
                parts)), repeat)
    finally:
        lib.unmap(addr, mapped)
        os.unlink(path)
    return nbytes / secs / 1e9
