"""Child process for the store's crash and full-disk tests (tests/test_store_crash.py).

``python crash_writer.py crash STORE SEED``
    Waits for a line on stdin (so the parent can start the interpreter ahead of time), opens
    the store (with the default host cache, without one, or with one smaller than the entries), then
    loops forever writing new versions of ``ENTRIES`` with ``put`` and ``put_many`` (and now
    and then taking/dropping a snapshot). After each ``flush()`` returns it prints
    ``ack NAME KIND VERSION`` for what that round wrote, and ``evictions N`` (the cache's). The parent kills it with SIGKILL.

``python crash_writer.py race STORE SEED``
    Waits for a line on stdin, opens the store (cache mode by seed, as ``crash``), then
    runs two threads until killed: one puts and deletes ``RACE_ENTRIES`` (and now and then
    puts a batch), the other flushes in a loop (a snapshot now and then: it flushes too).
    Before each operation it prints ``put IDX SEQ`` or ``del IDX SEQ``; once a flush that
    started after the operation returned has returned, ``ack SEQ``. SEQ numbers every
    operation, increasing, from ``race_base(SEED)`` on; a put's contents encode it.

``python crash_writer.py fill STORE LIMIT CACHE``
    Sets RLIMIT_FSIZE to LIMIT bytes, opens the store with (CACHE ``cache``) or without
    (``nocache``) the host cache, writes until the store is full and reports what happened
    as one JSON line.

Contents encode the entry and its version, so the parent can decode and verify them.
"""

from __future__ import annotations

import json
import random
import resource
import sys
import threading

import torch

# (name, kind, bytes): 8 bytes to 4 MiB, page multiples and odd sizes
ENTRIES = [
    ("layers.0.experts.0.w1", "param", 4096),
    ("layers.0.experts.0.w2", "param", 12_296),
    ("layers.0.experts.0.w1", "exp_avg", 65_536),
    ("layers.0.experts.1.w1", "param", 262_152),
    ("layers.0.experts.1.w2", "param", 1 << 20),
    ("layers.0.experts.1.w1", "grad", (2 << 20) - 8),
    ("layers.1.experts.0.w1", "param", 4 << 20),
    ("scalar.step", "param", 8),
]
STRIDE = 1_000_003
# A wide batch now and then: more entries than tierstore.commits.AHEAD_MIN_ENTRIES, so its
# commit is built while its last requests are in flight (and a kill may land there).
WIDE = 96
WIDE_BYTES = 64 << 10


_ARANGE: dict[int, torch.Tensor] = {}


def _arange(n: int) -> torch.Tensor:
    if n not in _ARANGE:  # cached: the writer should spend its time in the store, not here
        _ARANGE[n] = torch.arange(n, dtype=torch.int64)
    return _ARANGE[n]


