"""``tierstore.connect(socket)``: a store served by ``tierstore serve``, with ``Store``'s API.

Reads come out of the daemon's host cache through a read-only shared-memory mapping: a get
asks the daemon for the entry, which answers where its slot is (leased: pinned until
released), and the bytes are copied from the mapping once (``get``) or not at all
(``view``, which keeps the lease for as long as the tensor lives). Writes travel over the
socket and are acknowledged once committed (durable).

Device prefetch queues run in the client (:class:`tierstore.prefetch.DeviceQueues`, the
same ones a local store uses), fed by daemon gets; their figures are reported to the daemon
for ``tierstore status`` and the metrics. The socket itself (connections, the daemon's
errors, leases) is ``connection.py``'s.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import platform
import queue
import select
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from tierstore.nvme import IDLE_READ_BUFFER_BYTES, RecycledBuffers

from .. import errors
from ..collector import paused
from ..devices import bytes_to_device
from ..errors import StoreClosedError, StoreError
from ..interface import (
    Borrowed,
    Capabilities,
    EntryInfo,
    FsckReport,
    Meta,
    SnapshotInfo,
    Staged,
    Store,
)
from ..keys import Key, PutItems, StageEntry, as_key, put_items
from ..prefetch import DeviceQueues
from ..tensors import as_bytes, dtype_from_name, dtype_name, from_bytes
from . import protocol as P
from .connection import RELEASE_DELAY_S, Connection, Lease
from .control import daemon_identity
from .identity import check_serves

MAX_CONNECTIONS = 8  # per client: concurrent requests from its threads
HITS_BATCH = 256  # self-served hits told to the daemon in one message, at most
HITS_EVERY_S = 0.2  # ... and at least this often while gets keep coming
# Reading the daemon's published index without a lock relies on loads not being reordered
# with other loads (a sequence lock without fences), which x86-64 guarantees.
FAST_PATH = platform.machine().lower() in ("x86_64", "amd64")
REPORT_EVERY_S = 0.5


class RemoteStore(Store):
    """A store served by a daemon: :class:`tierstore.Store` over its socket.

    Thread-safe: concurrent calls use separate connections (up to ``MAX_CONNECTIONS``).
    """

    def __init__(self, socket_path: str | os.PathLike[str], *,
                 device_budget: int | str | Mapping[str, int | str] | None = None,
                 store: str | os.PathLike[str] | None = None, run: str | None = None) -> None:
        self.socket_path = os.path.abspath(os.fspath(socket_path))
        self._run = run
        self.client_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._idle: list[Connection] = []
        self._all: list[Connection] = []
        self._pool_lock = threading.Lock()
        self._pool_cv = threading.Condition(self._pool_lock)
        self._lent = 0  # connections in use by a call
        self._closed = False
        # Results land in reused memory once callers drop earlier ones: faulting fresh pages
        # in (on a VM that returns freed memory to its host) costs more than the copy.
        self._results = RecycledBuffers(IDLE_READ_BUFFER_BYTES)
        first = Connection(self.socket_path, self.client_id, want_arena=True, run=run)
        try:
            if store is not None:
                check_serves(self.socket_path, first.hello, store)
            if first.arena_fd < 0:
                raise StoreError(f"the daemon at {self.socket_path} sent no cache mapping")
        except BaseException:
            first.close()
            raise
        self.daemon = daemon_identity(first)
        self._all.append(first)
        self._idle.append(first)
        hello = first.hello
        self._instance = hello.get("instance")
        self._restarted = False
        # A connection that carries no requests: its hang-up says that the daemon whose
        # shared memory this client maps is gone, before any read served from that memory
        # alone (the published index) could return what a restarted daemon replaced.
        try:
            self._watch = Connection(self.socket_path, self.client_id, want_arena=False,
                                     role="status")
        except BaseException:  # the daemon at its connection limit, say
            first.close()
            raise
        self.path = str(hello["store"])
        self._backing = str(hello["backing"])
        self._describe = str(hello["describe"])
        self.max_request_bytes = int(hello["max_request_bytes"])
        size = int(hello["arena_bytes"])
        rows = int(hello.get("index_rows", 0))
        self._map = mmap.mmap(first.arena_fd, os.fstat(first.arena_fd).st_size,
                              mmap.MAP_SHARED, mmap.PROT_READ)
        self._arena_np = np.frombuffer(self._map, dtype=np.uint8, count=size)
        # The daemon's index of published slots (``shared_cache.py``): a get
        # of an entry learned through the socket is served from it without a round trip.
        self._index = (np.frombuffer(self._map, dtype=np.int64, count=2 * rows,
                                     offset=int(hello["index_offset"])).reshape(rows, 2)
                       if rows and FAST_PATH else None)
        self._rows: dict[Key, tuple[int, int, Meta]] = {}
        self._hits: list[int] = []  # [row, seq, ...] of self-served hits not yet told
        self._hits_lock = threading.Lock()
        self._hits_sent = time.monotonic()
        self._local_hits = 0
        with warnings.catch_warnings():  # read-only on purpose: the daemon owns the slots
            warnings.simplefilter("ignore", UserWarning)
            self._arena_t = torch.from_numpy(self._arena_np)
        # Views handed out are released by the garbage collector, which may run inside any
        # call (even one holding a connection's lock): finalizers only queue the release.
        self._late: queue.SimpleQueue[Lease | bool | None] = queue.SimpleQueue()
        self._armed = False
        self._releaser = threading.Thread(target=self._release_loop, daemon=True,
                                          name="tierstore-client-release")
        self._releaser.start()
        self._queues = DeviceQueues(self._host_bytes, self._entry_nbytes, device_budget)
        self._last_report = 0.0

    # -- connections ------------------------------------------------------------------
    def _take(self) -> Connection:
        """An idle connection, or a new one (at most MAX_CONNECTIONS at a time)."""
        self._check_open()
        with self._pool_cv:
            while not self._idle and self._lent >= MAX_CONNECTIONS:
                self._pool_cv.wait()
            self._lent += 1
            if self._idle:
                return self._idle.pop()
        try:
            conn = Connection(self.socket_path, self.client_id, want_arena=False,
                              run=self._run)
            if conn.hello.get("instance") != self._instance:
                conn.close()
                self._daemon_replaced()
        except BaseException:
            with self._pool_cv:
                self._lent -= 1
                self._pool_cv.notify()
            raise
        with self._pool_lock:
            self._all.append(conn)
        return conn

    def _daemon_hung_up(self) -> bool:
        """Whether the daemon closed the watch connection (it carries no requests, so
        anything readable there is its end). ``select`` rather than one shared ``poll``
        object: gets run on many threads at once, and a poll object refuses that."""
        return bool(select.select([self._watch.sock], [], [], 0)[0])

    def _daemon_replaced(self) -> None:
        """The daemon this client connected to is gone (another may serve the socket now):
        its shared memory, which this client maps, no longer says where anything is, so
        nothing is read from it again and every call says so."""
        self._restarted = True
        self._rows.clear()
        self._index = None
        raise StoreClosedError(f"the daemon at {self.socket_path} this client connected to "
                               "has stopped (or was restarted): connect again with "
                               "tierstore.connect()")

    def _give(self, conn: Connection) -> None:
        with self._pool_cv:
            self._lent -= 1
            if not conn.closed:
                self._idle.append(conn)
            self._pool_cv.notify()

    def _call(self, op: int, fields: dict[str, Any] | None = None,
              payload: list[Any] | None = None) -> dict[str, Any]:
        return self._exchange(op, fields, payload)[0]

    def _exchange(self, op: int, fields: dict[str, Any] | None = None,
                  payload: list[Any] | None = None) -> tuple[dict[str, Any], Any]:
        """One request on a pooled connection: the answer's fields and payload."""
        fields = self._with_hits(fields or {})
        conn = self._take()
        try:
            return conn.request(op, fields, payload)
        finally:
            self._give(conn)

    def _with_hits(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` carrying the self-served hits not yet told (the daemon counts them as
        cache hits and in its eviction policy)."""
        if not self._hits:
            return fields
        with self._hits_lock:
            hits, self._hits = self._hits, []
        return {**fields, "h": hits}

    def _note_hit(self, row: int, seq: int) -> None:
        # Told in batches: riding on the next request, or alone once HITS_BATCH have
        # gathered or HITS_EVERY_S has passed (a message per get would cost both sides a
        # wake-up, which is what serving hits locally saves).
        with self._hits_lock:
            self._hits += (row, seq)
            due = (len(self._hits) >= 2 * HITS_BATCH
                   or time.monotonic() - self._hits_sent > HITS_EVERY_S)
        if due:
            self._send_hits()

    def _send_hits(self) -> None:
        self._hits_sent = time.monotonic()
        fields = self._with_hits({})
        if "h" not in fields or self._closed:
            return
        with contextlib.suppress(StoreError):
            conn = self._take()
            try:
                conn.send_oneway(P.Op.REPORT, fields)
            finally:
                self._give(conn)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"connection to {self.socket_path} is closed")
        if self._restarted:
            self._daemon_replaced()

    def _arm_releaser(self) -> None:
        if not self._armed:
            self._armed = True
            self._late.put(True)

    def _release_loop(self) -> None:
        """Send releases that no request carried within RELEASE_DELAY_S; release the
        leases of views the garbage collector finalized (queued here, see __init__)."""
        while (item := self._late.get()) is not None:
            time.sleep(RELEASE_DELAY_S)
            items = [item]
            with contextlib.suppress(queue.Empty):
                while True:
                    items.append(self._late.get_nowait())
            self._armed = False  # before flushing: a later release arms again
            for it in items:
                if isinstance(it, Lease):
                    it.release()
            with self._pool_lock:
                conns = list(self._all)
            for conn in conns:
                if conn.pending:
                    conn.flush_releases()
            if self._hits:
                self._send_hits()
            if None in items:
                return

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the device queues and disconnect; the daemon drops this client's leases.
        (The daemon keeps serving; writes were durable when acknowledged.)"""
        if self._closed:
            return
        try:
            self._queues.close()
            # Last figures for the daemon's status, where it is still there to take them.
            with contextlib.suppress(StoreError):
                self._report(force=True)
                self._send_hits()
        finally:
            self._closed = True
            self._results.close()
            self._late.put(None)
            self._releaser.join(timeout=5)
            with self._pool_lock:
                conns, self._all, self._idle = self._all, [], []
            for c in [*conns, self._watch]:
                c.close()

    def flush(self) -> None:
        """Every acknowledged put is already durable; this also writes back anything the
        daemon holds dirty."""
        self._call(P.Op.FLUSH)

    def tick(self) -> None:
        self._call(P.Op.TICK)

    @property
    def capabilities(self) -> Capabilities:
        # Borrows are leased views of the daemon's slots, but stages are local tensors
        # that a commit sends: not the zero-copy both-ways a local cached store offers.
        return Capabilities(zero_copy=False, remote=True, backing=self._backing,
                            host_cache=True)

    @property
    def backing(self) -> str:
        return self._backing

    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> str:
        return f"{self._describe} (via the daemon at {self.socket_path})"

    # -- writes -------------------------------------------------------------------------
    @paused()  # a field dict per entry, as the local store's records (tierstore.collector)
    def put_many(self, items: PutItems, kind: str = "param") -> list[int]:
        """Store several tensors in one request; returns their versions once committed."""
        self._check_open()
        fields, parts, total = [], [], 0
        for name, k, t in put_items(items, kind):
            src = as_bytes(t)
            fields.append({"name": name, "kind": k, "dtype": dtype_name(t.dtype),
                           "shape": list(t.shape), "nbytes": int(src.nbytes)})
            parts.append(src)
            total += src.nbytes
        if total > self.max_request_bytes:
            raise StoreError(f"a put of {total} bytes exceeds the daemon's limit of "
                             f"{self.max_request_bytes} bytes per request (--max-request)")
        if not fields:
            return []
        return [int(v) for v in self._call(P.Op.PUT, {"items": fields}, parts)["versions"]]

    def _delete(self, name: str, kind: str, missing_ok: bool) -> bool:
        return bool(self._call(P.Op.DELETE, {"name": name, "kind": kind,
                                             "missing_ok": missing_ok})["deleted"])

    # -- reads --------------------------------------------------------------------------
    def _fetch(self, keys: list[Key]) -> tuple[list[tuple[Meta, Any]], Lease]:
        """Each key's meta and bytes (a slice of the mapping, or answer bytes), leased.
        The keys are valid ones (the callers check them)."""
        request = self._with_hits({"keys": [list(k) for k in keys]})
        conn = self._take()
        try:
            fields, payload = conn.request(P.Op.GET, request)
        finally:
            self._give(conn)
        lease = Lease(self._arm_releaser, conn, int(fields["lease"]))
        out = []
        for key, item in zip(keys, fields["items"]):
            meta = Meta(item["d"], tuple(item["s"]), int(item["n"]), int(item["v"]))
            if "o" in item:
                off = int(item["o"])
                raw = self._arena_t[off : off + meta.nbytes]
                if "x" in item and self._index is not None:
                    self._rows[key] = (int(item["x"]), int(item["q"]), meta)
            else:
                at = int(item["i"])
                buf = payload if payload is not None else memoryview(bytearray(0))
                raw = np.frombuffer(buf, dtype=np.uint8, count=meta.nbytes, offset=at)
            out.append((meta, raw))
        return out, lease

    def _read(self, keys: list[Key], device: Any, outs: list[torch.Tensor | None],
              cache: bool = True) -> list[torch.Tensor]:
        """Copies once out of the daemon's cache (checksums were verified when the daemon
        read the entries from the backing tier). ``cache`` is the daemon's to decide: its
        host cache serves every client."""
        results: list[torch.Tensor | None] = [None] * len(keys)
        if self._rows and (device is None or torch.device(device).type == "cpu"):
            for i, key in enumerate(keys):
                results[i] = self._read_published(key, outs[i])
        slow = [i for i, t in enumerate(results) if t is None]
        if slow:
            got, lease = self._fetch([keys[i] for i in slow])
            try:
                for i, (meta, raw) in zip(slow, got):
                    results[i] = _deliver(keys[i], meta, raw, outs[i], device,
                                          self._results.take)
            finally:
                lease.release()
        return results  # type: ignore[return-value]

    def _read_published(self, key: Key, out: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of ``key`` straight out of the mapping if the daemon has it published and
        it stays published while copying (a sequence lock); None means ask the daemon."""
        rec = self._rows.get(key)
        if rec is None:
            return None
        if self._daemon_hung_up():  # its index may be another daemon's memory now
            self._rows.clear()
            self._index = None
            return None  # the socket path says what happened
        row, seq, meta = rec
        index = self._index
        if index is None:
            return None
        if index[row, 0] != seq:
            self._rows.pop(key, None)
            return None
        if out is not None and not (out.device.type == "cpu" and out.is_contiguous()):
            return None
        off = int(index[row, 1])
        if not 0 <= off <= len(self._arena_np) - meta.nbytes:
            return None
        try:
            t = _deliver(key, meta, self._arena_np[off : off + meta.nbytes], out, None,
                         self._results.take)
        except errors.ShapeMismatchError:
            return None  # the socket path raises it
        if index[row, 0] != seq:  # retired while copying: the copy may be torn
            self._rows.pop(key, None)
            return None
        self._note_hit(row, seq)
        self._local_hits += 1
        return t

    def _view(self, name: str, kind: str) -> torch.Tensor:
        """A read-only zero-copy tensor over the daemon's cache slot; the slot stays leased
        (pinned) while the tensor object lives. Do not write into it. An entry the daemon
        does not cache comes back as a copy."""
        (meta, raw), lease = (lambda r: (r[0][0], r[1]))(self._fetch([(name, kind)]))
        if not isinstance(raw, torch.Tensor) or not meta.nbytes:
            lease.release()
            return _deliver((name, kind), meta, raw, None, None, self._results.take)
        # The lease follows the memory, not the tensor object: ``own`` owns the storage,
        # so slices of the view and its ``.numpy()`` keep the slot pinned after it is gone.
        off = raw.data_ptr() - self._arena_t.data_ptr()
        own = self._arena_np[off : off + meta.nbytes]
        with warnings.catch_warnings():  # read-only on purpose: the daemon owns the slots
            warnings.simplefilter("ignore", UserWarning)
            u8 = torch.from_numpy(own)
        weakref.finalize(own, self._late.put, lease)
        return from_bytes(u8, dtype_from_name(meta.dtype), meta.shape)

    def _borrow(self, asked: list[str | Key], keys: list[Key]) -> Borrowed:
        """Read-only views of the daemon's cache slots, leased (pinned) in one request until
        the borrow is released; an entry the daemon does not cache comes back as a copy."""
        got, lease = self._fetch(keys)
        tensors: dict[Any, torch.Tensor] = {}
        try:
            for a, key, (meta, raw) in zip(asked, keys, got):
                if isinstance(raw, torch.Tensor) and meta.nbytes:
                    tensors[a] = from_bytes(raw, dtype_from_name(meta.dtype), meta.shape)
                else:
                    tensors[a] = _deliver(key, meta, raw, None, None, self._results.take)
        except BaseException:
            lease.release()
            raise
        return Borrowed(tensors, lease.release)

    def _stage(self, entries: list[StageEntry]) -> Staged:
        """Tensors of this process's own, sent by the commit as one ``put_many`` (so the
        daemon sees nothing before it, and a discarded stage leaves nothing to undo)."""
        tensors = {key: torch.empty(shape, dtype=dtype) for key, dtype, shape, _ in entries}

        def commit() -> list[int]:
            self._check_open()
            return self.put_many([(n, k, t) for (n, k), t in tensors.items()])

        return Staged(tensors, commit, _nothing)

    # -- catalog queries ----------------------------------------------------------------
    def __contains__(self, key: str | Key) -> bool:
        name, kind = as_key(key)
        return bool(self._call(P.Op.CONTAINS, {"name": name, "kind": kind})["found"])

    def keys(self, prefix: str = "") -> list[Key]:
        _, payload = self._exchange(P.Op.KEYS, {"prefix": prefix})
        return [(n, k) for n, k in json.loads(bytes(payload or b"[]"))]

    def _info(self, name: str, kind: str) -> EntryInfo:
        f = self._call(P.Op.INFO, {"name": name, "kind": kind})
        f["dtype"] = dtype_from_name(f["dtype"])
        f["shape"] = tuple(f["shape"])
        return EntryInfo(**f)

    def stats(self) -> dict[str, Any]:
        """The daemon store's stats, this client's prefetch queues under ``"prefetch"``, the
        daemon's own figures (clients, leases, queue depths) under ``"daemon"``, and under
        ``"local_hits"`` the gets this client served from the daemon's published index
        without a round trip (counted in the daemon's cache hits too)."""
        stats = self._call(P.Op.STATS)  # carries this client's self-served hits
        stats["prefetch"] = self._queues.stats()
        stats["local_hits"] = self._local_hits
        return stats

    def status(self) -> dict[str, Any]:
        """The daemon's figures: clients, leases, hit rate, bytes per tier, queue depths."""
        return self._call(P.Op.STATUS)

    # -- snapshots and verification -----------------------------------------------------
    def snapshot(self, tag: str) -> SnapshotInfo:
        return SnapshotInfo(**self._call(P.Op.SNAPSHOT, {"tag": tag}))

    def snapshots(self) -> list[SnapshotInfo]:
        return [SnapshotInfo(**s) for s in self._call(P.Op.SNAPSHOTS)["snapshots"]]

    def restore(self, tag: str) -> SnapshotInfo:
        return SnapshotInfo(**self._call(P.Op.RESTORE, {"tag": tag}))

    def drop_snapshot(self, tag: str) -> None:
        self._call(P.Op.DROP_SNAPSHOT, {"tag": tag})

    def fsck(self, progress: Callable[[int], None] | None = None) -> FsckReport:
        """The daemon flushes and verifies the whole store (``progress`` gets the total at
        the end: the work happens in the daemon)."""
        f = self._call(P.Op.FSCK)
        report = FsckReport(entries=int(f["entries"]), nbytes=int(f["nbytes"]),
                            problems=list(f["problems"]), notes=list(f["notes"]))
        if progress is not None:
            progress(report.nbytes)
        return report

    # -- device prefetch (queues in this process, fed by daemon gets) ---------------------
    def _host_bytes(self, keys: list[Key]) -> tuple[dict[Key, tuple[Meta, Any]], list[Any]]:
        got, lease = self._fetch(keys)
        return dict(zip(keys, got)), [lease]

    def _entry_nbytes(self, key: Key) -> int:
        return self.info(*key).nbytes

    def _device_queues(self) -> DeviceQueues:
        """This process's prefetch queues (on the CPU, after ``prefetch_views``, they lend
        read-only views of the daemon's cache slots, leased while held)."""
        self._check_open()
        return self._queues

    def _prefetch_used(self) -> None:
        self._report()

    def _report(self, force: bool = False) -> None:
        """Tell the daemon this client's queue figures, at most every REPORT_EVERY_S."""
        now = time.monotonic()
        if not force and now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        figures = {dev: {k: v for k, v in q.items() if isinstance(v, (int, float))}
                   for dev, q in self._queues.stats().items()}
        with contextlib.suppress(StoreError):
            conn = self._take()
            try:
                conn.send_oneway(P.Op.REPORT, {"prefetch": figures})
            finally:
                self._give(conn)


def _nothing() -> None:
    pass


def _deliver(key: Key, meta: Meta, raw: Any, out: torch.Tensor | None, device: Any,
             take: Callable[[int], np.ndarray]) -> torch.Tensor:
    """The caller's own tensor: one copy of its raw bytes (typed copies alter some dtypes' bits)."""
    dtype = dtype_from_name(meta.dtype)
    src = raw.numpy() if isinstance(raw, torch.Tensor) else raw
    if out is not None:
        if out.dtype != dtype or tuple(out.shape) != tuple(meta.shape):
            raise errors.ShapeMismatchError(
                f"out= for {key[0]!r} (kind {key[1]!r}) is {out.dtype} {tuple(out.shape)}, "
                f"the entry is {dtype} {tuple(meta.shape)}")
        if out.device.type == "cpu" and out.is_contiguous() and meta.nbytes:
            np.copyto(out.reshape(-1).view(torch.uint8).numpy(), src[: meta.nbytes])
            return out
        if out.device.type != "cpu":
            return bytes_to_device(src, meta.nbytes, dtype, tuple(meta.shape), out.device,
                                   out=out)
        return out.copy_(from_bytes(torch.from_numpy(src[: meta.nbytes].copy()), dtype,
                                    meta.shape))
    if device is not None and torch.device(device).type != "cpu":
        # Raw bytes straight from the daemon's slot (typed copies lack kernels for some).
        return bytes_to_device(src, meta.nbytes, dtype, tuple(meta.shape), device)
    if not meta.nbytes:
        return torch.empty(meta.shape, dtype=dtype, device=device)
    dst = take(meta.nbytes)
    # numpy's copy stays on this thread: torch's would use its OpenMP pool, and several
    # client processes each spinning a pool on the same cores slow each other down.
    # (Splitting large copies over threads was measured too: no faster on 2 cores.)
    np.copyto(dst[: meta.nbytes], src[: meta.nbytes])
    return from_bytes(dst, dtype, meta.shape)


def connect(socket_path: str | os.PathLike[str], *,
            device_budget: int | str | Mapping[str, int | str] | None = None,
            store: str | os.PathLike[str] | None = None,
            run: str | None = None) -> RemoteStore:
    """Connect to ``tierstore serve`` on ``socket_path``: a store with ``tierstore.open``'s
    API whose host cache is the daemon's, shared with every other client. The daemon must
    run as this user or root (or a user ``TIERSTORE_DAEMON_USER`` names) and, with
    ``store``, serve that store (``identity.py``). ``run``, an id the processes of one
    training run share, claims the store for it: a client of another run is refused while
    this run's are connected. ``RemoteStore.daemon`` says who answered."""
    return RemoteStore(socket_path, device_budget=device_budget, store=store, run=run)
