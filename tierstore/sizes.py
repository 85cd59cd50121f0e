"""Byte sizes as users write them: ``4096``, ``"64MiB"``, ``"2 GiB"``, ``"1.5GB"``; the
memory this process may use; and the range a timeout in seconds may take."""

from __future__ import annotations

import os
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
#: A socket timeout in seconds: at least a millisecond (to the kernel a send timeout of zero
#: means none at all, and to Python a timeout of zero means non-blocking), at most a day.
TIMEOUT_RANGE_S = (0.001, 86400.0)
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string with an optional SI (kB, MB) or IEC (KiB, MiB) unit."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"not a size: {value!r} (write bytes, or a number with a unit such as 64MiB or 2GB)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    """Human-readable IEC size: ``format_size(3 << 20) == "3.0 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_limit() -> int:
    """Bytes this process may have resident: the machine's memory, or its cgroup's limit
    where that is lower."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(f) as fh:
                raw = fh.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            limit = min(limit, int(raw))
    return limit
