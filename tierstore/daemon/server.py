"""``tierstore serve``: one process owns a store and serves it to local clients.

- Control travels over a Unix stream socket (``protocol.py``); one thread per connection,
  because every store call blocks (LMDB, I/O, waiting on another thread's cache fill) and
  the store is thread-safe; the heavy parts (I/O, checksums, copies) release the GIL.
- Bulk bytes do not: the host cache's slot arena is a memfd (shared memory) that the
  daemon maps read-write and hands to each client as a read-only file descriptor (a fresh
  O_RDONLY open of it, passed over the socket with SCM_RIGHTS; the memfd itself is chmod
  0400 so a client cannot reopen it for writing). A get answers (offset, length, dtype,
  shape, lease): the client copies from its mapping, or keeps a read-only view. Later
  gets of a published entry skip the socket (see "the published index" below).
- Leases: the slots a get answered with stay pinned in the cache (never evicted, never
  reused) until the client releases the lease or its connection closes.
- Acknowledgement means durable: a put through the daemon lands in the cache and is then
  flushed (written back copy-on-write and committed in LMDB) before the answer goes out,
  so a SIGKILL of the daemon loses no acknowledged write. Concurrent puts share flushes.
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
"""

from __future__ import annotations

import contextlib
import functools
import grp
import itertools
import math
import mmap
import os
import selectors
import signal
import socket
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tierstore.cache.slab import PAGE

from ..errors import StoreError, UnsupportedTensorError
from ..opening import check_host_cache
from ..sizes import format_size, parse_size
from ..store import Store, check_kind, check_name, check_tag, open_store
from ..tensors import DTYPES, dtype_name, element_size, from_bytes
from . import protocol as P
from .metrics import Histogram, MetricsServer, exposition

DEFAULT_MAX_REQUEST = 4 << 30
DEFAULT_MAX_INFLIGHT = 8 << 30
BUDGET_WAIT_S = 30.0  # how long a request waits for others' payloads to be done with
INDEX_ROW_BYTES = 16  # (seq, offset), int64 each
MAX_INDEX_ROWS = 1 << 18  # 4 MiB of index; entries beyond it are served over the socket
MAX_CONNECTIONS = 1024  # a connection costs a thread; more are refused
MAX_CLIENT_ID = 64


