"""The daemon's answers: one handler per request op, on :class:`~.server.Server`.

Each handler gets the connection, the request's fields (checked as they are read) and the
request itself (for a put's payload), and returns the answer's fields, or (fields, payload
parts[, descriptors]). ``HANDLERS`` maps ops to them.
"""

from __future__ import annotations

import json
import math
import os
import select
from collections.abc import Callable
from typing import Any

import torch

from ..errors import StoreError, StoreLockedError, UnsupportedTensorError
from ..keys import check_kind, check_name, check_tag
from ..local import LocalStore
from ..tensors import DTYPES, dtype_name, element_size, from_bytes
from . import protocol as P
from .intake import Conn, Request
from .shared_cache import SharedCache

PROTOCOL_ANY = -1
MAX_CLIENT_ID = 64
_MAX_TENSOR_BYTES = (1 << 63) - 1  # torch computes sizes and strides in int64
_REPORTED = ("queued", "in_flight", "resident", "in_use_bytes", "budget_bytes", "stall_s",
             "transfers", "bytes_moved", "requests", "acquires")


class OpHandlers:
    """The request handlers of :class:`~.server.Server`, which sets up the state below."""

    store: LocalStore
    max_request: int
    max_inflight: int
    arena_bytes: int
    index_rows: int
    instance: str
    identity: dict[str, Any]
    _shared: SharedCache
    _conns: dict[int, Conn]
    _conns_lock: Any
    _reports: dict[str, dict[str, Any]]
    status: Callable[[], dict[str, Any]]

    def _hello(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        version = f.int("version", PROTOCOL_ANY)
        if version != P.PROTOCOL_VERSION:
            raise P.ProtocolError(f"client speaks protocol {version}, the daemon "
                                  f"{P.PROTOCOL_VERSION}", fatal=True)
        conn.client = f.str("client", conn.client, MAX_CLIENT_ID)
        conn.pid = f.int("pid", 0, 0, 1 << 31)
        role = f.str("role", "client", 16)
        if role not in ("client", "status"):
            raise P.ProtocolError("role is client or status")
        run = f.str("run", "", 64)
        if run and role == "client":
            self._claim(conn, run)
        conn.role = role
        fds = [self._shared.ro_fd] if f.bool("arena", False) else []
        st = self.store
        return ({"pid": os.getpid(), "store": st.path, "backing": st.backing,
                 "describe": st.describe(), "arena_bytes": self.arena_bytes,
                 "max_request_bytes": self.max_request,
                 "max_inflight_bytes": self.max_inflight, "connection": conn.cid,
                 "arena": bool(fds), "index_offset": self.arena_bytes,
                 "index_rows": self.index_rows, "instance": self.instance,
                 "run": self.claimed_by(), **self.identity}, [], fds)

    def _claim(self, conn: Conn, run: str) -> None:
        """One training run at a time uses the store: a client of another run is refused
        while any connection of the run that holds it is open (a crashed run's close with
        its processes, so its claim goes with them)."""
        with self._conns_lock:
            holder = next((c for c in self._conns.values()
                           if c.run and c.run != run and not _hung_up(c)), None)
            if holder is None:
                conn.run = run
                return
        raise StoreLockedError(f"store {self.store.path} is in use by another training run "
                               f"(process {holder.pid}); wait for it to finish, or stop it")

    def claimed_by(self) -> dict[str, Any] | None:
        """The run using the store: its id and the process of its first connection."""
        with self._conns_lock:
            holders = [c for c in self._conns.values() if c.run and not _hung_up(c)]
        if not holders:
            return None
        first = min(holders, key=lambda c: c.cid)
        return {"id": first.run, "pid": first.pid}

    def _put(self, conn: Conn, f: P.Fields, req: Request) -> Any:
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
        # Acknowledged means committed (see the module docstring), and committed before any
        # client can see it: a client outlives a daemon crash, so it must never have read a
        # version the crash takes back.
        versions = self.store.put_many(batch, durable=True)
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

    def _get(self, conn: Conn, f: P.Fields, req: Request) -> Any:
        keys = f.keys()
        for name, kind in keys:
            check_name(name)
            check_kind(kind)
        # An entry the cache does not hold may be read into a buffer of its own that the
        # answer carries: its bytes count against --max-inflight (held before reading,
        # given back as the cache takes them or once the answer is sent).
        cache = self.store.internals.cache
        unsure = list(dict.fromkeys(k for k in keys if cache is None or k not in cache))
        sizes = {k: self.store.info(*k).nbytes for k in unsure}
        req.hold(sum(sizes.values()))
        found, handles = self.store.internals.host_bytes(keys)
        req.let_go(sum(n for k, n in sizes.items() if isinstance(found[k][1], torch.Tensor)))
        by_key = {h.key: h for h in handles}
        items, parts, at = [], [], 0
        try:
            for key in keys:
                meta, raw = found[key]
                item: dict[str, Any] = {"d": meta.dtype, "s": list(meta.shape),
                                        "n": meta.nbytes, "v": meta.version}
                if isinstance(raw, torch.Tensor):
                    item["o"] = self._shared.offset(raw)
                    h = by_key.get(key)
                    token = self._shared.watch(h, key) if h is not None else None
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

    def _release(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        return {"released": self._release_leases(conn, f.list("leases"))}

    @staticmethod
    def _release_leases(conn: Conn, leases: list[Any]) -> int:
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

    def _delete(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        name, kind = _one_key(f)
        done = self.store.delete(name, kind, missing_ok=f.bool("missing_ok"))
        return {"deleted": done}

    def _keys(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        # As the answer's payload, not its fields: an MoE catalog's keys (tens of
        # thousands) outgrow the fields' 1 MiB.
        prefix = f.str("prefix", "", P.MAX_NAME_BYTES)
        listing = json.dumps([list(k) for k in self.store.keys(prefix)],
                             separators=(",", ":")).encode()
        return {}, [listing]

    def _info(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        info = self.store.info(*_one_key(f))
        out = dict(vars(info))
        out["dtype"] = dtype_name(info.dtype)
        out["shape"] = list(info.shape)
        return out

    def _stats(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        stats = self.store.stats()
        stats.pop("prefetch", None)  # the daemon has no device queues; clients report theirs
        return P.jsonable({**stats, "daemon": self.status()})

    def _flush(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        self.store.flush()
        return {}

    def _snapshot(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        tag = f.str("tag", None, 128)
        check_tag(tag)
        return vars(self.store.snapshot(tag))

    def _snapshots(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        return {"snapshots": [vars(s) for s in self.store.snapshots()]}

    def _restore(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        tag = f.str("tag", None, 128)
        check_tag(tag)
        return vars(self.store.restore(tag))

    def _drop_snapshot(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        tag = f.str("tag", None, 128)
        check_tag(tag)
        self.store.drop_snapshot(tag)
        return {}

    def _fsck(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        r = self.store.fsck()
        return {"entries": r.entries, "nbytes": r.nbytes, "problems": r.problems,
                "notes": r.notes}

    def _contains(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        return {"found": _one_key(f) in self.store}

    def _tick(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        self.store.tick()
        return {}

    def _report(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
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

    def _status(self, conn: Conn, f: P.Fields, _p: Any) -> Any:
        return self.status()


def _hung_up(conn: Conn) -> bool:
    """Whether the client closed ``conn`` (it exited, or was killed), which its own thread
    may not have noticed yet (it may still have bytes of it to read): the kernel's word."""
    poll = select.poll()
    try:
        poll.register(conn.sock, select.POLLRDHUP)
    except (OSError, ValueError):  # closed meanwhile
        return True
    return bool(poll.poll(0))


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


HANDLERS: dict[int, Callable[..., Any]] = {
    P.Op.HELLO: OpHandlers._hello,
    P.Op.PUT: OpHandlers._put,
    P.Op.GET: OpHandlers._get,
    P.Op.RELEASE: OpHandlers._release,
    P.Op.DELETE: OpHandlers._delete,
    P.Op.KEYS: OpHandlers._keys,
    P.Op.INFO: OpHandlers._info,
    P.Op.STATS: OpHandlers._stats,
    P.Op.FLUSH: OpHandlers._flush,
    P.Op.SNAPSHOT: OpHandlers._snapshot,
    P.Op.SNAPSHOTS: OpHandlers._snapshots,
    P.Op.RESTORE: OpHandlers._restore,
    P.Op.DROP_SNAPSHOT: OpHandlers._drop_snapshot,
    P.Op.FSCK: OpHandlers._fsck,
    P.Op.CONTAINS: OpHandlers._contains,
    P.Op.TICK: OpHandlers._tick,
    P.Op.REPORT: OpHandlers._report,
    P.Op.STATUS: OpHandlers._status,
}
