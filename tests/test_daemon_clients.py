"""What one client of the daemon can rely on whatever the daemon or the other clients do:

- a daemon restarted under a connected client never has that client read another entry's
  bytes (its mapping is the old daemon's): every call then says to connect again;
- a view's slot stays leased while anything over its memory lives (slices, ``.numpy()``);
- another client never sees a put before it is committed;
- thousands of leases released at once all come back;
- a catalog of tens of thousands of keys lists through the daemon;
- the daemon's errors arrive as the local store's: a missing entry names itself, a store
  OSError is the same OSError (and the connection serves on);
- the shared memory cannot be made writable through the descriptor a client holds;
- a get larger than the daemon's whole request budget is refused, not read;
- a daemon never takes a socket it cannot tell is dead, and a stopping one removes its own
  before a successor could bind the path;
- a connection over the daemon's --max-connections is told so, in a clear error, and the
  daemon serves new clients once others have gone; a full daemon still answers status
  from a few spares, which serve nothing else and come back when closed (the limit's log
  line, at most once a minute, is in test_daemon_log.py);
- releases riding on a request the daemon refuses unread go again with the next request,
  so no lease is left behind;
- a client that stops reading an answer is dropped after --send-timeout, giving back the
  request budget it held, and the other clients are served;
- out of descriptors, the daemon waits for connections to close without spinning, then
  serves again.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import re
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_daemon import Daemon, exchange, raw_conn, wait_for

import tierstore
from tierstore.cli import main
from tierstore.daemon import protocol as P
from tierstore.daemon.client import RemoteStore
from tierstore.daemon.connection import Connection, Lease
from tierstore.daemon.server import STATUS_SPARES, Server

pytestmark = pytest.mark.timeout(300)


def _value(i: int, version: int = 0, n: int = 16 << 10) -> torch.Tensor:
    return torch.full((n,), float(i + 1 + 1000 * version))


def _store(path: Path, n: int = 8) -> None:
    with tierstore.open(path, create=True, host_cache=0, slab_size="64MiB") as st:
        st.put_many({f"e{i}": _value(i) for i in range(n)})


def test_a_client_of_a_restarted_daemon_never_reads_anothers_bytes(tmp_path: Path) -> None:
    _store(tmp_path / "store")
    sock = tmp_path / "s.sock"
    first = Daemon(tmp_path / "store", sock, "--host-cache", "1MiB")
    x = tierstore.connect(sock)
    try:
        for name in ("e0", "e0", "e1", "e2", "e3"):  # e0 twice: served from the mapping
            assert torch.equal(x.get(name), _value(int(name[1:])))
        first.kill()
        second = Daemon(tmp_path / "store", sock, "--host-cache", "1MiB")
        try:
            with tierstore.connect(sock) as y:
                y.put("e0", _value(0, version=1))
            for name in ("e0", "e7", "e0"):
                with pytest.raises(tierstore.StoreError):  # never the wrong bytes
                    x.get(name)
            with pytest.raises(tierstore.StoreError, match="connect again"):
                x.get("e1")
        finally:
            assert second.terminate() == 0, second.log.read_text()
    finally:
        x.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    _store(tmp_path / "store", 64)
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock, "--host-cache", "1MiB")
    yield daemon, sock
    assert daemon.terminate() == 0, daemon.log.read_text()


def test_slices_and_numpy_of_a_view_keep_its_slot(served: tuple[Daemon, Path]) -> None:
    _, sock = served
    with tierstore.connect(sock) as st:
        part = st.view("e0")[:8]
        arr = st.view("e1").numpy()
        gc.collect()  # the views' own tensor objects are gone
        assert st.status()["leases"] == 2
        for i in range(2, 64):  # a 1 MiB cache: these evict whatever is not leased
            st.get(f"e{i}")
        assert torch.equal(part, _value(0)[:8]) and (arr == 2.0).all()
        del part, arr
        gc.collect()
        wait_for(lambda: st.status()["leases"] == 0)


def test_thousands_of_leases_released_at_once_all_come_back(tmp_path: Path) -> None:
    _store(tmp_path / "store")
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock)  # 64 MiB: a slot for each entry below
    try:
        with tierstore.connect(sock) as st:
            for start in (0, 4000):
                st.put_many({f"small.{i}": torch.full((4,), float(i))
                             for i in range(start, min(start + 4000, 5000))})
            views = [st.view(f"small.{i}") for i in range(5000)]
            assert st.status()["leases"] == 5000
            del views  # every lease is queued for release at once
            gc.collect()
            wait_for(lambda: st.status()["leases"] == 0)
    finally:
        assert daemon.terminate() == 0, daemon.log.read_text()


def test_a_catalog_of_tens_of_thousands_of_keys_lists(served: tuple[Daemon, Path]) -> None:
    _, sock = served
    with tierstore.connect(sock) as st:
        names = [f"layers.{i // 64}.experts.{i % 64}.w1" for i in range(30_000)]
        for start in range(0, len(names), 4000):
            st.put_many({n: torch.zeros(1) for n in names[start:start + 4000]})
        assert len(st.keys("layers.")) == 30_000
        assert len(st.names("layers.1.")) == len([n for n in names
                                                   if n.startswith("layers.1.")])


def test_the_daemons_errors_are_the_local_stores(served: tuple[Daemon, Path],
                                                 tmp_path: Path) -> None:
    _, sock = served
    with tierstore.connect(sock) as st:
        with pytest.raises(tierstore.EntryNotFoundError) as missing:
            st.get("nope", kind="exp_avg")
        assert (missing.value.name, missing.value.kind) == ("nope", "exp_avg")
        # A directory where the snapshot's catalog copy goes: the store's error, which
        # takes the snapshot back (a snapshot and its copy are one unit).
        os.mkdir(tmp_path / "store" / "catalog-snapshot.mdb.tmp")
        with pytest.raises(tierstore.StoreError, match="snapshot 't1' was not taken"):
            st.snapshot("t1")
        os.rmdir(tmp_path / "store" / "catalog-snapshot.mdb.tmp")
        assert torch.equal(st.get("e3"), _value(3))  # the same client serves on
        assert "t1" not in [s.tag for s in st.snapshots()]
        st.snapshot("t1")


def test_the_shared_memory_cannot_be_made_writable_by_a_client(
        served: tuple[Daemon, Path]) -> None:
    _, sock = served
    with tierstore.connect(sock) as st:
        fd = st._all[0].arena_fd
        assert fd >= 0
        os.fchmod(fd, 0o600)  # the client may own the inode: the mode is not the guard
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(rw, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(rw)


def test_a_get_over_the_daemons_request_budget_is_refused(tmp_path: Path) -> None:
    with tierstore.open(tmp_path / "store", create=True, host_cache=0, slab_size="64MiB") as st:
        st.put_many({f"big{i}": torch.zeros(1 << 20) for i in range(3)})  # 4 MiB each
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock, "--host-cache", "1MiB", "--max-request",
                    "8MiB", "--max-inflight", "8MiB")
    try:
        with tierstore.connect(sock) as st:
            with pytest.raises(tierstore.StoreError, match="--max-inflight"):
                st.get_many(["big0", "big1", "big2"])
            assert torch.equal(st.get("big1"), torch.zeros(1 << 20))
    finally:
        assert daemon.terminate() == 0, daemon.log.read_text()


def test_another_client_never_sees_a_put_before_its_commit(tmp_path: Path) -> None:
    _store(tmp_path / "store")
    srv = Server(str(tmp_path / "store"), str(tmp_path / "s.sock"), host_cache="16MiB")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    store = srv.store
    writing, may_commit = threading.Event(), threading.Event()
    real = store._write_through

    def held(batch):  # the put's commit waits here
        writing.set()
        assert may_commit.wait(60)
        return real(batch)

    store._write_through = held  # type: ignore[method-assign]
    try:
        with tierstore.connect(srv.socket_path) as a, tierstore.connect(srv.socket_path) as b:
            before = b.info("e0").version
            # Cached first, so the read below is a hit: a miss would wait for the key's lock,
            # which the put holds until its commit.
            assert torch.equal(b.get("e0"), _value(0))
            put = threading.Thread(target=a.put, args=("e0", _value(0, version=1)))
            put.start()
            assert writing.wait(60)
            assert b.info("e0").version == before  # not committed: not there
            assert torch.equal(b.get("e0"), _value(0))
            may_commit.set()
            put.join(60)
            assert b.info("e0").version > before
            assert torch.equal(b.get("e0"), _value(0, version=1))
    finally:
        may_commit.set()
        store._write_through = real  # type: ignore[method-assign]
        srv.stop()
        thread.join(60)


def test_a_socket_the_daemon_cannot_ask_about_is_left_alone(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    _store(tmp_path / "store")
    path = tmp_path / "s.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    real_connect = socket.socket.connect

    def cannot_tell(self: socket.socket, address: object) -> None:
        if address == str(path):  # as for another user's socket: not "nobody listens"
            raise PermissionError(13, "Permission denied")
        real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", cannot_tell)
    try:
        with pytest.raises(tierstore.StoreError, match="cannot tell whether a daemon"):
            Server(str(tmp_path / "store"), str(path), host_cache="4MiB")
        assert path.exists()  # the live one's socket was not taken
    finally:
        live.close()
    with tierstore.open(tmp_path / "store") as st:  # the refused daemon let the store go
        assert torch.equal(st.get("e0"), _value(0))


def test_a_stopping_daemon_removes_its_socket_before_it_lets_the_store_go(
        tmp_path: Path) -> None:
    _store(tmp_path / "store")
    path = tmp_path / "s.sock"
    srv = Server(str(tmp_path / "store"), str(path), host_cache="4MiB")
    seen: list[bool] = []
    real_close = srv.store.close

    def close() -> None:  # the moment a successor could take the store and bind the path
        seen.append(path.exists())
        real_close()

    srv.store.close = close  # type: ignore[method-assign]
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.stop()
    thread.join(60)
    assert seen == [False]


def test_threads_of_one_client_read_published_entries_at_once(served: tuple[Daemon, Path]
                                                              ) -> None:
    _, sock = served
    errors: list[str] = []
    with tierstore.connect(sock) as st:
        names = [f"e{i}" for i in range(8)]  # 512 KiB: all cached, all published

        def reader() -> None:
            try:
                for _ in range(300):
                    for i, name in enumerate(names):
                        assert torch.equal(st.get(name), _value(i))
            except Exception as e:  # noqa: BLE001  (any failure fails the test below)
                errors.append(repr(e))

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        assert st.stats()["local_hits"] > 0  # the published path was the one exercised


# -- limits on connections ----------------------------------------------------------------------
def _connect_once_free(sock: Path) -> RemoteStore:
    """A client, as soon as the daemon has a slot for it: connections that just closed
    leave the daemon's count when their threads notice, a moment later."""
    got: list[RemoteStore] = []

    def attempt() -> bool:
        try:
            got.append(tierstore.connect(sock))
        except tierstore.StoreError as e:
            assert "connection limit" in str(e), e
            return False
        return True

    wait_for(attempt, timeout=60)
    return got[0]


