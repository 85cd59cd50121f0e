"""A client's side of the daemon's socket: one connection (:class:`Connection`), the
daemon's errors as the store's exception classes, and the lease on the slots of one get."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from .. import errors
from ..errors import StoreError
from . import protocol as P
from .identity import check_peer

RELEASE_DELAY_S = 0.002
# How long the daemon may take to answer a connection's first message. A daemon answers at
# once; something else listening on the socket (or a daemon wedged in its accept loop)
# would otherwise leave the client waiting for ever.
HELLO_TIMEOUT_S = 30.0


class NoDaemonError(StoreError):
    """Nothing listens at the socket's path: it does not exist, or connecting to it is
    refused (a daemon that was killed left it)."""


class Connection:
    """One socket to the daemon. ``request`` is one call at a time (``busy``); one-way
    frames (releases) may be sent from any thread meanwhile under ``send_lock``."""

    def __init__(self, path: str, client_id: str, want_arena: bool, role: str = "client",
                 hello_timeout_s: float | None = None, run: str | None = None) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
            # Before a byte goes out: the process listening must be a trusted user's.
            self.peer = check_peer(path, self.sock)
        except OSError as e:
            self.sock.close()
            cls = NoDaemonError if e.errno in (errno.ENOENT, errno.ECONNREFUSED) else StoreError
            raise cls(f"cannot connect to a tierstore daemon at {path}: {e.strerror or e}"
                      ) from None
        except BaseException:
            self.sock.close()
            raise
        self.reader = P.Reader(self.sock)
        self.pending: list[int] = []  # released leases not yet told to the daemon
        self.pending_lock = threading.Lock()
        self.busy = threading.Lock()
        self.send_lock = threading.Lock()
        self.rid = 0
        self.closed = False
        self.arena_fd = -1
        wait = HELLO_TIMEOUT_S if hello_timeout_s is None else hello_timeout_s
        self.sock.settimeout(wait)
        hello = {"version": P.PROTOCOL_VERSION, "client": client_id, "pid": os.getpid(),
                 "arena": want_arena, "role": role}
        if run is not None:  # this connection belongs to a training run (the daemon's claim)
            hello["run"] = run
        try:
            self.hello, _ = self.request(P.Op.HELLO, hello, fds=want_arena)
        except BaseException as e:
            self.close()  # the socket, and the arena's descriptor if it came
            if isinstance(e, StoreError) and (isinstance(e.__context__, TimeoutError)
                                              or "timed out" in str(e)):
                raise StoreError(f"no tierstore daemon answered at {path} within {wait:g} s "
                                 "(is `tierstore serve` what listens there?)") from None
            raise
        self.sock.settimeout(None)  # requests after the handshake may take as long as they take

    def request(self, op: int, fields: dict[str, Any], payload: list[Any] | None = None,
                fds: bool = False) -> tuple[dict[str, Any], bytearray | None]:
        """Send a request and wait for its answer: (fields, payload bytes or None)."""
        with self.busy:
            self.rid = (self.rid + 1) & 0xFFFFFFFF
            rid = self.rid
            released: list[int] = []
            if self.pending:
                with self.pending_lock:  # at most a list's worth: the daemon refuses more
                    released = self.pending[: P.MAX_KEYS]
                    del self.pending[: P.MAX_KEYS]
                fields = {**fields, "r": released}
            parts = payload or []
            total = sum(p.nbytes for p in parts)
            try:
                head = P.encode(op, rid, fields, total)
                with self.send_lock:
                    self.sock.sendall(head)
                    for p in parts:
                        self.sock.sendall(p)
            except OSError as e:
                # The daemon may have answered (an error) and closed before taking it all
                # (a connection over its limit is refused before its hello is read): the
                # answer says why better than the broken pipe does.
                answer = None
                with contextlib.suppress(StoreError):
                    answer = self._next_frame(rid, fds)
                lost = self._lost(e)
                if answer is not None and answer[0] == P.Op.ERROR:
                    raise daemon_error(answer[1]) from None
                raise lost from None
            try:
                return self._read_answer(rid, fds)
            except StoreError:
                # A refused request (the daemon busy) was not read, releases and all: they
                # go again with the next one. Lease ids are never reused and the daemon
                # ignores ones it no longer holds, so one that did get through is harmless.
                if released and not self.closed:
                    with self.pending_lock:
                        self.pending[:0] = released
                raise

    def _read_answer(self, rid: int, fds: bool) -> tuple[dict[str, Any], bytearray | None]:
        op, fields, payload = self._next_frame(rid, fds)
        if op == P.Op.ERROR:
            raise daemon_error(fields)
        return fields, payload

    def _next_frame(self, rid: int, fds: bool
                    ) -> tuple[int, dict[str, Any], bytearray | None]:
        """The answer to request ``rid``, or an error after which the daemon closes this
        connection, whatever it answers: (op, fields, payload)."""
        while True:
            try:
                if fds:  # the hello answer brings the arena's descriptor with its first bytes
                    head, got_fds, _, _ = socket.recv_fds(self.sock, P.HEADER_BYTES, 1)
                    if got_fds:
                        self.arena_fd = got_fds[0]
                    fds = False
                    r = self.reader
                    r.buf[r.end : r.end + len(head)] = head
                    r.end += len(head)
                frame = self.reader.frame(1 << 62)
                if frame is None:
                    raise P.ProtocolError("the daemon closed the connection", fatal=True)
            except (OSError, P.ProtocolError) as e:
                raise self._lost(e) from None
            op, _, got_rid, raw, payload = frame
            fields = P.decode_fields(raw)
            if op == P.Op.ERROR and fields.get("closed") is True:
                self._lost(P.ProtocolError("closed by the daemon"))  # never reused
                return op, fields, payload
            if got_rid != rid:
                continue  # an answer to an earlier one-way frame's error: not ours
            return op, fields, payload

    def flush_releases(self) -> None:
        with self.pending_lock:
            released, self.pending = self.pending, []
        for i in range(0, len(released), P.MAX_KEYS):  # a list's worth a frame
            self.send_oneway(P.Op.RELEASE, {"leases": released[i : i + P.MAX_KEYS]})

    def send_oneway(self, op: int, fields: dict[str, Any]) -> None:
        if self.closed:
            return
        with contextlib.suppress(OSError), self.send_lock:
            self.sock.sendall(P.encode(op, 0, fields, flags=P.NO_REPLY))

    def _lost(self, e: BaseException) -> StoreError:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        return StoreError(f"lost the connection to the daemon at {self.path}: {e}")

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.arena_fd >= 0:
            os.close(self.arena_fd)
            self.arena_fd = -1


def daemon_error(fields: dict[str, Any]) -> Exception:
    """The daemon's error as the same exception class a local store raises: a StoreError
    subclass, or an OSError (its errno picks the subclass, as for a local one)."""
    message = str(fields.get("message", "daemon error"))
    if "errno" in fields:
        return OSError(int(fields["errno"]), message, fields.get("filename"))
    cls = getattr(errors, str(fields.get("error")), None)
    if not (isinstance(cls, type) and issubclass(cls, StoreError)):
        cls = StoreError
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    for attr in ("name", "kind"):  # what a local store's error names (EntryNotFoundError...)
        if isinstance(fields.get(attr), str):
            setattr(err, attr, fields[attr])
    return err


class Lease:
    """The daemon-side pin on the slots of one get; ``release`` exactly once.

    A release rides on the connection's next request (no message of its own, which would
    cost both processes a wake-up per get); if none follows within RELEASE_DELAY_S, the
    client's releaser thread sends it alone.
    """

    __slots__ = ("arm", "conn", "lease", "done")

    def __init__(self, arm: Callable[[], None], conn: Connection, lease: int) -> None:
        # ``arm`` wakes the client's releaser thread (RemoteStore._arm_releaser).
        self.arm, self.conn, self.lease, self.done = arm, conn, lease, False

    def release(self) -> None:
        if not self.done and self.lease:
            self.done = True
            with self.conn.pending_lock:
                self.conn.pending.append(self.lease)
            self.arm()
