"""The sidecar daemon, run as a real `tierstore serve` process with real client processes.

- Four client processes doing mixed put/get/view/prefetch on shared and private names, every
  value verified; each shared expert read from the backing tier exactly once.
- Concurrent writers of one entry: no torn value is ever read, the newest version wins.
- SIGKILL of the daemon under that load, restart: every acknowledged write is intact and
  fsck is clean.
- A protocol fuzz of 10 000+ random and mutated frames (seeded): the daemon keeps serving
  correct data.
- A client killed while holding a lease releases it; a second daemon on the store is
  refused; SIGTERM flushes and exits 0; socket mode 0600 (0660 with --group); oversized names
  and sizes are rejected; metrics and status answer.
"""

# Over 600 lines: the daemon's processes, fuzz and signals share one set of launchers.

from __future__ import annotations

import gc
import grp
import json
import os
import random
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore.daemon import protocol as P
from tierstore.daemon.server import MAX_CONNECTIONS

SHARED = 8
SHARED_ELEMS = 64 * 1024  # 256 KiB float32 experts


def shared_name(i: int) -> str:
    return f"layers.0.experts.{i}.w1"


def shared_value(i: int) -> torch.Tensor:
    return torch.randn(SHARED_ELEMS, generator=torch.Generator().manual_seed(1000 + i))


def make_store(path: Path) -> int:
    """A store holding the shared experts, committed; returns their total bytes."""
    with tierstore.open(path, create=True, host_cache=0, slab_size="64MiB") as st:
        for i in range(SHARED):
            st.put(shared_name(i), shared_value(i))
    return SHARED * SHARED_ELEMS * 4


class Daemon:
    """`python -m tierstore.cli serve` in a subprocess, its stderr in a file."""

    def __init__(self, store: Path, sock: Path, *extra: str,
                 preexec_fn: Callable[[], Any] | None = None) -> None:
        self.store, self.sock = store, sock
        self.log = sock.with_suffix(f".{time.monotonic_ns()}.log")
        self._err = open(self.log, "w")  # noqa: SIM115 (closed in wait())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.cli", "serve", "--store", str(store),
             "--socket", str(sock), "--host-cache", "64MiB", "--metrics-port", "0", *extra],
            stderr=self._err, stdout=subprocess.DEVNULL, preexec_fn=preexec_fn)
        deadline = time.monotonic() + 90
        while "serving" not in self.log.read_text():
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited: {self.log.read_text()}")
            assert time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.05)
        text = self.log.read_text()
        self.metrics_port = int(text.split("http://127.0.0.1:")[1].split("/")[0])

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._err.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait()


