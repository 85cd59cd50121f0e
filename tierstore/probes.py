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


class DurableCopy:
    """A pmem pool's durable write without the store: ``threads`` workers copy disjoint parts
    of ``nbytes`` into a file mapped as the pool maps its own, made durable as the pool makes
    its writes durable. On persistent memory (DAX) that is each worker's
    ``pmem_memcpy_nodrain`` and drain, i.e. ``pmem_memcpy_persist``; on any other file it is
    a copy into the page cache and one msync of the range (``pmem_msync``, or mmap's flush
    where libpmem is absent), since flushing CPU caches over the page cache persists
    nothing. The ceiling for the store's writes to its pmem tier. The file is fallocated:
    the first :meth:`write` lands in never-written space, later ones rewrite it."""

    def __init__(self, path: str, nbytes: int, threads: int = 1) -> None:
        from tierstore.pmem.libpmem import load
        from tierstore.pmem.mapping import LibpmemMapping, MmapMapping

        self.path, self.nbytes = path, nbytes
        lib = load()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            self._map = LibpmemMapping(lib, path) if lib is not None else MmapMapping(path)
        except BaseException:
            os.unlink(path)  # a full disk, say: no scratch file left behind
            raise
        if self._map.durability == "persist":
            self.name = "pmem_memcpy_persist"
        else:
            self.name = "memcpy+pmem_msync" if lib is not None else "memcpy+msync"
        self._src = aligned_empty(nbytes)
        self._src[:] = 1
        self._parts = _split(nbytes, threads)
        self._pool = ThreadPoolExecutor(threads)

    def write(self) -> float:
        """GB/s of one durable copy of all ``nbytes``."""
        m, src = self._map, self._src.ctypes.data
        t0 = time.perf_counter()
        list(self._pool.map(lambda p: m.write(p[0], src + p[0], p[1] - p[0]), self._parts))
        m.sync_written([(0, self.nbytes)])
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self._pool.shutdown()
        self._map.release()
        os.unlink(self.path)


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
