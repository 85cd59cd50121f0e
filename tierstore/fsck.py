"""Whole-store verification: every checksum, every reference count, the free map."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Collection

from tierstore.nvme import holds_data

from .alloc import ExtentAllocator
from .catalog import Catalog, Record
from .errors import CorruptEntryError, StoreError
from .interface import FsckReport
from .media import Medium, missing_segments, orphan_files

LOST_FOUND = "lost+found"  # where a repair puts slab files the restored catalog does not name


def check_store(path: str, cat: Catalog, medium: Medium,
                verify: Callable[[str, str, Record], None],
                progress: Callable[[int], None] | None = None,
                alloc: ExtentAllocator | None = None,
                set_aside: Collection[str] = ()) -> FsckReport:
    """Check the store at ``path`` (its catalog and backing medium, both open):
    ``verify(name, kind, record)`` reads a stored version back and raises
    :class:`CorruptEntryError` where its checksums disagree.

    On a store in use, pass its ``alloc``: every extent of the catalog's snapshot is then
    leased in the same step as the snapshot is read (under the allocator's lock, as a read
    leases its records), so a write committed meanwhile cannot reuse the space of a version
    still to be verified, which would read as a false checksum failure.

    ``set_aside``: files no segment names that a repair is about to move into
    ``lost+found`` (so not a problem of the store it is making)."""
    leased: list[tuple[int, int]] = []
    try:
        with alloc.lock if alloc is not None else contextlib.nullcontext():
            with cat.read() as txn:
                live = list(cat.iter_records(txn))
                snaps = [
                    (bytes(k).decode(), n, kd, r)
                    for k, _ in txn.cursor(db=cat.db["snapshots"])
                    for n, kd, r in cat.iter_records(txn, db="snapentries",
                                                     tag=bytes(k).decode())
                ]
                refs = {(s, o): (length, n) for s, o, length, n in cat.refs(txn)}
                free = list(cat.free_extents(txn))
                segments = {s: size for s, _, _, size in cat.segments(txn)}
            if alloc is not None:
                for _, _, rec in live + [(n, k, r) for _, n, k, r in snaps]:
                    if rec.seg >= 0:
                        alloc.lease_locked(rec.seg, rec.off)
                        leased.append((rec.seg, rec.off))
        report = _check(path, medium, verify, progress, live, snaps, refs, free, segments)
        _check_files(report, path, medium, segments, set_aside)
        return report
    finally:
        for seg, off in leased:
            alloc.unlease(seg, off)  # type: ignore[union-attr]


def _check(path: str, medium: Medium, verify: Callable[[str, str, Record], None],
           progress: Callable[[int], None] | None, live: list[tuple[str, str, Record]],
           snaps: list[tuple[str, str, str, Record]], refs: dict[tuple[int, int], tuple[int, int]],
           free: list[tuple[int, int, int]], segments: dict[int, int]) -> FsckReport:
    report = FsckReport()

    # Reference counts: one per live entry and one per snapshot entry pointing at an extent.
    want: Counter[tuple[int, int]] = Counter()
    lengths: dict[tuple[int, int], int] = {}
    for name, kind, rec in [(n, k, r) for n, k, r in live] + [(n, k, r) for _, n, k, r in snaps]:
        if rec.seg < 0:
            continue
        want[(rec.seg, rec.off)] += 1
        if lengths.setdefault((rec.seg, rec.off), rec.length) != rec.length:
            report.problems.append(f"{name!r} ({kind}): extent length disagrees with another record")
        if rec.seg not in segments:
            report.problems.append(f"{name!r} ({kind}): segment {rec.seg} does not exist")
    for ext, n in want.items():
        have = refs.get(ext)
        if have is None:
            report.problems.append(f"extent {ext} is used but has no reference count")
        elif have[1] != n or have[0] != lengths[ext]:
            report.problems.append(f"extent {ext}: reference count {have} != expected ({lengths[ext]}, {n})")
    for ext in refs.keys() - want.keys():
        report.problems.append(f"extent {ext} has references but no entry uses it (leaked)")

    # Free map: inside its segment, disjoint from used space, and free + used = capacity.
    spans: dict[int, list[tuple[int, int, str]]] = {s: [] for s in segments}
    for seg, off, length in free:
        spans.setdefault(seg, []).append((off, length, "free"))
    for (seg, off), (length, _) in refs.items():
        spans.setdefault(seg, []).append((off, length, "used"))
    for seg, items in spans.items():
        size = segments.get(seg)
        if size is None:
            report.problems.append(f"free map names segment {seg}, which does not exist")
            continue
        items.sort()
        pos = 0
        for off, length, what in items:
            if off < pos:
                report.problems.append(f"segment {seg}: {what} extent at {off} overlaps the previous one")
            elif off > pos:
                report.problems.append(f"segment {seg}: bytes {pos}..{off} are neither free nor used (leaked)")
            pos = max(pos, off + length)
        if pos != size:
            report.problems.append(f"segment {seg}: extents end at {pos}, segment size is {size}")

    # Checksums of every distinct stored version.
    done: set[tuple[int, int]] = set()
    verified = 0
    for name, kind, rec in live + [(n, k, r) for _, n, k, r in snaps]:
        if rec.seg >= 0 and (rec.seg, rec.off) in done:
            continue
        done.add((rec.seg, rec.off))
        try:
            verify(name, kind, rec)
        except CorruptEntryError as e:
            report.problems.append(str(e))
        except (StoreError, OSError) as e:
            report.problems.append(f"{name!r} ({kind}): unreadable: {e}")
        report.entries += 1
        report.nbytes += rec.nbytes
        verified += rec.nbytes
        if progress:
            progress(verified)
    return report


def _check_files(report: FsckReport, path: str, medium: Medium, segments: dict[int, int],
                 set_aside: Collection[str]) -> None:
    """Slab files missing, and files no segment names."""
    for seg, where in missing_segments(medium).items():
        report.problems.append(f"{where}: slab file of segment {seg} is missing; the entries "
                               "stored there cannot be read")
    for where in orphan_files(medium, segments):
        if where in set_aside:
            report.notes.append(f"{where}: written after the snapshot; set aside into "
                                f"{LOST_FOUND}")
        elif holds_data(where):
            report.problems.append(f"{where}: holds data but no catalog segment names it; the "
                                   "store never reuses it: move it away once you know whose it is")
        else:
            report.notes.append(f"{where}: never written, left by a crash (reused as the "
                                "store grows)")
    found = os.path.join(path, LOST_FOUND)
    if os.path.isdir(found) and os.listdir(found):
        report.notes.append(f"{found}: files set aside by a repair; delete them when they "
                            "are no longer wanted")
