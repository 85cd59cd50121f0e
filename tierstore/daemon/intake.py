"""What arrives on a daemon connection, and the memory it may take.

Requests are read within bounds, whatever clients declare (see ``server.py``'s module
docstring for the whole policy): a frame's header is checked before any of it is read
(:func:`admit`), a put's payload is read in pieces into a buffer that grows only as bytes
arrive, and every byte held counts against the daemon-wide :class:`ByteBudget` until the
request is done with.
"""

from __future__ import annotations

import itertools
import socket
import threading
from typing import Any

from ..errors import StoreError
from ..sizes import format_size, parse_size
from . import protocol as P

DEFAULT_MAX_REQUEST = 4 << 30
DEFAULT_MAX_INFLIGHT = 8 << 30
BUDGET_WAIT_S = 30.0  # how long a request waits for others' payloads to be done with
_ZEROS = memoryview(bytes(P.PAYLOAD_CHUNK))  # what a payload buffer grows by, then overwrites


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


class Request:
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
        if big > self.budget.limit:  # no wait would make room: refused now, unread
            raise StoreError(f"a request with {format_size(big)} of fields is more than the "
                             f"daemon's --max-inflight of {format_size(self.budget.limit)}; "
                             f"ask for fewer entries at once")
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
            try:
                with memoryview(buf)[at:] as dst:
                    self.reader.read_exact_into(dst)
            except OSError as e:  # the socket's: an OSError out of a handler is the store's
                raise P.ProtocolError(f"the connection failed mid-payload: {e}",
                                      fatal=True) from None
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

    def hold(self, n: int) -> None:
        """Count ``n`` more bytes this request keeps in memory (an answer's) against the
        daemon's budget until :meth:`release`; waits, then refuses, as a payload does. An
        answer larger than the whole budget is refused outright: counting only the budget's
        worth of it would let one request take more memory than the limit says."""
        if n > self.budget.limit:
            raise StoreError(f"this get needs {format_size(n)} of entries the host cache does "
                             f"not hold, more than the daemon's --max-inflight of "
                             f"{format_size(self.budget.limit)}; ask for fewer at once")
        if n:
            self._hold(n)

    def let_go(self, n: int) -> None:
        """Give back ``n`` of the bytes :meth:`hold` took."""
        self._let_go(min(n, self.held))

    def release(self) -> None:
        self._let_go(self.held)


class Conn:
    """One client connection and the leases it holds."""

    def __init__(self, sock: socket.socket, cid: int) -> None:
        self.sock = sock
        self.cid = cid
        self.client = f"anonymous-{cid}"
        self.pid = 0
        self.role = "anonymous"  # until its hello
        self.run = ""  # the training run this client connection belongs to, if any
        self.spare = False  # past --max-connections: for a status request only
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


def inflight_limit(max_request: int, max_inflight: int | str | None) -> int:
    if max_inflight is None:
        return max(DEFAULT_MAX_INFLIGHT, max_request)
    limit = parse_size(max_inflight)
    if limit < max_request:
        raise StoreError(f"--max-inflight ({format_size(limit)}) must be at least "
                         f"--max-request ({format_size(max_request)}): a request that large "
                         f"could never be served")
    return limit


def admit(conn: Conn, op: int, nfields: int, npayload: int) -> None:
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