def encode(idx: int, version: int) -> torch.Tensor:
    return _arange(ENTRIES[idx][2] // 8) + (version * STRIDE + idx * 7)


def decode(idx: int, t: torch.Tensor) -> int:
    """The version a stored tensor encodes; raises AssertionError if it is not one whole
    version of entry ``idx``."""
    n = ENTRIES[idx][2] // 8
    assert t.dtype == torch.int64 and tuple(t.shape) == (n,), (t.dtype, t.shape)
    base = int(t[0]) - idx * 7
    assert base % STRIDE == 0, f"entry {idx}: first element {int(t[0])} encodes no version"
    version = base // STRIDE
    assert torch.equal(t, encode(idx, version)), f"entry {idx}: mixed or damaged contents"
    return version


def wide_encode(i: int, version: int) -> torch.Tensor:
    return _arange(WIDE_BYTES // 8) + (version * STRIDE + (100 + i) * 7)


def wide_decode(i: int, t: torch.Tensor) -> int:
    """The version wide entry ``i`` holds; AssertionError if not one whole version."""
    base = int(t[0]) - (100 + i) * 7
    assert base % STRIDE == 0 and torch.equal(t, wide_encode(i, base // STRIDE)), (
        f"wide entry {i}: mixed or damaged contents")
    return base // STRIDE


def crash(path: str, seed: int) -> None:
    import tierstore

    rng = random.Random(seed)
    sys.stdin.readline()  # the parent says go
    # small chunks: entries span several, written and checksummed in parallel. Cache modes
    # by seed: the default cache, none, and one smaller than the entries, so dirty entries
    # are evicted (written back) while the writer runs.
    cache = ({}, {"host_cache": 0}, {"host_cache": "6MiB"})[seed % 3]
    st = tierstore.open(path, chunk_size="256KiB", **cache)
    versions = []
    for idx, (name, kind, _) in enumerate(ENTRIES):
        versions.append(decode(idx, st.get(name, kind)) if (name, kind) in st else 0)
    wide = max((wide_decode(i, st.get(f"wide.{i}")) for i in range(WIDE) if f"wide.{i}" in st),
               default=0)
    rounds = 0
    while True:
        rounds += 1
        if rng.random() < 0.4:
            chosen = [rng.randrange(len(ENTRIES))]
        else:
            chosen = rng.sample(range(len(ENTRIES)), rng.randint(2, len(ENTRIES)))
        for idx in chosen:
            versions[idx] += 1
        if len(chosen) == 1:
            idx = chosen[0]
            name, kind, _ = ENTRIES[idx]
            st.put(name, encode(idx, versions[idx]), kind=kind)
        else:
            st.put_many([(ENTRIES[i][0], ENTRIES[i][1], encode(i, versions[i])) for i in chosen])
        widened = rng.random() < 0.3
        if widened:
            wide += 1
            st.put_many([(f"wide.{i}", wide_encode(i, wide)) for i in range(WIDE)])
        st.flush()
        cached = st.stats()["cache"]
        sys.stdout.write("".join(
            f"ack {ENTRIES[i][0]} {ENTRIES[i][1]} {versions[i]}\n" for i in chosen)
            + (f"wide {wide}\n" if widened else "")
            + (f"evictions {cached['evictions']}\n" if cached else ""))
        sys.stdout.flush()
        if rounds % 5 == 0:  # snapshot churn: commits that touch every reference count
            tags = {s.tag for s in st.snapshots()}
            for tag in tags:
                st.drop_snapshot(tag)
            st.snapshot(f"r{rounds}")


# -- deletes and puts racing flushes -----------------------------------------------------------
# (name, kind, bytes): small, so a round is quick and many operations race each flush; the
# small cache mode cannot hold them all, so evictions write back too.
RACE_ENTRIES = [
    ("race.0", "param", 8),
    ("race.0", "exp_avg", 4096),
    ("race.1", "param", 12_296),
    ("race.2", "param", 65_536),
    ("race.3", "param", 131_080),
    ("race.4", "exp_avg", 200_000),
]
RACE_SPAN = 10_000_000  # sequence numbers per child: more than one child ever issues


def race_base(seed: int) -> int:
    """The first sequence number of child ``seed``: later children number above earlier
    ones, so sequence numbers order operations across crashes too."""
    return (seed + 1) * RACE_SPAN


def race_encode(idx: int, seq: int) -> torch.Tensor:
    return _arange(RACE_ENTRIES[idx][2] // 8) + (seq * STRIDE + idx * 7)


def race_decode(idx: int, t: torch.Tensor) -> int:
    """The sequence number a stored race entry encodes; AssertionError if none, whole."""
    n = RACE_ENTRIES[idx][2] // 8
    assert t.dtype == torch.int64 and tuple(t.shape) == (n,), (t.dtype, t.shape)
    base = int(t[0]) - idx * 7
    assert base % STRIDE == 0, f"race entry {idx}: first element {int(t[0])} encodes no put"
    seq = base // STRIDE
    assert torch.equal(t, race_encode(idx, seq)), f"race entry {idx}: mixed or damaged"
    return seq


def race(path: str, seed: int) -> None:
    import tierstore

    rng = random.Random(seed)  # the writer thread's alone
    sys.stdin.readline()  # the parent says go
    # Cache modes by seed, as in crash(); the small one cannot hold every entry, so puts
    # evict (and write back) dirty entries while the flusher runs.
    cache = ({}, {"host_cache": 0}, {"host_cache": "256KiB"})[seed % 3]
    st = tierstore.open(path, chunk_size="64KiB", **cache)
    out = threading.Lock()  # one line at a time from either thread
    pending: list[int] = []  # returned operations no flush has covered yet
    seqs = iter(range(race_base(seed), race_base(seed + 1)))
    failed = threading.Event()

    def say(text: str) -> None:
        with out:
            sys.stdout.write(text)
            sys.stdout.flush()

    def writer() -> None:
        try:
            while not failed.is_set():
                r = rng.random()
                if r < 0.15:  # a batch: several puts in one call
                    idxs = rng.sample(range(len(RACE_ENTRIES)), rng.randint(2, 3))
                    batch = [(i, next(seqs)) for i in idxs]
                    say("".join(f"put {i} {q}\n" for i, q in batch))
                    st.put_many([(RACE_ENTRIES[i][0], RACE_ENTRIES[i][1], race_encode(i, q))
                                 for i, q in batch])
                    done = [q for _, q in batch]
                else:
                    i, q = rng.randrange(len(RACE_ENTRIES)), next(seqs)
                    name, kind, _ = RACE_ENTRIES[i]
                    if r < 0.55:
                        say(f"del {i} {q}\n")
                        st.delete(name, kind, missing_ok=True)
                    else:
                        say(f"put {i} {q}\n")
                        st.put(name, race_encode(i, q), kind=kind)
                    done = [q]
                with out:
                    pending.extend(done)
        except BaseException:
            failed.set()
            raise

    def flusher() -> None:
        rounds = 0
        try:
            while not failed.is_set():
                rounds += 1
                with out:
                    covered = pending[:]
                    pending.clear()
                if rounds % 7 == 0:
                    for s in st.snapshots():
                        st.drop_snapshot(s.tag)
                    st.snapshot(f"r{rounds}")
                else:
                    st.flush()
                cached = st.stats()["cache"]
                say("".join(f"ack {q}\n" for q in covered)
                    + (f"evictions {cached['evictions']}\n" if cached else ""))
        except BaseException:
            failed.set()
            raise

    threads = [threading.Thread(target=writer), threading.Thread(target=flusher)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    raise SystemExit("a race thread failed")  # its traceback is on stderr


# -- full disk ---------------------------------------------------------------------------------
FILL_BYTES = 3 << 20  # each entry
SMALL_BYTES = 1 << 20


def fill_tensor(i: int, nbytes: int) -> torch.Tensor:
    return torch.full((nbytes // 8,), i, dtype=torch.int64)


def fill(path: str, limit: int, cache: str) -> None:
    """With the cache a put only lands in memory, so running out of space shows at flush();
    without it, at the put itself. Either way it must be a StoreFullError."""
    import tierstore

    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    result: dict = {"committed": [], "errors": []}
    st = tierstore.open(path, **({} if cache == "cache" else {"host_cache": 0}))
    before = sorted(st.names())
    result["before"] = before
    for i in range(1, 30):  # 29 x 3 MiB is far past any limit the test uses
        name = f"fill.{i}"
        op = "put"
        try:
            st.put(name, fill_tensor(i, FILL_BYTES))
            op = "flush"
            st.flush()
        except tierstore.StoreFullError as e:
            result["errors"].append({"op": op, "name": name, "message": str(e)})
            break
        result["committed"].append(name)
    # what was put but could not be written back is still there, in memory
    result["pending_readable"] = []
    for err in result["errors"]:
        if err["op"] == "flush":
            t = st.get(err["name"])
            result["pending_readable"].append([err["name"], int(t[0]), int(t.numel())])
        st.delete(err["name"], missing_ok=True)  # give up on it
    # a batch that needs more space than there is: its small entry fits, its big one does
    # not, and one commit means neither may appear
    op = "put_many"
    try:
        st.put_many([("batch.small", fill_tensor(100, SMALL_BYTES)),
                     ("batch.big", fill_tensor(101, FILL_BYTES))])
        op = "flush"
        st.flush()
        result["batch"] = "committed"
    except tierstore.StoreFullError as e:
        result["batch"] = f"full at {op}"
        result["batch_message"] = str(e)
    result["batch_visible"] = [n for n in ("batch.small", "batch.big") if n in st]
    # what was committed before the failures is still readable in this process
    result["readable"] = []
    for name in before + result["committed"]:
        t = st.get(name)
        result["readable"].append([name, int(t[0]), int(t.numel())])
    try:
        report = st.fsck()
        result["fsck"] = {"ok": report.ok, "problems": report.problems}
    except tierstore.StoreError as e:
        result["fsck"] = {"error": type(e).__name__, "message": str(e)}
    try:
        st.close()
        result["close"] = "ok"
    except tierstore.StoreError as e:
        result["close"] = type(e).__name__
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "race":
        race(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "fill":
        fill(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
