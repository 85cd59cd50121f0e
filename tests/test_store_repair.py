"""``tierstore fsck --repair`` is all or nothing, and a rerun finishes it.

A SIGKILL at any instant of a repair, followed by a rerun, leaves the latest snapshot's
state, verified: the campaign kills a real repair process just before each of its steps
(every rename, fsync, copy and catalog commit, and just after each commit), and at random
instants, then reruns it. A saved catalog that cannot be used (garbage pages, cut short,
another store's, no snapshot, data that does not verify) is refused with one line naming
it, and nothing in the store changes.

``TIERSTORE_REPAIR_KILLS`` sets the number of random-instant kills (default 12; reruns
are killed at random too in every other one).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from test_store_catalog_loss import cli, fill, lose_garbage, lose_removed, one_line_error, t

import tierstore

KILLS = int(os.environ.get("TIERSTORE_REPAIR_KILLS", "12"))
HELPER = Path(__file__).with_name("repair_child.py")

Repair = Callable[[Path, int, float], str]


@pytest.fixture(scope="module")
def repair() -> Iterator[Repair]:
    """``repair(store, step, delay)``: one repair in a process of its own, SIGKILLed
    before its ``step``-th step or ``delay`` seconds in (see tests/repair_child.py)."""
    proc = subprocess.Popen([sys.executable, str(HELPER)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def run(store: Path, step: int = 0, delay: float = -1) -> str:
        proc.stdin.write(f"{store} {step} {delay}\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        return proc.stdout.readline().strip()  # type: ignore[union-attr]

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


def make_damaged(root: Path, lose: Callable[[Path], None]) -> Path:
    """The catalog-loss tests' store (see ``fill``), its catalog then lost."""
    path = fill(root / "st")
    lose(path)
    return path


def assert_repaired(path: Path, lost_catalog: bool) -> None:
    """The snapshot's state, verified; what the repair replaced set aside once."""
    with tierstore.open(path) as st:
        assert sorted(st.keys()) == [("a", "param"), ("b", "exp_avg")]
        assert torch.equal(st.get("a"), t(1.0))
        assert torch.equal(st.get("b", "exp_avg"), t(2.0))
        assert [s.tag for s in st.snapshots()] == ["s1"]
        assert st.fsck().ok
    assert sorted(os.listdir(path / "lost+found")) == ["slab-000001.dat"]
    assert not (path / "catalog.repair").exists()
    kept = [p for p in os.listdir(path) if p.startswith("catalog.damaged-")]
    assert len(kept) == (0 if lost_catalog else 1), kept


def finish(repair: Repair, path: Path, rng: random.Random | None = None,
           longest: float = 0.0) -> None:
    """Rerun the repair until one finishes (killed at random instants while ``rng``
    says so); it must never fail."""
    for _ in range(20):
        delay = rng.uniform(0, longest) if rng is not None and rng.random() < 0.5 else -1
        said = repair(path, 0, delay)
        if said.startswith("ok"):
            return
        assert said == "killed", said
    raise AssertionError("the repair never finished")


LOSSES = [(lose_garbage, False), (lose_removed, True)]


def test_a_repair_killed_before_each_of_its_steps_is_finished_by_a_rerun(
        tmp_path: Path, repair: Repair) -> None:
    # The catalog overwritten, not removed: the repair then also moves it aside, so its
    # run has every step a repair takes (the random campaign covers both).
    template = make_damaged(tmp_path / "template", lose_garbage)
    work = tmp_path / "work"
    shutil.copytree(template, work)
    said = repair(work, 0, -1).split()  # one whole run: how many steps it takes
    assert said[0] == "ok", said
    steps = int(said[1])
    assert steps >= 10  # the instrumentation sees the repair's steps
    assert_repaired(work, lost_catalog=False)
    for step in range(1, steps + 1):
        shutil.rmtree(work)
        shutil.copytree(template, work)
        assert repair(work, step, -1) == "killed", step
        finish(repair, work)
        assert_repaired(work, lost_catalog=False)


