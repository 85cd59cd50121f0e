"""Where a write's new versions go: fresh extents for a batch's entries, and their records.

A batch takes its extents first fit, a group of entries at a time as the engine asks for
requests (see :mod:`tierstore.writes`), and adds a slab where no free extent is large
enough. Adding a slab commits (the catalog records the segment), so a batch that builds its
commit in flight (:class:`tierstore.commits.Committer`, which holds the catalog's writer)
could only start that commit once its last group was placed. Such a batch therefore first
tries to take ONE extent for all its entries (:meth:`Placing._reserve`) and cuts them from
it in order: its placing then never commits, and its commit can begin before its last group
is placed (see :mod:`tierstore.commits`). In a store rewritten in place that extent is the
one the batch's previous versions left. Where no free extent holds the whole batch, it is
placed first fit as before.
"""

from __future__ import annotations

import numpy as np

from .catalog import Record
from .errors import StoreError
from .interface import Meta
from .local_state import LocalState
from .media import align_up

Extent = tuple[int, int, int]  # (segment, offset, length)


class Placing(LocalState):
    """Placing new versions (see the module docstring)."""

    def _reserve(self, lengths: list[int], taken: list[Extent]) -> list[int] | None:
        """One free extent for all of ``lengths`` (aligned), appended to ``taken``, as
        ``[segment, next offset]`` for :meth:`_placed` to cut from; None where no free
        extent holds them all (no slab is added for it)."""
        total = sum(lengths)
        got = self._alloc.allocate(total) if total else None
        if got is None:
            return None
        taken.append((*got, total))
        return list(got)

    def _placed(self, items: list[tuple[np.ndarray, Meta]], taken: list[Extent],
                span: list[int] | None = None) -> list[Record]:
        """The records of the sources' new versions at fresh extents, each appended to
        ``taken`` as it is taken (so a full disk met part way releases what was taken),
        their chunks' crc32c still to fill in; an empty tensor has no extent (and crc
        [0]). With ``span`` (from :meth:`_reserve`, already in ``taken``) they are cut
        from it in order."""
        chunk, recs = self._chunk, []
        for src, meta in items:
            length = align_up(src.nbytes)
            recs.append(Record(meta.dtype, list(meta.shape), src.nbytes, [0] * (
                -(-length // chunk) or 1), chunk, meta.version, -1, 0, length))
        sized = [rec for rec in recs if rec.nbytes]
        if span is not None:
            seg, off = span
            for rec in sized:
                rec.seg, rec.off = seg, off
                off += rec.length
            span[1] = off
            return recs
        got = self._alloc.allocate_many([rec.length for rec in sized])
        taken.extend((g[0], g[1], rec.length) for rec, g in zip(sized, got) if g is not None)
        for rec, g in zip(sized, got):
            if g is None:  # past the free space: a new slab (see _allocate)
                g = self._allocate(rec.length)
                taken.append((*g, rec.length))
            rec.seg, rec.off = g
        return recs

    def _allocate(self, length: int) -> tuple[int, int]:
        got = self._alloc.allocate(length)
        while got is None:
            with self._seg_lock:
                got = self._alloc.allocate(length)  # another thread may have added a slab
                if got is not None:
                    break
                seg = self._next_seg
                try:
                    new = self._medium.create_segment(seg, max(length, self._grow_bytes))
                except FileExistsError as e:
                    raise StoreError(f"{e.filename}: {e.strerror}") from None
                self._catalog.write(lambda txn, new=new: self._catalog.add_segment(txn, *new))
                seg, _, _, size = new
                self._next_seg = seg + 1
                self._alloc.add(seg, 0, size)
            got = self._alloc.allocate(length)
        return got