def test_a_connection_over_the_limit_is_told_why(tmp_path: Path) -> None:
    _store(tmp_path / "store")
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock, "--max-connections", "2")
    try:
        held = [raw_conn(sock) for _ in range(2)]
        try:
            for s in held:  # answered, so the daemon counts both
                assert exchange(s, P.Op.HELLO, {"version": P.PROTOCOL_VERSION})[0] == P.Op.REPLY
            with pytest.raises(tierstore.StoreError) as refused:
                tierstore.connect(sock)
            assert type(refused.value) is tierstore.StoreError
            assert str(refused.value) == (
                f"the tierstore daemon at {sock} is at its connection limit of 2 "
                "(--max-connections); try again once a client has disconnected")
            # A full daemon still says who holds it: status has spare connections. A
            # connection just refused holds a spare until its thread notices, hence the
            # waits (for the count to settle, for a spare to serve).
            def settled() -> bool:
                res = CliRunner().invoke(main, ["status", "--connect", str(sock), "--json"])
                assert res.exit_code == 0, res.output
                got = json.loads(res.stdout)
                assert (got["connections"], got["max_connections"]) == (2, 2)
                return got["open_connections"] == 3  # the two, and this probe in a spare

            wait_for(settled, timeout=60)
            res = CliRunner().invoke(main, ["status", "--connect", str(sock)])
            assert res.exit_code == 0, res.output
            assert re.search(r"2 connections, 0 leases\); [34] connections open, limit 2",
                             res.output), res.output
            # A spare serves status and nothing else: a client's hello there, or any other
            # request (first, or after a status), is refused as over the limit.
            for first in ((P.Op.HELLO, {"version": P.PROTOCOL_VERSION}), (P.Op.KEYS, {})):
                s = raw_conn(sock)
                try:
                    op, fields = exchange(s, *first)
                    assert (op, fields["closed"]) == (P.Op.ERROR, True)
                    assert "connection limit of 2" in fields["message"]
                finally:
                    s.close()
            spare: list[socket.socket] = []

            def status_on_a_spare() -> bool:
                s = raw_conn(sock)
                op, fields = exchange(s, P.Op.STATUS, {})
                if op != P.Op.REPLY:
                    s.close()
                    return False
                assert fields["connections"] == 2
                spare.append(s)
                return True

            wait_for(status_on_a_spare, timeout=60)
            try:
                op, fields = exchange(spare[0], P.Op.CONTAINS, {"name": "e0", "kind": "param"})
                assert (op, fields["closed"]) == (P.Op.ERROR, True)
                assert "connection limit of 2" in fields["message"]
            finally:
                spare[0].close()
        finally:
            for s in held:
                s.close()
        with _connect_once_free(sock) as st:
            assert torch.equal(st.get("e0"), _value(0))
            assert st.status()["connections"] == 1  # its own (a watch is no client)
    finally:
        assert daemon.terminate() == 0, daemon.log.read_text()
    log = daemon.log.read_text()
    assert "at the limit of 2 connections" in log and "internal error" not in log


