"""The read path of a local store: entries into host memory, then out to the caller.

A read looks its records up and leases their extents (so no write reuses the space under
it), reads each extent in ``chunk``-sized pieces (:mod:`tierstore.fetch`), checks each
piece's crc32c as it lands and raises :class:`~tierstore.CorruptEntryError` on a mismatch.
With the host cache, a miss is read straight into a fresh cache slot under the entry's key
lock, and the slot is published only once every chunk has been verified.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import crc32c
import numpy as np
import torch

from tierstore.cache.pinned import cuda_consumer

from .catalog import Record
from .devices import bytes_to_device
from .errors import (
    CorruptEntryError,
    EntryNotFoundError,
    ShapeMismatchError,
    StoreFullError,
)
from .fetch import FetchPath
from .interface import Meta
from .keys import Key
from .landing import Deferred, Target, accepts
from .landing import targets as landing_targets
from .media import memory_alignment
from .tensors import dtype_from_name, from_bytes, raw_bytes

_DIRECT = object()  # found's bytes for a key read straight into the caller's out=
_NOTHING = np.empty(0, np.uint8)  # the direct part of a target read wholly bounced


class ReadPath(FetchPath):
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
            # todo position -> the caller's tensor it lands in
            targets: dict[int, Target] | Deferred = {}
            aimed: list[int] = []  # todo positions of entries read into the caller's tensor

            def provide(i: int) -> np.ndarray:
                if i not in own:  # into the caller's tensor, its target worked out late
                    t = targets[i]
                    buf = bufs[i] = t.dst[: t.direct] if t.direct else _NOTHING
                    return buf
                buf = self._results.take(todo_recs[i].length)
                meta = own[i]
                found[todo_keys[i]] = (meta, buf)
                if views is not None:
                    views[todo_keys[i]] = from_bytes(buf, dtype_from_name(meta.dtype),
                                                     meta.shape)
                bufs[i] = buf
                return buf

            for key, rec, meta in zip(keys, recs, metas):
                if key in into_of:
                    found[key] = (meta, _DIRECT)
                    aimed.append(len(bufs))
                    todo_keys.append(key)
                    todo_recs.append(rec)
                    bufs.append(None)  # its target's direct part (``provide``)
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
            if aimed:
                outs = [into_of[todo_keys[i]] for i in aimed]
                nbytes = [todo_recs[i].nbytes for i in aimed]
                lengths = [todo_recs[i].length for i in aimed]
                align = memory_alignment(self._medium)
                if self._batched():
                    targets = Deferred(aimed, outs, nbytes, lengths, align)
                else:  # on the chunk workers: all now
                    targets = dict(zip(aimed, landing_targets(outs, nbytes, lengths, align)))
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
