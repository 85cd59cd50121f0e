"""``tierstore serve``: one process owns a store and serves it to local clients.

- Control travels over a Unix stream socket (``protocol.py``); one thread per connection,
  because every store call blocks (LMDB, I/O, waiting on another thread's cache fill) and
  the store is thread-safe; the heavy parts (I/O, checksums, copies) release the GIL. At
  most ``max_connections`` (``--max-connections``, 1024) at once: one more is answered with
  an error saying so, then closed, unless it is a status probe (``tierstore status``),
  for which a few spare connections stay (``STATUS_SPARES``), so that a full daemon can
  still be asked who holds it. A connection is dropped if it has not said hello within
  ``--hello-timeout`` (10 s), or has not taken a byte of an answer for ``--send-timeout``
  (30 s).
- Bulk bytes do not: the host cache's slot arena is a memfd (shared memory) that the
  daemon maps read-write and hands to each client as a read-only file descriptor (a fresh
  O_RDONLY open of it, passed over the socket with SCM_RIGHTS; the memfd itself is chmod
  0400 so a client cannot reopen it for writing). A get answers (offset, length, dtype,
  shape, lease): the client copies from its mapping, or keeps a read-only view. Later
  gets of a published entry skip the socket (``shared_cache.py``: the published index).
- Leases: the slots a get answered with stay pinned in the cache (never evicted, never
  reused) until the client releases the lease or its connection closes.
- Acknowledgement means durable, and visibility means committed: a put through the daemon
  is written copy-on-write and committed in LMDB first and only then lands (clean) in the
  cache, before the answer goes out. So a SIGKILL of the daemon loses no acknowledged
  write, and no client, which outlives the daemon, ever read a version a crash took back.
- Memory for requests is bounded, whatever clients declare:

  - before its hello a connection is served only a hello or a status request, with at
    most 64 KiB of fields. Other frames are answered "say hello first", and their payloads
    and larger fields skipped unread, through the read buffer; a payload over 64 KiB is
    fatal there, and none of it is read;
  - a put's payload is read in pieces of 1 MiB into one buffer that grows only as bytes
    arrive: a client that declares 3 GiB and sends nothing costs nothing;
  - per connection (one request at a time): a payload over ``max_request_bytes``
    (``--max-request``, default 4 GiB) is refused before any of it is read, and the
    connection closed, since the stream can no longer be trusted to be framed;
  - for the whole daemon: the payload bytes held by all connections together, and fields
    blocks over 64 KiB, are at most ``max_inflight_bytes`` (``--max-inflight``, default
    8 GiB, never less than ``max_request_bytes``). A request that would go over waits for
    others to finish, up to ``budget_wait_s`` (30 s), and is then refused; what it had
    read is dropped, the rest of it is read and discarded, and the connection serves on.

The daemon's parts: ``intake.py`` reads requests within those bounds, ``handlers.py``
answers each op, ``shared_cache.py`` holds the cache's shared memory and the published
index; this module accepts connections, serves each on its thread and reports the figures.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import itertools
import os
import resource
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from tierstore.cache.slab import PAGE

from ..errors import StoreError
from ..interface import status_figures
from ..local import LocalStore
from ..opening import check_host_cache, open_store, read_marker
from ..sizes import TIMEOUT_RANGE_S, format_size, parse_size
from . import protocol as P
from .handlers import HANDLERS, OpHandlers
from .intake import (
    BUDGET_WAIT_S,
    DEFAULT_MAX_REQUEST,
    ByteBudget,
    Conn,
    Request,
    admit,
    inflight_limit,
)
from .metrics import DaemonRegistry, MetricsServer
from .shared_cache import SharedCache

# A connection costs a thread; more are answered with an error and closed
# (``--max-connections``).
MAX_CONNECTIONS = 1024
# Connections past that limit taken for a look at the daemon (``tierstore status``): a full
# daemon must still say who holds it. Each is served a status request and nothing else, and
# is dropped if it is quiet for the hello timeout.
STATUS_SPARES = 4
# A condition the operator should hear of (at the connection limit, out of descriptors) is
# logged when it first happens and then at most this often, with how often it happened.
LOG_EVERY_S = 60.0
# A connection that has not said hello by then is dropped: idle ones must not hold the
# connection slots (or descriptors) that real clients need (``--hello-timeout``).
HELLO_DEADLINE_S = 10.0
# An answer the client has not taken a byte of for this long: the client is stopped (a
# debugger, Ctrl-Z) and its connection is dropped, giving back the answer's bytes, which
# count against --max-inflight for every client (``--send-timeout``).
SEND_TIMEOUT_S = 30.0
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_OP_NAMES = {op.value: op.name.lower() for op in P.Op}


class Server(OpHandlers):
    """A daemon serving ``store_path`` on ``socket_path``; see the module docstring."""

    def __init__(
        self,
        store_path: str,
        socket_path: str,
        *,
        host_cache: int | str = "1GiB",
        metrics_port: int | None = None,
        group: str | None = None,
        max_request_bytes: int | str = DEFAULT_MAX_REQUEST,
        max_inflight_bytes: int | str | None = None,
        budget_wait_s: float = BUDGET_WAIT_S,
        max_connections: int = MAX_CONNECTIONS,
        hello_timeout_s: float = HELLO_DEADLINE_S,
        send_timeout_s: float = SEND_TIMEOUT_S,
        create: bool = False,
        policy: str = "lfu-decay",
        for_run: bool = False,
        store_options: dict[str, Any] | None = None,
        log: Callable[[str], Any] | None = None,
    ) -> None:
        self.socket_path = os.path.abspath(socket_path)
        _check_socket_path(self.socket_path)  # before the store: nothing to undo
        self.max_request = parse_size(max_request_bytes)
        self.max_inflight = inflight_limit(self.max_request, max_inflight_bytes)
        self._budget = ByteBudget(self.max_inflight)
        self._budget_wait = budget_wait_s
        if max_connections < 1:
            raise StoreError(f"--max-connections must be at least 1, not {max_connections}")
        self.max_connections = max_connections
        self.hello_timeout = _timeout("--hello-timeout", hello_timeout_s)
        self.send_timeout = _timeout("--send-timeout", send_timeout_s)
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._logged: dict[str, tuple[float, int]] = {}  # what -> (last logged, times since)
        self._logged_lock = threading.Lock()
        self._clock = time.monotonic
        self._spares = 0  # connections open in the status spares (STATUS_SPARES)
        _raise_open_files_limit()
        cap = parse_size(host_cache) // PAGE * PAGE
        if cap < PAGE:
            raise StoreError("the daemon needs a host cache (--host-cache of at least 4KiB): "
                             "clients read entries out of it")
        check_host_cache(cap)  # before the shared memory is made
        self._gid = _group_id(group) if group is not None else None
        # The arena first: the store's cache is carved out of it.
        self._shared = SharedCache(cap)
        self.index_rows = self._shared.index_rows
        self.arena_bytes = cap
        # Which daemon this is: a client mapped one daemon's shared memory, and must never
        # read another's offsets into it (a daemon restarted on the same socket).
        self.instance = uuid.uuid4().hex
        # The store lock decides which daemon owns the store, before the socket is touched,
        # so a refused second daemon never disturbs the first one's socket.
        try:
            # ``store_options``: backing, pmem_path, pmem_size, slab_size (tierstore.open's).
            options = {k: v for k, v in (store_options or {}).items() if v is not None}
            self.store: LocalStore = open_store(store_path, create=create, host_cache=cap,
                                                policy=policy, cache_arena=self._shared.arena,
                                                **options)
        except BaseException:
            self._shared.close()
            raise
        cache = self.store.internals.cache
        assert cache is not None
        self._shared.attach(cache)
        # What a client checks before it uses this daemon (``identity.py``): the store it
        # serves, and whether a training run started it (the run that finishes stops it).
        marker = read_marker(self.store.path)
        self.identity: dict[str, Any] = {
            "store_realpath": os.path.realpath(self.store.path),
            "store_id": marker.get("store_id"), "store_backing": marker["backing"],
            "for_run": for_run}
        self._stop = threading.Event()
        self._conns: dict[int, Conn] = {}
        self._conns_lock = threading.Lock()
        self._cids = itertools.count(1)
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._reports: dict[str, dict[str, Any]] = {}
        self._registry = DaemonRegistry(lambda: P.jsonable(self.status()))
        self._started = time.time()
        self._listener: socket.socket | None = None
        self.metrics: MetricsServer | None = None
        try:
            self._listener = self._bind()
            if metrics_port is not None:
                self.metrics = self._serve_metrics(metrics_port)
        except BaseException:
            self._teardown()
            raise

    def _serve_metrics(self, port: int) -> MetricsServer:
        try:
            return MetricsServer(port, self._registry, lambda: not self._stop.is_set())
        except OSError as e:
            raise StoreError(f"cannot serve metrics on 127.0.0.1:{port}: "
                             f"{e.strerror or e}") from None

    # -- socket ---------------------------------------------------------------------
    def _bind(self) -> socket.socket:
        path = self.socket_path
        try:
            return self._bind_at(path)
        except OSError as e:
            raise StoreError(f"cannot listen on {path}: {e.strerror or e}") from None

    def _bind_at(self, path: str) -> socket.socket:
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise StoreError(f"{path} exists and is not a socket; choose another --socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)  # left by a daemon that was killed: nobody listens
            except OSError as e:  # not ours to judge (another user's daemon, say): never unlink
                raise StoreError(f"cannot tell whether a daemon listens on {path} "
                                 f"({e.strerror or e}); choose another --socket") from None
            else:
                raise StoreError(f"socket {path} is in use by a running daemon")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # never visible with wider permissions, not even briefly
            try:
                sock.bind(path)
            finally:
                os.umask(old)
            if self._gid is not None:
                os.chown(path, -1, self._gid)
                os.chmod(path, 0o660)
            else:
                os.chmod(path, 0o600)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        return sock

    # -- main loop ------------------------------------------------------------------
    def serve_forever(self) -> int:
        """Accept clients until SIGTERM/SIGINT (or ``stop()``); then flush, close, return 0."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: stop() only
                signal.signal(sig, lambda *_: self._stop.set())
        assert self._listener is not None
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                if not sel.select(timeout=0.2):
                    continue
                try:
                    sock, _ = self._listener.accept()
                except OSError as e:
                    if e.errno in _OUT_OF_DESCRIPTORS:
                        # The listener stays readable: without a pause this loop would
                        # spin on the same error until a connection closes.
                        self._log_now_and_then(
                            "accept", f"tierstore serve: cannot accept a connection "
                            f"({e.strerror}); waiting for one to close")
                        self._stop.wait(0.1)
                    continue
                with self._conns_lock:
                    spare = len(self._conns) - self._spares >= self.max_connections
                    full = spare and self._spares >= STATUS_SPARES
                if full:
                    self._refuse(sock)
                    continue
                sock.settimeout(self.hello_timeout)  # until its hello (see _serve_one)
                secs = int(self.send_timeout)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack(
                    "ll", secs, round((self.send_timeout - secs) * 1e6)))
                conn = Conn(sock, next(self._cids))
                conn.spare = spare
                conn.thread = threading.Thread(target=self._serve_conn, args=(conn,),
                                               name=f"tierstore-conn-{conn.cid}", daemon=True)
                with self._conns_lock:
                    self._conns[conn.cid] = conn
                    self._spares += spare
                conn.thread.start()
        finally:
            sel.close()
            self.shutdown()
        return 0

    def _refuse(self, sock: socket.socket) -> None:
        """Tell a connection over the limit why it is closed, rather than hang up on it."""
        limit = self.max_connections
        self._log_now_and_then("limit", f"tierstore serve: at the limit of {limit} "
                               "connections (--max-connections): refusing new ones until "
                               "some close")
        # Request id 0 and ``closed``: it answers no request (none is read), it ends the
        # connection. Sent without blocking, since this is the accept loop: a new socket's
        # empty buffer takes one small frame, and a client already gone is no loss.
        fields = {"error": "StoreError", "closed": True,
                  "message": f"the tierstore daemon at {self.socket_path} is at its connection "
                             f"limit of {limit} (--max-connections); try again once a "
                             "client has disconnected"}
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(P.encode(P.Op.ERROR, 0, fields))
        sock.close()

    def stop(self) -> None:
        self._stop.set()

    def _log_now_and_then(self, what: str, message: str) -> None:
        """Log ``message`` the first time ``what`` happens, then at most every LOG_EVERY_S,
        saying how many times it happened since: a flood of refusals is one line a minute,
        and a daemon full again a day later says so again."""
        with self._logged_lock:  # the accept loop and connection threads both refuse
            now = self._clock()
            last, times = self._logged.get(what, (None, 0))
            times += 1
            if last is not None and now - last < LOG_EVERY_S:
                self._logged[what] = (last, times)
                return
            self._logged[what] = (now, 0)
        self._log(message if times == 1 else f"{message} ({times} times since the last report)")

    def shutdown(self) -> None:
        """Stop serving: drop every connection (their leases with them), flush, close."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._conns_lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for conn in conns:
            if conn.thread is not None and conn.thread is not threading.current_thread():
                conn.thread.join(timeout=30)
        self._teardown()

    def _teardown(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        # The socket goes before the store lock does: once the lock is free, a new daemon
        # on this store may bind the same path, and unlinking then would take its socket.
        if self._listener is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            self._listener = None
        store = getattr(self, "store", None)
        if store is not None and not store.closed:
            store.close()  # writes back every dirty entry
        self._shared.close()

    # -- one connection ---------------------------------------------------------------
    def _serve_conn(self, conn: Conn) -> None:
        reader = P.Reader(conn.sock)
        try:
            while not self._stop.is_set():
                req = Request(reader, self._budget, self._budget_wait)
                try:
                    go_on = self._serve_one(conn, req)
                finally:
                    req.release()
                # After a refused request, outside its handler's frames: what it read is
                # freed before waiting on the bytes it left unread.
                if not go_on or not req.skip_rest():
                    return
        except OSError:
            return
        finally:
            with self._conns_lock:
                self._conns.pop(conn.cid, None)
                self._spares -= conn.spare
            try:
                conn.release_all()
            finally:
                with contextlib.suppress(OSError):
                    conn.sock.close()

    def _serve_one(self, conn: Conn, req: Request) -> bool:
        """Read one request, act on it and answer; False once the connection is done."""
        rid = flags = 0
        op = -1
        try:
            head = req.header(self.max_request)
            if head is None:
                return False
            op, flags, rid, nfields, npayload = head
            admit(conn, op, nfields, npayload)
            fields = req.fields()
            if conn.spare and op != P.Op.STATUS and not (
                    op == P.Op.HELLO and fields.get("role") == "status"):
                self._refuse(conn.sock)  # a client in a status spare: over the limit
                return False
            if op == P.Op.HELLO and not conn.spare:
                conn.sock.settimeout(None)  # a client may be quiet as long as it likes
            try:
                answer = self._dispatch(conn, op, fields, req)
            except OSError as e:
                # The store's (a full disk, a failed write, a file in the way), not the
                # socket's, which the request's reading turns into a ProtocolError: the
                # client gets it as the OSError a local store raises, and goes on.
                if not flags & P.NO_REPLY:
                    self._send_error(conn, rid, e)
                return True
            if answer is not None and not flags & P.NO_REPLY:
                fields_out, parts, fds = answer
                self._send(conn, rid, fields_out, parts, fds)
            return True
        except P.ProtocolError as e:
            if e.fatal or not flags & P.NO_REPLY:
                self._send_error(conn, rid, e)
            return not e.fatal
        except StoreError as e:
            if not flags & P.NO_REPLY:
                self._send_error(conn, rid, e)
            return True
        except OSError:
            return False
        except Exception as e:  # a request must never take the daemon down
            self._log(f"tierstore serve: internal error serving op {op}: {e!r}")
            if not flags & P.NO_REPLY:
                self._send_error(conn, rid, StoreError(f"internal error: {e!r}"[:300]))
            return True

    def _send(self, conn: Conn, rid: int, fields: dict[str, Any],
              parts: list[Any] | None = None, fds: list[int] | None = None) -> None:
        parts = parts or []
        total = sum(len(memoryview(p).cast("B")) for p in parts)
        head = P.encode(P.Op.REPLY, rid, fields, total)
        with conn.send_lock:
            if fds:
                socket.send_fds(conn.sock, [head], fds)
            else:
                conn.sock.sendall(head)
            for p in parts:
                conn.sock.sendall(p)

    def _send_error(self, conn: Conn, rid: int, err: Exception) -> None:
        kind = type(err).__name__ if not isinstance(err, P.ProtocolError) else "StoreError"
        fields: dict[str, Any] = {"error": kind, "message": str(err)[:1000]}
        if isinstance(err, P.ProtocolError):
            fields["protocol"] = True
            if err.fatal:  # whatever it answers, the client's connection ends here
                fields["closed"] = True
        if isinstance(err, OSError) and not isinstance(err, StoreError):
            fields.update(errno=err.errno or 0, message=(err.strerror or str(err))[:1000])
            if err.filename is not None:
                fields["filename"] = str(err.filename)
        for attr in ("name", "kind"):  # what the local store's error names
            if isinstance(getattr(err, attr, None), str):
                fields[attr] = getattr(err, attr)
        with contextlib.suppress(OSError), conn.send_lock:
            conn.sock.sendall(P.encode(P.Op.ERROR, rid, fields))

    # -- requests ---------------------------------------------------------------------
    def _dispatch(self, conn: Conn, op: int, fields: dict[str, Any],
                  req: Request) -> tuple[dict[str, Any], list[Any], list[int]] | None:
        handler = HANDLERS.get(op)
        if handler is None:
            raise P.ProtocolError(f"unknown request op {op}")
        if op not in (P.Op.HELLO, P.Op.STATUS) and conn.role == "anonymous":
            raise P.ProtocolError("say hello first")
        if "r" in fields:  # leases released since the client's last request
            self._release_leases(conn, P.Fields(fields).list("r"))
        if "h" in fields:  # hits the client served itself since it last said
            self._shared.record_hits(P.Fields(fields).list("h", 2 * P.MAX_KEYS))
        counted = op not in (P.Op.STATUS, P.Op.STATS, P.Op.RELEASE, P.Op.REPORT)
        if counted:
            with self._in_flight_lock:
                self._in_flight += 1
        t0 = time.perf_counter()
        try:
            out = handler(self, conn, P.Fields(fields), req)
        finally:
            if counted:
                with self._in_flight_lock:
                    self._in_flight -= 1
            self._registry.observe(_OP_NAMES[op], time.perf_counter() - t0)
        if out is None:
            return None
        if isinstance(out, tuple):
            return out[0], out[1], out[2] if len(out) > 2 else []
        return out, [], []

    def status(self) -> dict[str, Any]:
        """Clients, leases, hit rate, bytes per tier and queue depths."""
        with self._conns_lock:
            conns = list(self._conns.values())
            reports = dict(self._reports)
        clients: dict[str, dict[str, Any]] = {}
        for c in conns:
            if c.role != "client":
                continue
            entry = clients.setdefault(c.client, {"client": c.client, "pid": c.pid,
                                                  "connections": 0, "leases": 0})
            entry["connections"] += 1
            entry["leases"] += len(c.leases)
        with self._conns_lock:  # reports of clients that have gone are dropped
            for gone in set(self._reports) - set(clients):
                del self._reports[gone]
        queues = []
        for name, devices in reports.items():
            if name in clients:
                clients[name]["prefetch"] = devices
                queues += devices.values()
        st = self.store
        figures = status_figures(st.stats() if not st.closed else None, st.backing, queues)
        return {
            "pid": os.getpid(),
            "store": st.path,
            "socket": self.socket_path,
            "backend": st.describe() if not st.closed else None,
            "uptime_s": time.time() - self._started,
            "metrics_port": self.metrics.port if self.metrics is not None else None,
            "clients": len(clients),
            "connections": sum(c["connections"] for c in clients.values()),
            # Every open connection (before its hello, and status probes too) against the
            # limit, which only the former count towards: what an operator of a full
            # daemon needs to see.
            "open_connections": len(conns), "max_connections": self.max_connections,
            "leases": sum(c["leases"] for c in clients.values()),
            "client_list": list(clients.values()),
            "run": self.claimed_by(),
            **self.identity,
            **figures,
            "queues": {"requests_in_flight": self._in_flight,
                       "request_bytes_held": self._budget.used,
                       "request_bytes_limit": self._budget.limit,
                       **figures["queues"]},
        }

    def describe(self) -> str:
        port = f", metrics on http://127.0.0.1:{self.metrics.port}/metrics" if self.metrics else ""
        return (f"serving {self.store.path} ({self.store.describe()}) on {self.socket_path}, "
                f"host cache {format_size(self.arena_bytes)} in shared memory, requests up "
                f"to {format_size(self.max_request)} each and {format_size(self.max_inflight)} "
                f"in all{port}")


def _check_socket_path(path: str) -> None:
    if len(os.fsencode(path)) >= 108:
        raise StoreError(f"socket path {path} is too long for a Unix socket (max 107 bytes)")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise StoreError(f"cannot listen on {path}: directory {parent} does not exist")


def _timeout(option: str, seconds: float) -> float:
    low, high = TIMEOUT_RANGE_S  # as the command line's TIMEOUT checks it
    if not low <= seconds <= high:  # false for nan as well
        raise StoreError(f"{option} must be between {low:g} and {high:g} seconds, not {seconds}")
    return float(seconds)


def _group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StoreError(f"no group named {group!r}") from None


def _raise_open_files_limit() -> None:
    """Every connection is a descriptor (and a client opens up to eight): the soft limit,
    often 1024, is raised to the hard one, as servers do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
