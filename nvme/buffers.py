"""Page-aligned host buffers, as O_DIRECT and GPUDirect Storage require."""

from __future__ import annotations

import contextlib
import mmap
import threading

import numpy as np

ALIGNMENT = 4096
# Idle read buffers a store keeps for reuse (:class:`RecycledBuffers`), at most: enough for
# a steady stream of reads up to this size to land in mapped pages, small enough to be a
# fixed part of a process's memory budget.
IDLE_READ_BUFFER_BYTES = 64 << 20


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose address is a multiple of ``alignment``.

    numpy (like torch) only promises 64-byte alignment, so over-allocate and slice; the slice
    keeps the parent alive.
    """
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    skip = -raw.ctypes.data % alignment
    return raw[skip : skip + nbytes]


HUGE_PAGE = 2 << 20
SHEAF_BYTES = 8 << 20  # read buffers under HUGE_PAGE are carved from arrays this large


def huge_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` on a 2 MiB boundary, in a fresh private
    anonymous mapping (a shared one is shmem, whose huge pages another setting governs)
    advised for transparent huge pages (``MADV_HUGEPAGE``), so the kernel backs it
    with them where it can. An O_DIRECT read into huge pages pins one page instead of 512
    and reaches the device as fewer segments: into 256 KiB buffers on 4 KiB pages the disk
    here read at 0.7 of the rate into huge pages. A mapping of its own, not the C
    allocator's memory: that may be reused heap already faulted in on 4 KiB pages, which
    advice does not change (so did a long test run's read buffers, now and then). The up to
    2 MiB skipped at the front is address space only: it is never touched. The array keeps
    the mapping; it is unmapped with the last view of it."""
    if nbytes < HUGE_PAGE:
        return aligned_empty(nbytes)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # advice only: refused, 4 KiB pages
        m.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(m, dtype=np.uint8)
    skip = -raw.ctypes.data % HUGE_PAGE
    return raw[skip : skip + nbytes]


_bump_lock = threading.Lock()
_bump: list = [None, 0]  # the sheaf small buffers are cut from now, and its next free byte


def small_huge_empty(nbytes: int) -> np.ndarray:
    """:func:`huge_empty`, and under 1 MiB on huge pages too: cut, a page-rounded step at a
    time, from a 2 MiB sheaf shared with the buffers made before and after it.

    Separate small buffers on 4 KiB pages read and wrote slower than slices of one buffer
    on huge pages (1 GiB of 256 KiB entries, AIO: 2.0 against 3.1 GB/s read, 4.8 against
    7.0 written from a raw batch): a vectored request across them pins 4 KiB pages and
    reaches the disk as many short segments. A buffer keeps its sheaf alive (it is a numpy
    view of it), so a sheaf's memory is freed with the last buffer cut from it, and one
    kept buffer holds at most its 2 MiB page."""
    step = -(-nbytes // ALIGNMENT) * ALIGNMENT
    if step > HUGE_PAGE // 2:
        return huge_empty(nbytes)
    with _bump_lock:
        sheaf, at = _bump
        if sheaf is None or at + step > HUGE_PAGE:
            sheaf, at = huge_empty(HUGE_PAGE), 0
        _bump[0], _bump[1] = sheaf, at + step
    return sheaf[at : at + nbytes]


def is_aligned(buf: np.ndarray, alignment: int = ALIGNMENT) -> bool:
    return buf.ctypes.data % alignment == 0 and buf.nbytes % alignment == 0


class StagingPool:
    """Reusable aligned buffers of one size, for copying unaligned sources before O_DIRECT
    writes: fresh buffers would cost a page fault (and the kernel zeroing a page) for every
    4 KiB written. Holds at most ``keep`` idle buffers."""

    def __init__(self, nbytes: int, keep: int) -> None:
        self.nbytes, self.keep = nbytes, keep
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return huge_empty(self.nbytes)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buf)


