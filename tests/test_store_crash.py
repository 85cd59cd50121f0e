"""The durability contract, tested with real processes.

- Crash: a child writes versions and acknowledges them only after ``flush()`` returns; it is
  SIGKILLed at random moments. After every kill the store opens, every entry reads without a
  CorruptEntryError and holds a version at least as new as the last acknowledged, and fsck
  is clean.
- Full disk: with RLIMIT_FSIZE below what a new slab / a grown pool needs, the put (no host
  cache) or the flush() that writes it back (host cache) raises StoreFullError; what was
  committed stays intact, a batch is all or nothing, and the store works once space is back.
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest
import torch

import tierstore

WRITER = Path(__file__).with_name("crash_writer.py")
_spec = importlib.util.spec_from_file_location("crash_writer", WRITER)
assert _spec is not None and _spec.loader is not None
crash_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_writer)

KILLS = 20
PRESTART = 2  # interpreters started ahead of time: importing torch is most of a child's cost
FIRST_ACK_TIMEOUT = 120.0


class Child:
    """A crash_writer process, its acknowledged versions and its stderr."""

    def __init__(self, store: str, seed: int, logdir: Path) -> None:
        self.log = logdir / f"child-{seed}.stderr"
        self._err = open(self.log, "w")  # noqa: SIM115  (closed in finish())
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER), "crash", store, str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
        )
        self.acks: list[tuple[str, str, int]] = []
        self.evictions = 0  # the most its host cache reported, if it had one
        self.first_ack = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.endswith("\n"):  # cut short by the kill: not an acknowledgement
                break
            word, *rest = line.split()
            if word == "evictions":
                self.evictions = max(self.evictions, int(rest[0]))
                continue
            assert word == "ack", line
            name, kind, version = rest
            self.acks.append((name, kind, int(version)))
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


def verify_after_crash(st: tierstore.Store, acked: dict[tuple[str, str], int]) -> None:
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


@pytest.mark.slow
def test_sigkill_never_loses_acknowledged_writes(make_store, backing, tmp_path) -> None:
    st = make_store(slab_size="8MiB", pmem_size="32MiB")
    path = st.path
    st.close()
    rng = random.Random(20240611 + (backing == "pmem"))
    acked: dict[tuple[str, str], int] = {}
    waiting: deque[Child] = deque()
    seeds = iter(range(1000))
    total_acks = evictions = 0
    try:
        for _ in range(PRESTART):
            waiting.append(Child(path, next(seeds), tmp_path))
        for kill in range(KILLS):
            child = waiting.popleft()
            waiting.append(Child(path, next(seeds), tmp_path))
            child.go()
            if not child.first_ack.wait(FIRST_ACK_TIMEOUT):
                rc = child.finish()
                pytest.fail(f"kill {kill}: the writer acknowledged nothing (rc {rc}):\n"
                            + child.stderr())
            time.sleep(rng.uniform(0.05, 0.4))
            rc = child.kill()
            assert rc == -signal.SIGKILL, (
                f"kill {kill}: the writer ended by itself (rc {rc}):\n{child.stderr()}")
            for name, kind, version in child.acks:
                acked[(name, kind)] = max(acked.get((name, kind), 0), version)
            total_acks += len(child.acks)
            evictions = max(evictions, child.evictions)

            st = make_store(path, reopen=True)  # only the path: the backing is recorded
            try:
                verify_after_crash(st, acked)
            finally:
                st.close()
    finally:
        while waiting:
            waiting.popleft().finish()
    assert total_acks >= KILLS
    assert evictions > 0, "no writer ever evicted a dirty entry from its small host cache"
    assert len(acked) == len(crash_writer.ENTRIES), "some entry was never written"


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
