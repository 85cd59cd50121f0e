"""Is a file really direct-access persistent memory?

libpmem answers that question itself, but ``PMEM_IS_PMEM_FORCE=1`` makes it answer yes for
any file, and then ``pmem_persist`` (a CPU cache flush) would be taken for durability on a
page-cache-backed file, where only msync reaches the disk. When that variable is set, the
pool asks the kernel instead: the file must be DAX (statx ``STATX_ATTR_DAX``, or the mount's
``dax`` option on kernels too old to report it) and must accept ``MAP_SYNC``, which is what
makes a cache flush sufficient (virtio-pmem, for one, is DAX but refuses MAP_SYNC because
the host's page cache still sits behind it). A device-DAX character device needs neither.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
import struct

__all__ = [
    "FORCE_ENV",
    "device_dax",
    "file_is_dax",
    "map_sync_supported",
    "mount_dax",
    "parse_mountinfo",
    "really_pmem",
    "statx_dax",
]

FORCE_ENV = "PMEM_IS_PMEM_FORCE"

STATX_ATTR_DAX = 0x00200000
_AT_FDCWD = -100
_STATX_SIZE = 256  # sizeof(struct statx), with its reserved tail
_STATX_ATTRIBUTES = 8  # offsetof(struct statx, stx_attributes)
_STATX_ATTRIBUTES_MASK = 56  # offsetof(struct statx, stx_attributes_mask)

_PROT_READ = 0x1
_MAP_SHARED_VALIDATE = 0x03
_MAP_SYNC = 0x80000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if hasattr(libc, "statx"):  # glibc >= 2.28
            libc.statx.restype = ctypes.c_int
            libc.statx.argtypes = [
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_int,
                ctypes.c_uint,
                ctypes.c_void_p,
            ]
        _libc = libc
    return _libc


def statx_dax(path: str | os.PathLike[str]) -> bool | None:
    """The kernel's per-file DAX flag (Linux >= 5.8); None where it does not report one."""
    libc = _c()
    if not hasattr(libc, "statx"):
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if libc.statx(_AT_FDCWD, os.fsencode(path), 0, 0, buf) != 0:
        return None
    (attributes,) = struct.unpack_from("=Q", buf, _STATX_ATTRIBUTES)
    (supported,) = struct.unpack_from("=Q", buf, _STATX_ATTRIBUTES_MASK)
    if not supported & STATX_ATTR_DAX:
        return None
    return bool(attributes & STATX_ATTR_DAX)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[tuple[str, frozenset[str]]]:
    """(mount point, mount options | super options) per line of /proc/self/mountinfo."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 6:
            continue
        sep = fields.index("-")
        opts = set(fields[5].split(","))
        if len(fields) > sep + 3:
            opts.update(fields[sep + 3].split(","))
        mounts.append((_unescape(fields[4]), frozenset(opts)))
    return mounts


def mount_dax(path: str | os.PathLike[str], mountinfo: str | None = None) -> bool | None:
    """Whether the mount holding ``path`` has ``dax``/``dax=always``; None if unknown.

    ``dax=inode`` leaves it to the per-file flag, which only statx can see, so it reads as
    not DAX here.
    """
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    real = os.path.realpath(path)
    best: tuple[str, frozenset[str]] | None = None
    # Later lines are mounted over earlier ones, so ">=" lets the topmost mount win.
    for point, opts in parse_mountinfo(mountinfo):
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, opts)
    if best is None:
        return None
    return bool({"dax", "dax=always"} & best[1])


def device_dax(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a device-DAX character device (/dev/daxX.Y)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISCHR(st.st_mode):
        return False
    subsystem = f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/subsystem"
    return os.path.basename(os.path.realpath(subsystem)) == "dax"


def file_is_dax(path: str | os.PathLike[str]) -> bool:
    """Whether loads and stores to a mapping of ``path`` go straight to the medium."""
    if device_dax(path):
        return True
    flag = statx_dax(path)
    if flag is not None:
        return flag
    return bool(mount_dax(path))


def map_sync_supported(path: str | os.PathLike[str]) -> bool | None:
    """Whether ``path`` accepts a ``MAP_SHARED_VALIDATE | MAP_SYNC`` mapping.

    None where the probe itself could not run (so the answer is unknown).
    """
    c = _c()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        length = os.sysconf("SC_PAGE_SIZE")
        addr = c.mmap(None, length, _PROT_READ, _MAP_SHARED_VALIDATE | _MAP_SYNC, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            return False if err in (errno.EOPNOTSUPP, errno.EINVAL) else None
        c.munmap(addr, length)
        return True
    finally:
        os.close(fd)


def really_pmem(path: str | os.PathLike[str]) -> bool:
    """Whether a CPU cache flush alone makes stores to ``path``'s mapping durable."""
    if device_dax(path):
        return True
    return file_is_dax(path) and map_sync_supported(path) is not False