class _Lease:
    """Exposes one pooled buffer to numpy; the buffer goes back to its pool when the last
    array (or tensor) over it is gone. numpy keeps the object providing
    ``__array_interface__`` as the array's base, so this object lives exactly as long as
    any view of the buffer."""

    __slots__ = ("__array_interface__", "_pool", "_raw")

    def __init__(self, pool: RecycledBuffers, raw: np.ndarray) -> None:
        self._pool, self._raw = pool, raw
        self.__array_interface__ = raw.__array_interface__

    def __del__(self) -> None:
        pool, raw = self._pool, self._raw
        self._pool = self._raw = None
        if pool is not None:
            pool._give(raw)


class RecycledBuffers:
    """Page-aligned read destinations whose memory is reused once the reader drops them.

    A read that lands in freshly allocated memory also pays for faulting that memory in:
    the kernel zeroes every page, and on a virtual machine whose guest hands freed memory
    back to the host (virtio-balloon free page reporting) the host has to map it again,
    which can cost more than the disk read itself. fio never pays this (it reuses its
    buffers). Buffers taken here are plain numpy arrays; when the last array or tensor over
    one is dropped, its memory returns to the pool and the next read of that size lands in
    pages that are already mapped. At most ``keep_bytes`` sit idle; beyond that, returned
    buffers are freed. Buffers smaller than ``min_bytes`` are allocated fresh: the C
    allocator keeps blocks that small mapped. The default is low because an aligned 128 KiB
    read buffer is already past glibc's mmap threshold, and reading 128 KiB entries into
    fresh buffers spent more system time faulting pages than reading.
    """

    def __init__(self, keep_bytes: int, min_bytes: int = 64 << 10) -> None:
        self.keep_bytes, self.min_bytes = keep_bytes, min_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self._spare: dict[int, list[np.ndarray]] = {}  # untouched sheaf buffers (_fresh)
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.reused = 0  # takes served from idle memory, for tests and benchmarks

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """An aligned uint8 array of ``nbytes`` (contents undefined)."""
        if nbytes < self.min_bytes or self.keep_bytes <= 0:
            return aligned_empty(nbytes)
        raw = None
        with self._lock:
            free = self._idle.get(nbytes)
            if free:
                raw = free.pop()
                self._idle_bytes -= nbytes
                self.reused += 1
            if raw is None:
                spare = self._spare.get(nbytes)
                if spare:
                    raw = spare.pop()
        if raw is None:
            raw = self._fresh(nbytes)
        return np.asarray(_Lease(self, raw))

    def _fresh(self, nbytes: int) -> np.ndarray:
        """A new buffer on huge pages (see :func:`huge_empty`). One under 2 MiB is cut from
        a sheaf of its size; the sheaf's other buffers are spares for the next takes. Spares
        were never touched, so they cost address space, not memory, and are not counted as
        idle bytes. A sheaf is freed when none of its buffers is in use, idle or spare; so
        that buffers dropped for want of idle room do not keep theirs alive, their size's
        spares are dropped with them."""
        step = -(-nbytes // ALIGNMENT) * ALIGNMENT
        count = SHEAF_BYTES // step
        if nbytes >= HUGE_PAGE or count < 2:
            return huge_empty(nbytes)
        sheaf = huge_empty(count * step)
        bufs = [sheaf[i * step : i * step + nbytes] for i in range(count)]
        with self._lock:
            if not self._closed:
                self._spare[nbytes] = bufs[:0:-1]
        return bufs[0]

    def _give(self, raw: np.ndarray) -> None:
        with self._lock:
            if self._closed or self._idle_bytes + raw.nbytes > self.keep_bytes:
                self._spare.pop(raw.nbytes, None)
                return
            self._idle.setdefault(raw.nbytes, []).append(raw)
            self._idle_bytes += raw.nbytes

    def close(self) -> None:
        """Free the idle buffers; buffers still in use are freed when they are dropped."""
        with self._lock:
            self._closed = True
            idle, self._idle, self._idle_bytes = self._idle, {}, 0
            self._spare.clear()
        idle.clear()
