"""A daemon seen from outside: :func:`status` (``tierstore status``), :func:`probe` (who
answers on a socket, checked) and :func:`stop` (SIGTERM to the process that listens)."""

from __future__ import annotations

import os
import select
import signal
from typing import Any

from . import protocol as P
from .connection import Connection, NoDaemonError
from .identity import check_serves, check_socket_file


def daemon_identity(conn: Connection) -> dict[str, Any]:
    """Who the daemon behind ``conn`` is: its process and user as the kernel says
    (``pid``, ``uid``), and from its hello the store it serves (``store_realpath``,
    ``store_id``, ``store_backing``: the marker's backing), ``arena_bytes`` (its host cache),
    ``instance``, ``for_run`` (a training run started it) and ``run`` (the run using it)."""
    pid, uid, _ = conn.peer
    keys = ("store", "store_realpath", "store_id", "store_backing", "arena_bytes", "instance",
            "for_run", "run")
    return {"pid": pid, "uid": uid, **{k: conn.hello.get(k) for k in keys}}


def probe(socket_path: str | os.PathLike[str],
          store: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """Who answers on ``socket_path`` (:func:`daemon_identity`), checked as
    ``tierstore.connect`` checks it, and the socket file too (:func:`check_socket_file`);
    None where nothing listens there (no socket, or connecting is refused)."""
    path = os.path.abspath(os.fspath(socket_path))
    if not check_socket_file(path):
        return None
    try:
        conn = Connection(path, f"probe-{os.getpid()}", want_arena=False, role="status")
    except NoDaemonError:
        return None
    try:
        if store is not None:
            check_serves(path, conn.hello, store)
        return daemon_identity(conn)
    finally:
        conn.close()


def stop(socket_path: str | os.PathLike[str], *, instance: str | None = None,
         timeout_s: float = 60.0) -> bool:
    """SIGTERM the daemon on ``socket_path`` (it flushes and exits) and wait for it to end;
    False where nothing listens there, or where ``instance`` is given and another daemon
    answers. The process signalled is the one the kernel says listens (``SO_PEERCRED``),
    pinned by a pidfd while the connection is open, never a pid the daemon reports; after
    ``timeout_s`` it is killed."""
    path = os.path.abspath(os.fspath(socket_path))
    try:
        conn = Connection(path, f"stop-{os.getpid()}", want_arena=False, role="status")
    except NoDaemonError:
        return False
    try:
        if instance is not None and conn.hello.get("instance") != instance:
            return False
        pidfd = os.pidfd_open(conn.peer[0])
    finally:
        conn.close()
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        if not select.select([pidfd], [], [], timeout_s)[0]:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            select.select([pidfd], [], [], timeout_s)
    except ProcessLookupError:
        pass  # it ended meanwhile
    finally:
        os.close(pidfd)
    return True


def status(socket_path: str | os.PathLike[str]) -> dict[str, Any]:
    """A running daemon's figures, without mapping its cache (``tierstore status``)."""
    conn = Connection(os.path.abspath(os.fspath(socket_path)), f"status-{os.getpid()}",
                       want_arena=False, role="status")
    try:
        return conn.request(P.Op.STATUS, {})[0]
    finally:
        conn.close()