def wait_for(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One daemon for the tests that do not stop it."""
    d = tmp_path_factory.mktemp("daemon")
    nbytes = make_store(d / "store")
    daemon = Daemon(d / "store", d / "s.sock")
    daemon.shared_bytes = nbytes  # type: ignore[attr-defined]
    yield daemon
    assert daemon.terminate() == 0, daemon.log.read_text()


# -- client processes ---------------------------------------------------------------------
CLIENT = r"""
import os, random, sys, torch, tierstore
sock, index, ops, acks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
SHARED, ELEMS = @SHARED@, @ELEMS@
def shared(i):
    return torch.randn(ELEMS, generator=torch.Generator().manual_seed(1000 + i))
def private(j, n):  # value n of private entry j: its counter in every element, plus a ramp
    return torch.arange(4096 * (j + 1), dtype=torch.float64) + n * 1e6
rng = random.Random(index)
fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
last = {}
try:
    st = tierstore.connect(sock)
    for k in range(ops if ops > 0 else 1 << 30):
        op = rng.random()
        if op < 0.3:
            i = rng.randrange(SHARED)
            assert torch.equal(st.get(f"layers.0.experts.{i}.w1"), shared(i)), "shared get"
        elif op < 0.45:
            i = rng.randrange(SHARED)
            v = st.view(f"layers.0.experts.{i}.w1")
            assert torch.equal(v, shared(i)), "shared view"
            del v
        elif op < 0.6:
            ids = rng.sample(range(SHARED), 3)
            names = [f"layers.0.experts.{i}.w1" for i in ids]
            st.prefetch(names, priority=k)
            for i, name in zip(ids, names):
                assert torch.equal(st.acquire(name, timeout=60), shared(i)), "prefetch"
                st.release(name)
        elif op < 0.85:
            j = rng.randrange(4)
            n = last.get(j, 0) + 1
            st.put(f"client{index}.e{j}", private(j, n), kind="exp_avg")
            last[j] = n
            os.write(fd, f"client{index}.e{j} {n}\n".encode())
        elif last:
            j = rng.choice(sorted(last))
            got = st.get(f"client{index}.e{j}", kind="exp_avg")
            assert torch.equal(got, private(j, last[j])), "private get"
    st.close()
except tierstore.StoreError as e:
    if ops > 0:
        raise
    print("lost:", e, file=sys.stderr)
print("ok")
""".replace("@SHARED@", str(SHARED)).replace("@ELEMS@", str(SHARED_ELEMS))


def private_value(j: int, n: int) -> torch.Tensor:
    return torch.arange(4096 * (j + 1), dtype=torch.float64) + n * 1e6


def start_clients(sock: Path, n: int, ops: int, acks: Path) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-c", CLIENT, str(sock), str(i), str(ops),
                              str(acks)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for i in range(n)]


def test_four_clients_mixed_load_every_value_verified(served: Daemon, tmp_path: Path) -> None:
    acks = tmp_path / "acks.log"
    procs = start_clients(served.sock, 4, 80, acks)
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err
    with tierstore.connect(served.sock) as st:
        # Every private entry holds its last acknowledged value.
        last: dict[str, int] = {}
        for line in acks.read_text().splitlines():
            name, n = line.split()
            last[name] = int(n)
        assert last
        for name, n in last.items():
            j = int(name.rsplit(".e", 1)[1])
            assert torch.equal(st.get(name, kind="exp_avg"), private_value(j, n))
        stats = st.stats()
        # Each shared expert came from the backing tier once, however many clients read it;
        # private entries were served from the cache they were written through.
        assert stats["tiers"]["nvme"]["bytes_read"] == served.shared_bytes  # type: ignore[attr-defined]
        assert stats["cache"]["hits"] > 4 * SHARED
        wait_for(lambda: st.status()["leases"] == 0)
        assert st.status()["clients"] == 1  # this one; the four have gone


def test_concurrent_writers_last_commit_wins_no_torn_data(served: Daemon) -> None:
    script = r"""
import sys, torch, tierstore
st = tierstore.connect(sys.argv[1]); w = int(sys.argv[2]); out = []
for k in range(25):
    v = st.put("contended", torch.full((32768,), float(w * 1000 + k)))
    out.append(f"{v} {w * 1000 + k}")
    got = st.get("contended")
    assert bool((got == got[0]).all()), "torn read"
print("\n".join(out)); st.close()
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(served.sock), str(w)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in range(4)]
    acked = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        acked += [tuple(map(int, line.split())) for line in out.splitlines()]
    version, value = max(acked)
    with tierstore.connect(served.sock) as st:
        got = st.get("contended")
        assert bool((got == value).all())
        assert st.info("contended").version == version


