"""Child process for the store's crash and full-disk tests (tests/test_store_crash.py).

``python crash_writer.py crash STORE SEED``
    Waits for a line on stdin (so the parent can start the interpreter ahead of time), opens
    the store (with the default host cache, without one, or with one smaller than the entries), then
    loops forever writing new versions of ``ENTRIES`` with ``put`` and ``put_many`` (and now
    and then taking/dropping a snapshot). After each ``flush()`` returns it prints
    ``ack NAME KIND VERSION`` for what that round wrote, and ``evictions N`` (the cache's). The parent kills it with SIGKILL.

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


_ARANGE: dict[int, torch.Tensor] = {}


def encode(idx: int, version: int) -> torch.Tensor:
    n = ENTRIES[idx][2] // 8
    if n not in _ARANGE:  # cached: the writer should spend its time in the store, not here
        _ARANGE[n] = torch.arange(n, dtype=torch.int64)
    return _ARANGE[n] + (version * STRIDE + idx * 7)


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
        st.flush()
        cached = st.stats()["cache"]
        sys.stdout.write("".join(
            f"ack {ENTRIES[i][0]} {ENTRIES[i][1]} {versions[i]}\n" for i in chosen)
            + (f"evictions {cached['evictions']}\n" if cached else ""))
        sys.stdout.flush()
        if rounds % 5 == 0:  # snapshot churn: commits that touch every reference count
            tags = {s.tag for s in st.snapshots()}
            for tag in tags:
                st.drop_snapshot(tag)
            st.snapshot(f"r{rounds}")


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
    elif sys.argv[1] == "fill":
        fill(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
