"""The chunk workers' writes: a job of several small entries' chunks, written from the
source where its memory is aligned, else copied into one staging buffer per run of chunks
that follow each other on disk. The write path (:mod:`tierstore.writes`) sends a batch here
on an engine without a deep queue (PMem, the POSIX engines), and from the AIO engine only
where the benchmark sends it (:func:`tierstore.landing.on_workers`).
"""

from __future__ import annotations

import errno
from concurrent.futures import Future, wait

import crc32c
import numpy as np

from .catalog import Record
from .commits import commit_records
from .errors import StoreFullError
from .interface import Meta
from .landing import copy_checked, direct_end
from .placing import Placing

_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# Without a batching engine (PMem, the POSIX engines), a worker writes the chunks of small
# entries up to this many bytes as one job: a 256 KiB chunk handed to a worker and waited for
# cost about as much as copying it to PMem. 1 GiB of 256 KiB entries, alternated: PMem
# 2.42-2.67 -> 2.79-2.92 GB/s with 8 I/O threads, POSIX O_DIRECT 2.03-2.13 -> 2.22-2.27 with
# 1 and 3.38-3.52 -> 3.65-3.67 with 8. Jobs of 4 MiB did better on POSIX (2.47, 3.81) and
# worse on PMem with 8 threads (1.84-1.91), not understood yet.
GROUP_BYTES = 1 << 20


class WriteJobs(Placing):
    """The chunk workers' part of the write path (see the module docstring)."""

    def _write_on_workers(self, batch: list[tuple[str, str, np.ndarray, Meta]],
                          copies: list[bool]) -> None:
        """Copy-on-write of ``batch`` (``copies``: whether each entry is staged) in jobs of
        several small entries' chunks (see ``GROUP_BYTES``), then sync and one commit."""
        taken: list[tuple[int, int, int]] = []
        records: list[tuple[str, str, Record]] = []
        jobs: list[tuple[list[tuple[np.ndarray, Record, int, bool]], Future[list[int]]]] = []
        # A job per worker at least, where the batch has that many chunks.
        workers = 2 * self._io_threads
        limit = min(GROUP_BYTES, -(-sum(src.nbytes for _, _, src, _ in batch) // workers))
        group: list[tuple[np.ndarray, Record, int, bool]] = []  # the next job's chunks
        size = 0

        def send() -> None:
            nonlocal group, size
            if group:
                chunks = group
                jobs.append((chunks, self._workers.submit(self._write_group, chunks)))
            group, size = [], 0

        try:
            placed = self._placed([(src, meta) for _, _, src, meta in batch], taken)
            for (name, k, src, _), rec, copy in zip(batch, placed, copies):
                records.append((name, k, rec))
                for start in range(0, rec.length, self._chunk):
                    group.append((src, rec, start, copy))
                    size += min(self._chunk, rec.length - start)
                    if size >= limit:
                        send()
            send()
            for chunks, job in jobs:
                for (_, rec, start, _), crc in zip(chunks, job.result()):
                    rec.crc[start // self._chunk] = crc
            self._medium.sync({seg for seg, _, length in taken if length})
            freed = self._catalog.write(
                lambda txn: commit_records(self._catalog, self._tombstones, txn, records))
        except BaseException as e:
            # A write still in flight must land before its extent can be handed out again.
            wait([job for _, job in jobs])
            self._write_failed(taken, e)
            raise
        self._written(freed, records)


    def _write_failed(self, taken: list[tuple[int, int, int]], e: BaseException) -> None:
        """A write-through failed with nothing in flight: its extents go back; a full disk
        becomes :class:`StoreFullError`."""
        self._alloc.release(taken)
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            raise StoreFullError(f"no space to write to {self.path}: {e}") from e

    def _written(self, freed: list[tuple[int, int, int]],
                 records: list[tuple[str, str, Record]]) -> None:
        """A write-through committed: the extents it replaced go back, and it is counted."""
        self._alloc.release(freed)
        with self._stats_lock:
            self._tier.writes += len(records)
            self._tier.bytes_written += sum(r.nbytes for _, _, r in records)

    def _write_group(self, chunks: list[tuple[np.ndarray, Record, int, bool]]) -> list[int]:
        """A worker's job: write ``chunks`` (source, record, start, whether staged),
        returning their crc32c. Staged chunks that follow each other on disk (small entries
        of one put, from torch's allocator) share one staging buffer and request of up to a
        chunk's bytes, as the AIO batch joins them: a request and a staging buffer per
        256 KiB entry cost the workers more than the copy."""
        crcs: list[int] = []
        k = 0
        while k < len(chunks):
            src, rec, start, copy = chunks[k]
            if not copy:
                crcs.append(self._write_aligned(src, rec, start))
                k += 1
                continue
            last, at, size = k, rec.off + start, 0
            while last < len(chunks):
                s, r, st, c = chunks[last]
                e = min(st + self._chunk, r.length)
                if (not c or r.seg != rec.seg or r.off + st != at
                        or size + e - st > self._chunk):
                    break
                at, size, last = r.off + e, size + e - st, last + 1
            crcs += self._write_staged([(s, r, st, 0) for s, r, st, _ in chunks[k:last]])
            k = last
        return crcs

    def _write_staged(self, parts: list[tuple[np.ndarray, Record, int, int]]) -> list[int]:
        """Copy ``parts`` (source, record, first byte, crc32c of the bytes before it), one
        after another on disk and each to its chunk's end, into one staging buffer (reused,
        so no page faults on the hot path) and write them as one request; returns each
        one's crc32c continued over its bytes."""
        crcs = []
        stage = self._staging.take()
        try:
            used = 0
            for s, r, lo, crc in parts:
                e = min(lo - lo % self._chunk + self._chunk, r.length)
                stop = min(e, s.nbytes)
                crcs.append(copy_checked(stage[used : used + stop - lo], s[lo:stop], crc))
                stage[used + stop - lo : used + e - lo] = 0
                used += e - lo
            rec, lo = parts[0][1], parts[0][2]
            self._medium.write(rec.seg, rec.off + lo, memoryview(stage[:used]))
        finally:
            self._staging.give(stage)
        return crcs

    def _write_aligned(self, src: np.ndarray, rec: Record, start: int) -> int:
        """Write the chunk of aligned ``src`` (see ``landing.staged``) at ``start`` to
        ``rec``'s extent from the source itself, up to its last whole page; a partial
        last page is staged. Returns the chunk's crc32c."""
        end = min(start + self._chunk, rec.length)
        cut = direct_end(False, src.nbytes, start, end)
        crc = 0
        if cut > start:
            # Checksummed after the write, as _run_writes does (see there).
            self._medium.write(rec.seg, rec.off + start, memoryview(src[start:cut]))
            crc = crc32c.crc32c(src[start:cut])
        return crc if cut == end else self._write_staged([(src, rec, cut, crc)])[0]
