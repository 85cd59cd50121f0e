"""``tierstore fsck --repair``: a store whose live catalog is lost or damaged, back to its
latest snapshot.

Every snapshot leaves a copy of the catalog beside it (``catalog-snapshot.mdb``, refreshed
when a snapshot is dropped), and the space a snapshot references is never reused while the
snapshot exists. So that copy plus the backing tier hold the latest snapshot whole. A repair:

1. refuses unless the live catalog really fails to open (a sound store is rolled back with
   ``tierstore restore``, never by a repair);
2. checks that the copy is this store's (the same identity as the marker);
3. moves the damaged catalog aside (``catalog.damaged-<time>``), never deleting it, and puts
   a fresh copy of the saved one in its place;
4. moves slab files the restored catalog does not name (made after the snapshot) into
   ``lost+found/``;
5. restores the latest snapshot and verifies every stored version against its checksums.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierstore.nvme import fsync_dir, orphan_slabs

from .catalog import Catalog
from .errors import CatalogError, StoreError
from .fsck import LOST_FOUND
from .interface import FsckReport
from .opening import CATALOG_DIR, check_identity, lock, open_store, read_marker
from .snapshots import CATALOG_COPY


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
    saved = os.path.join(path, CATALOG_COPY)
    try:
        with open_store(path, host_cache=0):
            pass
    except CatalogError:
        pass  # the case a repair is for
    else:
        raise StoreError(f"the catalog of {path} is sound: nothing to repair (`tierstore "
                         "restore STORE TAG` goes back to a snapshot)")
    if not os.path.exists(saved):
        raise StoreError(f"{path} has no saved catalog to repair from: one is kept from "
                         "the store's first snapshot on")
    fd = lock(path)
    try:
        staging = os.path.join(path, "catalog.repair")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        shutil.copyfile(saved, os.path.join(staging, "data.mdb"))
        cat = Catalog(staging)
        try:
            check_identity(path, marker, cat)
            with cat.read() as txn:
                snaps = [(bytes(k).decode(), raw) for k, raw in txn.cursor(db=cat.db["snapshots"])]
                known = {s for s, *_ in cat.segments(txn)}
            cat.env.sync(True)
        finally:
            cat.close()
        if not snaps:
            raise StoreError(f"the saved catalog {saved} lists no snapshot")
        live = os.path.join(path, CATALOG_DIR)
        damaged = None
        if os.path.exists(live):
            damaged = f"{live}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
            os.rename(live, damaged)
        os.rename(staging, live)
        fsync_dir(path)
        set_aside = _set_aside_orphans(path, known)
    finally:
        os.close(fd)
    with open_store(path, host_cache=0) as st:
        latest = max(st.snapshots(), key=lambda s: s.created)
        st.restore(latest.tag)
        report = st.fsck(progress)
    return RepairReport(latest.tag, damaged, set_aside, report)


def _set_aside_orphans(path: str, known: set[int]) -> list[str]:
    """Slab files no segment of the restored catalog names, moved into lost+found."""
    orphans = orphan_slabs(path, known)
    found = os.path.join(path, LOST_FOUND)
    moved = []
    for src in orphans:
        os.makedirs(found, exist_ok=True)
        moved.append(os.path.join(found, os.path.basename(src)))
        os.rename(src, moved[-1])
    if moved:
        fsync_dir(os.path.dirname(orphans[0]))
        fsync_dir(found)
    return moved
