"""The Store API against a plain dict, by hypothesis' stateful testing.

Random sequences of put, put_many, delete, get, get_many, flush, snapshot, restore,
drop_snapshot, tick and reopen run on a small store (both backings, host cache on and off);
after every step every entry reads back as the model says, ``keys()`` is the model's keys,
missing entries raise EntryNotFoundError, and the snapshot list matches. A ``race`` rule
runs a delete or put of one entry in one thread against a flush, a snapshot or an
eviction-forcing read of other entries in another, then checks that the outcome is the one
a serial order would give: a delete that returned stays deleted, a put that returned is not
overwritten by an older write-back. Every example ends with a clean fsck.

CI runs a fixed, small number of examples (derandomized, so a failure reproduces); set
``TIERSTORE_HYPOTHESIS_EXAMPLES`` to run more per backing and cache mode, and
``TIERSTORE_HYPOTHESIS_STEPS`` for longer sequences.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import tierstore

EXAMPLES = int(os.environ.get("TIERSTORE_HYPOTHESIS_EXAMPLES", "40"))
STEPS = int(os.environ.get("TIERSTORE_HYPOTHESIS_STEPS", "30"))

Key = tuple[str, str]
# Few names and two kinds, so rules keep hitting the same entries: overwrites, deletes of
# cached entries, puts of deleted ones. Same names under both kinds share a name prefix.
NAMES = ("layers.0.experts.0.w1", "layers.0.experts.1.w1", "layers.1.experts.0.w2")
KINDS = ("param", "exp_avg")
KEYS: tuple[Key, ...] = tuple(itertools.product(NAMES, KINDS))
TAGS = ("s0", "s1", "s2")
DTYPES = (torch.float32, torch.bfloat16, torch.int8)
MAX_BYTES = 100 * 1024
# Room for two entries of 64 KiB or one of the largest (a 128 KiB slot): most reads and puts
# evict, and evicting a dirty entry writes it back, racing whatever else runs.
HOST_CACHE = "128KiB"

Spec = tuple[torch.dtype, tuple[int, ...]]


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    """dtype and shape of a tensor of 0 bytes to ~100 KiB; odd sizes included."""
    dtype = draw(st.sampled_from(DTYPES))
    # Mostly tens of KiB, so the small cache fills; the edges (empty, one byte, a page and
    # one byte more) now and then.
    nbytes = draw(st.one_of(
        st.integers(8 * 1024, MAX_BYTES),
        st.sampled_from([0, 1, 4096, 4097, MAX_BYTES]),
        st.integers(0, MAX_BYTES)))
    numel = nbytes // dtype.itemsize
    layout = draw(st.sampled_from(["flat", "matrix", "scalar"]))
    if layout == "scalar":
        return dtype, ()
    if layout == "matrix":
        return dtype, (4, numel // 4)
    return dtype, (numel,)


def make_tensor(spec: Spec, stamp: int) -> torch.Tensor:
    """Contents derived from ``stamp``, which each put draws fresh: an older version read
    back where a newer is due differs from it. Small integers, exact in every dtype."""
    dtype, shape = spec
    n = math.prod(shape)
    base = (torch.arange(n, dtype=torch.int64) * 7 + stamp) % 241 - 120
    return base.to(dtype).reshape(shape)


def show(t: torch.Tensor | None) -> str:
    if t is None:
        return "absent"
    first = t.flatten()[0].item() if t.numel() else "-"
    return f"{t.dtype} {tuple(t.shape)} first={first}"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


class StoreMachine(RuleBasedStateMachine):
    """One store, its model (``model``: key -> tensor) and the snapshots' models
    (``snaps``: tag -> key -> the values it may hold; one, unless a race left it open
    whether the snapshot saw a write)."""

    def __init__(self, backing: str, cached: bool, root: Path, serial: Callable[[], int]) -> None:
        super().__init__()
        self.backing = backing
        self.cached = cached
        self.dir = root / f"ex{serial()}"
        self.dir.mkdir()
        self.path = self.dir / "store"
        self.model: dict[Key, torch.Tensor] = {}
        self.snaps: dict[str, dict[Key, list[torch.Tensor | None]]] = {}
        self.stamps = itertools.count(1)
        self.race_tags = itertools.count()
        self.last_version = 0
        opts: dict[str, Any] = {"backing": backing}
        if backing == "nvme":
            opts["slab_size"] = "4MiB"
        else:
            opts |= {"pmem_path": str(self.dir / "pool"), "pmem_size": "8MiB"}
        self.store = self._open(create=True, **opts)

    def _open(self, **kw: Any) -> tierstore.Store:
        # Small chunks: most entries span several, written and verified in parallel.
        return tierstore.open(self.path, chunk_size="16KiB", io_threads=2,
                              host_cache=HOST_CACHE if self.cached else 0, **kw)

    def teardown(self) -> None:
        try:
            try:
                report = self.store.fsck()
            except tierstore.StoreClosedError:
                return  # a reopen failed: its error is the one reported
            assert report.ok, report.problems
        finally:
            with contextlib.suppress(tierstore.StoreError):
                self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------
    def _tensor(self, spec: Spec) -> torch.Tensor:
        return make_tensor(spec, next(self.stamps))

    def _check_version(self, version: int) -> None:
        # Versions order writes to one entry (the newest commit wins), so they must grow.
        assert version > self.last_version, (version, self.last_version)
        self.last_version = version

    def _check_entry(self, key: Key, want: torch.Tensor | None) -> None:
        name, kind = key
        if want is None:
            assert key not in self.store, f"{key} should be absent"
            with pytest.raises(tierstore.EntryNotFoundError):
                self.store.get(name, kind)
            with pytest.raises(tierstore.EntryNotFoundError):
                self.store.info(name, kind)
            return
        got = self.store.get(name, kind)
        assert same(got, want), f"{key}: read {show(got)}, expected {show(want)}"

    def _snapshot_model(self) -> dict[Key, list[torch.Tensor | None]]:
        return {key: [self.model.get(key)] for key in KEYS}

    # -- writes ------------------------------------------------------------------
    @rule(key=st.sampled_from(KEYS), spec=specs(), kind_arg=st.booleans())
    def put(self, key: Key, spec: Spec, kind_arg: bool) -> None:
        name, kind = key
        t = self._tensor(spec)
        if kind == "param" and not kind_arg:
            version = self.store.put(name, t)
        else:
            version = self.store.put(name, t, kind=kind)
        self._check_version(version)
        self.model[key] = t

    @rule(
        items=st.lists(st.tuples(st.sampled_from(KEYS), specs()), min_size=1, max_size=4,
                       unique_by=lambda item: item[0]),
        form=st.sampled_from(["triples", "pairs", "mapping"]),
    )
    def put_many(self, items: list[tuple[Key, Spec]], form: str) -> None:
        batch = [(key, self._tensor(spec)) for key, spec in items]
        kinds = {key[1] for key, _ in batch}
        if form != "triples" and len(kinds) == 1:
            (kind,) = kinds
            if form == "pairs":
                versions = self.store.put_many([(n, t) for (n, _), t in batch], kind=kind)
            else:
                versions = self.store.put_many({n: t for (n, _), t in batch}, kind=kind)
        else:
            versions = self.store.put_many([(n, k, t) for (n, k), t in batch])
        assert len(versions) == len(batch)
        for v in versions:
            self._check_version(v)
        self.model.update(batch)

    @rule(key=st.sampled_from(KEYS), missing_ok=st.booleans())
    def delete(self, key: Key, missing_ok: bool) -> None:
        name, kind = key
        if key in self.model:
            assert self.store.delete(name, kind, missing_ok=missing_ok) is True
            del self.model[key]
        elif missing_ok:
            assert self.store.delete(name, kind, missing_ok=True) is False
        else:
            with pytest.raises(tierstore.EntryNotFoundError):
                self.store.delete(name, kind)

    # -- reads -------------------------------------------------------------------
    @rule(key=st.sampled_from(KEYS), into=st.booleans())
    def get(self, key: Key, into: bool) -> None:
        name, kind = key
        want = self.model.get(key)
        if want is None:
            with pytest.raises(tierstore.EntryNotFoundError):
                self.store.get(name, kind)
            return
        if into:
            out = torch.full_like(want, 99)
            got = self.store.get(name, kind, out=out)
            assert same(out, want), f"{key}: out= holds {show(out)}, expected {show(want)}"
        else:
            got = self.store.get(name, kind)
        assert same(got, want), f"{key}: read {show(got)}, expected {show(want)}"

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6), by_name=st.booleans())
    def get_many(self, keys: list[Key], by_name: bool) -> None:
        # Names alone ask for kind "param"; the others go as (name, kind).
        asked: list[str | Key] = [n if by_name and k == "param" else (n, k) for n, k in keys]
        if any(key not in self.model for key in keys):
            with pytest.raises(tierstore.EntryNotFoundError):
                self.store.get_many(asked)
            return
        got = self.store.get_many(asked)
        assert set(got) == set(asked)
        for a, key in zip(asked, keys):
            assert same(got[a], self.model[key]), (
                f"{key}: read {show(got[a])}, expected {show(self.model[key])}")

    @rule(steps=st.integers(1, 3), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def tick(self, steps: int, keys: list[Key]) -> None:
        # The policy's clock moves between reads, so what it keeps and evicts changes.
        for i in range(steps):
            self.store.tick()
            for key in keys[i::steps]:
                if key in self.model:
                    self._check_entry(key, self.model[key])

    # -- durability and snapshots ------------------------------------------------
    @rule()
    def flush(self) -> None:
        self.store.flush()
        for key in self.model:
            assert self.store.info(*key).tier == self.backing, f"{key} not written back"

    @rule()
    def reopen(self) -> None:
        self.store.close()
        with pytest.raises(tierstore.StoreClosedError):
            self.store.get(*KEYS[0])
        self.store = self._open()
        self.last_version = 0  # a new session; the committed versions still bound new ones

    @rule(tag=st.sampled_from(TAGS))
    def snapshot(self, tag: str) -> None:
        if tag in self.snaps:
            with pytest.raises(tierstore.SnapshotError):
                self.store.snapshot(tag)
            return
        info = self.store.snapshot(tag)
        assert (info.tag, info.entries) == (tag, len(self.model))
        assert info.nbytes == sum(t.nbytes for t in self.model.values())
        self.snaps[tag] = self._snapshot_model()

    def _any_tag(self) -> st.SearchStrategy[str]:
        return st.sampled_from(sorted(set(TAGS) | set(self.snaps)))

    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        tag = data.draw(self._any_tag(), label="tag")
        if tag not in self.snaps:
            with pytest.raises(tierstore.SnapshotError):
                self.store.restore(tag)
            return
        self.store.restore(tag)
        # Where a race left open what the snapshot saw, the store says, within the choices.
        saved = self.snaps[tag]
        for key, choices in saved.items():
            if len(choices) > 1:
                present = key in self.store
                got = self.store.get(*key) if present else None
                match = [c for c in choices if (c is None) == (got is None)
                         and (got is None or same(got, c))]
                assert match, f"{key} restored as {show(got)}, not one of " + ", ".join(
                    show(c) for c in choices)
                saved[key] = [match[0]]
        self.model = {key: c[0] for key, c in saved.items() if c[0] is not None}

    @rule(data=st.data())
    def drop_snapshot(self, data: st.DataObject) -> None:
        tag = data.draw(self._any_tag(), label="tag")
        if tag not in self.snaps:
            with pytest.raises(tierstore.SnapshotError):
                self.store.drop_snapshot(tag)
            return
        self.store.drop_snapshot(tag)
        del self.snaps[tag]

    # -- races -------------------------------------------------------------------
    @rule(
        key=st.sampled_from(KEYS),
        write=st.sampled_from(["delete", "put"]),
        other=st.sampled_from(["flush", "snapshot", "evict"]),
        dirty=st.booleans(),
        spec=specs(),
    )
    def race(self, key: Key, write: str, other: str, dirty: bool, spec: Spec) -> None:
        """``write`` (delete or put of ``key``) and ``other`` start together in two threads.

        With ``dirty`` the key is first put again, so (host cache on) the other thread finds
        a dirty version to write back while the write runs. Either order of the two is a
        serial history, and in both the write shows afterwards: whatever the interleaving,
        nothing older than it may come back, not even after a further flush.
        """
        name, kind = key
        if dirty:
            self.put(key, spec, True)
        before = self.model.get(key)
        new = self._tensor(spec) if write == "put" else None
        others = [k for k in self.model if k != key]
        tag = f"race{next(self.race_tags)}" if other == "snapshot" else ""
        result: dict[str, Any] = {}
        errors: list[BaseException] = []
        gate = threading.Barrier(2)

        def do_write() -> None:
            try:
                gate.wait()
                if new is None:
                    result["write"] = self.store.delete(name, kind, missing_ok=True)
                else:
                    result["write"] = self.store.put(name, new, kind=kind)
            except BaseException as e:
                errors.append(e)

        def do_other() -> None:
            try:
                gate.wait()
                if other == "flush":
                    self.store.flush()
                elif other == "snapshot":
                    result["snapshot"] = self.store.snapshot(tag)
                else:
                    # Reading the other entries into the small cache evicts, and so writes
                    # back, the dirty version of ``key``.
                    for _ in range(2):
                        self.store.tick()
                        got = self.store.get_many(others)
                        for k in others:
                            assert same(got[k], self.model[k]), f"{k}: read {show(got[k])}"
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=do_write), threading.Thread(target=do_other)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads), "a racing thread hung"
        if errors:
            raise errors[0]

        if new is None:
            assert result["write"] is (before is not None), (
                f"delete of {key} returned {result['write']}, it was {show(before)}")
            self.model.pop(key, None)
        else:
            self._check_version(result["write"])
            self.model[key] = new
        if other == "snapshot":
            snap = self._snapshot_model()
            snap[key] = [before, new]  # taken before or after the write: either is serial
            info = result["snapshot"]
            counts = {len(self.model) - (new is not None) + (c is not None) for c in snap[key]}
            assert info.entries in counts, (info.entries, counts)
            self.snaps[tag] = snap
        # The write must hold now, and after everything dirty has been written back.
        self._check_entry(key, self.model.get(key))
        self.store.flush()
        self._check_entry(key, self.model.get(key))

    # -- invariants --------------------------------------------------------------
    @invariant()
    def matches_model(self) -> None:
        assert self.store.keys() == sorted(self.model), (self.store.keys(), sorted(self.model))
        for key in KEYS:
            self._check_entry(key, self.model.get(key))
        assert sorted(s.tag for s in self.store.snapshots()) == sorted(self.snaps)


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "nocache"])
def test_store_matches_a_dict(backing: str, cached: bool, tmp_path: Path) -> None:
    serial = itertools.count().__next__
    run_state_machine_as_test(
        lambda: StoreMachine(backing, cached, tmp_path, serial),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,
            database=None,
            # Each example opens a store and runs threads: slow by hypothesis' measure.
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            print_blob=False,
        ),
    )
