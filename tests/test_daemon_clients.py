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
  before a successor could bind the path.
"""

from __future__ import annotations

import gc
import mmap
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_daemon import Daemon, wait_for

import tierstore
from tierstore.daemon.server import Server

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
        # A directory where the snapshot's catalog copy goes: the store's OSError.
        os.mkdir(tmp_path / "store" / "catalog-snapshot.mdb.tmp")
        with pytest.raises(IsADirectoryError):
            st.snapshot("t1")
        os.rmdir(tmp_path / "store" / "catalog-snapshot.mdb.tmp")
        assert torch.equal(st.get("e3"), _value(3))  # the same client serves on
        st.snapshot("t2")


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
