"""Whether memory is on 4 KiB pages, asked of the kernel (Linux 6.7's ``PAGEMAP_SCAN``).

An O_DIRECT request into memory on 4 KiB pages reaches the disk as one segment per run of
physically adjacent pages, and a disk takes a bounded number of segments per request (128
on the development VM's virtio disk). There, 16 MiB entries read into an anonymous mapping
at 0.70 of DeepNVMe's rate while the same entries into 2 MiB pages read at 1.48. The
store's own buffers are on 2 MiB pages where the kernel allows
(:func:`~tierstore.nvme.buffers.huge_empty`), so entries in memory a caller hands it on
4 KiB pages are moved through them instead, at the cost of a copy overlapped with the I/O
(see the note in ``tierstore.landing``). A batch asks once for all its entries
(:func:`small_pages`).

``PAGEMAP_SCAN`` is an ioctl on ``/proc/self/pagemap`` that reports which pages of a range
are huge, without privileges and without reading the range. Where it is missing (an older
kernel, no procfs) or huge pages are off, :func:`small_pages` says False: every page is
then treated as a huge one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Sequence

import numpy as np

_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg), 96 bytes
_PAGE_IS_PRESENT = 1 << 3
_PAGE_IS_HUGE = 1 << 6


class _ScanArg(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_lock = threading.Lock()
_fd = -1
_fd_pid = 0  # the process the descriptor's /proc/self is: a fork's child opens its own
_usable: bool | None = None
_scratch = threading.local()  # each thread's scan buffers


def _huge_pages_on() -> bool:
    """Whether transparent huge pages back any anonymous memory (``always`` or ``madvise``):
    with them ``never``, the store's buffers are on 4 KiB pages too."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _pagemap() -> int:
    """This process's ``/proc/self/pagemap`` descriptor, or -1 where it cannot scan."""
    global _fd, _fd_pid, _usable
    with _lock:
        pid = os.getpid()
        if _usable is None:
            _usable = _huge_pages_on()
        if _usable and _fd_pid != pid:
            try:
                _fd, _fd_pid = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC), pid
            except OSError:
                _usable = False
        return _fd if _usable else -1


# Ranges no further apart than this are scanned as one span: a scan walks the page tables
# between them instead of making a system call for each. A batch of 4,096 page-aligned
# 256 KiB buffers is a few spans, not 4,096 calls of 2.6-3.3 us each (0.6 ms for slices of
# one read buffer, 5 ms for a mapping each). Not further: the few of 4,096 `torch.empty`
# tensors that happen to be page-aligned, scattered through a GiB of heap, cost 3.3 ms
# joined across 64 MiB gaps (the whole heap's page tables walked) and 0.7 apart.
JOIN_GAP = 1 << 20
_VEC = 1024  # regions a scan reports per call; a span with more is scanned on from there
FEW = 8  # ranges asked one by one: fewer system calls would not pay for the arrays


def on_small_pages(addr: int, nbytes: int) -> bool:
    """Whether any page of ``[addr, addr + nbytes)`` is in memory on a 4 KiB page; True only
    where the kernel can say so (see the module docstring). A page not yet faulted in does
    not count: memory advised for huge pages (a read buffer) gets them on its first read."""
    return small_pages([addr], [nbytes])[0]


def small_pages(addrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
    """:func:`on_small_pages` of each range ``[addrs[i], addrs[i] + sizes[i])``, asked of
    the kernel a span of neighbouring ranges at a time (see :data:`JOIN_GAP`). An empty
    range is not asked about (False): a caller passes 0 for what it need not know."""
    fd = _pagemap()
    if fd < 0 or not any(sizes):
        return [False] * len(addrs)
    page = 4096
    if len(addrs) <= FEW:
        got = []
        for a, n in zip(addrs, sizes):
            starts: list[int] = []
            a0, b = a // page * page, -(-(a + n) // page) * page
            if n > 0 and not _scan(fd, a0, b, starts, [], first=True):
                return [False] * len(addrs)
            got.append(bool(starts))
        return got
    lo = np.asarray(addrs, dtype=np.uint64)
    hi = lo + np.asarray(sizes, dtype=np.uint64)
    order = np.flatnonzero(hi > lo)  # the ranges asked about, in address order
    order = order[np.argsort(lo[order], kind="stable")]
    lo_sorted, hi_sorted = lo[order], np.maximum.accumulate(hi[order])
    # A span ends where the next range starts more than JOIN_GAP past every end before it.
    cuts = np.flatnonzero(lo_sorted[1:] > hi_sorted[:-1] + np.uint64(JOIN_GAP)) + 1
    starts, ends = [], []
    for first, last in zip([0, *cuts.tolist()], [*cuts.tolist(), len(order)]):
        a = int(lo_sorted[first]) // page * page
        b = -(-int(hi_sorted[last - 1]) // page) * page
        if b > a and not _scan(fd, a, b, starts, ends):
            return [False] * len(addrs)  # the kernel cannot scan after all
    if not starts:
        return [False] * len(addrs)
    # The last small region that starts before each range ends: small if it ends after the
    # range starts (regions are reported in order, and never overlap).
    rs, re_ = np.asarray(starts, dtype=np.uint64), np.asarray(ends, dtype=np.uint64)
    k = np.searchsorted(rs, hi, side="left").astype(np.int64) - 1
    hit = (k >= 0) & (re_[np.maximum(k, 0)] > lo) & (hi > lo)
    return hit.tolist()


def _scan(fd: int, start: int, end: int, starts: list[int], ends: list[int], *,
          first: bool = False) -> bool:
    """Append the regions of ``[start, end)`` on present 4 KiB pages to ``starts`` and
    ``ends`` (``first``: only the first page of the first, which says whether there is
    any); False where the kernel has no ``PAGEMAP_SCAN`` (never asked again)."""
    global _usable
    held = getattr(_scratch, "held", None)
    if held is None:  # made once a thread: 24 KiB zeroed, dearer than a scan
        regions = (_Region * _VEC)()
        arg = _ScanArg(size=ctypes.sizeof(_ScanArg), vec=ctypes.addressof(regions),
                       vec_len=_VEC, category_inverted=_PAGE_IS_HUGE,
                       category_mask=_PAGE_IS_PRESENT | _PAGE_IS_HUGE,
                       return_mask=_PAGE_IS_HUGE)
        held = _scratch.held = (regions, arg, np.frombuffer(regions, np.uint64).reshape(_VEC, 3))
    regions, arg, table = held
    arg.max_pages = 1 if first else 0
    while start < end:
        arg.start, arg.end, arg.walk_end = start, end, 0
        found = _libc.ioctl(fd, _PAGEMAP_SCAN, ctypes.byref(arg))
        if found < 0:
            if ctypes.get_errno() in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                _usable = False
                return False
            return True  # a failed scan: treated as huge pages, as before this existed
        got = table[:found]
        starts += got[:, 0].tolist()
        ends += got[:, 1].tolist()
        if first or found < _VEC or arg.walk_end <= start:
            break
        start = arg.walk_end
    return True
