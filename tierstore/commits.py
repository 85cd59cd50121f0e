"""A write's commit: the one LMDB transaction that points a batch's entries at the extents
its bytes were written to, and frees the extents they replace.

It is the commit point of copy-on-write (see :mod:`tierstore.writes`): it is committed only
once the batch's bytes are durable, so a crash before it leaves every entry at its last
committed version. For a batch of many entries the transaction is built while the batch's
requests are still in flight (:class:`Committer`), on a thread of its own: each record is
put as its checksums come in, and the transaction commits once the batch is synced, or is
dropped if the batch fails. A 4,096-entry put of 256 KiB entries spends about 17 ms in its
commit's Python. Begun once every entry was placed (the batch's last ~25 ms of I/O, placing
overlapping the writes), it was still putting records 6-9 ms after the sync; begun with the
first group (where the batch took one extent for all its entries, see
:mod:`tierstore.placing`), it was done when the sync was: 1 GiB from slices of one buffer,
alternated in one process, 5.73 -> 6.10 and 5.67 -> 6.07 GB/s. It begins
``COMMIT_AHEAD_BYTES`` before the last group is placed, so the catalog's writer is held
across a bounded stretch of I/O, not all of a large batch's (against beginning with the
first group: 4.54 and 4.21, 4.95 and 4.79 GB/s, a noisy disk). Not where the first group's
memory needs staging: beside the copies, on the development VM's two cores, the committer
working through the whole batch cost 27 % more CPU and 5 % of the throughput (pinned
memory, 5.47 -> 5.20 GB/s); begun once every entry is placed, as before, even.

Caveat: while a committer waits for its batch, the catalog's writer is held, so another
writer's commit (and a write that needs a new slab) waits for this batch to be synced:
about the last 220 MiB of its I/O. A batch placed first fit starts its committer only once
every entry is placed, since placing may itself commit (a new slab): it never waits on a
commit of its own batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .catalog import Catalog, Record, entry_key, record_numbers
from .errors import StoreError
from .keys import Key

Extent = tuple[int, int, int]
# A batch of at least this many entries builds its commit during its I/O; a smaller one
# commits after it, on the calling thread (a thread's start costs more than its commit).
AHEAD_MIN_ENTRIES = 64
# A batch that took one extent for all its entries begins its commit once at most this many
# of its bytes are left to place: the commit's Python (17 ms for 4,096 records, 25-27 beside
# the batch's I/O) then overlaps the last ~220 MiB of I/O (placing runs ~96 MiB ahead of the
# disk), about 40 ms at 5.5 GB/s, and holds the catalog's writer that long whatever the
# batch's size, not for all of its I/O.
COMMIT_AHEAD_BYTES = 128 << 20


def commit_records(cat: Catalog, tombstones: dict[Key, int], txn: Any,
                   records: list[tuple[str, str, Record]], encoded: dict[int, bytes] | None = None,
                   ready: Callable[[int], int] | None = None,
                   count: int | None = None) -> list[Extent]:
    """Point each entry of ``records`` at its new extent in ``txn``; returns the extents to
    hand back to the allocator. ``encoded`` holds records encoded already, by position;
    ``ready(i)`` waits until record ``i`` is in ``records`` with its checksums, returning
    how many records have theirs; ``count``: how many ``records`` will hold (it may be
    growing while this runs).

    Versions are given out when ``put`` is called, so a record older than the one the
    catalog holds (a slow write-back overtaken by a newer write) is dropped: the newest
    version wins whatever order commits land in. So is one older than a delete of its key
    (``tombstones``: a write-back that took the entry before the delete and commits after
    it, see ``WritePath._delete``).

    Its key's old record is swapped out in one operation (and put back in the rare case
    that it is newer) and read through the head of its encoding (``record_numbers``)."""
    top = cat.get_meta(txn, "version", 0)
    live = cat.get_meta(txn, "live_bytes", 0)
    freed: list[Extent] = []
    carve: list[Extent] = []
    free: list[Extent] = []
    cur = txn.cursor(db=cat.db["entries"])
    encoded = encoded or {}
    have = 0 if ready is not None else len(records)
    for i in range(len(records) if count is None else count):
        if i >= have:
            have = ready(i)  # type: ignore[misc]
        name, kind, rec = records[i]
        dead = tombstones.get((name, kind)) if tombstones else None
        if dead is not None and dead > rec.version:
            if rec.seg >= 0:
                freed.append(rec.extent)  # taken in memory only, never carved
            continue
        key = entry_key(name, kind)
        raw = encoded.get(i)
        prev = cur.replace(key, rec.encode() if raw is None else raw)
        if prev is not None:
            old_nbytes, old_version, seg, off, _ = record_numbers(prev)
            if old_version > rec.version:
                cur.put(key, prev)
                if rec.seg >= 0:
                    freed.append(rec.extent)
                continue
            live -= old_nbytes
            ext = cat.decref_at(txn, seg, off, free)
            if ext:
                freed.append(ext)
        cat.incref(txn, rec, carve)
        live += rec.nbytes
        if rec.version > top:
            top = rec.version
    cat.carve_many(txn, carve)
    cat.add_free_many(txn, free)
    cat.put_meta(txn, "version", top)
    cat.put_meta(txn, "live_bytes", live)
    return freed


class _Abandoned(Exception):
    """The batch failed: its transaction is dropped."""


class Committer:
    """The commit of one batch, built on a thread of its own while the batch's
    requests are in flight (see the module docstring).

    The write path tells it, for each request in order, how many of the batch's records are
    whole once that request and the ones before it have their checksums (``bounds``, given
    to :meth:`start` and appended to as requests are planned, until :meth:`planned`), and
    calls :meth:`finished` as each request's checksums are in, in any order; then
    :meth:`durable` once the batch is synced, and :meth:`result` for the extents to free.
    :meth:`abandon` drops the transaction, started or not."""

    def __init__(self, cat: Catalog, tombstones: dict[Key, int],
                 records: list[tuple[str, str, Record]], encoded: dict[int, bytes],
                 count: int) -> None:
        self._cat, self._tombstones = cat, tombstones
        self._records, self._encoded, self._count = records, encoded, count
        self._planned = False  # every request is in _bounds
        self._cond = threading.Condition()
        self._bounds: list[int] = []
        self._done: set[int] = set()  # requests finished, not yet counted in _have
        self._next = 0  # the first request not counted in _have
        self._have = 0  # records whose checksums are all in
        self._outcome: bool | BaseException | None = None  # True: commit
        self._result: Future[list[Extent]] = Future()
        self._thread: threading.Thread | None = None

    def start(self, bounds: list[int]) -> None:
        """Begin the transaction; ``bounds[m]``: the records whole after request ``m``,
        appended to as requests are planned, until :meth:`planned`."""
        self._bounds = bounds
        self._thread = threading.Thread(target=self._run, name="tierstore-commit", daemon=True)
        self._thread.start()

    def planned(self) -> None:
        """Every request of the batch is in ``bounds``."""
        with self._cond:
            self._planned = True
            self._cond.notify_all()

    def finished(self, m: int) -> None:
        """Request ``m``'s checksums are in (any thread)."""
        with self._cond:
            self._done.add(m)
            self._cond.notify_all()

    def durable(self) -> None:
        """The batch is synced: commit."""
        self._end(True)

    def abandon(self, why: BaseException) -> None:
        """The batch failed: drop the transaction and wait until it is dropped."""
        self._end(why)
        if self._thread is not None:
            self._thread.join()

    def result(self) -> list[Extent]:
        """The extents the commit freed, once it is committed; what it raised otherwise."""
        return self._result.result()

    def _end(self, outcome: bool | BaseException) -> None:
        with self._cond:
            if self._outcome is None:
                self._outcome = outcome
            self._cond.notify_all()

    def _ready(self, i: int) -> int:
        with self._cond:
            while True:
                while self._next in self._done:
                    self._done.discard(self._next)
                    self._have = max(self._have, self._bounds[self._next])
                    self._next += 1
                if self._planned and self._next == len(self._bounds):
                    self._have = self._count  # and the empty entries after the last
                if i < self._have:
                    return self._have
                if self._outcome is True:  # synced with a request never finished: a bug
                    raise StoreError(f"commit of {len(self._records)} entries: record {i} "
                                     "never had its checksums")
                if self._outcome is not None:
                    raise _Abandoned
                self._cond.wait()

    def _transaction(self, txn: Any) -> list[Extent]:
        freed = commit_records(self._cat, self._tombstones, txn, self._records,
                               self._encoded, self._ready, self._count)
        with self._cond:
            while self._outcome is None:
                self._cond.wait()
            if self._outcome is not True:
                raise _Abandoned  # leaves the transaction uncommitted
        return freed

    def _run(self) -> None:
        try:
            freed = self._cat.write(self._transaction)
        except BaseException as e:  # noqa: BLE001 (handed to the caller by result())
            self._result.set_exception(e)
        else:
            self._result.set_result(freed)