class ByteBudget:
    """Bytes of requests held in memory by all connections together: at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cv = threading.Condition()

    def take(self, n: int, timeout: float) -> bool:
        """Hold ``n`` more bytes, waiting up to ``timeout`` seconds for others to give
        theirs back; False if they did not."""
        with self._cv:
            if not self._cv.wait_for(lambda: self.used + n <= self.limit, timeout):
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        if n:
            with self._cv:
                self.used -= n
                self._cv.notify_all()


class _Request:
    """One request as it arrives: header, fields, payload. Each is read only when asked for,
    in bounded pieces, and the bytes it holds count against the daemon's budget until
    ``release``."""

    def __init__(self, reader: P.Reader, budget: ByteBudget, wait_s: float) -> None:
        self.reader, self.budget, self.wait_s = reader, budget, wait_s
        self.fields_left = self.payload_left = self.payload_bytes = self.held = 0

    def header(self, max_payload: int) -> tuple[int, int, int, int, int] | None:
        """(op, flags, request id, fields length, payload length); None on a clean EOF."""
        head = self.reader.read(P.HEADER_BYTES)
        if head is None:
            return None
        out = P.parse_header(head, max_payload)
        self.fields_left = out[3]
        self.payload_left = self.payload_bytes = out[4]
        return out

    def _hold(self, n: int) -> None:
        if not self.budget.take(n, self.wait_s):
            raise StoreError(f"the daemon is busy: requests in flight hold "
                             f"{self.budget.used} of its {self.budget.limit} bytes "
                             f"(--max-inflight); try again")
        self.held += n

    def _let_go(self, n: int) -> None:
        self.budget.give(n)
        self.held -= n

    def fields(self) -> dict[str, Any]:
        n = self.fields_left
        # Large fields grow the connection's read buffer until they are decoded; held only
        # that long, so that they never stand between a put and its own payload.
        big = n if n > P.READER_BYTES else 0
        if big:
            self._hold(big)
        try:
            raw = self.reader.read(n) if n else b"{}"
            if raw is None:
                raise P.ProtocolError("truncated frame", fatal=True)
            self.fields_left = 0
            return P.decode_fields(raw)
        finally:
            self._let_go(big)

    def payload(self) -> bytearray:
        """The payload, read piece by piece into one buffer that grows as bytes arrive (on
        Linux, growing a large buffer remaps its pages rather than copying them)."""
        buf = bytearray()
        while self.payload_left:
            k = min(P.PAYLOAD_CHUNK, self.payload_left)
            self._hold(k)
            at = len(buf)
            buf += _ZEROS[:k]
            with memoryview(buf)[at:] as dst:
                self.reader.read_exact_into(dst)
            self.payload_left -= k
        return buf

    def skip_rest(self) -> bool:
        """Read and drop what a refused request left unread, so that the next frame starts
        where it should; False if the connection ended first."""
        try:
            self.reader.skip(self.fields_left + self.payload_left)
        except (OSError, P.ProtocolError):
            return False
        self.fields_left = self.payload_left = 0
        return True

    def release(self) -> None:
        self._let_go(self.held)


class _Conn:
    """One client connection and the leases it holds."""

    def __init__(self, sock: socket.socket, cid: int) -> None:
        self.sock = sock
        self.cid = cid
        self.client = f"anonymous-{cid}"
        self.pid = 0
        self.role = "anonymous"  # until its hello
        self.leases: dict[int, list[Any]] = {}
        self.lease_ids = itertools.count(1)
        self.send_lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def release_all(self) -> int:
        n = 0
        while self.leases:
            _, handles = self.leases.popitem()
            for h in handles:
                h.release()
            n += 1
        return n


class Server:
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
        create: bool = False,
        policy: str = "lfu-decay",
        log: Callable[[str], Any] | None = None,
    ) -> None:
        self.socket_path = os.path.abspath(socket_path)
        _check_socket_path(self.socket_path)  # before the store: nothing to undo
        self.max_request = parse_size(max_request_bytes)
        self.max_inflight = _inflight_limit(self.max_request, max_inflight_bytes)
        self._budget = ByteBudget(self.max_inflight)
        self._budget_wait = budget_wait_s
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        cap = parse_size(host_cache) // PAGE * PAGE
        if cap < PAGE:
            raise StoreError("the daemon needs a host cache (--host-cache of at least 4KiB): "
                             "clients read entries out of it")
        check_host_cache(cap)  # before the shared memory is made
        self._gid = _group_id(group) if group is not None else None
        # The arena first: the store's cache is carved out of it. The index of published
        # slots follows it in the same segment (see _publish).
        self.index_rows = max(1, min(cap // PAGE, MAX_INDEX_ROWS))
        index_bytes = -(-self.index_rows * INDEX_ROW_BYTES // PAGE) * PAGE
        self._memfd = os.memfd_create("tierstore-cache", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._memfd, cap + index_bytes)
            self._map = mmap.mmap(self._memfd, cap + index_bytes)
        except OSError as e:
            os.close(self._memfd)
            raise StoreError(f"cannot map a host cache of {format_size(cap)} in shared "
                             f"memory: {e.strerror or e}; choose a smaller --host-cache"
                             ) from None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            arena = torch.frombuffer(self._map, dtype=torch.uint8, count=cap)
        self._index = np.frombuffer(self._map, dtype=np.int64, count=self.index_rows * 2,
                                    offset=cap).reshape(self.index_rows, 2)
        self._index[:, 0] = 1  # odd: not published
        self._free_rows = list(range(self.index_rows - 1, -1, -1))
        self._row_keys: dict[int, Any] = {}
        # What clients get: a read-only open of the memfd, which is then made unopenable
        # for writing (a client could otherwise reopen /proc/self/fd/N read-write).
        self._ro_fd = os.open(f"/proc/self/fd/{self._memfd}", os.O_RDONLY | os.O_CLOEXEC)
        os.fchmod(self._memfd, 0o400)
        os.close(self._memfd)  # the mapping keeps the memory
        self.arena_bytes = cap
        # The store lock decides which daemon owns the store, before the socket is touched,
        # so a refused second daemon never disturbs the first one's socket.
        try:
            self.store: Store = open_store(store_path, create=create, host_cache=cap,
                                           policy=policy, cache_arena=arena)
        except BaseException:
            os.close(self._ro_fd)
            raise
        self._cache = self.store._cache
        assert self._cache is not None
        self._arena_ptr = self._cache.arena.data_ptr()
        self._cache.on_retire(self._retire_row)
        self._stop = threading.Event()
        self._conns: dict[int, _Conn] = {}
        self._conns_lock = threading.Lock()
        self._cids = itertools.count(1)
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._reports: dict[str, dict[str, Any]] = {}
        self._latency = Histogram()
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
            return MetricsServer(port, self.metrics_text, lambda: not self._stop.is_set())
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
            except OSError:
                os.unlink(path)  # left by a daemon that was killed
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
                except OSError:
                    continue
                if len(self._conns) >= MAX_CONNECTIONS:
                    sock.close()
                    continue
                conn = _Conn(sock, next(self._cids))
                conn.thread = threading.Thread(target=self._serve_conn, args=(conn,),
                                               name=f"tierstore-conn-{conn.cid}", daemon=True)
                with self._conns_lock:
                    self._conns[conn.cid] = conn
                conn.thread.start()
        finally:
            sel.close()
            self.shutdown()
        return 0

    def stop(self) -> None:
        self._stop.set()

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
        store = getattr(self, "store", None)
        if store is not None and not store._closed:
            store.close()  # writes back every dirty entry
        if self._listener is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            self._listener = None
        for fd in ("_ro_fd",):
            if getattr(self, fd, -1) >= 0:
                os.close(getattr(self, fd))
                setattr(self, fd, -1)

    # -- one connection ---------------------------------------------------------------
    def _serve_conn(self, conn: _Conn) -> None:
        reader = P.Reader(conn.sock)
        try:
            while not self._stop.is_set():
                req = _Request(reader, self._budget, self._budget_wait)
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
            try:
                conn.release_all()
            finally:
                with contextlib.suppress(OSError):
                    conn.sock.close()

    def _serve_one(self, conn: _Conn, req: _Request) -> bool:
        """Read one request, act on it and answer; False once the connection is done."""
        rid = flags = 0
        op = -1
        try:
            head = req.header(self.max_request)
            if head is None:
                return False
            op, flags, rid, nfields, npayload = head
            _admit(conn, op, nfields, npayload)
            answer = self._dispatch(conn, op, req.fields(), req)
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

    def _send(self, conn: _Conn, rid: int, fields: dict[str, Any],
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

    def _send_error(self, conn: _Conn, rid: int, err: Exception) -> None:
        kind = type(err).__name__ if not isinstance(err, P.ProtocolError) else "StoreError"
        fields = {"error": kind, "message": str(err)[:1000]}
        if isinstance(err, P.ProtocolError):
            fields["protocol"] = True
        with contextlib.suppress(OSError), conn.send_lock:
            conn.sock.sendall(P.encode(P.Op.ERROR, rid, fields))

    # -- requests ---------------------------------------------------------------------
    def _dispatch(self, conn: _Conn, op: int, fields: dict[str, Any],
                  req: _Request) -> tuple[dict[str, Any], list[Any], list[int]] | None:
        handler = _HANDLERS.get(op)
        if handler is None:
            raise P.ProtocolError(f"unknown request op {op}")
        if op not in (P.Op.HELLO, P.Op.STATUS) and conn.role == "anonymous":
            raise P.ProtocolError("say hello first")
        if "r" in fields:  # leases released since the client's last request
            self._release_leases(conn, P.Fields(fields).list("r"))
        if "h" in fields:  # hits the client served itself since it last said
            self._fast_hits(P.Fields(fields).list("h", 2 * P.MAX_KEYS))
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
            self._latency.observe(_OP_NAMES[op], time.perf_counter() - t0)
        if out is None:
            return None
        if isinstance(out, tuple):
            return out[0], out[1], out[2] if len(out) > 2 else []
        return out, [], []

    def _hello(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        version = f.int("version", PROTOCOL_ANY)
        if version != P.PROTOCOL_VERSION:
            raise P.ProtocolError(f"client speaks protocol {version}, the daemon "
                                  f"{P.PROTOCOL_VERSION}", fatal=True)
        conn.client = f.str("client", conn.client, MAX_CLIENT_ID)
        conn.pid = f.int("pid", 0, 0, 1 << 31)
        role = f.str("role", "client", 16)
        if role not in ("client", "status"):
            raise P.ProtocolError("role is client or status")
        conn.role = role
        fds = [self._ro_fd] if f.bool("arena", False) else []
        st = self.store
        return ({"pid": os.getpid(), "store": st.path, "backing": st.backing,
                 "describe": st.describe(), "arena_bytes": self.arena_bytes,
                 "max_request_bytes": self.max_request,
                 "max_inflight_bytes": self.max_inflight, "connection": conn.cid,
                 "arena": bool(fds), "index_offset": self.arena_bytes,
                 "index_rows": self.index_rows}, [], fds)

    def _put(self, conn: _Conn, f: P.Fields, req: _Request) -> Any:
        items = [self._put_item(item) for item in f.list("items")]
        total = sum(item[4] for item in items)
        if total != req.payload_bytes:
            raise StoreError(f"put payload of {req.payload_bytes} bytes does not match its "
                             f"items, which say {total}")
        # Only now, with the items valid, is the payload read (see the module docstring).
        buf = memoryview(req.payload())
        batch, at = [], 0
        for name, kind, dtype, shape, nbytes in items:
            batch.append((name, kind, _tensor(buf, at, nbytes, dtype, shape)))
            at += nbytes
        versions = self.store.put_many(batch)
        # Acknowledged means committed: see the module docstring.
        self.store.flush()
        return {"versions": versions}

    def _put_item(self, item: Any) -> tuple[str, str, torch.dtype, tuple[int, ...], int]:
        """One put item, checked: (name, kind, dtype, shape, nbytes)."""
        if not isinstance(item, dict):
            raise P.ProtocolError("put items are objects")
        g = P.Fields(item)
        name, kind = P.check_key([g.str("name", None, P.MAX_NAME_BYTES), g.str("kind")])
        check_name(name)
        check_kind(kind)
        dtype = _storable_dtype(name, g.str("dtype", None, 32))
        shape = P.check_shape(g.list("shape", P.MAX_DIMS))
        nbytes = g.int("nbytes", None, 0, self.max_request)
        itemsize = element_size(dtype)
        # Exact integers: a product that wraps around could match nbytes by accident.
        if itemsize * math.prod(max(d, 1) for d in shape) > _MAX_TENSOR_BYTES:
            raise UnsupportedTensorError(f"{name!r}: shape {list(shape)} is too large for a "
                                         f"tensor")
        if itemsize * math.prod(shape) != nbytes:
            raise StoreError(f"{name!r}: {nbytes} bytes is not a {dtype_name(dtype)} tensor "
                             f"of shape {list(shape)}")
        return name, kind, dtype, shape, nbytes

    def _get(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        keys = f.keys()
        for name, kind in keys:
            check_name(name)
            check_kind(kind)
        found, handles = self.store._host_bytes(keys)
        by_key = {h.key: h for h in handles}
        items, parts, at = [], [], 0
        try:
            for key in keys:
                meta, raw = found[key]
                item: dict[str, Any] = {"d": meta.dtype, "s": list(meta.shape),
                                        "n": meta.nbytes, "v": meta.version}
                if isinstance(raw, torch.Tensor):
                    item["o"] = raw.data_ptr() - self._arena_ptr
                    h = by_key.get(key)
                    token = (self._cache.watch(h, functools.partial(self._publish, key))
                             if h is not None else None)
                    if token is not None:
                        item["x"], item["q"] = token
                else:  # not cached (refused, no room): the bytes travel in the answer
                    item["i"] = at
                    if meta.nbytes:
                        parts.append(memoryview(raw)[: meta.nbytes])
                    at += meta.nbytes
                items.append(item)
        except BaseException:
            for h in handles:
                h.release()
            raise
        lease = 0
        if handles:
            lease = next(conn.lease_ids)
            conn.leases[lease] = handles
        return {"items": items, "lease": lease}, parts

    # -- the published index: cache hits without a round trip --------------------------
    # Row r of the index is (seq, offset). A published row's seq is even and its slot holds
    # the entry the client learned it for (the client keeps the seq, the entry's metadata
    # and the row from the get that published it); the cache retires the row (seq odd)
    # before that slot's bytes can change or the entry stops being current. A client copies
    # the bytes and keeps the copy only if the row's seq is the same before and after: a
    # sequence lock, with the daemon the only writer. Both callbacks run under the cache's
    # lock, so rows need no lock of their own.
    def _publish(self, key: Any, offset: int, nbytes: int) -> tuple[int, int] | None:
        if not self._free_rows:
            return None  # clients use the socket for this one
        row = self._free_rows.pop()
        self._row_keys[row] = key
        seq = int(self._index[row, 0]) + 1
        self._index[row, 1] = offset
        self._index[row, 0] = seq
        return row, seq

    def _retire_row(self, token: tuple[int, int]) -> None:
        row, seq = token
        self._index[row, 0] = seq + 1
        self._row_keys.pop(row, None)
        self._free_rows.append(row)

    def _fast_hits(self, rows: list[Any]) -> int:
        """Count the hits a client served itself from published rows ([row, seq, ...])."""
        if len(rows) % 2:
            raise P.ProtocolError("hits are [row, seq] pairs")
        keys = []
        for i in range(0, len(rows), 2):
            row, seq = rows[i], rows[i + 1]
            if (isinstance(row, bool) or isinstance(seq, bool) or not isinstance(row, int)
                    or not isinstance(seq, int) or not 0 <= row < self.index_rows):
                raise P.ProtocolError("hits are [row, seq] integer pairs")
            key = self._row_keys.get(row)
            if key is not None and int(self._index[row, 0]) == seq:
                keys.append(key)
        return self._cache.record_hits(keys)

    def _release(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        return {"released": self._release_leases(conn, f.list("leases"))}

    @staticmethod
    def _release_leases(conn: _Conn, leases: list[Any]) -> int:
        n = 0
        for lease in leases:
            if isinstance(lease, bool) or not isinstance(lease, int):
                raise P.ProtocolError("lease ids are integers")
            handles = conn.leases.pop(lease, None)
            if handles is not None:
                for h in handles:
                    h.release()
                n += 1
        return n

    def _delete(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        name, kind = _one_key(f)
        done = self.store.delete(name, kind, missing_ok=f.bool("missing_ok"))
        return {"deleted": done}

    def _keys(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        prefix = f.str("prefix", "", P.MAX_NAME_BYTES)
        return {"keys": [list(k) for k in self.store.keys(prefix)]}

    def _info(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        info = self.store.info(*_one_key(f))
        out = dict(vars(info))
        out["dtype"] = dtype_name(info.dtype)
        out["shape"] = list(info.shape)
        return out

    def _stats(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        stats = self.store.stats()
        stats.pop("prefetch", None)  # the daemon has no device queues; clients report theirs
        return P.jsonable({**stats, "daemon": self.status()})

    def _flush(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        self.store.flush()
        return {}

    def _snapshot(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        tag = f.str("tag", None, 128)
        check_tag(tag)
        return vars(self.store.snapshot(tag))

    def _snapshots(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        return {"snapshots": [vars(s) for s in self.store.snapshots()]}

    def _restore(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        tag = f.str("tag", None, 128)
        check_tag(tag)
        return vars(self.store.restore(tag))

    def _drop_snapshot(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        tag = f.str("tag", None, 128)
        check_tag(tag)
        self.store.drop_snapshot(tag)
        return {}

    def _fsck(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        r = self.store.fsck()
        return {"entries": r.entries, "nbytes": r.nbytes, "problems": r.problems,
                "notes": r.notes}

    def _contains(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        return {"found": _one_key(f) in self.store}

    def _tick(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        self.store.tick()
        return {}

    def _report(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        """A client's prefetch queue figures (its device queues live in the client) and the
        cache hits it served itself."""
        if "prefetch" not in f.f:  # hits only (read by _dispatch)
            return {}
        queues = f.f.get("prefetch")
        if not isinstance(queues, dict) or len(queues) > 16:
            raise P.ProtocolError("prefetch is an object of at most 16 devices")
        clean: dict[str, dict[str, float]] = {}
        for dev, q in queues.items():
            P.check_str(dev, "device", 32)
            if not isinstance(q, dict):
                raise P.ProtocolError("a device's figures are an object")
            g = P.Fields(q)
            clean[dev] = {k: g.number(k) for k in _REPORTED if k in q}
        with self._conns_lock:
            self._reports[conn.client] = clean
        return {}

    def _status(self, conn: _Conn, f: P.Fields, _p: Any) -> Any:
        return self.status()

    # -- figures ----------------------------------------------------------------------
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
        depth = {"queued": 0.0, "in_flight": 0.0, "resident": 0.0}
        device_bytes, stall = 0.0, 0.0
        for name, devices in reports.items():
            if name not in clients:
                continue
            clients[name]["prefetch"] = devices
            for q in devices.values():
                for k in depth:
                    depth[k] += q.get(k, 0)
                device_bytes += q.get("in_use_bytes", 0)
                stall += q.get("stall_s", 0)
        st = self.store
        stats = st.stats() if not st._closed else None
        cache = stats["cache"] if stats else None
        tiers = stats["tiers"] if stats else {}
        return {
            "pid": os.getpid(),
            "store": st.path,
            "socket": self.socket_path,
            "backend": st.describe() if not st._closed else None,
            "uptime_s": time.time() - self._started,
            "metrics_port": self.metrics.port if self.metrics is not None else None,
            "clients": len(clients),
            "connections": sum(c["connections"] for c in clients.values()),
            "leases": sum(c["leases"] for c in clients.values()),
            "client_list": list(clients.values()),
            "hit_rate": cache["hit_rate"] if cache else 0.0,
            "cache": cache,
            "tiers": tiers,
            "tier_bytes": {
                "device": int(device_bytes),
                "host": cache["bytes_resident"] if cache else 0,
                st.backing: stats["bytes_stored"] if stats else 0,
            },
            "queues": {"requests_in_flight": self._in_flight,
                       "request_bytes_held": self._budget.used,
                       "request_bytes_limit": self._budget.limit,
                       **{f"prefetch_{k}": int(v) for k, v in depth.items()}},
            "stall_s": stall,
        }

    def metrics_text(self) -> str:
        return exposition(P.jsonable(self.status()), self._latency)

    def describe(self) -> str:
        port = f", metrics on http://127.0.0.1:{self.metrics.port}/metrics" if self.metrics else ""
        return (f"serving {self.store.path} ({self.store.describe()}) on {self.socket_path}, "
                f"host cache {format_size(self.arena_bytes)} in shared memory, requests up "
                f"to {format_size(self.max_request)} each and {format_size(self.max_inflight)} "
                f"in all{port}")


PROTOCOL_ANY = -1
_ZEROS = memoryview(bytes(P.PAYLOAD_CHUNK))  # what a payload buffer grows by, then overwrites
_MAX_TENSOR_BYTES = (1 << 63) - 1  # torch computes sizes and strides in int64
_OP_NAMES = {op.value: op.name.lower() for op in P.Op}
_REPORTED = ("queued", "in_flight", "resident", "in_use_bytes", "budget_bytes", "stall_s",
             "transfers", "bytes_moved", "requests", "acquires")


def _check_socket_path(path: str) -> None:
    if len(os.fsencode(path)) >= 108:
        raise StoreError(f"socket path {path} is too long for a Unix socket (max 107 bytes)")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise StoreError(f"cannot listen on {path}: directory {parent} does not exist")


def _inflight_limit(max_request: int, max_inflight: int | str | None) -> int:
    if max_inflight is None:
        return max(DEFAULT_MAX_INFLIGHT, max_request)
    limit = parse_size(max_inflight)
    if limit < max_request:
        raise StoreError(f"--max-inflight ({format_size(limit)}) must be at least "
                         f"--max-request ({format_size(max_request)}): a request that large "
                         f"could never be served")
    return limit


def _admit(conn: _Conn, op: int, nfields: int, npayload: int) -> None:
    """Refuse, before reading any of it, what a frame's header may not declare on this
    connection. The refusals that are not fatal have their frame skipped unread, through
    the connection's read buffer: nothing is allocated for them."""
    if npayload and op != P.Op.PUT:
        raise P.ProtocolError(f"op {op} carries no payload", fatal=True)
    if conn.role != "anonymous":
        return
    if npayload > P.MAX_ANON_PAYLOAD:  # not worth reading only to drop it
        raise P.ProtocolError(f"say hello first: a payload of {npayload} bytes before the "
                              f"hello, at most {P.MAX_ANON_PAYLOAD}", fatal=True)
    if nfields > P.MAX_ANON_FIELDS:
        raise P.ProtocolError(f"say hello first: fields of {nfields} bytes before the "
                              f"hello, at most {P.MAX_ANON_FIELDS}")