def test_status_spares_are_bounded_and_given_back(tmp_path: Path) -> None:
    _store(tmp_path / "store")
    sock = tmp_path / "s.sock"
    # A long hello timeout: the spares held below must not be dropped while it runs.
    daemon = Daemon(tmp_path / "store", sock, "--max-connections", "1", "--hello-timeout",
                    "600")
    held: list[socket.socket] = []
    try:
        held.append(raw_conn(sock))
        assert exchange(held[0], P.Op.HELLO, {"version": P.PROTOCOL_VERSION})[0] == P.Op.REPLY
        for _ in range(STATUS_SPARES):  # status probes that stay
            held.append(raw_conn(sock))
            hello = {"version": P.PROTOCOL_VERSION, "role": "status"}
            assert exchange(held[-1], P.Op.HELLO, hello)[0] == P.Op.REPLY
        res = CliRunner().invoke(main, ["status", "--connect", str(sock)])
        assert res.exit_code == 2, res.output
        assert "connection limit of 1" in res.output
        held.pop().close()

        def status_served() -> bool:
            res = CliRunner().invoke(main, ["status", "--connect", str(sock), "--json"])
            return res.exit_code == 0 and json.loads(res.stdout)["connections"] == 1

        wait_for(status_served, timeout=60)  # once the daemon has seen that spare close
    finally:
        for s in held:
            s.close()
        assert daemon.terminate() == 0, daemon.log.read_text()


