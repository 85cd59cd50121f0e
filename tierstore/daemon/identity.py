"""Who answers on a daemon's socket, checked before a client uses it.

Anyone who can create a socket where a client looks for one could otherwise receive what the
client writes, and feed it what it reads. So, before its first byte goes out, every
connection checks the kernel's word on the process at the other end (``SO_PEERCRED``): it
must run as this user or as root, or as a user named in ``TIERSTORE_DAEMON_USER`` (the
account a shared daemon runs under, ``tierstore`` in docs/tierstore.service). A client that
names the store it wants (``tierstore.connect(socket, store=PATH)``) also checks that the
daemon serves that store: the same resolved path and the store id in its ``TIERSTORE``
marker. Directories a client makes or trusts for sockets (a distributed run's run directory)
and the socket file itself are refused when they belong to someone else or others may write
there. Every mismatch is one line naming what did not match.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct
from pathlib import Path
from typing import Any

from ..errors import StoreError

TRUST_ENV = "TIERSTORE_DAEMON_USER"
_UCRED = struct.Struct("3i")  # pid, uid, gid


class DaemonIdentityError(StoreError):
    """The daemon on a socket is not the one the client may use: another user's, another
    store's, or reached through a place others control."""


def user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def trusted_uids() -> set[int]:
    """This user, root, and the users ``TIERSTORE_DAEMON_USER`` names (comma-separated names
    or uids)."""
    uids = {os.geteuid(), 0}
    for item in os.environ.get(TRUST_ENV, "").split(","):
        item = item.strip()
        if not item:
            continue
        if item.isdigit():
            uids.add(int(item))
            continue
        try:
            uids.add(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise DaemonIdentityError(f"{TRUST_ENV} names {item!r}, which is no user on this "
                                      "machine") from None
    return uids


def _who_may(uids: set[int]) -> str:
    others = sorted(u for u in uids if u not in (0, os.geteuid()))
    names = ["you", "root"] if os.geteuid() else ["root"]
    return ", ".join(names + [user_name(u) for u in others])


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the
    kernel recorded them when it listened."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def check_peer(path: str, sock: socket.socket) -> tuple[int, int, int]:
    """The peer's credentials, refused unless it runs as a trusted user."""
    pid, uid, gid = peer_credentials(sock)
    uids = trusted_uids()
    if uid not in uids:
        raise DaemonIdentityError(
            f"the daemon at {path} (process {pid}) runs as {user_name(uid)}, not as "
            f"{_who_may(uids)}: refusing to use it (set {TRUST_ENV} to trust that user)")
    return pid, uid, gid


def _owner_and_mode(path: str, what: str) -> os.stat_result:
    st = os.stat(path)
    uids = trusted_uids()
    if st.st_uid not in uids:
        raise DaemonIdentityError(f"{what} {path} is owned by {user_name(st.st_uid)}, not by "
                                  f"{_who_may(uids)}: refusing to use it")
    return st


def check_private_dir(path: str | os.PathLike[str], what: str = "directory") -> None:
    """Refuse a directory (followed through symlinks) that someone else owns, or that its
    group or others may write to: they could put their own socket in it."""
    where = os.fspath(path)
    st = _owner_and_mode(where, what)
    if not stat.S_ISDIR(st.st_mode):
        raise DaemonIdentityError(f"{what} {where} is not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DaemonIdentityError(
            f"{what} {where} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): refusing to use it (chmod go-w {where})")


def check_socket_file(path: str | os.PathLike[str]) -> bool:
    """False where nothing is at ``path``; otherwise refuse a socket someone else owns or
    that anyone may write to (connecting is writing), and anything that is not a socket."""
    where = os.fspath(path)
    try:
        st = _owner_and_mode(where, "socket")
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonIdentityError(f"{where} is not a socket")
    if st.st_mode & stat.S_IWOTH:
        raise DaemonIdentityError(
            f"socket {where} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
            "refusing to use it")
    return True


def store_identity(store: str | os.PathLike[str]) -> tuple[str, str | None]:
    """The store's resolved path and the store id its marker records (None if it has no
    readable marker)."""
    from ..opening import read_marker

    real = os.path.realpath(os.fspath(store))
    try:
        sid = read_marker(real).get("store_id")
    except StoreError:
        sid = None
    return real, sid if isinstance(sid, str) else None


def check_serves(path: str, hello: dict[str, Any], store: str | os.PathLike[str]) -> None:
    """Refuse a daemon that does not serve ``store``: its resolved path and store id must be
    the ones the store's marker here names."""
    want_path, want_id = store_identity(store)
    got_path, got_id = hello.get("store_realpath"), hello.get("store_id")
    if got_path != want_path:
        raise DaemonIdentityError(f"the daemon at {path} serves the store {got_path}, not "
                                  f"{want_path}: refusing to use it")
    if want_id is None or got_id != want_id:
        mine = f"store id {want_id}" if want_id else "no readable store marker"
        raise DaemonIdentityError(f"the daemon at {path} serves store id {got_id} at "
                                  f"{got_path}, where the marker here says {mine}: refusing "
                                  "to use it")


def make_private_dir(path: str | os.PathLike[str], what: str = "run directory") -> None:
    """``path`` as a directory only this user may write to: made 0700 where missing
    (parents too), then checked as :func:`check_private_dir` checks it."""
    Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(path, what)