def _storable_dtype(name: str, dtype: str) -> torch.dtype:
    td = DTYPES.get(dtype)
    if td is None:
        raise UnsupportedTensorError(f"{name!r}: unknown dtype {dtype!r}")
    try:
        element_size(td)
    except RuntimeError:  # placeholder dtypes without storage
        raise UnsupportedTensorError(f"{name!r}: dtype {dtype} cannot be stored") from None
    return td


def _one_key(f: P.Fields) -> tuple[str, str]:
    name, kind = P.check_key([f.str("name", None, P.MAX_NAME_BYTES), f.str("kind", "param")])
    check_name(name)
    check_kind(kind)
    return name, kind


def _tensor(buf: memoryview, at: int, nbytes: int, dtype: torch.dtype,
            shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over payload bytes; copied where the offset breaks the dtype's alignment."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    u8 = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=at)
    if at % element_size(dtype):
        u8 = u8.clone()
    return from_bytes(u8, dtype, shape)


def _group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StoreError(f"no group named {group!r}") from None


_HANDLERS: dict[int, Callable[..., Any]] = {
    P.Op.HELLO: Server._hello,
    P.Op.PUT: Server._put,
    P.Op.GET: Server._get,
    P.Op.RELEASE: Server._release,
    P.Op.DELETE: Server._delete,
    P.Op.KEYS: Server._keys,
    P.Op.INFO: Server._info,
    P.Op.STATS: Server._stats,
    P.Op.FLUSH: Server._flush,
    P.Op.SNAPSHOT: Server._snapshot,
    P.Op.SNAPSHOTS: Server._snapshots,
    P.Op.RESTORE: Server._restore,
    P.Op.DROP_SNAPSHOT: Server._drop_snapshot,
    P.Op.FSCK: Server._fsck,
    P.Op.CONTAINS: Server._contains,
    P.Op.TICK: Server._tick,
    P.Op.REPORT: Server._report,
    P.Op.STATUS: Server._status,
}
