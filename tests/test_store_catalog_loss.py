"""A store whose catalog is lost, emptied, truncated, overwritten or swapped is refused with
one clear line and left untouched (never opened as an empty store, never a SIGBUS), fsck
reports it, and ``tierstore fsck --repair`` brings it back to its latest snapshot. Slab data
no catalog names is never reused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore.errors import CatalogError

CLI = [sys.executable, "-m", "tierstore.cli"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed CLI in a process of its own (so a signal would show as one)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Assert the CLI failed as a user's mistake should: exit 2, one `tierstore:` line."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tierstore: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the catalog and the lock, by content."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_file() and not rel.startswith("catalog") and rel != "LOCK":
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def t(x: float, n: int = 50_000) -> torch.Tensor:
    return torch.full((n,), x)


def fill(path: Path) -> Path:
    """``a`` and ``b`` in snapshot s1, then a later ``a`` and a ``c`` in a slab of its own."""
    with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
        st.put("b", t(2.0), kind="exp_avg")
        st.snapshot("s1")
        st.put("a", t(3.0))
        st.put("c", t(4.0, 400_000))  # needs a slab of its own: made after the snapshot
    return path


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    return fill(tmp_path / "st")


def lose_removed(p: Path) -> None:
    shutil.rmtree(p / "catalog")


def lose_emptied(p: Path) -> None:
    os.truncate(p / "catalog" / "data.mdb", 0)


def lose_truncated(p: Path) -> None:
    os.truncate(p / "catalog" / "data.mdb", 8192)


def lose_garbage(p: Path) -> None:
    size = (p / "catalog" / "data.mdb").stat().st_size
    (p / "catalog" / "data.mdb").write_bytes(os.urandom(size))


def lose_swapped(p: Path) -> None:
    other = p.parent / "other"
    with tierstore.open(other, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("x", t(9.0))
    shutil.rmtree(p / "catalog")
    shutil.copytree(other / "catalog", p / "catalog")


LOSSES = [lose_removed, lose_emptied, lose_truncated, lose_garbage, lose_swapped]


@pytest.mark.parametrize("lose", LOSSES, ids=lambda f: f.__name__)
def test_a_lost_catalog_is_refused_and_nothing_is_touched(filled: Path, lose) -> None:
    lose(filled)
    before = digest(filled)
    with pytest.raises(CatalogError, match="repair"):
        tierstore.open(filled)
    with pytest.raises(CatalogError):
        tierstore.open(filled, create=True)  # create= never makes a new catalog over data
    one_line_error(cli("info", str(filled)), "catalog")  # never a signal, never a traceback
    r = cli("fsck", str(filled))
    assert r.returncode == 1 and "PROBLEM" in r.stdout and "catalog" in r.stdout, r
    assert digest(filled) == before


@pytest.mark.parametrize("lose", LOSSES, ids=lambda f: f.__name__)
def test_repair_brings_the_store_back_to_its_latest_snapshot(filled: Path, lose) -> None:
    lose(filled)
    r = cli("fsck", "--repair", str(filled))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "restored snapshot 's1'" in r.stdout
    with tierstore.open(filled) as st:
        assert sorted(st.keys()) == [("a", "param"), ("b", "exp_avg")]
        assert torch.equal(st.get("a"), t(1.0))
        assert torch.equal(st.get("b", "exp_avg"), t(2.0))
        assert [s.tag for s in st.snapshots()] == ["s1"]
        st.put("d", t(5.0, 400_000))  # the store grows again past the slabs set aside
        report = st.fsck()
    assert report.ok, report.problems
    assert any("lost+found" in n for n in report.notes)
    assert list((filled / "lost+found").iterdir()), "the later slab was deleted, not set aside"
    assert cli("fsck", str(filled)).returncode == 0


def test_repair_refuses_a_sound_store_and_one_without_a_saved_catalog(tmp_path: Path) -> None:
    path = tmp_path / "st"
    with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
    one_line_error(cli("fsck", "--repair", str(path)), "sound")
    lose_removed(path)
    one_line_error(cli("fsck", "--repair", str(path)), "snapshot")


def test_dropping_a_snapshot_refreshes_the_saved_catalog(tmp_path: Path) -> None:
    path = tmp_path / "st"
    with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
        st.snapshot("s1")
        st.put("a", t(2.0))
        st.snapshot("s2")
        st.drop_snapshot("s2")  # s2's space may now be reused: the copy must not list it
        st.put("a", t(3.0))
    lose_emptied(path)
    assert cli("fsck", "--repair", str(path)).returncode == 0
    with tierstore.open(path) as st:
        assert [s.tag for s in st.snapshots()] == ["s1"]
        assert torch.equal(st.get("a"), t(1.0))


def test_slab_data_no_catalog_names_is_reported_and_never_reused(tmp_path: Path) -> None:
    path = tmp_path / "st"
    with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
    stray = path / "slabs" / "slab-000001.dat"  # the name the store's next slab would get
    stray.write_bytes(b"somebody's data" * 70_000)
    before = stray.read_bytes()
    r = cli("fsck", str(path))
    assert r.returncode == 1 and str(stray) in r.stdout, r.stdout
    with tierstore.open(path, host_cache=0) as st, \
            pytest.raises(tierstore.StoreError, match="slab-000001.dat"):
        st.put("big", t(5.0, 400_000))  # needs a new slab
    assert stray.read_bytes() == before
    # a slab a crash left before its commit was never written: noted, and reused
    stray.unlink()
    with open(stray, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
    r = cli("fsck", str(path))
    assert r.returncode == 0 and "never written" in r.stdout, r.stdout
    with tierstore.open(path, host_cache=0) as st:
        st.put("big", t(5.0, 400_000))
        assert st.fsck().ok


def test_a_store_made_before_identities_gets_one(tmp_path: Path) -> None:
    path = tmp_path / "st"
    with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
        st._catalog.write(lambda txn: txn.delete(b"store_id", db=st._catalog.db["meta"]))
    marker = json.loads((path / "TIERSTORE").read_text())
    del marker["store_id"]
    (path / "TIERSTORE").write_text(json.dumps(marker))
    with tierstore.open(path) as st:
        assert torch.equal(st.get("a"), t(1.0))
    assert "store_id" in json.loads((path / "TIERSTORE").read_text())
    with tierstore.open(path) as st:
        assert st.fsck().ok
