"""``tierstore fsck --repair``: a store whose live catalog is lost or damaged, back to its
latest snapshot, all or nothing.

Every snapshot leaves a copy of the catalog beside it (``catalog-snapshot.mdb``, refreshed
when a snapshot is dropped), and the space a snapshot references is never reused while the
snapshot exists. So that copy plus the backing tier hold the latest snapshot whole. A repair:

1. refuses unless the live catalog really fails to open (a sound store is rolled back with
   ``tierstore restore``, never by a repair);
2. builds the repaired catalog beside the store (``catalog.repair/``), from a copy of the
   saved one: every page its tree references is checked, then it must be this store's
   (the marker's identity), the latest snapshot is restored in it, and every version is
   verified against its checksums. Anything wrong so far names the saved copy and leaves
   the store as it was;
3. notes what it is about to do in ``repair.json``, moves the damaged catalog aside
   (``catalog.damaged-<time>``, never deleted) and slab files the repaired catalog does not
   name (made after the snapshot) into ``lost+found/``;
4. renames ``catalog.repair/`` to ``catalog/``: that rename is the commit point.

A SIGKILL before the rename leaves a store whose live catalog is damaged or missing, so a
rerun repairs it again from the start (carrying over what the note says was set aside).
After the rename the store is the snapshot's; a rerun finds it sound and, while its catalog
is still the one the note records (nothing committed since), verifies it again and reports
the repair instead of refusing a sound store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierstore.nvme import fsync_dir, orphan_slabs

from . import lmdb_file
from .catalog import DATA_FILE, Catalog
from .errors import CatalogError, StoreError
from .fsck import LOST_FOUND
from .interface import FsckReport
from .opening import (
    CATALOG_DIR,
    assemble,
    check_identity,
    lock,
    open_store,
    read_marker,
    write_json,
)
from .snapshots import CATALOG_COPY

STAGING = "catalog.repair"  # the repaired catalog, until it is renamed into place
NOTE = "repair.json"  # the last repair: what it set aside, and the catalog it made
_UNUSABLE = "nothing was changed; only a backup of the store directory can bring it back"


@dataclass
class RepairReport:
    """What a repair did; ``check`` is the fsck of the repaired store."""

    snapshot: str
    damaged_catalog: str | None
    set_aside: list[str]
    check: FsckReport


def repair_store(path: str | os.PathLike[str],
                 progress: Callable[[int], None] | None = None) -> RepairReport:
    """Bring the store at ``path`` back to its latest snapshot (see the module doc)."""
    path = os.path.abspath(os.fspath(path))
    marker = read_marker(path)
    note = _read_note(path)
    try:
        st = open_store(path, host_cache=0)
    except CatalogError:
        pass  # the case a repair is for
    else:
        with st:
            if note is None or note.get("txnid") != _commit_id(os.path.join(path, CATALOG_DIR)):
                raise StoreError(f"the catalog of {path} is sound: nothing to repair "
                                 "(`tierstore restore STORE TAG` goes back to a snapshot)")
            report = st.fsck(progress)  # a repair that committed, then was interrupted
        return RepairReport(note["snapshot"], note["damaged"], note["set_aside"], report)
    saved = os.path.join(path, CATALOG_COPY)
    if not os.path.exists(saved):
        raise StoreError(f"{path} has no saved catalog to repair from: one is kept from "
                         "the store's first snapshot on")
    fd = lock(path)
    staging = os.path.join(path, STAGING)
    try:
        tag, known, txnid, report = _stage(path, marker, saved, staging, fd, progress)
        live = os.path.join(path, CATALOG_DIR)
        orphans = orphan_slabs(path, known)
        interrupted = note if note is not None and not os.path.exists(live) else None
        damaged = _unused(f"{live}.damaged-{time.strftime('%Y%m%d-%H%M%S')}") \
            if os.path.exists(live) else None
        found = os.path.join(path, LOST_FOUND)
        moves = [(src, _unused(os.path.join(found, os.path.basename(src)))) for src in orphans]
        if interrupted is not None:  # what the interrupted run did before the kill
            damaged = damaged or interrupted["damaged"]
        set_aside = [p for p in (interrupted or {}).get("set_aside", []) if os.path.exists(p)]
        set_aside += [dst for _, dst in moves]
        write_json(path, NOTE, {"snapshot": tag, "damaged": damaged, "set_aside": set_aside,
                           "txnid": txnid})
        if os.path.exists(live):
            os.rename(live, damaged)  # type: ignore[arg-type]
            fsync_dir(path)
        for src, dst in moves:
            os.makedirs(found, exist_ok=True)
            os.rename(src, dst)
        if moves:
            fsync_dir(os.path.dirname(orphans[0]))
            fsync_dir(found)
        os.rename(staging, live)  # the commit point
        fsync_dir(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # only there if it was not committed
        os.close(fd)
    return RepairReport(tag, damaged, set_aside, report)


def _stage(path: str, marker: dict[str, Any], saved: str, staging: str, fd: int,
           progress: Callable[[int], None] | None) -> tuple[str, set[int], int, FsckReport]:
    """Make the repaired catalog at ``staging``: the saved copy with its latest snapshot
    restored, every version verified. Returns the snapshot's tag, the segments the catalog
    names, its last commit's id and the verification. The store itself is not touched."""
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    shutil.copyfile(saved, os.path.join(staging, DATA_FILE))
    try:
        cat = Catalog(staging, deep=True, label=saved, hint=_UNUSABLE)
    except StoreError as e:
        raise StoreError(f"cannot repair {path}: the saved {e}") from None
    with contextlib.ExitStack() as held:
        held.callback(cat.close)
        try:
            check_identity(path, marker, cat)
            with cat.read() as txn:
                known = {s for s, *_ in cat.segments(txn)}
            lock_fd = os.dup(fd)  # the store closes it; the repair keeps the lock
            try:
                st = assemble(path, marker, cat, lock_fd, may_make_pool=False)
            except BaseException:
                os.close(lock_fd)
                raise
            held.pop_all()  # the store closes the catalog now
            with st:
                snaps = st.snapshots()
                if not snaps:
                    raise StoreError(f"the saved catalog {saved} lists no snapshot; {_UNUSABLE}")
                tag = max(snaps, key=lambda s: s.created).tag
                st.restore(tag)
                report = st.fsck(progress, set_aside=orphan_slabs(path, known))
        except CatalogError as e:
            raise StoreError(f"cannot repair {path}: the saved {e}") from None
        except (ValueError, TypeError, KeyError, struct.error) as e:  # garbage records
            raise StoreError(f"cannot repair {path}: the saved catalog {saved} holds "
                             f"records that cannot be read ({e}); {_UNUSABLE}") from None
    if not report.ok:
        raise StoreError(f"cannot repair {path}: snapshot {tag!r} of the saved catalog {saved} "
                         f"does not verify ({len(report.problems)} problem(s), the first: "
                         f"{report.problems[0]}); {_UNUSABLE}")
    fsync_dir(staging)
    return tag, known, _commit_id(staging), report


def _commit_id(catalog: str) -> int | None:
    """The id of the last commit of the catalog at ``catalog`` (None if it cannot be read)."""
    try:
        fd = os.open(os.path.join(catalog, DATA_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        metas = lmdb_file.read_metas(fd)
        return lmdb_file.current(metas).txnid if metas else None
    finally:
        os.close(fd)


def _unused(where: str) -> str:
    """``where``, or ``where-N`` with the first N that names nothing yet."""
    n, out = 1, where
    while os.path.lexists(out):
        out, n = f"{where}-{n}", n + 1
    return out


def _read_note(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, NOTE)) as f:
            note = json.load(f)
    except (OSError, ValueError):
        return None
    keys = {"snapshot": str, "damaged": (str, type(None)), "set_aside": list, "txnid": int}
    if not isinstance(note, dict) or not all(isinstance(note.get(k), t) for k, t in keys.items()):
        return None  # not one a repair wrote: as if there were none
    return note
