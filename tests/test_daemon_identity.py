"""A client checks who answers on a daemon's socket before it uses it.

- Another user's daemon (a real second user, made for the test) is refused in one line by
  ``tierstore.connect``, ``tierstore.daemon_status`` and ``tierstore.probe_daemon`` on the
  kernel's word (SO_PEERCRED), even where the socket file was made to look like root's;
  trusted only where ``TIERSTORE_DAEMON_USER`` names that user. Nothing unlinks its socket.
- ``connect(store=...)`` checks that the daemon serves that store: the resolved path and
  the store id of its marker (a symlink to the store passes, a copy of it elsewhere and
  another store do not).
- Directories and sockets others own or may write to are refused.
- A run's claim: a client of a second run is refused while the first run is connected.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore.daemon.identity import check_private_dir, check_socket_file


def _serve(store: Path, sock: Path) -> subprocess.Popen[bytes]:
    log = sock.with_suffix(".log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tierstore", "serve", "--create",
                                 "--store", str(store), "--socket", str(sock),
                                 "--host-cache", "16MiB"], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while "serving" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the daemon did not start"
        time.sleep(0.05)
    return proc


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A daemon of this user serving ``tmp_path/b``: (store, socket)."""
    store, sock = tmp_path / "b", tmp_path / "b.sock"
    proc = _serve(store, sock)
    try:
        yield store, sock
    finally:
        _end(proc)


def test_another_users_daemon_is_refused(other_user: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    shared = other_user.shared
    sock = shared / "daemon.sock"
    theirs = other_user.serve(shared / "theirs", sock)
    try:
        os.chmod(sock, 0o777)  # as the reporter's: anyone may connect
        said = f"runs as {other_user.name} (uid {other_user.uid}), not as root"
        for call in (tierstore.connect, tierstore.daemon_status, tierstore.probe_daemon):
            with pytest.raises(tierstore.DaemonIdentityError) as e:
                call(sock)
            if call is tierstore.probe_daemon:  # it looks at the socket file first
                assert f"socket {sock} is owned by {other_user.name}" in str(e.value)
            else:
                assert said in str(e.value) and "\n" not in str(e.value)
        # The file made to look like root's: the kernel still says who listens.
        os.chown(sock, 0, 0)
        os.chmod(sock, 0o600)
        with pytest.raises(tierstore.DaemonIdentityError, match=re.escape(said)):
            tierstore.probe_daemon(sock)
        # A daemon of root's, asked to serve on that socket, leaves it alone.
        done = subprocess.run([sys.executable, "-m", "tierstore", "serve", "--create",
                               "--store", str(shared / "mine"), "--socket", str(sock)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "in use by a running daemon" in done.stderr
        assert sock.exists() and theirs.poll() is None
        # Trusted by name, it is used; nothing was written to its store.
        monkeypatch.setenv("TIERSTORE_DAEMON_USER", other_user.name)
        with tierstore.connect(sock) as st:
            assert st.daemon["uid"] == other_user.uid and st.keys() == []
            with pytest.raises(tierstore.DaemonIdentityError, match="serves the store"):
                tierstore.connect(sock, store=shared / "mine")
    finally:
        _end(theirs)


def test_connect_checks_the_store_the_daemon_serves(tmp_path: Path,
                                                    served: tuple[Path, Path]) -> None:
    store, sock = served
    with tierstore.open(tmp_path / "a", create=True, slab_size="8MiB"):
        pass
    with pytest.raises(tierstore.DaemonIdentityError,
                       match=re.escape(f"serves the store {store}, not {tmp_path / 'a'}")):
        tierstore.connect(sock, store=tmp_path / "a")
    (tmp_path / "link").symlink_to(store)
    with tierstore.connect(sock, store=tmp_path / "link") as st:  # the same store, resolved
        st.put("x", torch.ones(2))
        assert st.daemon["store_realpath"] == str(store)
    # A copy at another path carries the same store id: not the store the daemon serves.
    (tmp_path / "copy").mkdir()
    shutil.copy(store / "TIERSTORE", tmp_path / "copy" / "TIERSTORE")
    with pytest.raises(tierstore.DaemonIdentityError, match="serves the store"):
        tierstore.connect(sock, store=tmp_path / "copy")
    # The same path, another store's marker: the id does not match.
    (store / "TIERSTORE").rename(tmp_path / "marker")
    shutil.copy(tmp_path / "a" / "TIERSTORE", store / "TIERSTORE")
    try:
        with pytest.raises(tierstore.DaemonIdentityError, match="serves store id"):
            tierstore.probe_daemon(sock, store=store)
    finally:
        (tmp_path / "marker").replace(store / "TIERSTORE")
    info = tierstore.probe_daemon(sock, store=store)
    assert info is not None and info["for_run"] is False and info["run"] is None


def test_folders_and_sockets_others_may_write_to_are_refused(tmp_path: Path,
                                                             other_user: Any) -> None:
    d = tmp_path / "run"
    tierstore.private_dir(d)
    assert (d.stat().st_mode & 0o777) == 0o700
    for mode, who in ((0o770, "its group"), (0o707, "others"), (0o1777, "others")):
        d.chmod(mode)
        with pytest.raises(tierstore.DaemonIdentityError, match=f"writable by {who}"):
            check_private_dir(d, "run directory")
    d.chmod(0o700)
    other_user.own(d, 0o700)
    with pytest.raises(tierstore.DaemonIdentityError, match=f"owned by {other_user.name}"):
        tierstore.private_dir(d)
    assert not check_socket_file(tmp_path / "none.sock")  # nothing there
    (tmp_path / "file").write_text("")
    with pytest.raises(tierstore.DaemonIdentityError, match="is not a socket"):
        check_socket_file(tmp_path / "file")


def test_a_second_run_is_refused_while_the_first_is_connected(
        served: tuple[Path, Path]) -> None:
    store, sock = served
    first = tierstore.connect(sock, store=store, run="first")
    try:
        also = tierstore.connect(sock, store=store, run="first")  # another rank of it
        also.close()
        with pytest.raises(tierstore.StoreLockedError,
                           match=f"in use by another training run \\(process {os.getpid()}\\)"):
            tierstore.connect(sock, store=store, run="second")
        info = tierstore.probe_daemon(sock)
        assert info is not None and info["run"] == {"id": "first", "pid": os.getpid()}
        with tierstore.connect(sock) as plain:  # a client of no run is not refused
            plain.put("y", torch.zeros(1))
    finally:
        first.close()
    with tierstore.connect(sock, store=store, run="second"):  # the claim went with it
        pass
