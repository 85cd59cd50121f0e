"""A read's bytes from the backing tier: each extent in ``chunk``-sized pieces, on the chunk
workers or as one batch on a deep-queued engine (AIO), every chunk's crc32c checked as it
lands, and a caller's ``out=`` tensor filled straight or through a bounce buffer
(:mod:`tierstore.landing`). The lookup, leases and cache slots around it are
:mod:`tierstore.reads`'.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import wait
from typing import Any, NamedTuple

import crc32c
import numpy as np

from tierstore.nvme import HANDOFF_MIN_BYTES, BatchError, aligned_empty
from tierstore.nvme.aio import DEFAULT_WINDOW, MAX_PIECES, EngineClosedError, address

from .catalog import Record
from .errors import CorruptEntryError, StoreClosedError, StoreError
from .keys import Key
from .landing import CopiedInFlight, Deferred, Target, land
from .local_state import LocalState
from .media import adjacent_runs, joined


class _Request(NamedTuple):
    """One request of a read: chunks ``[first, last)``, one range of a slab file."""

    first: int
    last: int
    seg: int
    off: int
    nbytes: int


def _coalesce(work: list[tuple[int, int, int]], recs: list[Record], pos: int, alone: int,
              limit: int) -> list[_Request]:
    """The requests for chunks ``pos`` onwards (see :func:`~tierstore.media.adjacent_runs`),
    the last one of several chunks made as two: at the chunk boundary at or past its middle.

    What lands last is checked (crc32c, a bounced target's copy) after the disk has gone
    idle; with the engine's taper (:meth:`~tierstore.nvme.aio.AioEngine.run`) the halves
    go one after the other, and only the second's checks follow the read's last transfer.
    Into ``torch.empty`` tensors, 9 rounds alternated in one process beside DeepNVMe
    reading as much a call: calls of 32 MiB of 1 MiB entries 1.93 -> 2.02 GB/s (4 MiB
    entries 1.98 -> 2.04, 256 KiB 1.84 -> 1.93), of 8 MiB 1.78 -> 1.87; 256 MiB calls
    2.10 -> 2.12. Entries of a chunk or more keep one request each."""
    runs = adjacent_runs(work[pos:], [(r.seg, r.off) for r in recs], limit, MAX_PIECES,
                         alone - pos)
    if runs and runs[-1][1] - runs[-1][0] > 1:
        first, last = runs.pop()
        half = sum(e - s for _, s, e in work[pos + first : pos + last]) / 2
        cut, got = first + 1, work[pos + first][2] - work[pos + first][1]
        while cut < last - 1 and got < half:
            got += work[pos + cut][2] - work[pos + cut][1]
            cut += 1
        runs += [(first, cut), (cut, last)]
    plan = []
    for first, last in runs:
        chunks = work[pos + first : pos + last]
        i, start, _ = chunks[0]
        plan.append(_Request(pos + first, pos + last, recs[i].seg, recs[i].off + start,
                             sum(e - s for _, s, e in chunks)))
    return plan


def settle(jobs: collections.deque[Any]) -> None:
    """Wait for every job in ``jobs``, then raise the first one's failure, if any."""
    wait(jobs)
    while jobs:
        jobs.popleft().result()


class FetchPath(LocalState):
    """Reading records' extents into host memory (see the module docstring)."""

    def _bounce(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """An aligned buffer of ``nbytes`` that a read lands in before :func:`land` copies
        it out, and whether it goes back to the staging pool (reused memory: no page
        faults). One larger than a pool buffer (a chunk) is recycled when dropped."""
        if nbytes <= self._staging.nbytes:
            return self._staging.take(), True
        return self._results.take(nbytes), False

    def _fetch(
        self, keys: list[Key], recs: list[Record], bufs: list[Any] | None = None,
        provide: Any = None, targets: dict[int, Target] | Deferred | None = None,
    ) -> list[np.ndarray]:
        """Read the records' extents in parallel chunks, verifying each chunk's crc32c.
        Where ``bufs[i]`` is None, ``provide(i)`` returns the buffer, called as the
        entry's first request is made. Where ``targets`` has entry ``i``, its bytes past
        ``direct`` are bounced and copied into the target's tensor as each chunk lands."""
        if bufs is None:
            bufs = [aligned_empty(rec.length) for rec in recs]
        targets = targets or {}
        if self._batched():
            return self._fetch_batched(keys, recs, bufs, provide, targets)
        assert not isinstance(targets, Deferred)  # made only for the batch
        for i, buf in enumerate(bufs):
            if buf is None:
                bufs[i] = provide(i)

        def chunk_job(i: int, c: int) -> None:
            rec, buf, start = recs[i], bufs[i], c * recs[i].chunk
            end = min(start + rec.chunk, rec.length)
            t = targets.get(i)
            lo = end if t is None else min(end, max(start, t.direct))
            stop = min(end, rec.nbytes)
            bounce: tuple[np.ndarray, bool] | None = None
            try:
                if lo > start:
                    self._medium.read(rec.seg, rec.off + start, memoryview(buf[start:lo]))
                if end > lo:
                    bounce = self._bounce(end - lo)
                    self._medium.read(rec.seg, rec.off + lo, memoryview(bounce[0][: end - lo]))
            except OSError as e:
                if bounce is not None and bounce[1]:
                    self._staging.give(bounce[0])
                where = self._medium.location(rec.seg, rec.off + start)[0]
                raise CorruptEntryError(
                    *keys[i], f"bytes {start}..{end} cannot be read from {where} "
                    f"({e.strerror or e}); restore the file, or the entry from a snapshot",
                ) from e
            got = crc32c.crc32c(buf[start : min(lo, stop)]) if lo > start else 0
            if bounce is not None:
                assert t is not None
                got = land(t, lo, bounce[0][: stop - lo], got)
                if bounce[1]:
                    self._staging.give(bounce[0])
            if got != rec.crc[c]:
                name, kind = keys[i]
                raise CorruptEntryError(
                    name, kind,
                    f"crc32c of bytes {start}..{stop} is {got:08x}, the catalog says "
                    f"{rec.crc[c]:08x} (version {rec.version}, "
                    f"{self._medium.location(rec.seg, rec.off + start)[0]})",
                )

        work = [(i, c) for i, rec in enumerate(recs)
                for c in range(len(range(0, rec.length, rec.chunk)))]
        if len(work) == 1:  # nothing to overlap: no hand-off
            chunk_job(*work[0])
            return bufs
        # A few workers take the chunks in turn, rather than a job (a future, a queue item
        # and a thread wake-up) per chunk: a layer of 512 KiB entries is a hundred chunks.
        # Requests under HANDOFF_MIN_BYTES are issued by the worker itself, io_threads at a
        # time, and more workers would only queue for those slots: one more, to issue the
        # next request while another worker checksums. Larger requests wait on the engine's
        # pool, whose queue must not run dry: the whole of this pool for those.
        big = any(min(rec.chunk, rec.length) >= HANDOFF_MIN_BYTES for rec in recs)
        fetchers = self._io_threads + (self._io_threads if big else 1)
        todo = iter(enumerate(work))
        take = threading.Lock()
        failed: list[tuple[int, BaseException]] = []

        def drain() -> None:
            while not failed:
                with take:
                    item = next(todo, None)
                if item is None:
                    return
                n, (i, c) = item
                try:
                    chunk_job(i, c)
                except BaseException as e:  # noqa: BLE001 (raised by the caller below)
                    failed.append((n, e))

        jobs = [self._workers.submit(drain) for _ in range(min(len(work), fetchers))]
        try:
            for f in jobs:
                f.result()
        finally:
            if not all(f.done() for f in jobs):  # interrupted: stop taking chunks
                failed.append((len(work), StoreError("fetch interrupted")))
            # Never let a read land in a buffer after its extent's lease has ended.
            for f in jobs:
                if not f.cancel():
                    f.exception()
        if failed:
            raise min(failed, key=lambda x: x[0])[1]
        return bufs

    def _fetch_batched(
        self, keys: list[Key], recs: list[Record], bufs: list[Any], provide: Any = None,
        targets: dict[int, Target] | Deferred | None = None,
    ) -> list[np.ndarray]:
        """:meth:`_fetch` as one batch on an engine that keeps a deep queue (AIO).

        Chunks that follow each other on disk (small entries written by one ``put_many``)
        go as one vectored request of up to a chunk's bytes, so a layer of 256 KiB entries
        costs the disk and this thread what a few large entries do. Each chunk's crc32c is
        checked on a chunk worker as its request lands, while this thread submits and
        reaps the requests after it. A request of several chunks that fails is tried again chunk by chunk, so
        the entry named is the one whose bytes cannot be read (and a transient failure
        costs nothing). A target's bounced bytes share their request with the others: a
        request's bounced pieces lie one after another in one pooled buffer, and each is
        checksummed and copied out as the request lands (see :mod:`tierstore.landing`)."""
        targets = targets or {}
        # chunk -> (bounce buffer, position in it, first bounced byte of the chunk)
        staged: dict[int, tuple[np.ndarray, int, int]] = {}
        work: list[tuple[int, int, int]] = []  # (record, start, end) of each chunk
        for i, rec in enumerate(recs):
            if rec.length:
                step, length = rec.chunk, rec.length
                work += [(i, start, min(start + step, length))
                         for start in range(0, length, step)]
        # Asked as each entry's first request is made, while earlier ones are in flight
        # (an entry read wholly through a bounce buffer never asks).
        addrs: list[int | None] = [None] * len(bufs)

        def addr(i: int) -> int:
            a = addrs[i]
            if a is None:
                b = bufs[i]
                a = addrs[i] = address(provide(i) if b is None else b)
            return a

        bad: list[tuple[int, CorruptEntryError]] = []

        def check(n: int) -> None:
            i, start, end = work[n]
            rec = recs[i]
            stop = min(end, rec.nbytes)
            at = staged.pop(n, None)
            if at is None:
                got = crc32c.crc32c(bufs[i][start:stop])
            else:
                buf, pos, lo = at
                got = crc32c.crc32c(bufs[i][start:lo]) if lo > start else 0
                got = land(targets[i], lo, buf[pos : pos + stop - lo], got)
            if got != rec.crc[start // rec.chunk]:
                # Kept, not raised: with several corrupt entries the first in the order
                # asked is named, whatever order the chunks land in.
                name, kind = keys[i]
                bad.append((n, CorruptEntryError(
                    name, kind,
                    f"crc32c of bytes {start}..{stop} is {got:08x}, the catalog says "
                    f"{rec.crc[start // rec.chunk]:08x} (version {rec.version}, "
                    f"{self._medium.location(rec.seg, rec.off + start)[0]})",
                )))

        pos = alone = 0  # chunks before ``alone`` go one request each
        while pos < len(work):
            plan = _coalesce(work, recs, pos, alone, self._chunk)
            failed = self._run_plan(keys, recs, work, plan, addr, check, bad, targets,
                                    staged)
            if (failed is None or failed[1] - failed[0] == 1
                    or any(n < failed[0] for n, _ in bad)):
                break
            # A request of several chunks failed: those chunks alone, then the rest.
            pos, alone = failed
        # Every chunk before a failed one was checked (the engine hands back all that
        # landed), so the lowest position is the first bad entry in the order asked.
        if bad:
            raise min(bad, key=lambda x: x[0])[1]
        return bufs

    def _run_plan(
        self, keys: list[Key], recs: list[Record], work: list[tuple[int, int, int]],
        plan: list[_Request], addr: Any, check: Any, bad: list[tuple[int, CorruptEntryError]],
        targets: dict[int, Target] | Deferred, staged: dict[int, tuple[np.ndarray, int, int]],
    ) -> tuple[int, int] | None:
        """Run ``plan`` as one batch, ``check``-ing every chunk that lands. Returns None when
        every request moved its bytes, else the chunks ``[first, last)`` of the request that
        failed; a single chunk's failure is recorded in ``bad`` as its entry's. Bytes of
        ``targets`` past their direct part are read into a bounce buffer per request (where
        each chunk's part is noted in ``staged``), given back once the request is checked."""
        at = [0]  # the request being made, should making it fail (a missing slab file)
        held: dict[int, tuple[np.ndarray, bool]] = {}  # request -> its bounce buffer
        # Landed requests' checks (crc32c, bounce copies) run on the chunk workers, so this
        # thread goes straight back to submitting and reaping: both release the GIL, and
        # the copy of one request overlaps the transfer of the next. At most ``backlog``
        # wait, so the bounce buffers they hold stay within the staging pool's idle ones.
        checking: collections.deque[Any] = collections.deque()
        backlog = max(2, self._io_threads) if len(plan) > 1 else 0
        flight = CopiedInFlight()  # bytes bound for bounce buffers (see COPIED_WINDOW)

        def requests() -> Any:
            for m, r in enumerate(plan):
                at[0] = m
                pieces: list[tuple[int, int]] = []
                used = 0
                for n in range(r.first, r.last):
                    i, s, e = work[n]
                    t = targets.get(i)
                    lo = e if t is None else min(e, max(s, t.direct))
                    if lo > s:
                        pieces.append((addr(i) + s, lo - s))
                    if e > lo:
                        if m not in held:
                            held[m] = self._bounce(r.nbytes)
                        bounce = held[m][0]
                        staged[n] = (bounce, used, lo)
                        pieces.append((bounce.ctypes.data + used, e - lo))
                        used += e - lo
                flight.made(m, used)
                yield r.seg, r.off, joined(pieces), r.nbytes, False

        def finish(m: int) -> None:
            try:
                for n in range(plan[m].first, plan[m].last):
                    check(n)
            finally:
                give(held.pop(m, None))

        def done(m: int) -> None:
            flight.landed(m)
            if isinstance(targets, Deferred):  # two windows ahead (see Deferred.reach)
                j, ahead = m, 0
                while j + 1 < len(plan) and ahead < 2 * DEFAULT_WINDOW:
                    j += 1
                    ahead += plan[j].nbytes
                targets.reach(work[plan[j].last - 1][0])
            if not backlog:
                finish(m)
                return
            while checking and (len(checking) >= backlog or checking[0].done()):
                checking.popleft().result()
            checking.append(self._workers.submit(finish, m))

        def give(bounce: tuple[np.ndarray, bool] | None) -> None:
            if bounce is not None and bounce[1]:
                self._staging.give(bounce[0])

        try:
            try:
                self._medium.run(requests(), done, len(plan), flight.window)
            finally:
                settle(checking)
            return None
        except EngineClosedError as e:  # only where no operation gate held it off (fsck)
            raise StoreClosedError(f"store {self.path} is closed") from e
        except OSError as e:
            # A request's failure (BatchError) or a missing slab file met while making a
            # request is the entry's; anything else (no AIO context, io_getevents) is
            # the batch's, not evidence against the bytes.
            if isinstance(e, BatchError):
                r = plan[e.index]
            elif isinstance(e, FileNotFoundError):
                r = plan[at[0]]
            else:
                name, kind = keys[work[0][0]]
                raise StoreError(
                    f"reading {name!r} (kind {kind!r}) and {len(keys) - 1} other entries: "
                    f"{e.strerror or e}") from e
            if r.last - r.first == 1:
                i, start, end = work[r.first]
                rec = recs[i]
                where = self._medium.location(rec.seg, rec.off + start)[0]
                err = CorruptEntryError(
                    *keys[i], f"bytes {start}..{end} cannot be read from {where} "
                    f"({e.strerror or e}); restore the file, or the entry from a snapshot")
                err.__cause__ = e
                bad.append((r.first, err))
            return r.first, r.last
        finally:
            # Nothing is in flight once the batch has ended, and every check has run (the
            # batch's ``settle``): requests that never landed
            # (or failed) give their bounce buffers back; their chunks are retried afresh.
            for m in list(held):
                give(held.pop(m))
            for n in range(plan[0].first if plan else 0, plan[-1].last if plan else 0):
                staged.pop(n, None)

    def _verify_record(self, name: str, kind: str, rec: Record) -> None:
        self._fetch([(name, kind)], [rec])
