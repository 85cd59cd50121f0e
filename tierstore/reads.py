"""The read path of a local store: entries into host memory, then out to the caller.

A read looks its records up and leases their extents (so no write reuses the space under
it), reads each extent in ``chunk``-sized pieces in parallel on the chunk workers, checks
each piece's crc32c as it lands and raises :class:`~tierstore.CorruptEntryError` on a
mismatch. With the host cache, a miss is read straight into a fresh cache slot under the
entry's key lock, and the slot is published only once every chunk has been verified.
"""

# Over 600 lines: the read path from catalog lookup to the caller's memory, with its checks on
# the chunk workers; to split next (landing and verification apart from the lookup).

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from collections.abc import Iterable
from concurrent.futures import wait
from typing import Any, NamedTuple

import crc32c
import numpy as np
import torch

from tierstore.cache.pinned import cuda_consumer
from tierstore.nvme import HANDOFF_MIN_BYTES, BatchError, aligned_empty
from tierstore.nvme.aio import MAX_PIECES, EngineClosedError, address

from .catalog import Record
from .devices import bytes_to_device
from .errors import (
    CorruptEntryError,
    EntryNotFoundError,
    ShapeMismatchError,
    StoreClosedError,
    StoreError,
    StoreFullError,
)
from .interface import Meta
from .keys import Key
from .landing import Target, accepts, land, on_workers
from .landing import targets as landing_targets
from .local_state import LocalState
from .media import adjacent_runs, joined
from .tensors import dtype_from_name, from_bytes, raw_bytes

_DIRECT = object()  # found's bytes for a key read straight into the caller's out=
_NOTHING = np.empty(0, np.uint8)  # the direct part of a target read wholly bounced


class _Request(NamedTuple):
    """One request of a read: chunks ``[first, last)``, one range of a slab file."""

    first: int
    last: int
    seg: int
    off: int
    nbytes: int


def _coalesce(work: list[tuple[int, int, int]], recs: list[Record], pos: int, alone: int,
              limit: int) -> list[_Request]:
    """The requests for chunks ``pos`` onwards (see :func:`~tierstore.media.adjacent_runs`)."""
    runs = adjacent_runs(work[pos:], [(r.seg, r.off) for r in recs], limit, MAX_PIECES,
                         alone - pos)
    plan = []
    for first, last in runs:
        chunks = work[pos + first : pos + last]
        i, start, _ = chunks[0]
        plan.append(_Request(pos + first, pos + last, recs[i].seg, recs[i].off + start,
                             sum(e - s for _, s, e in chunks)))
    return plan


def settle(jobs: collections.deque[Any]) -> None:
    """Wait for every job in ``jobs``, then raise the first one's failure, if any."""
    wait(jobs)
    while jobs:
        jobs.popleft().result()


