"""The one interface a backing tier implements.

A backing *medium* holds bytes in numbered *segments*; the store's allocator hands out
4 KiB-aligned extents (segment, offset, length) inside them and the LMDB catalog records
which extents are used, free or held by snapshots. A medium therefore knows nothing about
entries, versions or free space: it creates segments, moves bytes, makes them durable and
says where they are. NVMe (``nvme.SlabMedium``: one preallocated slab file per segment) and
persistent memory (``pmem.PoolMedium``: regions of one mapped pool file) differ only there.

The asynchronous calls are the primitives. ``read``/``write`` are their blocking forms,
for callers that are already on a worker thread (the store's chunk jobs): where the medium
can, it does a small request's I/O on the calling thread, sparing a hand-off to its own pool
and back, which on a small entry costs about as much CPU as the read itself; large requests
still queue on the pool, whose threads start the next one without a wake-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import NamedTuple, Protocol, runtime_checkable

ALIGNMENT = 4096


class Segment(NamedTuple):
    """Where a segment lives: ``size`` bytes of ``path`` starting at file offset ``base``.

    Leaf packages cannot import this module, so media take and return plain tuples of the
    same shape; ``Segment(*t)`` names the fields.
    """

    seg: int
    path: str
    base: int
    size: int


@runtime_checkable
class Medium(Protocol):
    kind: str
    """Short name of the tier: ``"nvme"`` or ``"pmem"``."""

    def describe(self) -> str:
        """One line naming the engine in use, e.g. ``"posix O_DIRECT, 8 threads"``."""

    def attach(self, segments: Iterable[tuple[int, str, int, int]]) -> None:
        """Open the segments the catalog knows, as (seg, path, base, size) tuples.

        Called once when a store is opened, before any other call but ``create_segment``.
        """

    def create_segment(self, seg: int, min_bytes: int) -> tuple[int, str, int, int]:
        """Add segment ``seg`` of at least ``min_bytes``; returns (seg, path, base, size).

        The space is preallocated and the segment durable before it returns.

        Raises ``OSError`` (ENOSPC, EFBIG, ...) when the space cannot be had; nothing the
        catalog references is touched in that case.
        """

    def pread(self, seg: int, offset: int, buf: memoryview) -> Future[None]:
        """Fill ``buf`` (whole 4 KiB pages, at an address aligned to the medium's
        :func:`memory_alignment`) from ``offset`` of ``seg``."""

    def pwrite(self, seg: int, offset: int, buf: memoryview) -> Future[None]:
        """Write ``buf`` (aligned as for ``pread``) at ``offset`` of ``seg``; not yet durable."""

    def read(self, seg: int, offset: int, buf: memoryview) -> None:
        """``pread`` that blocks until ``buf`` is full."""

    def write(self, seg: int, offset: int, buf: memoryview) -> None:
        """``pwrite`` that blocks until the bytes are written (not yet durable)."""

    def sync(self, segs: Iterable[int]) -> None:
        """Make every completed ``pwrite`` to these segments durable (fdatasync, persist)."""

    def view(self, seg: int, offset: int, nbytes: int) -> memoryview | None:
        """A read-only zero-copy view of stored bytes, or None where the medium has none."""

    def location(self, seg: int, offset: int) -> tuple[str, int]:
        """(file path, byte offset in that file) of ``offset`` in ``seg``."""

    def close(self) -> None:
        """Release files, mappings and threads. Idempotent."""


def missing_segments(medium: Medium) -> dict[int, str]:
    """Segments whose files are gone, with their paths: only a medium that keeps a file per
    segment (NVMe slabs) can lose one, and only such a medium has ``missing()``."""
    missing = getattr(medium, "missing", None)
    return missing() if missing is not None else {}


def orphan_files(medium: Medium, segments: Iterable[int]) -> list[str]:
    """Files of the medium that no segment of ``segments`` names (left by a crash between
    making a segment and committing it); only a medium with a file per segment has any."""
    orphans = getattr(medium, "orphans", None)
    return orphans(segments) if orphans is not None else []


def memory_alignment(medium: Medium) -> int:
    """The alignment of host memory the medium moves bytes into or out of directly; the
    store copies memory aligned less through buffers of its own. A page, unless the medium
    says less (NVMe slabs: what O_DIRECT needs on their files, as the kernel reports it,
    or 1 for files without O_DIRECT; PMem: 1). 1 is a CPU copy, which takes memory on pages
    of any size too."""
    return getattr(medium, "memory_alignment", ALIGNMENT)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


# A chunk of a batch: (entry, start, end) within that entry's extent.
Chunk = tuple[int, int, int]


def adjacent_runs(work: list[Chunk], extents: list[tuple[int, int]], limit: int,
                  max_pieces: int, alone: int = 0) -> list[tuple[int, int]]:
    """``work``'s chunks grouped as requests ``[first, last)``: chunks that follow each
    other on disk (``extents[entry]`` is the entry's (segment, offset)) join one request
    of up to ``limit`` bytes and ``max_pieces`` chunks; each chunk before ``alone`` is a
    request of its own. Small entries written by one batch sit next to each other, so a
    batch of them costs the disk a few large requests instead of many small ones."""
    runs: list[tuple[int, int]] = []
    n = 0
    while n < len(work):
        i, start, end = work[n]
        seg, stop, nbytes = extents[i][0], extents[i][1] + end, end - start
        last = n + 1
        while n >= alone and last < len(work) and last - n < max_pieces:
            j, s2, e2 = work[last]
            if (extents[j][0] != seg or extents[j][1] + s2 != stop
                    or nbytes + e2 - s2 > limit):
                break
            stop, nbytes, last = extents[j][1] + e2, nbytes + e2 - s2, last + 1
        runs.append((n, last))
        n = last
    return runs


def ramped(work: list[Chunk], before: int, first: int, limit: int,
           split: list[bool]) -> tuple[list[Chunk], list[int]]:
    """A batch's first requests ramped up to ``limit`` bytes: ``work`` (its chunks after
    its first ``before`` bytes) and the positions in it where a request ends, so that the
    batch's requests are ``first``, ``2 * first``, ``4 * first``... bytes while under
    ``limit``. A chunk of an entry ``split`` marks is cut in two where such a request ends
    inside it; any other ends its request after it."""
    ends: list[int] = []  # where in the batch's bytes each ramped request ends
    size = at = first
    while size < limit:
        ends.append(at)
        size *= 2
        at += size
    ends = [e for e in ends if e > before]
    if not ends:
        return work, []
    out: list[Chunk] = []
    cuts: list[int] = []
    pos = before
    for i, start, end in work:
        while ends and ends[0] < pos + end - start and split[i]:
            cut = start + ends.pop(0) - pos
            out.append((i, start, cut))
            cuts.append(len(out))
            pos, start = pos + cut - start, cut
        out.append((i, start, end))
        pos += end - start
        if ends and ends[0] <= pos:
            cuts.append(len(out))
            while ends and ends[0] <= pos:
                ends.pop(0)
    return out, cuts


def joined(pieces: list[tuple[int, int]]) -> int | tuple[tuple[int, int], ...]:
    """A request's buffer from its ``(address, length)`` pieces: one address where they
    are contiguous in memory, else the pieces of a vectored request."""
    out = [list(pieces[0])]
    for addr, length in pieces[1:]:
        if out[-1][0] + out[-1][1] == addr:
            out[-1][1] += length
        else:
            out.append([addr, length])
    return out[0][0] if len(out) == 1 else tuple((a, b) for a, b in out)
