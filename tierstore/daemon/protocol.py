"""The daemon's wire format: length-prefixed frames over a Unix stream socket.

Every frame is a fixed 24-byte header, a JSON object (the fields) and an optional binary
payload (tensor bytes)::

    offset size  field
    0      4     magic      b"TSDP"
    4      1     version    PROTOCOL_VERSION (2)
    5      1     op         an Op (requests) or REPLY / ERROR (answers)
    6      2     flags      bit 0: NO_REPLY (the sender expects no answer: release, report)
    8      4     request id echoed in the answer, so a client can match them
    12     4     fields length in bytes (<= MAX_FIELDS_BYTES)
    16     8     payload length in bytes (<= the daemon's max_request_bytes)
    24     ...   fields: UTF-8 JSON object; then the payload

Before its hello a connection may send only small frames: fields of at most
MAX_ANON_FIELDS bytes (more are skipped unread) and a payload of at most MAX_ANON_PAYLOAD
(more is fatal, and none of it is read; less is skipped unread). Only a put carries a
payload; the daemon reads it in pieces of at most PAYLOAD_CHUNK bytes, so
the memory it holds is what has arrived, not what was declared.

All integers are big-endian. A frame whose header is wrong (magic, version, lengths over
the limits) gets an ERROR answer and the connection is closed, since the rest of the stream
cannot be trusted to be framed; a frame that is well framed but whose fields are invalid
gets an ERROR answer and the connection stays usable. A truncated frame is a closed
connection. An ERROR answer whose fields say ``"closed": true`` is the connection's last
frame, whatever request it answers: the framing errors above, and a connection over the
daemon's ``--max-connections``, which is answered (request id 0) before any of it is read.

Why this and not gRPC: the data path never crosses the socket (get answers carry an offset
into the shared-memory arena, not bytes), so the socket carries small control messages
whose cost is dominated by per-message overhead; a 24-byte header plus a small JSON object
is cheaper to produce and check than protobuf over HTTP/2, needs only the standard library,
and is easy to fuzz and to document completely here.

Field validation lives here too (``Fields``): every value a request carries is checked for
type, range and length before the daemon acts on it. Names are catalog keys, checked like
the store checks them; they never become paths.
"""

from __future__ import annotations

import enum
import json
import math
import socket
import struct
from typing import Any

from ..errors import StoreError

# 2: key listings as payload, the daemon's instance id in the hello, closing ERROR frames.
PROTOCOL_VERSION = 2
MAGIC = b"TSDP"
HEADER = struct.Struct("!4sBBHIIQ")
HEADER_BYTES = HEADER.size  # 24
MAX_FIELDS_BYTES = 1 << 20  # a get_many of thousands of names fits; more is an error
MAX_KEYS = 4096  # names per request (put_many, get_many, prefetch reports)
MAX_DIMS = 16
MAX_NAME_BYTES = 400  # as the store: LMDB keys are at most 511 bytes
NO_REPLY = 1
READER_BYTES = 1 << 16  # a connection's read buffer; larger fields grow it for a while
MAX_ANON_FIELDS = READER_BYTES  # before the hello, fields never grow a connection's buffer
MAX_ANON_PAYLOAD = READER_BYTES  # ... and a payload there is skipped through that buffer
PAYLOAD_CHUNK = 1 << 20  # payloads are read (and their memory taken) this much at a time


class Op(enum.IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    RELEASE = 4
    DELETE = 5
    KEYS = 6
    INFO = 7
    STATS = 8
    FLUSH = 9
    SNAPSHOT = 10
    SNAPSHOTS = 11
    RESTORE = 12
    DROP_SNAPSHOT = 13
    FSCK = 14
    CONTAINS = 15
    TICK = 16
    REPORT = 17
    STATUS = 18
    REPLY = 64
    ERROR = 65


class ProtocolError(StoreError):
    """A frame that breaks the format; ``fatal`` ones end the connection."""

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class Frame:
    __slots__ = ("op", "flags", "rid", "fields", "payload")

    def __init__(self, op: int, flags: int, rid: int, fields: dict[str, Any],
                 payload: memoryview | bytes | None) -> None:
        self.op, self.flags, self.rid, self.fields, self.payload = op, flags, rid, fields, payload


def encode(op: int, rid: int, fields: dict[str, Any], payload_len: int = 0,
           flags: int = 0) -> bytes:
    """A frame's header and fields; the caller sends ``payload_len`` payload bytes after."""
    body = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_FIELDS_BYTES:
        raise StoreError(f"request too large: {len(body)} bytes of fields, at most "
                         f"{MAX_FIELDS_BYTES}")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, op, flags, rid, len(body), payload_len) + body


