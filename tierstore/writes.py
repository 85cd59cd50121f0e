"""The write path of a local store: new versions, copy-on-write, commit and delete.

Copy-on-write: take free aligned extents, write the new bytes there, make them durable
(``Medium.sync``), then one LMDB transaction points the entries at the new extents and frees
the old ones. Until that commit nothing the catalog references has changed, so a crash at
any instant leaves every entry at its last committed version. With the host cache, a put
lands in a cache slot as a dirty entry and takes that path on eviction or ``flush()``;
without it, the put takes it before returning.

Versions are given out when an operation is called, and a commit keeps the newest: a record
older than the catalog's (a slow write-back overtaken by a newer write) or than its key's
delete (a tombstone) is dropped, whatever order commits land in.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, wait
from typing import Any

import crc32c
import numpy as np
import torch

from tierstore.nvme.aio import DEFAULT_WINDOW, MAX_PIECES, BatchError, EngineClosedError, address

from .catalog import Record, entry_key
from .collector import paused
from .commits import AHEAD_MIN_ENTRIES, COMMIT_AHEAD_BYTES, Committer, commit_records
from .errors import EntryNotFoundError, StoreClosedError
from .interface import Meta
from .keys import Key, PutItems, put_items
from .landing import copy_checked, crc_join, direct_end, staged
from .media import adjacent_runs, align_up, joined, memory_alignment, ramped
from .ordered import InOrder, usable_cores
from .tensors import as_bytes, dtype_name
from .write_jobs import WriteJobs

# A flush commits dirty entries in batches of about this many bytes, each its own commit:
# copy-on-write needs room for a batch's new bytes before its commit frees the old ones, so
# on a nearly full disk a flush still makes progress (and freeing space lets it finish).
FLUSH_BATCH_BYTES = 256 << 20
STAGE_AHEAD_BYTES = 2 * DEFAULT_WINDOW  # why two windows: nvme/aio.py, DEFAULT_WINDOW
# A batch's extents are placed this many chunks' worth at a time (see _run_writes).
PLACE_AHEAD_CHUNKS = 4
# A batch's head ramps up: its first group of entries is placed, and its first request is
# staged, this many bytes' worth, each next one twice the last (up to PLACE_AHEAD_CHUNKS
# chunks, and a chunk a request). The disk waits for the first request, and a put that fits
# in the engine's window (a layer's experts) waited for all of it: a staged request of a
# chunk (8 MiB) is copied in about 1.1 ms on the development VM, and placing 128 entries
# took 0.8 ms, before the first byte went. Durable puts of 32 MiB, 7 alternated rounds
# beside DeepNVMe writing 32 MiB and fsyncing a call, with the engine sending each staged
# request as it is made (nvme/aio.py) and one staging lane (below): from torch.empty
# tensors 0.81 -> 1.11 of its rate (256 KiB entries), 0.86 -> 1.05 (1 MiB), 0.84 -> 1.07
# (4 MiB), 0.87 -> 1.01 (16 MiB); from slices of one buffer 1.05 -> 1.10, 1.09 -> 1.16,
# 1.20 and 1.22 even.
FIRST_REQUEST_BYTES = 1 << 20
# A batch made bytes as it is placed (see WritePath._converted_as_placed) whose memory needs
# staging, with entries under this size on average, has the rest made bytes at once when the
# first such group is met. Its flight is bound by per-entry work (the copies, then Python)
# on two cores, and converting there slowed it; from this size the flight has room, and
# converting there shortened the call's head by 12 ms a GiB. 1 GiB, alternated in one
# process, at once -> as placed, median GB/s: 64 KiB `torch.empty` 2.06 -> 1.92; 128 KiB
# 3.78 -> 3.37 and pinned 3.34 -> 3.06; 256 KiB 4.62 -> 4.84 and 4.86 -> 4.94, pinned
# 4.80 -> 5.01 and 4.81 -> 4.91; 512 KiB and 1 MiB even.
STAGED_AS_PLACED_MIN = 256 << 10


class WritePath(WriteJobs):
    """The write path of :class:`tierstore.LocalStore` (see the module docstring)."""

    @paused()
    def put_many(self, items: PutItems, kind: str = "param", *,
                 durable: bool = False) -> list[int]:
        """Store several tensors; returns their versions.

        ``items`` maps names to tensors, or yields ``(name, tensor)`` or
        ``(name, kind, tensor)``. What bypasses the cache is written with overlapped I/O
        and committed in ONE transaction: all of it or none of it.

        With a host cache (the default) the entries land there dirty and reach the backing
        tier on eviction, ``flush()``, ``snapshot()`` or ``close()``; without one
        (``host_cache=0``) they are committed before ``put_many`` returns. Either way
        ``flush()`` returning means every earlier put is durable. ``durable=True`` commits
        them first and only then puts them in the cache (clean), so no reader sees a version
        a crash could take back: the daemon's puts, whose readers outlive it.
        """
        self._check_open()
        named = list(put_items(items, kind))
        cached = self._cache is not None
        later = (not cached or durable) and self._converted_as_placed(named)
        batch: list[tuple[str, str, Any, Any]] = [(name, k, t, None) for name, k, t in named] \
            if later else [_entry(name, k, t) for name, k, t in named]
        # With the cache, versions are given out under the key locks, so two operations on
        # one key are ordered the same way by their versions and by the cache.
        with self._ops.shared(), self._key_locks([(n, k) for n, k, _, _ in batch] if cached else []):
            versions = self._next_versions(len(batch))
            if later:
                self._write_batched(batch, versions=versions)
            else:
                for (_, _, _, meta), v in zip(batch, versions):
                    meta.version = v
                if cached and not durable:
                    self._land(batch)
                    return versions
                self._write_through(batch)
            if cached:
                self._land(batch, clean=True)
        return versions

    def _converted_as_placed(self, named: list[tuple[str, str, Any]]) -> bool:
        """Whether a put's tensors are made bytes (and their memory asked about) a group at
        a time as its batch places them, rather than all before its first request: the
        batch must go as one AIO batch (:func:`tierstore.landing.on_workers`) and commit in
        flight, so its first request goes out before later entries are looked at. Making
        4,096 tensors bytes took 9-10 ms before the first request (1 GiB of 256 KiB
        entries, about 180 ms); taken as the batch places them, 1 GiB from slices of one
        buffer, alternated in one process, 4.95 -> 5.16 and 5.21 -> 5.45 GB/s. Memory that
        needs staging, in entries under ``STAGED_AS_PLACED_MIN`` on average, has the rest of
        its batch taken at once when met."""
        if len(named) < AHEAD_MIN_ENTRIES or not self._batched():
            return False
        # Not tensors: as_bytes says what is wrong before anything is written.
        return all(isinstance(t, torch.Tensor) for _, _, t in named)

    def _land(self, batch: list[tuple[str, str, np.ndarray, Meta]], *,
              clean: bool = False) -> None:
        """New versions into the host cache as dirty entries; what it does not take is
        written through in one commit. ``clean``: the versions are committed already, so
        they land clean and what the cache does not take is simply not cached. The caller
        holds the entries' key locks.

        A new version takes the old one's place in one step, so a reader never finds a
        key in neither the cache nor the catalog, nor a version older than one it has
        seen: it is written into the old version's slot where nobody holds that, else
        into a staged slot swapped in by ``commit_staged``; where the cache takes no slot,
        the old version leaves only once the new one is committed."""
        assert self._cache is not None
        cache = self._cache
        through = []
        for name, k, src, meta in batch:
            if meta.nbytes:
                if cache.overwrite((name, k), src, meta, dirty=not clean):
                    continue
                h = cache.stage((name, k), meta.nbytes, data=src)
                if h is not None:
                    cache.commit_staged(h, meta, dirty=not clean)
                    continue
            through.append((name, k, src, meta))
        if through and not clean:
            self._write_through(through)
        for name, k, _, _ in through:
            cache.invalidate((name, k))

    def _delete(self, name: str, kind: str, missing_ok: bool) -> bool:
        """With the host cache the delete is a version above every earlier put of the key,
        and leaves a tombstone (see ``_commit``)."""
        cache = self._cache
        dead = 0

        def txn_delete(txn: Any) -> tuple[int, int, int] | None | bool:
            if cache is not None:
                # A write-back that took the entry before it left the cache may commit
                # after this one: the tombstone, set in this commit (so a crash never shows
                # the delete's effect before it is durable), makes that commit drop it.
                # Tombstones matter only while such a write-back can exist.
                if not cache.writebacks_in_flight():
                    self._tombstones.clear()
                self._tombstones[(name, kind)] = dead
            old = self._catalog.get_record(txn, name, kind)
            if old is None:
                return False
            txn.delete(entry_key(name, kind), db=self._catalog.db["entries"])
            live = self._catalog.get_meta(txn, "live_bytes", 0)
            self._catalog.put_meta(txn, "live_bytes", live - old.nbytes)
            return self._catalog.decref(txn, old)

        with self._ops.shared(), self._key_locks([(name, kind)]):
            cached = False
            if cache is not None:
                # Above every earlier put of the key (the key lock orders them).
                (dead,) = self._next_versions(1)
                cached = cache.invalidate((name, kind))
            freed = self._catalog.write(txn_delete)
        if freed is False and not cached:
            if missing_ok:
                return False
            raise EntryNotFoundError(name, kind)
        if freed:
            self._alloc.release([freed])
        return True

    def flush(self) -> None:
        """Make every earlier ``put`` durable: dirty cache entries are written back
        copy-on-write and committed in batches of about ``FLUSH_BATCH_BYTES``, each batch
        one transaction. If it fails, the batches committed so far are durable and the
        rest stay dirty in the cache, so a later ``flush()`` retries them."""
        self._check_open()
        with self._ops.shared():
            self._flush()

    def _flush(self) -> None:
        if self._cache is not None:
            self._cache.flush(many=self._write_back, batch_bytes=FLUSH_BATCH_BYTES)
        self._catalog.env.sync(True)

    def _write_back_one(self, key: Key, view: torch.Tensor, meta: Meta) -> None:
        self._write_back([(key, view, meta)])

    @paused()
    def _write_back(self, items: list[tuple[Key, torch.Tensor, Meta]]) -> None:
        """The cache's write-back: dirty slots to the backing tier, one commit."""
        self._write_through([(n, k, view.numpy(), meta) for (n, k), view, meta in items])

    def _write_through(self, batch: list[tuple[str, str, np.ndarray, Meta]]) -> None:
        """Copy-on-write: fresh extents, the chunks written, sync, then one commit. On the
        AIO engine one batch (:meth:`_write_batched`), unless the benchmark sends it to the
        workers; else jobs for the chunk workers (:meth:`_write_on_workers`)."""
        # Each source's address and whether it is staged, once.
        addrs = [address(src) for _, _, src, _ in batch]
        copies = staged(addrs, [src.nbytes for _, _, src, _ in batch],
                        memory_alignment(self._medium))
        if self._batched():
            return self._write_batched(batch, copies, addrs)
        self._write_on_workers(batch, copies)

    def _write_batched(self, batch: list[tuple[str, str, Any, Any]],
                       copies: list[bool] | None = None, addrs: list[int] | None = None,
                       versions: list[int] | None = None) -> None:
        """:meth:`_write_through` as one batch on an engine with a deep queue (AIO): chunks
        are requests (see :meth:`_run_writes`), each chunk's crc32c taken while other
        chunks are in flight, and the batch's extents placed a group at a time as the
        engine takes requests, so placing the last entries overlaps writing the first."""
        taken: list[tuple[int, int, int]] = []
        records: list[tuple[str, str, Record]] = []
        encoded: dict[int, bytes] = {}
        committer = (Committer(self._catalog, self._tombstones, records, encoded, len(batch))
                     if len(batch) >= AHEAD_MIN_ENTRIES else None)
        try:
            self._run_writes(batch, copies, addrs, records, taken, encoded, committer,
                             versions)
            self._medium.sync({seg for seg, _, length in taken if length})
            if committer is None:
                freed = self._catalog.write(lambda txn: commit_records(
                    self._catalog, self._tombstones, txn, records, encoded))
            else:
                committer.durable()
                freed = committer.result()
        except BaseException as e:
            if committer is not None:
                committer.abandon(e)
            self._write_failed(taken, e)  # nothing is in flight once the batch has ended
            raise
        self._written(freed, records)

    def _run_writes(self, batch: list[tuple[str, str, Any, Any]], copies: list[bool] | None,
                    addrs: list[int] | None, records: list[tuple[str, str, Record]],
                    taken: list[tuple[int, int, int]], encoded: dict[int, bytes],
                    committer: Committer | None = None,
                    versions: list[int] | None = None) -> None:
        """Write ``batch`` (``copies``: whether each entry is staged; ``addrs``: its
        address) to fresh extents, appending each entry's record (its crc32c filled in as
        its chunks are staged or sent) to ``records``, each extent to ``taken``, and, for entries of one
        chunk, the record's encoding to ``encoded`` (by position). With ``versions``, the
        batch holds tensors (and no metas) yet, each made bytes of that version as its group
        is placed (see :meth:`_converted_as_placed`), ``copies`` and ``addrs`` with it.

        The engine takes the requests in order as its queue has room. Entries are placed a
        group of about ``PLACE_AHEAD_CHUNKS`` chunks at a time (the first groups, and a
        staged batch's first requests, smaller: ``FIRST_REQUEST_BYTES``), as the engine
        asks for more requests: the Python cost of placing a batch of small entries (a
        record and an allocation each) is paid while the first ones are in flight, not
        before. Chunks that
        follow each other on disk (small entries given fresh extents one after another) are
        one request of up to a chunk's bytes: a put of 256 KiB entries costs what a few large
        ones do. Where the source is not aligned, the chunk workers copy it into an aligned
        buffer a few requests ahead of submission (the first request: the calling thread),
        taking its crc32c as they copy. An
        aligned chunk is written from the source itself, and its crc32c is taken by a
        worker beside its transfer, handed over as its request is made (both release the
        GIL, so they use every core): submission never waits for a checksum, and the disk
        gets the batch's first bytes at once (256 MiB put, 5-7 alternated rounds: 64 MiB
        entries 6-11 % and 16 MiB ones 1-7 % faster than checksumming before submission,
        smaller ones unchanged). Taken once the write had landed instead, a put that fits in
        the engine's window (a layer's experts), which this disk completes in one go, had
        all its checksums after its transfer: durable puts of 32 MiB from slices of one
        buffer, 7 alternated rounds, 2.50 -> 2.94 GB/s (4 MiB entries) and 2.32 -> 2.75
        (1 MiB, a ``read_buffer`` each); 1 GiB puts 0.7-4.7 % faster."""
        chunk, srcs = self._chunk, [src for _, _, src, _ in batch]
        converted = [len(batch)]  # entries before it are bytes (see _converted_as_placed)
        if versions is not None:
            copies, addrs, converted[0] = [False] * len(batch), [0] * len(batch), 0

        def convert(hi: int) -> None:
            """Entries up to ``hi`` made bytes, with their addresses and whether each is
            staged (the kernel asked once for them all)."""
            lo = converted[0]
            self._convert(batch, versions, lo, hi)  # type: ignore[arg-type]
            got = srcs[lo:hi] = [src for _, _, src, _ in batch[lo:hi]]
            at = addrs[lo:hi] = [address(src) for src in got]  # type: ignore[index]
            copies[lo:hi] = staged(at, [s.nbytes for s in got],  # type: ignore[index]
                                   memory_alignment(self._medium))
            converted[0] = hi
        work: list[tuple[int, int, int]] = []  # (entry, start, end) of each chunk
        extents: list[tuple[int, int]] = []  # each entry's (segment, offset)
        runs: list[tuple[int, int]] = []  # requests: [first, last) of work
        sizes: list[int] = []
        bounds: list[int] = []  # records whole once each request (and those before) landed
        placing: list[BaseException] = []  # what placing entries raised (a full disk)

        def place() -> bool:
            """Place the next group of entries and plan their requests; False once every
            entry is placed. A request never spans two groups: a group is several chunks,
            so that costs at most one short request per group."""
            i = first_entry = len(records)
            first = len(work)
            budget = min(PLACE_AHEAD_CHUNKS * chunk, FIRST_REQUEST_BYTES << groups[0])
            if i == len(batch):
                return False
            groups[0] += 1
            while i < len(batch) and (budget > 0 or i == first_entry):  # one entry at least
                budget -= align_up(batch[i][2].nbytes)
                i += 1
            try:
                if converted[0] < i:
                    convert(i)
                    if small and any(copies[first_entry:i]):  # type: ignore[index]
                        convert(len(batch))  # see STAGED_AS_PLACED_MIN
                placed = self._placed([(src, meta) for _, _, src, meta in batch[first_entry:i]],
                                      taken, span)
            except BaseException as e:
                placing.append(e)  # raised as it is, not as a failed write (see below)
                raise
            for j, rec in enumerate(placed, first_entry):
                length = rec.length
                if length > chunk:
                    work.extend((j, start, min(start + chunk, length))
                                for start in range(0, length, chunk))
                elif length:
                    work.append((j, 0, length))
                records.append((batch[j][0], batch[j][1], rec))
                extents.append((rec.seg, rec.off))
            ends = [len(work) - first]
            if any(copies[first_entry:i]):  # type: ignore[index]
                # See FIRST_REQUEST_BYTES; a staged chunk cut in two is joined in ``parts``.
                work[first:], cuts = ramped(work[first:], sum(sizes), FIRST_REQUEST_BYTES,
                                            chunk, copies)  # type: ignore[arg-type]
                ends = [*cuts, len(work) - first]
            lo = 0
            for hi in ends:
                for a, b in adjacent_runs(work[first + lo : first + hi], extents, chunk,
                                          MAX_PIECES):
                    runs.append((first + lo + a, first + lo + b))
                    sizes.append(sum(work[n][2] - work[n][1]
                                     for n in range(first + lo + a, first + lo + b)))
                    j, _, end = work[first + lo + b - 1]
                    bounds.append(j + 1 if end == records[j][2].length else j)
                lo = hi
            # With one extent for the batch (see tierstore.placing), placing never commits,
            # so the commit may begin before the last group, COMMIT_AHEAD_BYTES before it;
            # unless the first group's memory needs staging, where the committer working
            # beside the copies cost more than it saved (see tierstore.commits). Else once
            # every entry is placed.
            if first_entry == 0:
                early.append(span is not None and not any(copies[:i]))  # type: ignore[index]
            if committer is not None and not begun and (i == len(batch) or (
                    early[0] and span[1] + COMMIT_AHEAD_BYTES >= span_end)):  # type: ignore[index]
                committer.start(bounds)
                begun.append(True)
            if committer is not None and i == len(batch):
                committer.planned()
            return True

        small = versions is not None and (
            sum(s.nbytes for s in srcs) < STAGED_AS_PLACED_MIN * len(srcs))
        # A batch that commits in flight takes one extent for all of it where one holds it.
        span = self._reserve([align_up(s.nbytes) for s in srcs], taken) if committer else None
        span_end = taken[-1][1] + taken[-1][2] if span is not None else 0
        begun: list[bool] = []
        early: list[bool] = []  # whether the commit may begin before every entry is placed
        groups = [0]  # how many groups are placed
        parts: dict[int, int] = {}  # the crc32c of each part of a chunk cut in two (ramped)

        # Staged ahead: up to a request per chunk worker and STAGE_AHEAD_BYTES (with the
        # engine's window in flight, within the staging pool's idle buffers for full chunks),
        # copied in order, one request per core at a time (tierstore.ordered), a core left
        # to the thread that sends them. The copies are bound by memory, not by cores: on
        # the development VM's two, one copies a chunk in 1.1 ms alone and two took 3.4 ms
        # for a chunk each; and the engine's thread, waiting for the oldest, got the GIL
        # back 1-2 ms after it was copied, between the other copier's steps. Durable puts
        # of 32 MiB from torch.empty tensors, alternated: 0.68 -> 0.77 of DeepNVMe's rate
        # (256 KiB entries), 0.78 -> 0.90 (4 MiB).
        ahead = 2 * self._io_threads
        staging = InOrder(self._workers, min(ahead, max(1, usable_cores() - 1)))
        pending: collections.deque[Future[tuple[list[int], Any, Any]]] = collections.deque()
        held: dict[int, Any] = {}  # staging buffers of requests in flight
        checks: list[Future[None]] = []  # the aligned chunks' checksums
        at = [0]

        def give(staged: Any) -> None:
            if staged is not None and staged[0] is not None:
                self._staging.give(staged[0])  # a chunk-sized buffer back to its pool

        def chunk_end(at: int, length: int) -> int:
            """Where the chunk holding byte ``at`` of an extent of ``length`` ends."""
            return min(at - at % chunk + chunk, length)

        def checksum(chunks: list[int], into: Any = None) -> None:
            """Each chunk's crc32c; with ``into`` (each chunk's first staged byte and its
            staging place, in order), the staged bytes' taken as they are copied there
            (:func:`copy_checked`), after the bytes before them, written from the source."""
            for m, n in enumerate(chunks):
                i, start, end = work[n]
                rec = records[i][2]
                src = srcs[i][start:min(end, rec.nbytes)]
                if into is None:
                    crc = crc32c.crc32c(src)
                else:
                    cut, place = into[m]
                    crc = crc32c.crc32c(src[: cut - start]) if cut > start else 0
                    crc = copy_checked(place, src[cut - start :], crc)
                if start % chunk or end < chunk_end(start, rec.length):
                    parts[n] = crc  # a part of a chunk (see ramped): joined in join_parts
                    continue
                rec.crc[start // chunk] = crc
                if rec.length <= chunk:
                    # Its one checksum is in: the commit's encoding of a small entry's
                    # record is done here, while other chunks are in flight.
                    encoded[i] = rec.encode()

        def stage(m: int) -> tuple[list[int], Any, Any]:
            """Request ``m``'s pieces: from an aligned source its whole pages are written
            from the source itself, and only what is left (all of an unaligned source's
            chunk; an aligned one's last partial page) is staged."""
            first, last = runs[m]
            pieces: list[list[Any]] = []
            copy: list[tuple[int, int]] = []  # (chunk, its first staged byte)
            direct: list[int] = []
            for n in range(first, last):
                i, start, end = work[n]
                cut = direct_end(copies[i], records[i][2].nbytes, start, end)
                if cut == end:
                    pieces.append([(addrs[i] + start, end - start)])
                    direct.append(n)
                else:
                    pieces.append([(addrs[i] + start, cut - start)] if cut > start else [])
                    copy.append((n, cut))
            staged = None
            if copy:
                # Reused memory, so no page faults on the hot path.
                need = sum(work[n][2] - cut for n, cut in copy)
                full = need > self._chunk // 2
                buf = self._staging.take() if full else self._results.take(need)
                staged = (buf if full else None, buf)
                used = 0
                places = []
                for n, cut in copy:
                    i, start, end = work[n]
                    stop = min(end, records[i][2].nbytes)
                    places.append((cut, buf[used : used + stop - cut]))
                    buf[used + stop - cut : used + end - cut] = 0
                    pieces[n - first].append((buf.ctypes.data + used, end - cut))
                    used += end - cut
                checksum([n for n, _ in copy], places)
            return direct, staged, joined([p for chunk_pieces in pieces for p in chunk_pieces])

        def join_parts(m: int) -> None:
            """The checksums of the chunks cut in parts whose last part is request ``m``'s,
            joined; the parts were staged by it and the requests before it."""
            first, last = runs[m]
            for n in range(first, last):
                i, start, end = work[n]
                rec = records[i][2]
                if n not in parts or end < chunk_end(start, rec.length):
                    continue
                base = start - start % chunk
                crc, k = 0, n
                while k > 0 and work[k - 1][0] == i and work[k - 1][1] >= base and k - 1 in parts:
                    k -= 1
                for p in range(k, n + 1):
                    _, s0, e0 = work[p]
                    crc = crc_join(crc, parts.pop(p), max(0, min(e0, rec.nbytes) - s0))
                rec.crc[base // chunk] = crc
                if rec.length <= chunk:
                    encoded[i] = rec.encode()

        # Requests queued for staging, their bytes not yet sent, and the next one to send.
        line = [0, 0, 0]

        def top_up(may_place: bool) -> None:
            """Queue staging jobs up to ``ahead`` and STAGE_AHEAD_BYTES, planning (placing)
            more requests only where ``may_place``, or where the next one to send is not
            planned yet. The engine asks for a window's requests in a row once the disk
            has completed the last window, and submits them together: placing a group
            there (0.5 ms for 128 entries) kept the disk waiting. So the generator only
            takes what is staged, and the topping up, placing included, runs as requests
            land (``landed``), after the engine has submitted their successors: 1 GiB of
            256 KiB entries, alternated in one process, 4.20-4.84 -> 4.70-5.20 GB/s from
            slices of one buffer, 4.13-4.65 -> 4.26-4.85 from ``torch.empty``; 1 MiB
            even."""
            queued, ahead_bytes, m = line
            while queued <= m or (queued < m + ahead and ahead_bytes < STAGE_AHEAD_BYTES):
                if queued == len(runs):
                    if (queued > m and not may_place) or not place():
                        break
                    continue  # a group of empty entries plans no request
                if queued:
                    pending.append(staging.submit(stage, queued))
                else:
                    # The first request is staged here, alone and at once: beside the
                    # next ones it shared the memory's bandwidth (see the lanes above).
                    done: Future[tuple[list[int], Any, Any]] = Future()
                    done.set_result(stage(0))
                    pending.append(done)
                ahead_bytes += sizes[queued]
                queued += 1
            line[0], line[1] = queued, ahead_bytes

        def requests() -> Any:
            while True:
                top_up(False)
                m = line[2]
                if m == len(runs):
                    return
                first = runs[m][0]
                nbytes = sizes[m]
                line[1] -= nbytes
                at[0] = m
                direct, staged, buf = pending.popleft().result()
                if parts:
                    join_parts(m)
                if direct:
                    checks.append(self._workers.submit(checksum, direct))
                    if committer is not None:
                        checks[-1].add_done_callback(lambda f, m=m: told(f, m))
                elif committer is not None:
                    committer.finished(m)
                if staged is not None:
                    held[m] = staged
                i, start, _ = work[first]
                rec = records[i][2]
                yield rec.seg, rec.off + start, buf, nbytes, True
                line[2] = m + 1

        def landed(m: int) -> None:
            give(held.pop(m, None))
            top_up(True)

        def told(f: Future[None], m: int) -> None:
            if f.exception() is None:  # else the batch fails, and drops the commit
                committer.finished(m)  # type: ignore[union-attr]

        try:
            self._medium.run(requests(), landed)
            for f in checks:
                f.result()
        except EngineClosedError as e:  # only where no operation gate held it off
            raise StoreClosedError(f"store {self.path} is closed") from e
        except OSError as e:
            if placing and e is placing[0]:
                raise
            if not isinstance(e, BatchError) and not isinstance(e, FileNotFoundError):
                # The batch's failure (no AIO context, io_getevents), not a chunk's.
                name, kind = batch[0][:2]  # records holds only the entries placed so far
                raise OSError(e.errno, f"writing {name!r} (kind {kind!r}) and "
                              f"{len(batch) - 1} other entries: {e.strerror}") from e
            first, last = runs[e.index if isinstance(e, BatchError) else at[0]]
            name, kind, rec = records[work[first][0]]
            start = work[first][1]
            where = self._medium.location(rec.seg, rec.off + start)[0]
            others = len({work[n][0] for n in range(first, last)}) - 1
            with_ = f" (one request with the {others} entries after it)" if others else ""
            raise OSError(e.errno, f"writing {name!r} (kind {kind!r}), bytes "
                          f"{start}..{work[first][2]} to {where}{with_}: {e.strerror}") from e
        finally:
            wait([*pending, *checks])  # jobs started ahead of a failure
            for f in pending:
                if f.exception() is None:
                    give(f.result()[1])
            for b in held.values():
                give(b)

    @staticmethod
    def _convert(batch: list[tuple[str, str, Any, Any]], versions: list[int], lo: int,
                 hi: int) -> None:
        """Entries ``lo`` to ``hi`` of a put's batch, tensors yet, made bytes of their
        version (in place)."""
        for j in range(lo, hi):
            name, k, t, _ = batch[j]
            batch[j] = _entry(name, k, t, versions[j])


def _entry(name: str, kind: str, t: Any, version: int = 0) -> tuple[str, str, np.ndarray, Meta]:
    """A put's entry: the tensor's bytes and their meta."""
    src = as_bytes(t)
    return name, kind, src, Meta(dtype_name(t.dtype), tuple(t.shape), src.nbytes, version)