# -- releases on a refused request --------------------------------------------------------------
def _leases(sock: Path) -> int:
    res = CliRunner().invoke(main, ["status", "--connect", str(sock), "--json"])
    assert res.exit_code == 0, res.output
    return int(json.loads(res.stdout)["leases"])


def test_releases_on_a_refused_request_go_with_the_next_one(tmp_path: Path) -> None:
    _store(tmp_path / "store")  # 64 KiB entries
    sock = tmp_path / "s.sock"
    daemon = Daemon(tmp_path / "store", sock, "--host-cache", "1MiB", "--max-request",
                    "256KiB", "--max-inflight", "256KiB")
    try:
        conn = Connection(str(sock), "requeue", want_arena=False)
    except BaseException:
        daemon.kill()
        raise
    try:
        leases = []
        for name in ("e0", "e1"):
            fields, _ = conn.request(P.Op.GET, {"keys": [[name, "param"]]})
            # No releaser thread (a client's sends releases alone after 2 ms): a release
            # goes only with the connection's next request, whichever that is.
            leases.append(Lease(lambda: None, conn, int(fields["lease"])))
        assert _leases(sock) == 2
        leases[0].release()
        # Fields over the daemon's whole request budget are refused before they are read,
        # the release riding on them with them.
        many = {"keys": [[f"missing.{i:04d}.{'x' * 80}", "param"] for i in range(3000)]}
        with pytest.raises(tierstore.StoreError, match="fields is more than the daemon's "
                                                       "--max-inflight"):
            conn.request(P.Op.GET, many)
        assert conn.pending == [leases[0].lease]  # put back
        assert _leases(sock) == 2  # the daemon never saw it
        assert conn.request(P.Op.CONTAINS, {"name": "e0", "kind": "param"})[0] == {
            "found": True}
        assert conn.pending == [] and _leases(sock) == 1
        # A get refused once its fields were read (its answer is over the budget) did take
        # the release it carried; the copy that goes again is ignored.
        leases[1].release()
        with pytest.raises(tierstore.StoreError, match="--max-inflight"):
            conn.request(P.Op.GET, {"keys": [[f"e{i}", "param"] for i in range(2, 8)]})
        assert conn.pending == [leases[1].lease] and _leases(sock) == 0
        assert conn.request(P.Op.CONTAINS, {"name": "e1", "kind": "param"})[0] == {
            "found": True}
        assert conn.pending == [] and _leases(sock) == 0
    finally:
        conn.close()
        assert daemon.terminate() == 0, daemon.log.read_text()