def parse_header(raw: bytes | bytearray | memoryview, max_payload: int) -> tuple[int, int, int,
                                                                                  int, int]:
    """(op, flags, rid, fields length, payload length), or a fatal ProtocolError."""
    magic, version, op, flags, rid, nfields, npayload = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("bad frame: wrong magic", fatal=True)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this daemon speaks "
                            f"{PROTOCOL_VERSION})", fatal=True)
    if nfields > MAX_FIELDS_BYTES:
        raise ProtocolError(f"frame fields of {nfields} bytes exceed {MAX_FIELDS_BYTES}",
                            fatal=True)
    if npayload > max_payload:
        raise ProtocolError(f"request payload of {npayload} bytes exceeds the daemon's limit "
                            f"of {max_payload} bytes per request (--max-request)", fatal=True)
    return op, flags, rid, nfields, npayload


def decode_fields(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        fields = json.loads(bytes(raw).decode(), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"bad frame fields: {str(e)[:80]}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("bad frame fields: not a JSON object")
    return fields


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


class Reader:
    """Buffered frame reading: a header, its fields and often the next frame arrive in one
    ``recv``, so a small request costs one system call instead of three."""

    def __init__(self, sock: socket.socket, size: int = READER_BYTES) -> None:
        self.sock = sock
        self.size = size
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    def _fill(self, n: int) -> bool:
        """Make ``n`` bytes available at ``start``; False on EOF before any byte of them."""
        if self.end - self.start >= n:
            return True
        if len(self.buf) - self.start < n:  # compact, or grow for a large fields block
            have = self.end - self.start
            if len(self.buf) < n:
                buf = bytearray(max(n, 2 * len(self.buf)))
                buf[:have] = self.view[self.start : self.end]
                self.view.release()
                self.buf, self.view = buf, memoryview(buf)
            else:
                self.buf[:have] = self.buf[self.start : self.end]
            self.start, self.end = 0, have
        begun = self.end > self.start
        while self.end - self.start < n:
            k = self.sock.recv_into(self.view[self.end :])
            if k == 0:
                if not begun:
                    return False
                raise ProtocolError("truncated frame", fatal=True)
            begun = True
            self.end += k
        return True

    def read(self, n: int) -> bytes | None:
        """The next ``n`` bytes (a copy); None on EOF at a frame boundary."""
        if not self._fill(n):
            return None
        out = bytes(self.view[self.start : self.start + n])
        self.start += n
        self._shrink()
        return out

    def _shrink(self) -> None:
        """Back to the usual size once a large fields block is consumed, so that an idle
        connection does not keep the memory its largest request needed."""
        if len(self.buf) > self.size and self.start == self.end:
            self.view.release()
            self.buf = bytearray(self.size)
            self.view = memoryview(self.buf)
            self.start = self.end = 0

    def read_exact_into(self, dst: memoryview) -> None:
        """Fill ``dst`` with the next bytes of the stream: buffered ones first, then
        straight from the socket."""
        n = len(dst)
        have = min(n, self.end - self.start)
        dst[:have] = self.view[self.start : self.start + have]
        self.start += have
        got = have
        while got < n:
            k = self.sock.recv_into(dst[got:])
            if k == 0:
                raise ProtocolError("truncated frame", fatal=True)
            got += k

    def skip(self, n: int) -> None:
        """Discard the next ``n`` bytes, through the read buffer (no memory of their own)."""
        have = min(n, self.end - self.start)
        self.start += have
        n -= have
        while n:
            self.start = self.end = 0
            k = self.sock.recv_into(self.view, min(n, len(self.buf)))
            if k == 0:
                raise ProtocolError("truncated frame", fatal=True)
            n -= k
        self._shrink()

    def read_into(self, n: int) -> bytearray:
        """The next ``n`` bytes into a new buffer of their own (an answer's payload)."""
        out = bytearray(n)
        with memoryview(out) as mv:
            self.read_exact_into(mv)
        return out

    def frame(self, max_payload: int) -> tuple[int, int, int, bytes, bytearray | None] | None:
        """(op, flags, request id, fields bytes, payload or None); None on a clean EOF. For
        reading answers from a daemon: the daemon reads requests piece by piece instead."""
        head = self.read(HEADER_BYTES)
        if head is None:
            return None
        op, flags, rid, nfields, npayload = parse_header(head, max_payload)
        try:
            raw = self.read(nfields) if nfields else b"{}"
            if raw is None:
                raise ProtocolError("truncated frame", fatal=True)
            payload = self.read_into(npayload) if npayload else None
        except ProtocolError as e:
            e.rid = rid  # type: ignore[attr-defined]
            raise
        return op, flags, rid, raw, payload


# -- field validation -----------------------------------------------------------------
class Fields:
    """Typed access to a request's fields; every getter raises ProtocolError on bad input."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.f = fields

    def _get(self, key: str, default: Any) -> Any:
        if key not in self.f:
            if default is _REQUIRED:
                raise ProtocolError(f"missing field {key!r}")
            return default
        return self.f[key]

    def int(self, key: str, default: Any = None, lo: int = 0, hi: int = (1 << 63) - 1,
            ) -> int:
        v = self._get(key, _REQUIRED if default is None else default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}]")
        return v

    def bool(self, key: str, default: bool = False) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise ProtocolError(f"field {key!r} must be true or false")
        return v

    def str(self, key: str, default: Any = None, max_bytes: int = 256) -> str:
        v = self._get(key, _REQUIRED if default is None else default)
        return check_str(v, key, max_bytes)

    def opt_str(self, key: str, max_bytes: int = 256) -> str | None:
        v = self.f.get(key)
        return None if v is None else check_str(v, key, max_bytes)

    def list(self, key: str, max_items: int = MAX_KEYS) -> list[Any]:
        v = self._get(key, _REQUIRED)
        if not isinstance(v, list) or len(v) > max_items:
            raise ProtocolError(f"field {key!r} must be a list of at most {max_items} items")
        return v

    def keys(self, key: str = "keys") -> list[tuple[str, str]]:
        return [check_key(item) for item in self.list(key)]

    def number(self, key: str, default: float = 0.0) -> float:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ProtocolError(f"field {key!r} must be a finite number")
        return float(v)


_REQUIRED = object()


def check_str(v: Any, what: str, max_bytes: int) -> str:
    try:  # JSON can carry lone surrogates, which no later encode() would survive
        n = len(v.encode()) if isinstance(v, str) else -1
    except UnicodeEncodeError:
        raise ProtocolError(f"field {what!r} must be valid UTF-8") from None
    if not 0 <= n <= max_bytes:
        raise ProtocolError(f"field {what!r} must be a string of at most {max_bytes} bytes")
    if "\0" in v:
        raise ProtocolError(f"field {what!r} contains NUL")
    return v


def check_key(item: Any) -> tuple[str, str]:
    """A (name, kind) pair: the name a non-empty catalog key, the kind an identifier."""
    if not isinstance(item, list) or len(item) != 2:
        raise ProtocolError("a key is a [name, kind] pair")
    name, kind = item
    name = check_str(name, "name", MAX_NAME_BYTES)
    if not name:
        raise ProtocolError("an entry name is a non-empty string")
    kind = check_str(kind, "kind", 32)
    return name, kind


def check_shape(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_DIMS:
        raise ProtocolError(f"a shape is a list of at most {MAX_DIMS} sizes")
    for d in v:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < (1 << 48):
            raise ProtocolError("shape sizes are non-negative integers")
    return tuple(v)


def jsonable(obj: Any) -> Any:
    """Stats as JSON: dict keys as strings, tuples as lists, floats finite."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)