def test_published_reads_never_torn_while_overwritten_in_place(served: Daemon) -> None:
    """Gets served from the published index (no round trip) while another process rewrites
    the entry in its own slot: every read is one whole version, and the reads really were
    served locally."""
    reader = r"""
import sys, torch, tierstore
st = tierstore.connect(sys.argv[1]); seen = set()
for k in range(3000):
    got = st.get("inplace")
    assert bool((got == got[0]).all()), f"torn read at {k}"
    seen.add(float(got[0]))
print(st.stats()["local_hits"], len(seen)); st.close()
"""
    with tierstore.connect(served.sock) as st:
        st.put("inplace", torch.full((65536,), -1.0))
        proc = subprocess.Popen([sys.executable, "-c", reader, str(served.sock)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        k = 0
        while proc.poll() is None:
            st.put("inplace", torch.full((65536,), float(k)))  # same size: in place
            k += 1
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        local, versions = map(int, out.split())
        assert local > 0 and versions > 1, out
        assert bool((st.get("inplace") == k - 1).all())


def test_published_read_torn_by_an_overwrite_is_discarded(
        served: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worst interleaving, forced: a local copy whose second half lands after another
    client's in-place overwrite. The sequence check must throw the torn copy away and read
    the new version through the daemon."""
    import numpy as np

    from tierstore.daemon import client as client_mod

    real = client_mod._deliver
    fired = []
    with tierstore.connect(served.sock) as a, tierstore.connect(served.sock) as b:
        b.put("torn", torch.full((8192,), 1.0))
        a.get("torn")  # publishes the row and tells a about it

        def racing(key: Any, meta: Any, raw: Any, *args: Any) -> torch.Tensor:
            t = real(key, meta, raw, *args)
            if isinstance(raw, np.ndarray) and not fired:  # a copy out of the mapping
                fired.append(True)
                b.put("torn", torch.full((8192,), 2.0))  # same size: in place
                half = meta.nbytes // 2
                t.view(-1).view(torch.uint8)[half:] = torch.from_numpy(np.array(raw[half:]))
            return t

        monkeypatch.setattr(client_mod, "_deliver", racing)
        local = a.stats()["local_hits"]
        got = a.get("torn")
        assert fired and bool((got == 2.0).all()), "a torn copy was returned"
        assert a.stats()["local_hits"] == local


def test_published_reads_see_every_acknowledged_change(served: Daemon) -> None:
    """A client holding a published row reads the newer version (same size or not) and a
    deletion once another client's put or delete is acknowledged; its local hits count as
    the daemon's cache hits."""
    with tierstore.connect(served.sock) as a, tierstore.connect(served.sock) as b:
        b.put("ryw", torch.zeros(1024))
        for _ in range(3):
            assert bool((a.get("ryw") == 0).all())
        hits0 = b.stats()["cache"]["hits"]
        stats = a.stats()  # carries a's local hits to the daemon
        assert stats["local_hits"] >= 2 and stats["cache"]["hits"] >= hits0 + 2
        b.put("ryw", torch.ones(1024))
        assert bool((a.get("ryw") == 1).all())
        assert bool((a.get("ryw") == 1).all())
        b.put("ryw", torch.full((2048,), 2.0))
        assert a.get("ryw").shape == (2048,) and bool((a.get("ryw") == 2).all())
        b.delete("ryw")
        with pytest.raises(tierstore.EntryNotFoundError):
            a.get("ryw")


def test_client_killed_mid_read_releases_its_lease(served: Daemon) -> None:
    script = r"""
import sys, time, tierstore
st = tierstore.connect(sys.argv[1])
v = st.view("layers.0.experts.3.w1")
print("holding", flush=True)
time.sleep(120)
"""
    p = subprocess.Popen([sys.executable, "-c", script, str(served.sock)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "holding"
        status = tierstore.daemon_status(served.sock)
        assert status["leases"] >= 1
        holder = [c for c in status["client_list"] if c["pid"] == p.pid]
        assert holder and holder[0]["leases"] == 1
    finally:
        p.kill()
        p.wait()
    wait_for(lambda: tierstore.daemon_status(served.sock)["leases"] == 0)
    assert tierstore.daemon_status(served.sock)["clients"] == 0


def test_second_daemon_on_the_same_store_is_refused(served: Daemon, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "tierstore.cli", "serve", "--store",
                        str(served.store), "--socket", str(tmp_path / "other.sock")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "is open in process" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "other.sock").exists()
    assert served.proc.poll() is None


def test_socket_mode_0600(served: Daemon) -> None:
    mode = os.stat(served.sock).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_oversized_name_and_size_are_rejected(served: Daemon) -> None:
    with tierstore.connect(served.sock) as st:
        with pytest.raises(tierstore.StoreError, match="at most 400 bytes"):
            st.put("n" * 500, torch.zeros(1))
        # A raw frame with a long name gets an error answer, not a crash.
        with raw_conn(served.sock) as s:
            assert exchange(s, P.Op.HELLO, {"version": P.PROTOCOL_VERSION})[0] == P.Op.REPLY
            ans = exchange(s, P.Op.GET, {"keys": [["n" * 500, "param"]]})
            assert ans[0] == P.Op.ERROR and "400" in ans[1]["message"]
            # A payload larger than the daemon's limit: an error, then the connection closes.
            s.sendall(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.Op.PUT, 0, 9, 2, 1 << 40) + b"{}")
            op, fields = read_frame(s)
            assert op == P.Op.ERROR and "exceeds" in fields["message"]
            assert s.recv(1) == b""
        assert torch.equal(st.get(shared_name(0)), shared_value(0))


def test_request_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    make_store(tmp_path / "store")
    daemon = Daemon(tmp_path / "store", tmp_path / "s.sock", "--max-request", "1MiB",
                    "--group", grp.getgrgid(os.getgid()).gr_name)
    try:
        assert stat.S_IMODE(os.stat(daemon.sock).st_mode) == 0o660
        with tierstore.connect(daemon.sock) as st:
            with pytest.raises(tierstore.StoreError, match="exceeds the daemon's limit"):
                st.put("big", torch.zeros(512 * 1024))  # 2 MiB
            st.put("small", torch.ones(1024))
            assert torch.equal(st.get("small"), torch.ones(1024))
    finally:
        assert daemon.terminate() == 0


def test_metrics_and_health(served: Daemon) -> None:
    with tierstore.connect(served.sock) as st:
        st.get(shared_name(1))
        base = f"http://127.0.0.1:{served.metrics_port}"
        text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        health = urllib.request.urlopen(f"{base}/healthz", timeout=10)
        assert health.status == 200
    for name in ("tierstore_cache_hit_rate", 'tierstore_tier_bytes{tier="host"}',
                 'tierstore_tier_bytes{tier="nvme"}', 'tierstore_prefetch_queue_depth{state="queued"}',
                 "tierstore_prefetch_stall_seconds_total", "tierstore_clients",
                 'tierstore_request_duration_seconds_bucket{le="+Inf",op="get"}'):
        assert name in text, name
    # The limit beside what is open (the client's own connections among them).
    assert f"tierstore_max_connections {MAX_CONNECTIONS}" in text
    assert re.search(r"^tierstore_open_connections [1-9]", text, re.M)


def test_status_command(served: Daemon) -> None:
    p = subprocess.run([sys.executable, "-m", "tierstore.cli", "status", "--connect",
                        str(served.sock), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    for key in ("clients", "hit_rate", "tier_bytes", "queues", "leases"):
        assert key in s
    p = subprocess.run([sys.executable, "-m", "tierstore.cli", "status", "--connect",
                        str(served.sock) + ".missing"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "cannot connect" in p.stderr


def test_remote_store_api(served: Daemon) -> None:
    with tierstore.connect(served.sock) as st:
        x = torch.randn(16, 8, dtype=torch.float32).to(torch.bfloat16)
        v1 = st.put("api.w", x)
        assert torch.equal(st.get("api.w"), x)
        out = torch.empty(16, 8, dtype=torch.bfloat16)
        assert st.get("api.w", out=out) is out and torch.equal(out, x)
        with pytest.raises(tierstore.ShapeMismatchError):
            st.get("api.w", out=torch.empty(3))
        st.put_many({"api.a": torch.ones(3), "api.b": torch.zeros(2, 2)})
        assert set(st.get_many(["api.a", "api.b"])) == {"api.a", "api.b"}
        assert {"api.a", "api.b", "api.w"} <= set(st.names("api."))
        assert ("api.w", "param") in st.keys("api.") and "api.w" in st
        info = st.info("api.w")
        assert info.dtype == torch.bfloat16 and info.shape == (16, 8) and info.version == v1
        st.snapshot("api-snap")
        st.put("api.w", torch.zeros(1))
        assert st.restore("api-snap").tag == "api-snap"
        assert torch.equal(st.get("api.w"), x)
        assert "api-snap" in [s.tag for s in st.snapshots()]
        st.drop_snapshot("api-snap")
        assert st.delete("api.a") and "api.a" not in st
        with pytest.raises(tierstore.EntryNotFoundError):
            st.get("api.a")
        futs = st.prefetch(["api.b"])
        assert torch.equal(futs[0].result(timeout=30), torch.zeros(2, 2))
        assert st.release("api.b")
        assert st.fsck().ok
        st.flush()
    with pytest.raises(tierstore.StoreClosedError):
        st.get("api.w")


def test_a_clients_put_of_many_entries_holds_the_collector_off(served: Daemon) -> None:
    """As a local store's put (tests/test_collector.py): a field dict per entry would set
    off collections in the calling thread; held off, at most one follows the call."""
    values = {f"gc.e{i}": torch.full((64,), i % 251, dtype=torch.uint8) for i in range(3000)}
    seen: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    with tierstore.connect(served.sock) as st:
        st.put_many(values)
        gc.callbacks.append(count)
        try:
            st.put_many(values)
            paused = len(seen)
            type(st).put_many.__wrapped__(st, values)  # the same put, collector on
        finally:
            gc.callbacks.remove(count)
        assert paused <= 1 < len(seen) - paused
        assert gc.isenabled()
        got = st.get_many(list(values))
    assert all(torch.equal(got[k], v) for k, v in values.items())


def test_borrowed_and_prefetched_views_are_the_daemons_slots(served: Daemon) -> None:
    """``borrow_many`` and a CPU prefetch queue lending views hand out the daemon's cache
    slots themselves (no copy), leased while held and given back when let go."""
    with tierstore.connect(served.sock) as st:
        vals = {f"lend.{i}": torch.randn(4096, generator=torch.Generator().manual_seed(i))
                for i in range(3)}
        st.put_many(vals)
        st.get_many(list(vals))  # cached in the daemon
        arena = st._arena_t
        lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()

        def mine() -> int:
            rows = [c for c in st.status()["client_list"] if c["pid"] == os.getpid()]
            return int(rows[0]["leases"]) if rows else 0

        lent = st.borrow_many(list(vals))
        assert all(lo <= t.data_ptr() < hi for t in lent.tensors.values())
        assert all(torch.equal(lent.tensors[n], v) for n, v in vals.items())
        assert mine() >= 1
        lent.release()
        wait_for(lambda: mine() == 0)
        assert st.prefetch_views("cpu")
        (fut,) = st.prefetch(["lend.0"], device="cpu")
        got = st.acquire("lend.0", device="cpu")
        assert fut.result(timeout=30) is got or torch.equal(fut.result(), got)
        assert lo <= got.data_ptr() < hi and torch.equal(got, vals["lend.0"])
        del got, fut
        assert st.release("lend.0", device="cpu")
        wait_for(lambda: mine() == 0)


# -- protocol fuzz ------------------------------------------------------------------------
def raw_conn(sock: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(sock))
    return s


def read_frame(s: socket.socket) -> tuple[int, dict[str, Any]]:
    head = b""
    while len(head) < P.HEADER_BYTES:
        chunk = s.recv(P.HEADER_BYTES - len(head))
        assert chunk, "closed"
        head += chunk
    _, _, op, _, _, nf, npl = P.HEADER.unpack(head)
    body = b""
    while len(body) < nf + npl:
        body += s.recv(nf + npl - len(body))
    return op, json.loads(body[:nf])


def exchange(s: socket.socket, op: int, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    s.sendall(P.encode(op, 7, fields))
    return read_frame(s)


GOOD = [
    (P.Op.GET, {"keys": [["fuzz.a", "param"]]}, b""),
    (P.Op.INFO, {"name": "fuzz.p"}, b""),
    (P.Op.KEYS, {"prefix": "fuzz."}, b""),
    (P.Op.CONTAINS, {"name": "x", "kind": "grad"}, b""),
    (P.Op.RELEASE, {"leases": [1, 2, 3]}, b""),
    (P.Op.REPORT, {"prefetch": {"cpu": {"queued": 1}}}, b""),
    (P.Op.STATUS, {}, b""),
    (P.Op.PUT, {"items": [{"name": "fuzz.p", "kind": "param", "dtype": "int8", "shape": [4],
                           "nbytes": 4}]}, b"abcd"),
    (P.Op.GET, {"keys": [["fuzz.p", "param"]], "r": [1]}, b""),
    (P.Op.SNAPSHOTS, {}, b""),
]
ODD = [None, 1, -1, 2**70, "x", [], [["a"]], [[1, 2]], {"a": 1}, [True], "\u0000", "n" * 600,
       1.5, [["a", "param"]] * 5000, [{"name": "fuzz.q", "kind": "param", "dtype": "float32",
                                       "shape": [2], "nbytes": 9}], [[["deep"]]]]


def mutate_fields(rng: random.Random, fields: Any) -> Any:
    """A structurally plausible but wrong value somewhere in the fields."""
    if isinstance(fields, dict) and fields and rng.random() < 0.7:
        key = rng.choice(list(fields))
        out = dict(fields)
        out[key] = mutate_fields(rng, fields[key]) if rng.random() < 0.5 else rng.choice(ODD)
        return out
    if isinstance(fields, list) and fields and rng.random() < 0.7:
        out = list(fields)
        k = rng.randrange(len(out))
        out[k] = mutate_fields(rng, out[k])
        return out
    return rng.choice(ODD)


def fuzz_frames(rng: random.Random) -> list[bytes]:
    """One connection's frames: well-framed requests with random or mutated fields (each
    gets an answer and the connection lives on), then maybe one frame that breaks the
    framing itself (random bytes, lying lengths, flipped header bytes, a cut-off frame)."""
    frames = []
    if rng.random() < 0.8:
        frames.append(P.encode(P.Op.HELLO, 0, {"version": P.PROTOCOL_VERSION, "client": f"fuzz{rng.random()}"}))
    for _ in range(rng.randint(5, 30)):
        op, fields, payload = rng.choice(GOOD)
        r = rng.random()
        if r < 0.6:
            fields = mutate_fields(rng, fields)
        elif r < 0.75:
            op = rng.randint(0, 70)
        body = json.dumps(fields).encode() if rng.random() < 0.9 else rng.randbytes(20)
        if r > 0.9 and body:
            body = bytearray(body)
            body[rng.randrange(len(body))] = rng.getrandbits(8)
        frames.append(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, op, rng.choice([0, 0, 1]), rng.getrandbits(32),
                                    len(body), len(payload)) + bytes(body) + payload)
    r = rng.random()
    if r < 0.15:
        frames.append(rng.randbytes(rng.randint(1, 80)))
    elif r < 0.3:
        version = rng.choice([P.PROTOCOL_VERSION, P.PROTOCOL_VERSION + 1, 255])
        frames.append(P.HEADER.pack(P.MAGIC, version, rng.randint(0, 70), 0, 1,
                                    rng.choice([0, 5, 1 << 21, 2**32 - 1]),
                                    rng.choice([0, 3, 1 << 33, 2**64 - 1])) + b"{}")
    elif r < 0.45:
        f = bytearray(P.encode(P.Op.GET, 1, {"keys": [["fuzz.a", "param"]]}))
        for _ in range(rng.randint(1, 4)):
            f[rng.randrange(P.HEADER_BYTES)] = rng.getrandbits(8)
        frames.append(bytes(f))
    elif r < 0.6:
        f = P.encode(P.Op.PUT, 1, GOOD[7][1], 4) + b"abcd"
        frames.append(f[: rng.randrange(len(f))])
    return frames


def count_frames(data: bytes) -> int:
    n = at = 0
    while at + P.HEADER_BYTES <= len(data):
        _, _, _, _, _, nf, npl = P.HEADER.unpack_from(data, at)
        at += P.HEADER_BYTES + nf + npl
        n += 1
    return n


def test_protocol_fuzz_daemon_keeps_serving(served: Daemon) -> None:
    rng = random.Random(20261122)
    sent = answered = 0
    while sent < 10_000:
        frames = fuzz_frames(rng)
        sent += len(frames)
        s = raw_conn(served.sock)
        got = bytearray()
        try:
            try:
                s.sendall(b"".join(frames))
                s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon closed it after a frame that broke the framing
            try:
                while chunk := s.recv(1 << 16):  # answers, until the daemon closes
                    got += chunk
            except ConnectionResetError:
                pass
        finally:
            s.close()
        answered += count_frames(bytes(got))
        assert served.proc.poll() is None, served.log.read_text()[-2000:]
    assert sent >= 10_000
    assert answered > 6_000  # most frames were parsed and answered, not cut off unread
    # Still serving, and serving the right bytes.
    with tierstore.connect(served.sock) as st:
        for i in range(SHARED):
            assert torch.equal(st.get(shared_name(i)), shared_value(i))
        st.put("after.fuzz", torch.arange(10))
        assert torch.equal(st.get("after.fuzz"), torch.arange(10))
        wait_for(lambda: st.status()["connections"] == 1)
        wait_for(lambda: st.status()["leases"] == 0)
    assert "internal error" not in served.log.read_text()


# -- lifecycle ------------------------------------------------------------------------------
def test_sigkill_under_load_loses_no_acknowledged_write(tmp_path: Path) -> None:
    make_store(tmp_path / "store")
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock)
    acks = tmp_path / "acks.log"
    procs = start_clients(sock, 4, 0, acks)  # run until the daemon goes away
    try:
        wait_for(lambda: acks.exists() and len(acks.read_text().splitlines()) >= 40, 180)
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.wait()
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0 and "ok" in out, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sock.exists()  # left behind by the killed daemon; the restart replaces it
    daemon = Daemon(tmp_path / "store", sock)
    try:
        last: dict[str, int] = {}
        for line in acks.read_text().splitlines():
            name, n = line.split()
            last[name] = int(n)
        with tierstore.connect(sock) as st:
            for name, n in last.items():
                j = int(name.rsplit(".e", 1)[1])
                got = st.get(name, kind="exp_avg")
                # The last acknowledged value, or the one its client was writing when the
                # daemon died (committed, not yet acknowledged); never anything torn.
                stored = int(round(float(got[0]) / 1e6))
                assert stored in (n, n + 1)
                assert torch.equal(got, private_value(j, stored))
            for i in range(SHARED):
                assert torch.equal(st.get(shared_name(i)), shared_value(i))
            assert st.fsck().ok
    finally:
        assert daemon.terminate() == 0


def test_sigterm_flushes_and_exits_zero(tmp_path: Path) -> None:
    make_store(tmp_path / "store")
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock)
    with tierstore.connect(sock) as st:
        st.put("kept", torch.arange(1000))
        st.tick()
    assert daemon.terminate() == 0
    assert "flushed and stopped" in daemon.log.read_text()
    assert not sock.exists()
    with tierstore.open(tmp_path / "store") as st:
        assert torch.equal(st.get("kept"), torch.arange(1000))
        assert st.fsck().ok


def test_frame_header_layout() -> None:
    head = P.encode(P.Op.GET, 5, {"keys": []}, 3, flags=P.NO_REPLY)
    magic, version, op, flags, rid, nfields, npayload = struct.unpack("!4sBBHIIQ", head[:24])
    assert (magic, version, op, flags, rid, npayload) == (b"TSDP", P.PROTOCOL_VERSION, P.Op.GET, 1, 5, 3)
    assert json.loads(head[24:]) == {"keys": []} and nfields == len(head) - 24


def test_host_cache_on_a_caller_supplied_arena() -> None:
    import mmap

    from tierstore.cache import HostCache

    m = mmap.mmap(-1, 1 << 20)
    arena = torch.frombuffer(m, dtype=torch.uint8)
    cache = HostCache(1 << 20, arena=arena)
    h = cache.insert("k", 5000, None, data=bytes(range(250)) * 20)
    assert h is not None and h.view.data_ptr() - arena.data_ptr() in range(0, 1 << 20, 4096)
    assert bytes(m[h.view.data_ptr() - arena.data_ptr():][:5000]) == bytes(range(250)) * 20
    h.release()
    with pytest.raises(ValueError, match="needs"):
        HostCache(2 << 20, arena=arena)
    with pytest.raises(ValueError, match="aligned"):
        HostCache(4096, arena=arena[1:8193])
    with pytest.raises(ValueError, match="uint8"):
        HostCache(4096, arena=torch.zeros(4096))


def test_train_and_generate_through_the_daemon(tmp_path: Path) -> None:
    """`tierstore train --connect` trains over the daemon's store (resuming there too), and
    `tierstore generate --connect` generates from it: the same tokens as a local store."""
    from click.testing import CliRunner

    from tierstore.cli import main

    def cli(*args: str) -> str:
        res = CliRunner().invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return res.output

    with tierstore.open(tmp_path / "store", create=True, slab_size="64MiB"):
        pass
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock)
    try:
        # On the CPU everywhere (auto would pick CUDA on a GPU machine; the tokens compared
        # are the CPU's, and the CUDA paths are tested where marked gpu).
        common = ("--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-every",
                  "0", "--checkpoint-every", "2", "--device", "cpu")
        assert "steps 1-2" in cli("train", "--connect", str(sock), "--steps", "2", *common)
        assert "steps 3-4" in cli("train", "--connect", str(sock), "--steps", "4", "--resume",
                                  "--device", "cpu")
        ask = ("--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--greedy", "--json",
               "--device", "cpu")
        remote = json.loads(cli("generate", "--connect", str(sock), *ask).splitlines()[-1])
        # expert mode too: both modes compute on views of the daemon's slots
        expert = json.loads(cli("generate", "--connect", str(sock), *ask, "--mode",
                                "expert").splitlines()[-1])
    finally:
        assert daemon.terminate() == 0, daemon.log.read_text()
    local = json.loads(cli("generate", "--store", str(tmp_path / "store"), *ask).splitlines()[-1])
    assert remote["tokens"] == local["tokens"] and len(local["tokens"][0]) == 6
    assert expert["tokens"] == local["tokens"]
    bad = CliRunner().invoke(main, ["train", "--connect", str(sock), "--store", "x",
                                    "--steps", "1"])
    assert bad.exit_code == 2 and "--connect" in bad.output


def test_a_socket_that_never_answers_is_an_error_not_a_hang(tmp_path: Path) -> None:
    from tierstore.daemon.connection import Connection

    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)  # accepts (the kernel completes the connect) and never answers
    try:
        with pytest.raises(tierstore.StoreError, match="no tierstore daemon answered"):
            Connection(path, "t", want_arena=False, hello_timeout_s=0.2)
    finally:
        listener.close()


@pytest.mark.gpu
def test_a_client_prefetches_and_gets_onto_cuda_through_the_daemon(tmp_path: Path) -> None:
    with tierstore.open(tmp_path / "store", create=True, slab_size="64MiB"):
        pass
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock)
    try:
        with tierstore.connect(sock) as st:
            want = {f"e{i}": torch.randn(4096 + i) for i in range(4)}
            st.put_many(want)
            futures = st.prefetch(list(want), device="cuda")
            for (name, x), fut in zip(want.items(), futures):
                got = fut.result(timeout=60)
                assert got.is_cuda and torch.equal(got.cpu(), x)
                st.release(name, device="cuda")
            got = st.get_many(list(want), device="cuda")
            assert all(got[k].is_cuda and torch.equal(got[k].cpu(), v) for k, v in want.items())
    finally:
        assert daemon.terminate() == 0, daemon.log.read_text()