# -- a client that stops reading ----------------------------------------------------------------
def test_a_client_that_stops_reading_is_dropped_and_others_are_served(tmp_path: Path) -> None:
    big = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB: far more than socket buffers
    with tierstore.open(tmp_path / "store", create=True, host_cache=0, slab_size="64MiB") as st:
        st.put_many({"big": big, **{f"e{i}": _value(i) for i in range(4)}})
    sock = tmp_path / "s.sock"
    # The cache cannot hold "big": it travels in the answer, and its 16 MiB are the
    # daemon's whole request budget until that answer is sent.
    daemon = Daemon(tmp_path / "store", sock, "--host-cache", "1MiB", "--max-request",
                    "16MiB", "--max-inflight", "16MiB", "--send-timeout", "1")
    try:
        stalled = raw_conn(sock)
    except BaseException:
        daemon.kill()
        raise
    try:
        hello = {"version": P.PROTOCOL_VERSION, "client": "stalled"}
        assert exchange(stalled, P.Op.HELLO, hello)[0] == P.Op.REPLY
        stalled.sendall(P.encode(P.Op.GET, 8, {"keys": [["big", "param"]]}))
        assert select.select([stalled], [], [], 60)[0]  # its answer has begun; not read
        with tierstore.connect(sock) as st:
            # Waits (up to 30 s) for the budget the stalled answer holds, until the daemon
            # gives up on that answer; or is served at once if it already has.
            assert torch.equal(st.get("big"), big)
            assert torch.equal(st.get("e1"), _value(1))

            def stalled_gone() -> bool:
                s = st.status()
                return (all(c["client"] != "stalled" for c in s["client_list"])
                        and s["queues"]["request_bytes_held"] == 0)

            wait_for(stalled_gone, timeout=60)
        # What the stalled client was sent: the start of the answer, then the end.
        head = stalled.recv(P.HEADER_BYTES, socket.MSG_WAITALL)
        _, _, op, _, _, nfields, npayload = P.HEADER.unpack(head)
        assert op == P.Op.REPLY and npayload == big.numel() * 4
        got = 0
        while chunk := stalled.recv(1 << 20):
            got += len(chunk)
        assert got < nfields + npayload
    finally:
        stalled.close()
        assert daemon.terminate() == 0, daemon.log.read_text()
    assert "internal error" not in daemon.log.read_text()


# -- out of descriptors -------------------------------------------------------------------------
OPEN_FILES = 48  # the daemon needs about 15 once started


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _limit_open_files() -> None:
    # Soft and hard alike: the daemon raises its soft limit to the hard one.
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def test_out_of_descriptors_the_daemon_waits_without_spinning(tmp_path: Path) -> None:
    _store(tmp_path / "store")
    sock = tmp_path / "s.sock"
    # Connections that never say hello are kept (the default would drop them in 10 s).
    daemon = Daemon(tmp_path / "store", sock, "--hello-timeout", "600",
                    preexec_fn=_limit_open_files)
    pid = daemon.proc.pid
    idle = _open_files(pid)
    conns: list[socket.socket] = []
    try:
        try:
            # More than the descriptors left: the rest wait in the listener's backlog.
            for _ in range(OPEN_FILES - idle + 4):
                conns.append(raw_conn(sock))
            wait_for(lambda: "cannot accept a connection" in daemon.log.read_text(),
                     timeout=60)
            assert "Too many open files" in daemon.log.read_text()
            cpu, t0 = _cpu_seconds(pid), time.monotonic()
            time.sleep(2)  # an interval to measure over, not a wait for anything
            used, wall = _cpu_seconds(pid) - cpu, time.monotonic() - t0
            assert used < 0.5 * wall, f"the daemon spun: {used:.2f} s of CPU in {wall:.2f} s"
        finally:
            for s in conns:
                s.close()
        wait_for(lambda: _open_files(pid) <= idle, timeout=60)  # every one accepted, closed
        with tierstore.connect(sock) as st:
            assert torch.equal(st.get("e0"), _value(0))
    finally:
        assert daemon.terminate() == 0, daemon.log.read_text()
    assert "internal error" not in daemon.log.read_text()
