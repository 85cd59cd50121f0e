"""ctypes binding of PMDK's libpmem.

Only the calls the pool needs are bound, each with its C prototype, so a wrong argument is a
``ctypes.ArgumentError`` rather than a corrupted stack. The library is optional: ``load()``
returns None where it is absent or hidden (``TIERSTORE_NO_LIBPMEM=1``), and the pool then
falls back to Python's ``mmap``. Every call goes through a ``CDLL`` function pointer, which
releases the GIL, so large copies on worker threads run in parallel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import threading

__all__ = [
    "ENV_HIDE",
    "PMEM_FILE_CREATE",
    "PMEM_FILE_EXCL",
    "PMEM_FILE_SPARSE",
    "PMEM_FILE_TMPFILE",
    "Libpmem",
    "PmemError",
    "libpmem_available",
    "load",
    "unavailable_reason",
]

ENV_HIDE = "TIERSTORE_NO_LIBPMEM"
"""Set to 1 to make ``load()`` behave as if libpmem were not installed."""

# Flags of pmem_map_file, from libpmem.h.
PMEM_FILE_CREATE = 1 << 0
PMEM_FILE_EXCL = 1 << 1
PMEM_FILE_SPARSE = 1 << 2
PMEM_FILE_TMPFILE = 1 << 3
# Flag of pmem_memcpy: stores that bypass the CPU's caches.
PMEM_F_MEM_NONTEMPORAL = 1 << 1

_c_size_p = ctypes.POINTER(ctypes.c_size_t)
_c_int_p = ctypes.POINTER(ctypes.c_int)

# name: (restype, argtypes). mode_t is unsigned int on every platform libpmem supports.
_PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "pmem_map_file": (
        ctypes.c_void_p,
        [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint, _c_size_p, _c_int_p],
    ),
    "pmem_unmap": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
    "pmem_is_pmem": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
    "pmem_persist": (None, [ctypes.c_void_p, ctypes.c_size_t]),
    "pmem_flush": (None, [ctypes.c_void_p, ctypes.c_size_t]),
    "pmem_drain": (None, []),
    "pmem_msync": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
    "pmem_memcpy_persist": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    "pmem_memcpy_nodrain": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    "pmem_memcpy": (
        ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    ),
    "pmem_errormsg": (ctypes.c_char_p, []),
    "pmem_check_version": (ctypes.c_char_p, [ctypes.c_uint, ctypes.c_uint]),
}

# Release builds of PMDK embed "src version: X.Y.Z" (printed by its logging); it is the only
# place the package version lives, since the soname (libpmem.so.1) carries the ABI only.
_SRC_VERSION = re.compile(rb"src version: ?(\d+)\.(\d+)(?:\.(\d+))?")


class PmemError(OSError):
    """A libpmem call failed.

    ``errno`` is the C errno the call left; ``strerror`` is ``pmem_errormsg()``, which names
    the failing step more precisely than errno alone ("open ...: No such file or directory").
    """


class Libpmem:
    """The loaded library: typed wrappers over its C functions plus version facts.

    Addresses are plain ints (``ctypes.addressof``, ``numpy.ndarray.ctypes.data``); the
    caller keeps the memory alive for the duration of a call.
    """

    def __init__(self, cdll: ctypes.CDLL) -> None:
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(cdll, name)
            fn.restype = restype
            fn.argtypes = argtypes
        self._c = cdll
        self.path: str = _resolved_path(cdll) or str(cdll._name)
        """The library file actually loaded (not just its soname)."""
        self.api_version: tuple[int, int] = self._probe_api_version()
        """(major, minor) of the C API, the numbers ``pmem_check_version`` compares."""
        self.version: tuple[int, ...] | None = _release_version(self.path)
        """Release of PMDK, e.g. (1, 12, 1); None where the build does not record it."""
        # libpmem reads PMEM_IS_PMEM_FORCE once, in its constructor, so what counts is the
        # environment at load time (checked again at map time, in case it was set later).
        self.force_env_at_load: str | None = os.environ.get("PMEM_IS_PMEM_FORCE")

    @property
    def version_string(self) -> str:
        """``"libpmem 1.12"``; the API version where the release is unknown."""
        if self.version is not None:
            return f"libpmem {self.version[0]}.{self.version[1]}"
        return f"libpmem (API {self.api_version[0]}.{self.api_version[1]})"

    def _probe_api_version(self) -> tuple[int, int]:
        # pmem_check_version(M, m) succeeds iff M is the library's major and m <= its minor.
        major = next((m for m in range(1, 16) if self.check_version(m, 0) is None), 0)
        minor = 0
        while major and minor < 1024 and self.check_version(major, minor + 1) is None:
            minor += 1
        return major, minor

    def _fail(self, what: str, filename: str | None = None) -> PmemError:
        code = ctypes.get_errno() or errno.EIO
        msg = self.errormsg() or os.strerror(code)
        if filename is None:
            return PmemError(code, f"{what}: {msg}")
        return PmemError(code, f"{what}: {msg}", filename)

    def map_file(
        self, path: str | os.PathLike[str], length: int = 0, flags: int = 0, mode: int = 0o600
    ) -> tuple[int, int, bool]:
        """``pmem_map_file``: map ``path`` whole (length 0) or create it at ``length``.

        Returns (address, mapped length, is_pmem). is_pmem is libpmem's own verdict, which
        ``PMEM_IS_PMEM_FORCE`` can override; see ``pmem.mapping`` for why it is not trusted
        blindly.
        """
        mapped = ctypes.c_size_t(0)
        is_pmem = ctypes.c_int(0)
        fspath = os.fsencode(path)
        addr = self._c.pmem_map_file(
            fspath, length, flags, mode, ctypes.byref(mapped), ctypes.byref(is_pmem)
        )
        if not addr:
            raise self._fail("pmem_map_file", os.fsdecode(fspath))
        return addr, mapped.value, bool(is_pmem.value)

    def unmap(self, addr: int, length: int) -> None:
        """``pmem_unmap``."""
        if self._c.pmem_unmap(addr, length) != 0:
            raise self._fail("pmem_unmap")

    def is_pmem(self, addr: int, length: int) -> bool:
        """``pmem_is_pmem``: whether flushing CPU caches alone persists this range."""
        return bool(self._c.pmem_is_pmem(addr, length))

    def persist(self, addr: int, length: int) -> None:
        """``pmem_persist``: flush + drain; durable only on real pmem."""
        self._c.pmem_persist(addr, length)

    def flush(self, addr: int, length: int) -> None:
        """``pmem_flush``: write back the cache lines; ``drain`` completes them."""
        self._c.pmem_flush(addr, length)

    def drain(self) -> None:
        """``pmem_drain``: wait for this thread's flushes and non-temporal stores."""
        self._c.pmem_drain()

    def msync(self, addr: int, length: int) -> None:
        """``pmem_msync``: msync(MS_SYNC) over the pages spanning the range."""
        if self._c.pmem_msync(addr, length) != 0:
            raise self._fail("pmem_msync")

    def memcpy_persist(self, dest: int, src: int, length: int) -> None:
        """``pmem_memcpy_persist``: copy, flush and drain."""
        self._c.pmem_memcpy_persist(dest, src, length)

    def memcpy_nodrain(self, dest: int, src: int, length: int) -> None:
        """``pmem_memcpy_nodrain``: copy and flush; a later ``drain`` completes it."""
        self._c.pmem_memcpy_nodrain(dest, src, length)

    def memcpy_streaming(self, dest: int, src: int, length: int) -> None:
        """``pmem_memcpy`` with non-temporal stores, then drained: a copy into any memory
        (DRAM too) that neither reads the destination into the cache before writing it
        nor leaves it there, for bytes the CPU will not touch again soon."""
        self._c.pmem_memcpy(dest, src, length, PMEM_F_MEM_NONTEMPORAL)

    def errormsg(self) -> str:
        """``pmem_errormsg``: this thread's last libpmem error message ("" if none)."""
        raw = self._c.pmem_errormsg()
        return raw.decode(errors="replace") if raw else ""

    def check_version(self, major: int, minor: int) -> str | None:
        """``pmem_check_version``: None if compatible, else the library's reason."""
        raw = self._c.pmem_check_version(major, minor)
        return raw.decode(errors="replace") if raw else None


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _resolved_path(cdll: ctypes.CDLL) -> str | None:
    """The file the dynamic linker loaded, found by dladdr() on one of its symbols."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (AttributeError, OSError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    symbol = ctypes.cast(cdll.pmem_map_file, ctypes.c_void_p).value
    if not dladdr(symbol, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def _release_version(path: str) -> tuple[int, ...] | None:
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:
        return None
    m = _SRC_VERSION.search(blob)
    if m is None:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


_lock = threading.Lock()
_attempted = False
_binding: Libpmem | None = None
_load_error: str | None = None


def _hidden() -> bool:
    return os.environ.get(ENV_HIDE, "").strip() not in ("", "0")


def load() -> Libpmem | None:
    """The process-wide binding, or None where libpmem is absent or hidden.

    ``TIERSTORE_NO_LIBPMEM`` is consulted on every call, so it can be flipped at run time;
    the library itself is loaded once.
    """
    global _attempted, _binding, _load_error
    if _hidden():
        return None
    if _attempted:  # no lock once loaded: the NVMe path asks on every copy it makes
        return _binding
    with _lock:
        if not _attempted:
            name = ctypes.util.find_library("pmem")
            if name is None:
                _load_error = "libpmem not found"
            else:
                try:
                    _binding = Libpmem(ctypes.CDLL(name, use_errno=True))
                except (OSError, AttributeError) as exc:
                    _load_error = f"libpmem unusable ({exc})"
            _attempted = True  # after the binding, which a reader without the lock takes
        return _binding


def libpmem_available() -> bool:
    """Whether ``load()`` returns a binding."""
    return load() is not None


def unavailable_reason() -> str | None:
    """Why ``load()`` returns None (for messages), or None when it does not."""
    if _hidden():
        return f"libpmem hidden by {ENV_HIDE}=1"
    if load() is None:
        return _load_error or "libpmem not found"
    return None
