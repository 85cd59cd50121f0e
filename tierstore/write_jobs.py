"""The chunk workers' writes: a job of several small entries' chunks, written from the
source where its memory is aligned, else copied into one staging buffer per run of chunks
that follow each other on disk. The write path (:mod:`tierstore.writes`) sends a batch here
on an engine without a deep queue (PMem, the POSIX engines), and from the AIO engine only
where the benchmark sends it (:func:`tierstore.landing.on_workers`).
"""

from __future__ import annotations

import crc32c
import numpy as np

from .catalog import Record
from .landing import copy_checked, direct_end
from .placing import Placing


class WriteJobs(Placing):
    """The chunk workers' part of the write path (see the module docstring)."""

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
        """Write the chunk of page-aligned ``src`` at ``start`` to ``rec``'s extent from
        the source itself (O_DIRECT and GDS need page-aligned memory), up to its last whole
        page; a partial last page is staged. Returns the chunk's crc32c."""
        end = min(start + self._chunk, rec.length)
        cut = direct_end(False, src.nbytes, start, end)
        crc = 0
        if cut > start:
            # Checksummed after the write, as _run_writes does (see there).
            self._medium.write(rec.seg, rec.off + start, memoryview(src[start:cut]))
            crc = crc32c.crc32c(src[start:cut])
        return crc if cut == end else self._write_staged([(src, rec, cut, crc)])[0]
