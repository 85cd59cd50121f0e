"""Whether memory is on 4 KiB pages, asked of the kernel (Linux 6.7's ``PAGEMAP_SCAN``).

An O_DIRECT request into memory on 4 KiB pages reaches the disk as one segment per run of
physically adjacent pages, and a disk takes a bounded number of segments per request (128
on the development VM's virtio disk). There, 16 MiB entries read into an anonymous mapping
at 0.70 of DeepNVMe's rate while the same entries into 2 MiB pages read at 1.48. The
store's own buffers are on 2 MiB pages where the kernel allows
(:func:`~tierstore.nvme.buffers.huge_empty`), so large entries in memory a caller hands it
on 4 KiB pages are moved through them instead, at the cost of a copy (see
``tierstore.landing.SMALL_PAGES_MIN``).

``PAGEMAP_SCAN`` is an ioctl on ``/proc/self/pagemap`` that reports which pages of a range
are huge, without privileges and without reading the range. Where it is missing (an older
kernel, no procfs) or huge pages are off, :func:`on_small_pages` says False: every page is
then treated as it was before, whatever its size.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

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


def on_small_pages(addr: int, nbytes: int) -> bool:
    """Whether any page of ``[addr, addr + nbytes)`` is in memory on a 4 KiB page; True only
    where the kernel can say so (see the module docstring). A page not yet faulted in does
    not count: memory advised for huge pages (a read buffer) gets them on its first read."""
    global _usable
    fd = _pagemap()
    if fd < 0 or nbytes <= 0:
        return False
    page = 4096
    first, end = addr - addr % page, -(-(addr + nbytes) // page) * page
    region = _Region()
    arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=first, end=end,
                   vec=ctypes.addressof(region), vec_len=1, max_pages=1,
                   category_inverted=_PAGE_IS_HUGE,
                   category_mask=_PAGE_IS_PRESENT | _PAGE_IS_HUGE,
                   return_mask=_PAGE_IS_HUGE)
    found = _libc.ioctl(fd, _PAGEMAP_SCAN, ctypes.byref(arg))
    if found < 0:
        if ctypes.get_errno() in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            _usable = False  # a kernel without PAGEMAP_SCAN: never ask again
        return False
    return found > 0
