"""In-memory extent allocator over the segments of a backing medium.

The LMDB free map is the durable truth; this is its working copy minus the extents that
writers have taken but not yet committed. A crash therefore leaks nothing: uncommitted
extents were never removed from the durable map.

Readers *lease* the extent of the record they are reading. An extent freed by a commit while
leased is parked until the last lease ends, so a concurrent writer can never reuse space a
reader is still reading (which would show up as a false checksum error).
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Iterable

Extent = tuple[int, int, int]  # (segment, offset, length)


class ExtentAllocator:
    def __init__(self, alignment: int = 4096) -> None:
        self.alignment = alignment
        self.lock = threading.Lock()
        self._offs: dict[int, list[int]] = {}  # segment -> sorted free offsets
        self._lens: dict[int, dict[int, int]] = {}  # segment -> {offset: length}
        self._leases: Counter[tuple[int, int]] = Counter()
        self._parked: dict[tuple[int, int], int] = {}  # freed while leased: (seg, off) -> len

    def load(self, extents: Iterable[Extent]) -> None:
        with self.lock:
            for seg, off, length in extents:
                self._insert(seg, off, length)

    def free_bytes(self) -> int:
        with self.lock:
            return sum(sum(d.values()) for d in self._lens.values())

    def allocate(self, nbytes: int) -> tuple[int, int] | None:
        """First fit over segments in order; None when no free extent is large enough."""
        with self.lock:
            for seg in sorted(self._offs):
                lens = self._lens[seg]
                for off in self._offs[seg]:
                    length = lens[off]
                    if length >= nbytes:
                        self._remove(seg, off)
                        if length > nbytes:
                            self._insert(seg, off + nbytes, length - nbytes)
                        return seg, off
        return None

    def release(self, extents: Iterable[Extent]) -> None:
        """Return extents: taken but never committed, or freed by a committed transaction."""
        with self.lock:
            for seg, off, length in extents:
                if length == 0:
                    continue
                if self._leases[(seg, off)]:
                    self._parked[(seg, off)] = length
                else:
                    self._insert(seg, off, length)

    def add(self, seg: int, off: int, length: int) -> None:
        with self.lock:
            self._insert(seg, off, length)

    def lease_locked(self, seg: int, off: int) -> None:
        """Lease an extent; the caller holds ``self.lock`` (it looked the record up under it)."""
        self._leases[(seg, off)] += 1

    def unlease(self, seg: int, off: int) -> None:
        with self.lock:
            key = (seg, off)
            self._leases[key] -= 1
            if self._leases[key] <= 0:
                del self._leases[key]
                length = self._parked.pop(key, None)
                if length is not None:
                    self._insert(seg, off, length)

    # -- sorted free lists, coalescing neighbours -------------------------------------
    def _remove(self, seg: int, off: int) -> None:
        offs = self._offs[seg]
        del offs[bisect.bisect_left(offs, off)]
        del self._lens[seg][off]

    def _insert(self, seg: int, off: int, length: int) -> None:
        offs = self._offs.setdefault(seg, [])
        lens = self._lens.setdefault(seg, {})
        i = bisect.bisect_left(offs, off)
        if i < len(offs) and offs[i] == off + length:  # merge with the next extent
            length += lens.pop(offs[i])
            del offs[i]
        if i > 0 and offs[i - 1] + lens[offs[i - 1]] == off:  # merge into the previous one
            lens[offs[i - 1]] += length
            return
        offs.insert(i, off)
        lens[off] = length
