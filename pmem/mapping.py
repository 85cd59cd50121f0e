"""One mapping of a whole pool file, and how stores to it become durable.

Durability is decided per mapping, once, when it is made:

- ``"persist"``: the mapping is real persistent memory (libpmem mapped it with MAP_SYNC, or
  it is device DAX). Data is durable once it leaves the CPU caches: copies use
  ``pmem_memcpy_nodrain`` and ``pmem_drain`` completes them.
- ``"msync"``: anything else. The mapping is page cache over a file, flushing CPU caches
  achieves nothing, and only ``msync`` (``pmem_msync`` or ``mmap.flush``) writes the pages
  back.

``PMEM_IS_PMEM_FORCE`` makes libpmem claim "pmem" for any file; when it is set the claim is
checked against the kernel (``pmem.dax.really_pmem``) and msync is used unless the file is
really DAX, so a forced flag can make I/O slower but never makes a write falsely durable.

Views handed out by ``view()`` keep their mapping alive: ``release()`` unmaps at once only
when none is left, otherwise the memory goes away with the last view. A view can therefore
never point at unmapped memory, whatever the pool does after handing it out.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Iterable

from .dax import FORCE_ENV, really_pmem
from .libpmem import Libpmem, PmemError

__all__ = ["LibpmemMapping", "MmapMapping", "page_span"]

_PAGE = mmap.PAGESIZE


def page_span(offset: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the whole pages covering ``nbytes`` at ``offset``."""
    start = offset - offset % _PAGE
    end = -(-(offset + nbytes) // _PAGE) * _PAGE
    return start, end - start


def _unmap_quietly(lib: Libpmem, addr: int, length: int) -> None:
    # Runs from a finalizer, where raising would only print; the process keeps running
    # with a leaked mapping at worst.
    with contextlib.suppress(PmemError):
        lib.unmap(addr, length)


class LibpmemMapping:
    """``pmem_map_file`` of a whole file."""

    engine = "libpmem"

    def __init__(self, lib: Libpmem, path: str) -> None:
        addr, length, is_pmem = lib.map_file(path)
        self._lib = lib
        self.addr = addr
        self.length = length
        self.reported_pmem = is_pmem
        forced = lib.force_env_at_load is not None or FORCE_ENV in os.environ
        self.forced = is_pmem and forced
        """libpmem said "pmem" while PMEM_IS_PMEM_FORCE was set, so the kernel was asked."""
        if not is_pmem:
            persist = False
        elif self.forced:
            persist = really_pmem(path)
        else:
            persist = True
        self.durability = "persist" if persist else "msync"
        self._live_views = 0
        self._views_lock = threading.Lock()
        self._unmap = weakref.finalize(self, _unmap_quietly, lib, addr, length)
        # At interpreter exit the kernel unmaps anyway; unmapping earlier could only turn a
        # late access from another finalizer into a segfault.
        self._unmap.atexit = False

    def write(self, offset: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` to ``offset``; not durable until synced."""
        self._lib.memcpy_nodrain(self.addr + offset, src, nbytes)
        if self.durability == "persist":
            # The drain (sfence) orders only the stores of the CPU that issues it, so it must
            # run on the thread that did the copy; sync() on another thread could not.
            self._lib.drain()

    def read(self, offset: int, dst: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``offset`` to address ``dst`` (plain memmove: the destination
        is DRAM, flushing it would be wasted work)."""
        ctypes.memmove(dst, self.addr + offset, nbytes)

    def persist_range(self, offset: int, nbytes: int) -> None:
        """Make bytes stored by any means (e.g. plain stores) in this range durable."""
        if self.durability == "persist":
            self._lib.persist(self.addr + offset, nbytes)
        else:
            self._lib.msync(self.addr + offset, nbytes)

    def sync_written(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Make what ``write()`` copied into these (start, end) ranges durable."""
        if self.durability == "persist":
            # Each write() already flushed and drained its own stores; this drain only
            # covers the calling thread, for completeness.
            self._lib.drain()
            return
        for start, end in ranges:
            self._lib.msync(self.addr + start, end - start)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Read-only zero-copy view; it holds the mapping alive (see module docstring)."""
        arr = (ctypes.c_ubyte * nbytes).from_address(self.addr + offset)
        arr._mapping = self  # type: ignore[attr-defined]
        with self._views_lock:
            self._live_views += 1
        weakref.finalize(arr, self._view_gone)
        return memoryview(arr).cast("B").toreadonly()

    def _view_gone(self) -> None:
        with self._views_lock:
            self._live_views -= 1

    def release(self) -> None:
        """Unmap now if no view is alive; otherwise when the last one goes."""
        with self._views_lock:
            if self._live_views:
                return
        self._unmap()


class MmapMapping:
    """Python ``mmap`` of a whole file: the fallback where libpmem is absent."""

    engine = "mmap"
    durability = "msync"
    forced = False
    reported_pmem = False

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._mm: mmap.mmap | None = mmap.mmap(
                fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        # A ctypes export pins the mmap (it cannot be closed under us) and yields the
        # address that lets copies run through ctypes.memmove, outside the GIL.
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._mm)
        self.addr = ctypes.addressof(self._anchor)
        self.length = len(self._mm)

    def write(self, offset: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` to ``offset``; not durable until synced."""
        ctypes.memmove(self.addr + offset, src, nbytes)

    def read(self, offset: int, dst: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``offset`` to address ``dst``."""
        ctypes.memmove(dst, self.addr + offset, nbytes)

    def persist_range(self, offset: int, nbytes: int) -> None:
        """msync the pages spanning the range."""
        assert self._mm is not None
        start, length = page_span(offset, nbytes)
        self._mm.flush(start, length)

    def sync_written(self, ranges: Iterable[tuple[int, int]]) -> None:
        """msync each (start, end) range."""
        for start, end in ranges:
            self.persist_range(start, end - start)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Read-only zero-copy view; it holds the mmap (and its memory) alive."""
        assert self._mm is not None
        return memoryview(self._mm)[offset : offset + nbytes].toreadonly()

    def release(self) -> None:
        """Close the mmap now if no view is alive; otherwise when the last one goes."""
        self._anchor = None
        mm, self._mm = self._mm, None
        if mm is None:
            return
        # Views may still export it; then dropping our reference leaves the unmap to them.
        with contextlib.suppress(BufferError):
            mm.close()
