"""A snapshot and the catalog copy it saves beside the store are one unit.

The copy goes to the store's directory wherever it has been moved while the store is open
(the catalog holds a descriptor on it), in-process and under a running daemon; a snapshot
whose copy cannot be saved is not taken (one line, the store and the previous copy as they
were); a drop whose copy cannot be refreshed says so in one line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from test_daemon import Daemon
from test_store_catalog_loss import lose_garbage, t

import tierstore
from tierstore.snapshots import CATALOG_COPY


def repaired_tags(path: Path) -> list[str]:
    """Lose the live catalog and repair from the saved copy: the snapshots it brings back."""
    lose_garbage(path)
    tierstore.repair_store(path)
    with tierstore.open(path) as st:
        assert st.fsck().ok
        return sorted(s.tag for s in st.snapshots())


def test_a_store_moved_while_open_keeps_its_snapshots_copy_beside_it(tmp_path: Path) -> None:
    old, new = tmp_path / "st", tmp_path / "moved"
    with tierstore.open(old, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
        st.snapshot("s1")
        os.rename(old, new)
        st.put("a", t(2.0))
        assert st.snapshot("s2").entries == 1
        st.drop_snapshot("s1")  # the copy beside the moved store is refreshed
        st.put("a", t(3.0))
    assert not old.exists()
    assert repaired_tags(new) == ["s2"]
    with tierstore.open(new) as st:
        assert torch.equal(st.get("a"), t(2.0))


def test_a_store_moved_while_open_makes_its_new_slabs_beside_it(tmp_path: Path) -> None:
    """A put that needs a new slab after the store was moved makes it in the moved store."""
    old, new = tmp_path / "st", tmp_path / "moved"
    big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: past the first 1 MiB slab
    with tierstore.open(old, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
        os.rename(old, new)
        st.put("b", big)
        st.snapshot("s1")
    assert not old.exists()
    assert len(list((new / "slabs").iterdir())) == 2
    with tierstore.open(new) as st:
        assert st.fsck().ok
        assert torch.equal(st.get("b"), big) and torch.equal(st.get("a"), t(1.0))


def test_a_store_moved_under_its_daemon_snapshots_with_its_copy(tmp_path: Path) -> None:
    store, moved = tmp_path / "store", tmp_path / "moved"
    with tierstore.open(store, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
    daemon = Daemon(store, tmp_path / "s.sock")
    try:
        os.rename(store, moved)
        with tierstore.connect(daemon.sock) as st:
            st.put("a", t(2.0))
            assert st.snapshot("s1").entries == 1
            st.put("a", t(3.0))
    finally:
        assert daemon.terminate() == 0, daemon.log.read_text()
    assert "Traceback" not in daemon.log.read_text()
    assert not store.exists()
    assert repaired_tags(moved) == ["s1"]
    with tierstore.open(moved) as st:
        assert torch.equal(st.get("a"), t(2.0))


def test_a_snapshot_whose_copy_cannot_be_saved_is_not_taken(tmp_path: Path) -> None:
    path = tmp_path / "st"
    with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
        st.snapshot("s1")
        saved = (path / CATALOG_COPY).read_bytes()
        st.put("a", t(2.0))
        # Something in the way of the copy's temporary file: the copy fails for real.
        (path / (CATALOG_COPY + ".tmp")).mkdir()
        with pytest.raises(tierstore.StoreError) as e:
            st.snapshot("s2")
        assert str(e.value).startswith("snapshot 's2' was not taken: cannot save a copy")
        assert "\n" not in str(e.value)
        assert [s.tag for s in st.snapshots()] == ["s1"]
        assert (path / CATALOG_COPY).read_bytes() == saved
        assert st.fsck().ok
        with pytest.raises(tierstore.StoreError, match="was dropped, but the saved catalog"):
            st.drop_snapshot("s1")
        assert st.snapshots() == []
        (path / (CATALOG_COPY + ".tmp")).rmdir()
        st.snapshot("s2")  # once the way is clear, as ever
        assert torch.equal(st.get("a"), t(2.0))
        assert st.fsck().ok
    shutil.copytree(path, tmp_path / "again")
    assert repaired_tags(tmp_path / "again") == ["s2"]
