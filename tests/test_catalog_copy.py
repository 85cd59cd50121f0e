"""The catalog's copy (what ``fsck --repair`` comes back to): it is the catalog as the
commit that asked for it left it, later commits go on while it is made, and a copy of an
older commit never replaces a newer one."""

from __future__ import annotations

import threading

import lmdb

from tierstore.catalog import Catalog


def _keys(path: str) -> list[bytes]:
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=len(Catalog.DBS))
    try:
        with env.begin() as txn:
            return [k for k, _ in txn.cursor(db=env.open_db(b"meta", txn=txn))]
    finally:
        env.close()


def _put(cat: Catalog, key: str, **kw) -> None:
    cat.write(lambda txn: cat.put_meta(txn, key, 1), **kw)


def test_a_copy_is_of_the_commit_that_asked_for_it(tmp_path) -> None:
    cat = Catalog(str(tmp_path / "cat"), create=True)
    dest = str(tmp_path / "copy.mdb")
    _put(cat, "a")
    with cat.read() as seen:  # as `write(..., copy_to=)` holds one across the lock's release
        _put(cat, "b")  # a commit made while the copy is pending
        cat.copy_to(dest, seen)
    assert b"a" in _keys(dest) and b"b" not in _keys(dest)
    _put(cat, "c", copy_to=dest)
    assert {b"a", b"b", b"c"} <= set(_keys(dest))
    cat.close()


def test_an_older_commits_copy_never_replaces_a_newer_one(tmp_path) -> None:
    cat = Catalog(str(tmp_path / "cat"), create=True)
    dest = str(tmp_path / "copy.mdb")
    _put(cat, "a")
    with cat.read() as older:
        _put(cat, "b", copy_to=dest)  # the newer commit's copy lands first
        cat.copy_to(dest, older)  # the older one, later: skipped
    assert {b"a", b"b"} <= set(_keys(dest))
    cat.close()


def test_commits_go_on_while_a_copy_is_made(tmp_path) -> None:
    cat = Catalog(str(tmp_path / "cat"), create=True)
    dest = str(tmp_path / "copy.mdb")
    for i in range(2000):  # a catalog worth copying
        _put(cat, f"k{i}")
    copying, may_finish = threading.Event(), threading.Event()
    real = cat.copy_to

    def held_copy(d: str, txn=None) -> None:
        copying.set()
        assert may_finish.wait(60)
        real(d, txn)

    cat.copy_to = held_copy  # type: ignore[method-assign]
    t = threading.Thread(target=_put, args=(cat, "snap"), kwargs={"copy_to": dest})
    t.start()
    assert copying.wait(60)
    # A commit while the copy is held: it would wait for the copy (here, for ever) if the
    # commit lock were still held.
    during = threading.Thread(target=_put, args=(cat, "during"))
    during.start()
    during.join(60)
    committed_while_copying = not during.is_alive()
    may_finish.set()
    t.join(60)
    during.join(60)
    assert committed_while_copying
    keys = set(_keys(dest))
    assert b"snap" in keys and b"during" not in keys
    cat.close()
