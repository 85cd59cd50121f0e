"""Snapshots of a local store: a tag records the current version of every entry.

A snapshot takes a reference on every extent the live entries use, so their space is never
reused while it exists; ``restore`` makes the live entries exactly the snapshot's, and
``drop_snapshot`` gives back what only the snapshot held. Each snapshot leaves a copy of the
catalog beside the store (:data:`CATALOG_COPY`): ``tierstore fsck --repair`` comes back to it
if the live catalog is lost. A snapshot and its copy are one unit (a snapshot whose copy
fails is dropped again), and the copy lands in the store's directory wherever that has been
moved while the store is open.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .catalog import CopyFailed, Record, entry_key
from .errors import SnapshotError, StoreError, StoreFullError
from .interface import SnapshotInfo
from .keys import check_tag
from .writes import WritePath

CATALOG_COPY = "catalog-snapshot.mdb"  # the catalog as the latest snapshot left it


class SnapshotOps(WritePath):
    """Snapshots of :class:`tierstore.LocalStore` (a snapshot flushes first)."""

    def snapshot(self, tag: str) -> SnapshotInfo:
        """Atomically record the current version of every entry under ``tag``."""
        self._check_open()
        check_tag(tag)
        cat = self._catalog

        def txn_snap(txn: Any) -> SnapshotInfo:
            if txn.get(tag.encode(), db=cat.db["snapshots"]) is not None:
                raise SnapshotError(f"snapshot {tag!r} exists; drop it first")
            n = nbytes = 0
            lead, saved = tag.encode() + b"\0", cat.db["snapentries"]
            # Each live record is saved as its bytes: the snapshot holds what the entry
            # holds, and the commit's cost is that of reading every record once.
            for key, raw in list(txn.cursor(db=cat.db["entries"])):
                rec = Record.decode(raw)
                cat.incref(txn, rec, held=True)
                txn.put(lead + key, raw, db=saved)
                n, nbytes = n + 1, nbytes + rec.nbytes
            info = SnapshotInfo(tag, time.time(), n, nbytes)
            txn.put(tag.encode(), json.dumps(vars(info)).encode(), db=cat.db["snapshots"])
            return info

        with self._ops.shared():
            self._flush()
            # A copy of the catalog as this commit left it: `tierstore fsck --repair` comes
            # back to it if the live catalog is lost (snapshots keep its extents in place).
            # It goes to the store's directory through the catalog's descriptor on it, so
            # a store moved while open keeps its copy beside it. The snapshot and its copy
            # are one unit: a snapshot whose copy fails is dropped again.
            try:
                return cat.write(txn_snap, copy_to=CATALOG_COPY)
            except CopyFailed as e:
                try:
                    self._alloc.release(cat.write(lambda txn: self._drop_txn(txn, tag)))
                except StoreError as undo:
                    raise StoreError(f"snapshot {tag!r} was taken, but its catalog copy was "
                                     f"not saved ({e}) and dropping it again failed ({undo}); "
                                     "drop it, then take it again") from None
                full = isinstance(e.__cause__, StoreFullError)  # a full disk stays one
                raise (StoreFullError if full else StoreError)(
                    f"snapshot {tag!r} was not taken: {e}") from None

    def snapshots(self) -> list[SnapshotInfo]:
        self._check_open()
        with self._catalog.read() as txn:
            return [
                SnapshotInfo(**json.loads(raw))
                for _, raw in txn.cursor(db=self._catalog.db["snapshots"])
            ]

    def restore(self, tag: str) -> SnapshotInfo:
        """Make the live entries exactly the snapshot's (entries made since are removed).

        Unflushed puts are discarded with the rest of the live state, so nothing is
        written back first. It runs alone: operations that change entries or fill the
        cache wait for it, and it waits for those already running.
        """
        self._check_open()
        check_tag(tag)
        cat = self._catalog

        def txn_restore(txn: Any) -> tuple[list[tuple[int, int, int]], SnapshotInfo]:
            raw = txn.get(tag.encode(), db=cat.db["snapshots"])
            if raw is None:
                raise SnapshotError(f"no snapshot {tag!r}")
            saved = list(cat.iter_records(txn, db="snapentries", tag=tag))
            for _, _, rec in saved:  # take the snapshot's references before dropping the live ones
                cat.incref(txn, rec)
            freed = []
            for name, kind, rec in list(cat.iter_records(txn)):
                ext = cat.decref(txn, rec)
                if ext:
                    freed.append(ext)
                txn.delete(entry_key(name, kind), db=cat.db["entries"])
            for name, kind, rec in saved:
                txn.put(entry_key(name, kind), rec.encode(), db=cat.db["entries"])
            cat.put_meta(txn, "live_bytes", sum(r.nbytes for _, _, r in saved))
            return freed, SnapshotInfo(**json.loads(raw))

        with self._ops.exclusive():  # so no write-back is in flight
            self._tombstones.clear()
            freed, info = cat.write(txn_restore)
            self._alloc.release(freed)
            if self._cache is not None:  # cached copies are of versions the restore replaced
                for key in list(self._cache):
                    self._cache.invalidate(key)
        return info

    def drop_snapshot(self, tag: str) -> None:
        """Forget a snapshot; space only it held becomes free."""
        self._check_open()
        cat = self._catalog
        # The copy is refreshed so it never lists a snapshot whose space may be reused.
        with self._ops.shared():
            copy = CATALOG_COPY if cat.has_copy(CATALOG_COPY) else None
            try:
                self._alloc.release(cat.write(lambda txn: self._drop_txn(txn, tag),
                                              copy_to=copy))
            except CopyFailed as e:
                self._alloc.release(e.result)
                raise StoreError(f"snapshot {tag!r} was dropped, but the saved catalog copy "
                                 f"was not refreshed ({e}): it still lists the snapshot, so "
                                 "`fsck --repair` may refuse it until the next snapshot "
                                 "saves a new one") from None

    def _drop_txn(self, txn: Any, tag: str) -> list[tuple[int, int, int]]:
        """Drop snapshot ``tag`` in ``txn``; returns the extents that freed."""
        cat = self._catalog
        if not txn.delete(tag.encode(), db=cat.db["snapshots"]):
            raise SnapshotError(f"no snapshot {tag!r}")
        freed: list[tuple[int, int, int]] = []
        lead = tag.encode() + b"\0"
        cur = txn.cursor(db=cat.db["snapentries"])
        more = cur.set_range(lead)
        while more and cur.key().startswith(lead):
            cat.decref(txn, Record.decode(cur.value()), freed)
            more = cur.delete()  # and on to the next record
        cat.add_free_many(txn, freed)  # neighbours freed together: one update each run
        return freed
