"""The durability contract, tested with real processes.

- Crash: a child writes versions and acknowledges them only after ``flush()`` returns; it is
  SIGKILLed at random moments. After every kill the store opens, every entry reads without a
  CorruptEntryError and holds a version at least as new as the last acknowledged, and fsck
  is clean. Now and then a round also puts a wide batch (its commit built while its last
  requests are in flight): without a host cache, it is found whole or not at all.
- Crash while deletes and puts race flushes: one thread of the child puts and deletes while
  another flushes (and snapshots); an operation is acknowledged once a flush that started
  after it returned has returned. After every kill, every acknowledged delete stays deleted
  (unless a later put was issued), and every acknowledged put is there, or a later one, or
  a delete issued after it took effect; never anything older.
- Full disk: with RLIMIT_FSIZE below what a new slab / a grown pool needs, the put (no host
  cache) or the flush() that writes it back (host cache) raises StoreFullError; what was
  committed stays intact, a batch is all or nothing, and the store works once space is back.

The crash tests kill ``TIERSTORE_CRASH_KILLS`` children per backing when it is set; unset
(as in CI), 20 for the first and 4 for the second. A maintainer runs them longer with, e.g.,
``TIERSTORE_CRASH_KILLS=500 pytest tests/test_store_crash.py -k sigkill``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore

WRITER = Path(__file__).with_name("crash_writer.py")
_spec = importlib.util.spec_from_file_location("crash_writer", WRITER)
assert _spec is not None and _spec.loader is not None
crash_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_writer)


def _kills(ci: int) -> int:
    raw = os.environ.get("TIERSTORE_CRASH_KILLS", "").strip()
    return int(raw) if raw else ci


KILLS = _kills(20)
RACE_KILLS = _kills(4)  # few in CI: each kill costs a child's start, mostly importing torch
PRESTART = 2  # interpreters started ahead of time: importing torch is most of a child's cost
FIRST_ACK_TIMEOUT = 120.0


class Child:
    """A crash_writer process (``mode`` crash or race), the lines it printed and its stderr."""

    def __init__(self, store: str, seed: int, logdir: Path, mode: str = "crash") -> None:
        self.seed = seed
        self.log = logdir / f"child-{seed}.stderr"
        self._err = open(self.log, "w")  # noqa: SIM115  (closed in finish())
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER), mode, store, str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
        )
        self.lines: list[list[str]] = []  # split; "evictions" lines left out
        self.evictions = 0  # the most its host cache reported, if it had one
        self.first_ack = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)

    @property
    def wide(self) -> int:
        """The newest wide batch a crash child acknowledged (0: none)."""
        return max((int(w[1]) for w in self.lines if w[0] == "wide"), default=0)

    @property
    def acks(self) -> list[tuple[str, str, int]]:
        """A crash child's acknowledged (name, kind, version)s."""
        return [(w[1], w[2], int(w[3])) for w in self.lines if w[0] == "ack"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.endswith("\n"):  # cut short by the kill: not an acknowledgement
                break
            words = line.split()
            if words[0] == "evictions":
                self.evictions = max(self.evictions, int(words[1]))
                continue
            assert words[0] in ("ack", "put", "del", "wide"), line
            self.lines.append(words)
            if words[0] == "ack":
                self.first_ack.set()

    def go(self) -> None:
        assert self.proc.stdin is not None
        self._reader.start()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        self._err.flush()
        return self.log.read_text()[-4000:]

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.finish()

    def finish(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait()
        if self._reader.is_alive() or self._reader.ident is not None:
            self._reader.join(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._err.close()
        return rc


def verify_after_crash(st: tierstore.Store, acked: dict[tuple[str, str], int],
                       wide: int = 0, before: list[int] | None = None) -> list[int]:
    """Every entry at its acknowledged version or newer, the wide batch's too; returns the
    wide entries' versions. ``before``: what they were before a child without a host cache,
    whose batches are written through: each one commits whole or not at all."""
    seen = [crash_writer.wide_decode(i, st.get(f"wide.{i}")) if f"wide.{i}" in st else 0
            for i in range(crash_writer.WIDE)]
    assert min(seen) >= wide, f"wide batch {wide} was acknowledged, the store holds {seen}"
    assert before is None or seen == before or len(set(seen)) == 1, (
        f"a wide batch was committed in part: {before} -> {seen}")
    for idx, (name, kind, _) in enumerate(crash_writer.ENTRIES):
        key = (name, kind)
        if key not in st:
            assert key not in acked, f"acknowledged entry {key} is gone"
            continue
        got = st.get(name, kind)  # a CorruptEntryError fails the test
        version = crash_writer.decode(idx, got)
        assert version >= acked.get(key, 0), (
            f"{key} holds version {version}, but {acked[key]} was acknowledged")
        assert st.info(name, kind).nbytes == crash_writer.ENTRIES[idx][2]
    report = st.fsck()
    assert report.ok, report.problems
    return seen


def kill_loop(
    make_store: Callable[..., tierstore.Store], path: str, mode: str, kills: int,
    rng: random.Random, logdir: Path, after_kill: Callable[[Child, tierstore.Store], None],
) -> None:
    """Start ``kills`` children one after another, SIGKILL each at a random moment after its
    first acknowledgement, and hand it with the reopened store to ``after_kill``."""
    waiting: deque[Child] = deque()
    seeds = itertools.count()
    try:
        for _ in range(PRESTART):
            waiting.append(Child(path, next(seeds), logdir, mode))
        for kill in range(kills):
            child = waiting.popleft()
            waiting.append(Child(path, next(seeds), logdir, mode))
            child.go()
            if not child.first_ack.wait(FIRST_ACK_TIMEOUT):
                rc = child.finish()
                pytest.fail(f"kill {kill}: the writer acknowledged nothing (rc {rc}):\n"
                            + child.stderr())
            time.sleep(rng.uniform(0.05, 0.4))
            rc = child.kill()
            assert rc == -signal.SIGKILL, (
                f"kill {kill}: the writer ended by itself (rc {rc}):\n{child.stderr()}")
            st = make_store(path, reopen=True)  # only the path: the backing is recorded
            try:
                after_kill(child, st)
            finally:
                st.close()
    finally:
        while waiting:
            waiting.popleft().finish()


@pytest.mark.slow
def test_sigkill_never_loses_acknowledged_writes(make_store, backing, tmp_path) -> None:
    st = make_store(slab_size="8MiB", pmem_size="32MiB")
    path = st.path
    st.close()
    acked: dict[tuple[str, str], int] = {}
    total_acks = evictions = wide = 0
    state = [0] * crash_writer.WIDE  # the wide entries' versions after the last kill

    def after_kill(child: Child, st: tierstore.Store) -> None:
        nonlocal total_acks, evictions, wide, state
        for name, kind, version in child.acks:
            acked[(name, kind)] = max(acked.get((name, kind), 0), version)
        total_acks += len(child.acks)
        evictions = max(evictions, child.evictions)
        wide = max(wide, child.wide)
        state = verify_after_crash(st, acked, wide,
                                   before=state if child.seed % 3 == 1 else None)  # no cache

    kill_loop(make_store, path, "crash", KILLS, random.Random(20240611 + (backing == "pmem")),
              tmp_path, after_kill)
    assert total_acks >= KILLS
    if KILLS >= 3:  # every third child has the small cache; a shorter run proves less
        assert evictions > 0, "no writer ever evicted a dirty entry from its small host cache"
        assert len(acked) == len(crash_writer.ENTRIES), "some entry was never written"
        assert wide > 0, "no writer ever acknowledged a wide batch"


class RaceLedger:
    """What the race children issued and had acknowledged, and what the store last showed.

    Per entry, ``settled`` is the newest fact the store must still honour: an acknowledged
    put or delete, or what a reopen after an earlier kill found (which later children build
    on). ``horizon`` is the last sequence number of the children already checked: nothing
    they issued that had not landed by their check may appear later.
    """

    def __init__(self) -> None:
        self.ops: dict[int, tuple[str, int]] = {}  # seq -> (put or del, entry index)
        self.settled: dict[int, tuple[int, str]] = {}  # entry -> (seq, put or del)
        # The last child's operations per entry, in order: [seq, put or del, acknowledged]
        self.recent: dict[int, list[list[Any]]] = defaultdict(list)
        self.horizon = 0
        self.acks = Counter[str]()

    def record(self, child: Child) -> None:
        steps: dict[int, list[Any]] = {}
        for word, *rest in child.lines:
            if word == "ack":
                seq = int(rest[0])
                op, idx = self.ops[seq]
                self.acks[op] += 1
                steps[seq][2] = True
                if seq > self.settled.get(idx, (0, "del"))[0]:
                    self.settled[idx] = (seq, op)
            else:
                idx, seq = int(rest[0]), int(rest[1])
                assert seq > self.horizon, "a child numbered below an earlier one"
                self.ops[seq] = (word, idx)
                steps[seq] = [seq, word, False]
                self.recent[idx].append(steps[seq])

    def history(self, idx: int) -> str:
        """The entry's last operations, for a failure message."""
        return "; ".join(f"{op} {seq}{' (acknowledged)' if acked else ''}"
                         for seq, op, acked in self.recent[idx][-12:])

    def verify(self, st: tierstore.Store, last_seq: int) -> None:
        for idx, (name, kind, nbytes) in enumerate(crash_writer.RACE_ENTRIES):
            key = (name, kind)
            floor, op = self.settled.get(idx, (0, "del"))
            hist = f"; the child's last operations on it: {self.history(idx)}"
            if key in st:
                got = crash_writer.race_decode(idx, st.get(name, kind))
                assert self.ops.get(got) == ("put", idx), f"{key} holds {got}, never put" + hist
                if op == "del":
                    assert got > floor, f"{key} holds put {got}: delete {floor} was undone" + hist
                else:
                    assert got >= floor, (
                        f"{key} holds put {got}, but {floor} was acknowledged" + hist)
                assert got == floor or got > self.horizon, (
                    f"{key} holds put {got}, which an earlier reopen had not found" + hist)
                assert st.info(name, kind).nbytes == nbytes
                self.settled[idx] = (got, "put")
            else:
                if op == "put":
                    later = [s for s, o, _ in self.recent[idx] if o == "del" and s > floor]
                    assert later, (
                        f"{key} is gone: put {floor} was acknowledged, no delete followed" + hist)
                self.settled[idx] = (last_seq, "del")
        self.horizon = last_seq
        self.recent.clear()
        report = st.fsck()
        assert report.ok, report.problems


@pytest.mark.slow
def test_sigkill_keeps_acknowledged_deletes_and_puts_racing_flush(make_store, backing, tmp_path) -> None:
    st = make_store(slab_size="8MiB", pmem_size="16MiB")
    path = st.path
    st.close()
    ledger = RaceLedger()

    def after_kill(child: Child, st: tierstore.Store) -> None:
        ledger.record(child)
        ledger.verify(st, crash_writer.race_base(child.seed + 1) - 1)

    kill_loop(make_store, path, "race", RACE_KILLS,
              random.Random(20250117 + (backing == "pmem")), tmp_path, after_kill)
    assert ledger.acks["put"] and ledger.acks["del"], f"too little was acknowledged: {ledger.acks}"


# -- full disk ---------------------------------------------------------------------------------
def test_full_disk_raises_store_full_and_keeps_committed_entries(
    make_store, cache_kw, tmp_path
) -> None:
    # Segment/pool of 8 MiB; the child may write files of at most 7 MiB. The first segment is
    # made here, without a limit; in the child, the next one (a new slab, or a grown pool)
    # fails with EFBIG.
    cached = not cache_kw
    st = make_store(slab_size="8MiB", pmem_size="8MiB")
    path = st.path
    st.put("fill.0", crash_writer.fill_tensor(0, crash_writer.FILL_BYTES))
    st.close()
    limit = 7 << 20
    res = subprocess.run(
        [sys.executable, str(WRITER), "fill", path, str(limit), "cache" if cached else "nocache"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])

    assert out["before"] == ["fill.0"]
    assert len(out["errors"]) == 1, f"nothing ran out of space: {out}"
    err = out["errors"][0]
    if not cached:
        assert err["op"] == "put", "without a cache the put itself must fail"
    message = err["message"]
    assert path in message and ("space" in message.lower() or "full" in message.lower()), message
    assert out["batch"].startswith("full"), out
    if not cached:
        assert out["batch_visible"] == [], "a failed put_many left part of its batch behind"
    committed = ["fill.0", *out["committed"]]
    assert err["name"] not in committed
    assert [r[0] for r in out["readable"]] == committed
    for name, first_value, numel in out["readable"] + out["pending_readable"]:
        assert first_value == int(name.split(".")[1]), "wrong bytes read back"
        assert numel == crash_writer.FILL_BYTES // 8
    if not cached:
        assert out["fsck"] == {"ok": True, "problems": []}, out["fsck"]
        assert out["close"] == "ok"

    # space is back (no limit here): everything committed is intact, nothing else is there
    # (what never made it past a flush was never committed), and the store works
    st = make_store(path, reopen=True, **cache_kw)
    assert sorted(st.names()) == sorted(committed)
    for name in committed:
        i = int(name.split(".")[1])
        assert torch.equal(st.get(name), crash_writer.fill_tensor(i, crash_writer.FILL_BYTES))
    report = st.fsck()
    assert report.ok, report.problems
    big = crash_writer.fill_tensor(77, 9 << 20)  # needs a segment/pool beyond the old limit
    st.put(err["name"], big)
    st.put_many({"batch.small": crash_writer.fill_tensor(100, crash_writer.SMALL_BYTES),
                 "batch.big": crash_writer.fill_tensor(101, crash_writer.FILL_BYTES)})
    st.flush()
    st.close()
    st = make_store(path, reopen=True)
    assert torch.equal(st.get(err["name"]), big)
    assert torch.equal(st.get("batch.big"),
                       crash_writer.fill_tensor(101, crash_writer.FILL_BYTES))
    for name in committed:
        i = int(name.split(".")[1])
        assert torch.equal(st.get(name), crash_writer.fill_tensor(i, crash_writer.FILL_BYTES))
    report = st.fsck()
    assert report.ok, report.problems
