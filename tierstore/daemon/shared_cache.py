"""The daemon's host cache in shared memory, and the published index that lets clients read
cache hits without a round trip.

The cache's slot arena is a memfd that the daemon maps read-write and hands to each client
as a read-only descriptor (a fresh O_RDONLY open of it; the memfd itself is chmod 0400 so a
client cannot reopen it for writing). The index of published slots follows the arena in the
same mapping.

Row r of the index is (seq, offset). A published row's seq is even and its slot holds the
entry the client learned it for (the client keeps the seq, the entry's metadata and the row
from the get that published it); the cache retires the row (seq odd) before that slot's
bytes can change or the entry stops being current. A client copies the bytes and keeps the
copy only if the row's seq is the same before and after: a sequence lock, with the daemon
the only writer. Both callbacks run under the cache's lock, so rows need no lock of their
own.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import warnings
from typing import Any

import numpy as np
import torch

from tierstore.cache import HostCache
from tierstore.cache.slab import PAGE

from ..errors import StoreError
from ..sizes import format_size
from . import protocol as P

INDEX_ROW_BYTES = 16  # (seq, offset), int64 each
MAX_INDEX_ROWS = 1 << 18  # 4 MiB of index; entries beyond it are served over the socket


# F_SEAL_FUTURE_WRITE (Linux 5.1): no write() and no new writable shared mapping of the
# memory, for anyone, root included; the daemon's own mapping, made before, stays writable.
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def _seal_writes(memfd: int) -> None:
    """Make the memory unwritable through any descriptor a client could get: the 0400 mode
    alone does not stop a client of the daemon's own user, who owns the inode, from
    chmod-ing its read-only descriptor and reopening it for writing. Where the kernel
    predates the seal, the mode is what is left."""
    seals = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
    try:
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE | seals)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, seals)


class SharedCache:
    """``arena_bytes`` of shared memory for the host cache's slots (``arena``, which the
    store's cache is carved out of), the published index after it, and ``ro_fd``, the
    read-only descriptor clients map. :meth:`attach` the store's cache once it is made."""

    def __init__(self, arena_bytes: int) -> None:
        cap = arena_bytes
        self.index_rows = max(1, min(cap // PAGE, MAX_INDEX_ROWS))
        index_bytes = -(-self.index_rows * INDEX_ROW_BYTES // PAGE) * PAGE
        memfd = os.memfd_create("tierstore-cache", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(memfd, cap + index_bytes)
            self._map = mmap.mmap(memfd, cap + index_bytes)
            _seal_writes(memfd)
        except OSError as e:
            os.close(memfd)
            raise StoreError(f"cannot map a host cache of {format_size(cap)} in shared "
                             f"memory: {e.strerror or e}; choose a smaller --host-cache"
                             ) from None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.arena = torch.frombuffer(self._map, dtype=torch.uint8, count=cap)
        self._index = np.frombuffer(self._map, dtype=np.int64, count=self.index_rows * 2,
                                    offset=cap).reshape(self.index_rows, 2)
        self._index[:, 0] = 1  # odd: not published
        self._free_rows = list(range(self.index_rows - 1, -1, -1))
        self._row_keys: dict[int, Any] = {}
        # What clients get: a read-only open of the memfd, which is then made unopenable
        # for writing (a client could otherwise reopen /proc/self/fd/N read-write).
        self.ro_fd = os.open(f"/proc/self/fd/{memfd}", os.O_RDONLY | os.O_CLOEXEC)
        os.fchmod(memfd, 0o400)
        os.close(memfd)  # the mapping keeps the memory
        self.arena_bytes = cap
        self._cache: HostCache | None = None
        self._arena_ptr = 0

    def attach(self, cache: HostCache) -> None:
        """The store's host cache, made on :attr:`arena`: its slots are published here."""
        self._cache = cache
        self._arena_ptr = cache.arena.data_ptr()
        cache.on_retire(self._retire_row)

    def offset(self, slot: torch.Tensor) -> int:
        """Where a cache slot's bytes start in the arena (what clients map)."""
        return slot.data_ptr() - self._arena_ptr

    def watch(self, handle: Any, key: Any) -> tuple[int, int] | None:
        """Publish the slot behind a cache handle of ``key``: (row, seq) for the client, or
        None where the cache will not (or the index is full)."""
        assert self._cache is not None
        return self._cache.watch(handle, functools.partial(self._publish, key))

    def _publish(self, key: Any, offset: int, nbytes: int) -> tuple[int, int] | None:
        if not self._free_rows:
            return None  # clients use the socket for this one
        row = self._free_rows.pop()
        self._row_keys[row] = key
        seq = int(self._index[row, 0]) + 1
        self._index[row, 1] = offset
        self._index[row, 0] = seq
        return row, seq

    def _retire_row(self, token: tuple[int, int]) -> None:
        row, seq = token
        self._index[row, 0] = seq + 1
        self._row_keys.pop(row, None)
        self._free_rows.append(row)

    def record_hits(self, rows: list[Any]) -> int:
        """Count the hits a client served itself from published rows ([row, seq, ...])."""
        if len(rows) % 2:
            raise P.ProtocolError("hits are [row, seq] pairs")
        keys = []
        for i in range(0, len(rows), 2):
            row, seq = rows[i], rows[i + 1]
            if (isinstance(row, bool) or isinstance(seq, bool) or not isinstance(row, int)
                    or not isinstance(seq, int) or not 0 <= row < self.index_rows):
                raise P.ProtocolError("hits are [row, seq] integer pairs")
            key = self._row_keys.get(row)
            if key is not None and int(self._index[row, 0]) == seq:
                keys.append(key)
        assert self._cache is not None
        return self._cache.record_hits(keys)

    def close(self) -> None:
        """Close the descriptor clients are handed (the mapping goes with the cache)."""
        if self.ro_fd >= 0:
            os.close(self.ro_fd)
            self.ro_fd = -1
