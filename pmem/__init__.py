"""Persistent-memory backing tier: a libpmem pool file behind the ``Medium`` protocol.

A leaf package: it imports nothing from tierstore, nvme, cache, trainer or bench, and takes
and returns plain (seg, path, base, size) tuples.
"""

from __future__ import annotations

from .dax import file_is_dax, really_pmem
from .header import HEADER_SIZE, LAYOUT_VERSION, PoolFormatError
from .libpmem import (
    ENV_HIDE,
    Libpmem,
    PmemError,
    libpmem_available,
    load,
    unavailable_reason,
)
from .pool import PmemFallbackWarning, PoolMedium

__all__ = [
    "ENV_HIDE",
    "HEADER_SIZE",
    "LAYOUT_VERSION",
    "Libpmem",
    "PmemError",
    "PmemFallbackWarning",
    "PoolFormatError",
    "PoolMedium",
    "file_is_dax",
    "libpmem_available",
    "libpmem_version",
    "load",
    "really_pmem",
    "unavailable_reason",
]


def libpmem_version() -> str | None:
    """``"libpmem 1.12"`` for the library in use, or None where there is none."""
    lib = load()
    return lib.version_string if lib is not None else None