def test_a_repair_killed_at_random_instants_is_finished_by_a_rerun(
        tmp_path: Path, repair: Repair) -> None:
    rng = random.Random(44)
    templates = {lose: make_damaged(tmp_path / lose.__name__, lose) for lose, _ in LOSSES}
    work = tmp_path / "work"
    shutil.copytree(templates[lose_removed], work)
    said = repair(work, 0, -1).split()
    assert said[0] == "ok", said
    longest = 1.5 * float(said[2])
    for n in range(KILLS):
        lose, lost = LOSSES[n % 2]
        shutil.rmtree(work)
        shutil.copytree(templates[lose], work)
        said = repair(work, 0, rng.uniform(0, longest))
        assert said == "killed" or said.startswith("ok"), said
        finish(repair, work, rng if n % 2 else None, longest)
        assert_repaired(work, lost)


def test_a_rerun_after_a_finished_repair_verifies_again_until_the_store_changes(
        tmp_path: Path) -> None:
    path = make_damaged(tmp_path, lose_garbage)
    first = tierstore.repair_store(path)
    again = tierstore.repair_store(path)  # as if the first's output was lost
    assert again.check.ok and again.check.entries == first.check.entries
    assert (again.snapshot, again.set_aside) == (first.snapshot, first.set_aside)
    assert_repaired(path, lost_catalog=False)
    with tierstore.open(path, host_cache=0) as st:
        st.put("d", t(5.0))
    with pytest.raises(tierstore.StoreError, match="sound: nothing to repair"):
        tierstore.repair_store(path)


# -- saved copies that cannot be used --------------------------------------------------------

def digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the lock, by content (the catalog included)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in ("LOCK",
                                                                                "lock.mdb")}


def garbage_pages(copy: Path) -> None:
    raw = bytearray(copy.read_bytes())
    raw[2 * 4096:] = os.urandom(len(raw) - 2 * 4096)  # the meta pages kept, the rest garbage
    copy.write_bytes(bytes(raw))


def one_garbage_page(copy: Path) -> None:
    raw = bytearray(copy.read_bytes())
    middle = len(raw) // 4096 // 2
    raw[middle * 4096:(middle + 1) * 4096] = os.urandom(4096)
    copy.write_bytes(bytes(raw))


def garbled_record(copy: Path) -> None:
    """Pages whole, a record's bytes not: the snapshot's record of ``a`` loses its shape."""
    raw = copy.read_bytes()
    at = raw.index(b'"shape":[')
    copy.write_bytes(raw[:at] + b'"shape":{' + raw[at + 9:])


def cut_short(copy: Path) -> None:
    os.truncate(copy, 3 * 4096)


def emptied(copy: Path) -> None:
    os.truncate(copy, 0)


def anothers(copy: Path) -> None:
    other = copy.parent.parent / "other"
    with tierstore.open(other, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("x", t(9.0))
        st.snapshot("s9")
    shutil.copyfile(other / "catalog-snapshot.mdb", copy)


def slab_damaged(copy: Path) -> None:
    slab = copy.parent / "slabs" / "slab-000000.dat"
    with open(slab, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)


SPOILS = [garbage_pages, one_garbage_page, garbled_record, cut_short, emptied, anothers,
          slab_damaged]


@pytest.mark.parametrize("spoil", SPOILS, ids=lambda f: f.__name__)
def test_a_saved_catalog_that_cannot_be_used_changes_nothing(tmp_path: Path, spoil) -> None:
    path = make_damaged(tmp_path, lose_garbage)
    spoil(path / "catalog-snapshot.mdb")
    before = digest(path)
    if spoil is garbage_pages:  # the command line: one line, exit 2
        line = one_line_error(cli("fsck", "--repair", str(path)), "cannot repair")
    else:
        with pytest.raises(tierstore.StoreError, match="cannot repair") as e:
            tierstore.repair_store(path)
        line = str(e.value)
        assert "\n" not in line
    named = "slab-000000.dat" if spoil is slab_damaged else "catalog-snapshot.mdb"
    assert named in line and "nothing was changed" in line, line
    assert str(path / "catalog" / "data.mdb") not in line  # the live catalog is not to blame
    assert digest(path) == before
    assert sorted(os.listdir(path)) == sorted(["TIERSTORE", "LOCK", "catalog", "slabs",
                                               "catalog-snapshot.mdb"])