class ReadPath(LocalState):
    """The read path of :class:`tierstore.LocalStore` (see the module docstring)."""

    def _read(self, keys: list[Key], device: str | torch.device | None,
              outs: list[torch.Tensor | None], cache: bool = True) -> list[torch.Tensor]:
        # Without caching (or a cache), a miss whose out= can take the read lands there,
        # straight or through a bounce buffer overlapped with the I/O (tierstore.landing).
        # A miss read into a buffer of its own is handed out as a tensor over that buffer,
        # made while the batch's later requests are in flight (``views``).
        views: dict[Key, torch.Tensor] | None = None
        if device is None or torch.device(device).type == "cpu":
            views = {}
        if cache and self._cache is not None:
            found, handles = self._host_bytes(keys, views=views)
        else:
            once = set(keys)
            if len(once) < len(keys):  # a key asked twice gets copies of one read
                once = {k for k, n in collections.Counter(keys).items() if n == 1}
            direct = {k: o for k, o in zip(keys, outs) if k in once and accepts(o)}
            found, handles = self._host_bytes(keys, admit=False, direct=direct, views=views)
        try:
            return [
                out if raw is _DIRECT else (
                    views.pop(key) if out is None and views and key in views
                    else self._deliver(key, meta, raw, out, device))
                for key, out in zip(keys, outs)
                for meta, raw in (found[key],)
            ]
        finally:
            self._release_handles(handles)

    def _host_bytes(
        self, keys: list[Key], *, admit: bool = True,
        direct: dict[Key, torch.Tensor] | None = None,
        views: dict[Key, torch.Tensor] | None = None,
    ) -> tuple[dict[Key, tuple[Meta, Any]], list[Any]]:
        """Every key's bytes in host memory, without a copy: a pinned cache slot (hit, or
        filled from the backing tier) or, where the cache holds no slot for it, a freshly
        read buffer. Release the returned handles when done with the bytes.

        ``admit=False`` leaves the cache as it is: hits are lent as usual, misses are read
        into buffers of their own, or straight into ``direct``'s tensor for their key
        (found then holds :data:`_DIRECT` for the bytes). ``views``, where given, gets a
        tensor of the entry's dtype and shape over each buffer of its own."""
        found: dict[Key, tuple[Meta, Any]] = {}
        handles: list[Any] = []
        try:
            if self._cache is None:
                misses = list(dict.fromkeys(keys))
            else:
                misses = []
                unique = list(dict.fromkeys(keys))
                for key, h in zip(unique, self._cache.lookup_many(unique)):
                    if h is None:
                        misses.append(key)
                    else:
                        handles.append(h)
                        found[key] = (h.meta, h.view)
            if misses:
                # Under the misses' key locks a write or delete of them is done or not
                # begun: a delete takes the cached version before its commit, and a read
                # in between would find the older committed one (or fill the cache with it).
                with self._ops.shared(), self._key_locks(misses if self._cache is not None else []):
                    self._load(misses, found, handles, admit=admit, direct=direct or {},
                               views=views)
            with self._stats_lock:
                self._tier.reads += len(misses)
        except BaseException:
            self._release_handles(handles)
            raise
        return found, handles

    def _release_handles(self, handles: list[Any]) -> None:
        if handles:
            assert self._cache is not None
            self._cache.release_many(handles)

    def _load(
        self, keys: list[Key], found: dict[Key, Any], handles: list[Any], *,
        admit: bool = True, direct: dict[Key, torch.Tensor] | None = None,
        views: dict[Key, torch.Tensor] | None = None,
    ) -> None:
        """Read missed entries from the backing tier, into cache slots where admitted
        (``admit``), else into ``direct``'s tensor for the key or a buffer of their own.
        A buffer of its own is taken (and its tensor made, into ``views``) only as the
        entry's first request is made, so on a batched engine that work runs while the
        requests before it are in flight."""
        recs = self._lookup(keys)
        try:
            metas = [Meta(rec.dtype, tuple(rec.shape), rec.nbytes, rec.version) for rec in recs]
            into_of: dict[Key, torch.Tensor] = {}
            for key, meta in zip(keys, metas) if direct else ():
                into = direct.get(key)  # type: ignore[union-attr]
                if into is not None:
                    self._check_out(key, meta, into)  # before any slot is taken
                    into_of[key] = into
                    if into.is_cuda:
                        cuda_consumer()
            todo_keys: list[Key] = []
            todo_recs: list[Record] = []
            bufs: list[np.ndarray | None] = []
            new: list[Any] = []
            own: dict[int, Meta] = {}  # todo position -> the meta of an entry read into its own
            targets: dict[int, Target] = {}  # todo position -> the caller's tensor it lands in

            def provide(i: int) -> np.ndarray:
                buf = self._results.take(todo_recs[i].length)
                meta = own[i]
                found[todo_keys[i]] = (meta, buf)
                if views is not None:
                    views[todo_keys[i]] = from_bytes(buf, dtype_from_name(meta.dtype),
                                                     meta.shape)
                bufs[i] = buf
                return buf

            at = [j for j, key in enumerate(keys) if key in into_of]
            placed = dict(zip(at, landing_targets([into_of[keys[j]] for j in at],
                                                  [recs[j].nbytes for j in at],
                                                  [recs[j].length for j in at])))
            for j, (key, rec, meta) in enumerate(zip(keys, recs, metas)):
                into = into_of.get(key)
                if into is not None:
                    found[key] = (meta, _DIRECT)
                    t = placed[j]
                    targets[len(bufs)] = t
                    todo_keys.append(key)
                    todo_recs.append(rec)
                    bufs.append(t.dst[: t.direct] if t.direct else _NOTHING)
                    continue
                h = None
                if admit and self._cache is not None and rec.nbytes:
                    try:
                        h = self._cache.insert(key, rec.nbytes, meta)
                    except StoreFullError:
                        h = None  # a victim's write-back found no space: serve uncached
                if h is not None:
                    handles.append(h)
                    found[key] = (h.meta, h.view)
                    if not h.new:
                        continue  # loaded by another thread meanwhile
                    new.append(h)
                    # Slots are 4 KiB-aligned powers of two: the extent's length fits.
                    buf = raw_bytes(h.view, rec.length)
                else:
                    own[len(bufs)] = meta
                    buf = None  # taken by ``provide``
                todo_keys.append(key)
                todo_recs.append(rec)
                bufs.append(buf)
            try:
                self._fetch(todo_keys, todo_recs, bufs, provide, targets)
            except BaseException:
                for h in new:  # never publish unverified bytes
                    self._cache.invalidate(h.key)
                raise
            for i in own:
                if bufs[i] is None:  # no request at all: an empty entry
                    provide(i)
            for h in new:
                self._cache.publish(h)
            with self._stats_lock:
                self._tier.bytes_read += sum(r.nbytes for r in todo_recs)
        finally:
            self._unlease(recs)

    def _lookup(self, keys: list[Key]) -> list[Record]:
        """Records of ``keys`` with their extents leased (release with ``_unlease``)."""
        recs: list[Record] = []
        try:
            with self._alloc.lock, self._catalog.read() as txn:
                for name, kind in keys:
                    rec = self._catalog.read_record(txn, name, kind)
                    if rec is None:
                        raise EntryNotFoundError(name, kind)
                    if rec.seg >= 0:
                        self._alloc.lease_locked(rec.seg, rec.off)
                    recs.append(rec)
        except BaseException:
            self._unlease(recs)
            raise
        return recs

    def _unlease(self, recs: Iterable[Record]) -> None:
        self._alloc.unlease_many([(rec.seg, rec.off) for rec in recs if rec.seg >= 0])

    def _deliver(
        self, key: Key, meta: Meta, raw: np.ndarray | torch.Tensor,
        out: torch.Tensor | None, device: str | torch.device | None,
    ) -> torch.Tensor:
        """The caller's own tensor: a copy out of a cache slot, or the freshly read buffer."""
        if out is not None:
            self._check_out(key, meta, out)
        target = out.device if out is not None else torch.device(device or "cpu")
        if target.type != "cpu":
            if target.type == "cuda":
                cuda_consumer()  # the first device read pins the cache arena
            # Raw bytes, as on the CPU (see there); synchronous, so the slot may go after.
            return bytes_to_device(raw, meta.nbytes, dtype_from_name(meta.dtype),
                                   tuple(meta.shape), target, out=out)
        if out is None and isinstance(raw, torch.Tensor):
            # A cache slot: copy the raw bytes out (typed copies have no kernel for some
            # dtypes and would canonicalise others, e.g. bool bytes other than 0/1). Into
            # reused memory: faulting fresh pages in costs more than the copy. A plain memcpy
            # on this thread: torch's copy splits across its intra-op threads and, with the
            # cores busy, waits a scheduler tick for the other half.
            buf = self._results.take(raw.numel())
            np.copyto(buf, raw.numpy())
            raw = buf
        if (out is not None and out.device.type == "cpu" and out.is_contiguous()
                and out.numel() and not out.requires_grad):
            # Bytes straight into the caller's tensor with a memcpy (see above).
            src = raw.numpy() if isinstance(raw, torch.Tensor) else raw
            np.copyto(out.view(-1).view(torch.uint8).numpy(), src[: meta.nbytes])
            return out
        t = from_bytes(raw, dtype_from_name(meta.dtype), meta.shape)
        if out is not None:
            return out.copy_(t)
        return t

    @staticmethod
    def _check_out(key: Key, meta: Meta, out: torch.Tensor) -> None:
        dtype = dtype_from_name(meta.dtype)
        if out.dtype != dtype or out.shape != tuple(meta.shape):  # a torch.Size is a tuple
            raise ShapeMismatchError(
                f"out= for {key[0]!r} (kind {key[1]!r}) is {out.dtype} {tuple(out.shape)}, "
                f"the entry is {dtype} {tuple(meta.shape)}"
            )

    def _bounce(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """An aligned buffer of ``nbytes`` that a read lands in before :func:`land` copies
        it out, and whether it goes back to the staging pool (reused memory: no page
        faults). One larger than a pool buffer (a chunk) is recycled when dropped."""
        if nbytes <= self._staging.nbytes:
            return self._staging.take(), True
        return self._results.take(nbytes), False

    def _fetch(
        self, keys: list[Key], recs: list[Record], bufs: list[Any] | None = None,
        provide: Any = None, targets: dict[int, Target] | None = None,
    ) -> list[np.ndarray]:
        """Read the records' extents in parallel chunks, verifying each chunk's crc32c.
        Where ``bufs[i]`` is None, ``provide(i)`` returns the buffer, called as the
        entry's first request is made. Where ``targets`` has entry ``i``, its bytes past
        ``direct`` are bounced and copied into the target's tensor as each chunk lands."""
        if bufs is None:
            bufs = [aligned_empty(rec.length) for rec in recs]
        targets = targets or {}
        bounced = sum(recs[i].length - t.direct for i, t in targets.items())
        if (getattr(self._medium, "batched", False)
                and not on_workers(bounced, sum(rec.length for rec in recs), len(recs))):
            return self._fetch_batched(keys, recs, bufs, provide, targets)
        for i, buf in enumerate(bufs):
            if buf is None:
                bufs[i] = provide(i)

        def chunk_job(i: int, c: int) -> None:
            rec, buf, start = recs[i], bufs[i], c * recs[i].chunk
            end = min(start + rec.chunk, rec.length)
            t = targets.get(i)
            lo = end if t is None else min(end, max(start, t.direct))
            stop = min(end, rec.nbytes)
            bounce: tuple[np.ndarray, bool] | None = None
            try:
                if lo > start:
                    self._medium.read(rec.seg, rec.off + start, memoryview(buf[start:lo]))
                if end > lo:
                    bounce = self._bounce(end - lo)
                    self._medium.read(rec.seg, rec.off + lo, memoryview(bounce[0][: end - lo]))
            except OSError as e:
                if bounce is not None and bounce[1]:
                    self._staging.give(bounce[0])
                where = self._medium.location(rec.seg, rec.off + start)[0]
                raise CorruptEntryError(
                    *keys[i], f"bytes {start}..{end} cannot be read from {where} "
                    f"({e.strerror or e}); restore the file, or the entry from a snapshot",
                ) from e
            got = crc32c.crc32c(buf[start : min(lo, stop)]) if lo > start else 0
            if bounce is not None:
                assert t is not None
                got = land(t, lo, bounce[0][: stop - lo], got)
                if bounce[1]:
                    self._staging.give(bounce[0])
            if got != rec.crc[c]:
                name, kind = keys[i]
                raise CorruptEntryError(
                    name, kind,
                    f"crc32c of bytes {start}..{stop} is {got:08x}, the catalog says "
                    f"{rec.crc[c]:08x} (version {rec.version}, "
                    f"{self._medium.location(rec.seg, rec.off + start)[0]})",
                )

        work = [(i, c) for i, rec in enumerate(recs)
                for c in range(len(range(0, rec.length, rec.chunk)))]
        if len(work) == 1:  # nothing to overlap: no hand-off
            chunk_job(*work[0])
            return bufs
        # A few workers take the chunks in turn, rather than a job (a future, a queue item
        # and a thread wake-up) per chunk: a layer of 512 KiB entries is a hundred chunks.
        # Requests under HANDOFF_MIN_BYTES are issued by the worker itself, io_threads at a
        # time, and more workers would only queue for those slots: one more, to issue the
        # next request while another worker checksums. Larger requests wait on the engine's
        # pool, whose queue must not run dry: the whole of this pool for those.
        big = any(min(rec.chunk, rec.length) >= HANDOFF_MIN_BYTES for rec in recs)
        fetchers = self._io_threads + (self._io_threads if big else 1)
        todo = iter(enumerate(work))
        take = threading.Lock()
        failed: list[tuple[int, BaseException]] = []

        def drain() -> None:
            while not failed:
                with take:
                    item = next(todo, None)
                if item is None:
                    return
                n, (i, c) = item
                try:
                    chunk_job(i, c)
                except BaseException as e:  # noqa: BLE001 (raised by the caller below)
                    failed.append((n, e))

        jobs = [self._workers.submit(drain) for _ in range(min(len(work), fetchers))]
        try:
            for f in jobs:
                f.result()
        finally:
            if not all(f.done() for f in jobs):  # interrupted: stop taking chunks
                failed.append((len(work), StoreError("fetch interrupted")))
            # Never let a read land in a buffer after its extent's lease has ended.
            for f in jobs:
                if not f.cancel():
                    f.exception()
        if failed:
            raise min(failed, key=lambda x: x[0])[1]
        return bufs

    def _fetch_batched(
        self, keys: list[Key], recs: list[Record], bufs: list[Any], provide: Any = None,
        targets: dict[int, Target] | None = None,
    ) -> list[np.ndarray]:
        """:meth:`_fetch` as one batch on an engine that keeps a deep queue (AIO).

        Chunks that follow each other on disk (small entries written by one ``put_many``)
        go as one vectored request of up to a chunk's bytes, so a layer of 256 KiB entries
        costs the disk and this thread what a few large entries do. Each chunk's crc32c is
        checked on a chunk worker as its request lands, while this thread submits and
        reaps the requests after it. A request of several chunks that fails is tried again chunk by chunk, so
        the entry named is the one whose bytes cannot be read (and a transient failure
        costs nothing). A target's bounced bytes share their request with the others: a
        request's bounced pieces lie one after another in one pooled buffer, and each is
        checksummed and copied out as the request lands (see :mod:`tierstore.landing`)."""
        targets = targets or {}
        # chunk -> (bounce buffer, position in it, first bounced byte of the chunk)
        staged: dict[int, tuple[np.ndarray, int, int]] = {}
        work: list[tuple[int, int, int]] = []  # (record, start, end) of each chunk
        for i, rec in enumerate(recs):
            if rec.length:
                step, length = rec.chunk, rec.length
                work += [(i, start, min(start + step, length))
                         for start in range(0, length, step)]
        # Asked as each entry's first request is made, while earlier ones are in flight
        # (an entry read wholly through a bounce buffer never asks).
        addrs: list[int | None] = [None] * len(bufs)

        def addr(i: int) -> int:
            a = addrs[i]
            if a is None:
                b = bufs[i]
                a = addrs[i] = address(provide(i) if b is None else b)
            return a

        bad: list[tuple[int, CorruptEntryError]] = []

        def check(n: int) -> None:
            i, start, end = work[n]
            rec = recs[i]
            stop = min(end, rec.nbytes)
            at = staged.pop(n, None)
            if at is None:
                got = crc32c.crc32c(bufs[i][start:stop])
            else:
                buf, pos, lo = at
                got = crc32c.crc32c(bufs[i][start:lo]) if lo > start else 0
                got = land(targets[i], lo, buf[pos : pos + stop - lo], got)
            if got != rec.crc[start // rec.chunk]:
                # Kept, not raised: with several corrupt entries the first in the order
                # asked is named, whatever order the chunks land in.
                name, kind = keys[i]
                bad.append((n, CorruptEntryError(
                    name, kind,
                    f"crc32c of bytes {start}..{stop} is {got:08x}, the catalog says "
                    f"{rec.crc[start // rec.chunk]:08x} (version {rec.version}, "
                    f"{self._medium.location(rec.seg, rec.off + start)[0]})",
                )))

        pos = alone = 0  # chunks before ``alone`` go one request each
        while pos < len(work):
            plan = _coalesce(work, recs, pos, alone, self._chunk)
            failed = self._run_plan(keys, recs, work, plan, addr, check, bad, targets,
                                    staged)
            if (failed is None or failed[1] - failed[0] == 1
                    or any(n < failed[0] for n, _ in bad)):
                break
            # A request of several chunks failed: those chunks alone, then the rest.
            pos, alone = failed
        # Every chunk before a failed one was checked (the engine hands back all that
        # landed), so the lowest position is the first bad entry in the order asked.
        if bad:
            raise min(bad, key=lambda x: x[0])[1]
        return bufs

    def _run_plan(
        self, keys: list[Key], recs: list[Record], work: list[tuple[int, int, int]],
        plan: list[_Request], addr: Any, check: Any, bad: list[tuple[int, CorruptEntryError]],
        targets: dict[int, Target], staged: dict[int, tuple[np.ndarray, int, int]],
    ) -> tuple[int, int] | None:
        """Run ``plan`` as one batch, ``check``-ing every chunk that lands. Returns None when
        every request moved its bytes, else the chunks ``[first, last)`` of the request that
        failed; a single chunk's failure is recorded in ``bad`` as its entry's. Bytes of
        ``targets`` past their direct part are read into a bounce buffer per request (where
        each chunk's part is noted in ``staged``), given back once the request is checked."""
        at = [0]  # the request being made, should making it fail (a missing slab file)
        held: dict[int, tuple[np.ndarray, bool]] = {}  # request -> its bounce buffer
        # Landed requests' checks (crc32c, bounce copies) run on the chunk workers, so this
        # thread goes straight back to submitting and reaping: both release the GIL, and
        # the copy of one request overlaps the transfer of the next. At most ``backlog``
        # wait, so the bounce buffers they hold stay within the staging pool's idle ones.
        checking: collections.deque[Any] = collections.deque()
        backlog = max(2, self._io_threads) if len(plan) > 1 else 0

        def requests() -> Any:
            for m, r in enumerate(plan):
                at[0] = m
                pieces: list[tuple[int, int]] = []
                used = 0
                for n in range(r.first, r.last):
                    i, s, e = work[n]
                    t = targets.get(i)
                    lo = e if t is None else min(e, max(s, t.direct))
                    if lo > s:
                        pieces.append((addr(i) + s, lo - s))
                    if e > lo:
                        if m not in held:
                            held[m] = self._bounce(r.nbytes)
                        bounce = held[m][0]
                        staged[n] = (bounce, used, lo)
                        pieces.append((bounce.ctypes.data + used, e - lo))
                        used += e - lo
                yield r.seg, r.off, joined(pieces), r.nbytes, False

        def finish(m: int) -> None:
            try:
                for n in range(plan[m].first, plan[m].last):
                    check(n)
            finally:
                give(held.pop(m, None))

        def done(m: int) -> None:
            if not backlog:
                finish(m)
                return
            while checking and (len(checking) >= backlog or checking[0].done()):
                checking.popleft().result()
            checking.append(self._workers.submit(finish, m))

        def give(bounce: tuple[np.ndarray, bool] | None) -> None:
            if bounce is not None and bounce[1]:
                self._staging.give(bounce[0])

        try:
            try:
                self._medium.run(requests(), done)
            finally:
                settle(checking)
            return None
        except EngineClosedError as e:  # only where no operation gate held it off (fsck)
            raise StoreClosedError(f"store {self.path} is closed") from e
        except OSError as e:
            # A request's failure (BatchError) or a missing slab file met while making a
            # request is the entry's; anything else (no AIO context, io_getevents) is
            # the batch's, not evidence against the bytes.
            if isinstance(e, BatchError):
                r = plan[e.index]
            elif isinstance(e, FileNotFoundError):
                r = plan[at[0]]
            else:
                name, kind = keys[work[0][0]]
                raise StoreError(
                    f"reading {name!r} (kind {kind!r}) and {len(keys) - 1} other entries: "
                    f"{e.strerror or e}") from e
            if r.last - r.first == 1:
                i, start, end = work[r.first]
                rec = recs[i]
                where = self._medium.location(rec.seg, rec.off + start)[0]
                err = CorruptEntryError(
                    *keys[i], f"bytes {start}..{end} cannot be read from {where} "
                    f"({e.strerror or e}); restore the file, or the entry from a snapshot")
                err.__cause__ = e
                bad.append((r.first, err))
            return r.first, r.last
        finally:
            # Nothing is in flight once the batch has ended, and every check has run (the
            # batch's ``settle``): requests that never landed
            # (or failed) give their bounce buffers back; their chunks are retried afresh.
            for m in list(held):
                give(held.pop(m))
            for n in range(plan[0].first if plan else 0, plan[-1].last if plan else 0):
                staged.pop(n, None)

    def _verify_record(self, name: str, kind: str, rec: Record) -> None:
        self._fetch([(name, kind)], [rec])

    def _view(self, name: str, kind: str) -> torch.Tensor:
        """A read-only zero-copy tensor over the stored bytes, where the medium is byte
        addressable (PMem); a checksum-verified copy elsewhere, or while the host cache
        holds a newer version than the backing tier.

        The entry's space stays reserved (not reused by later writes) while the returned
        tensor object is alive. Do not write into it.
        """
        if self._cache is not None and self._cache.peek((name, kind)) is not None:
            return self.get(name, kind)
        rec = self._lookup([(name, kind)])[0]
        try:
            mv = self._medium.view(rec.seg, rec.off, rec.nbytes) if rec.seg >= 0 else None
            if mv is None:
                self._unlease([rec])
                return self.get(name, kind)
            arr = np.frombuffer(mv, dtype=np.uint8)
            for c, start in enumerate(range(0, rec.nbytes, rec.chunk)):
                got = crc32c.crc32c(arr[start : start + rec.chunk])
                if got != rec.crc[c]:
                    raise CorruptEntryError(name, kind, f"crc32c {got:08x} != {rec.crc[c]:08x}")
            with warnings.catch_warnings():  # read-only on purpose: writes must go through put
                warnings.simplefilter("ignore", UserWarning)
                u8 = torch.from_numpy(arr)
            t = from_bytes(u8, dtype_from_name(rec.dtype), tuple(rec.shape))
        except BaseException:
            self._unlease([rec])
            raise
        # The lease follows the memory, not the tensor object: slices of ``t`` and
        # ``t.numpy()`` keep ``arr`` (the storage's owner) alive after ``t`` is gone.
        weakref.finalize(arr, self._alloc.unlease, rec.seg, rec.off)
        return t
