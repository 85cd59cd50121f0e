"""The store interface: what every store offers, whether it owns its files or talks to a
daemon that does.

:class:`Store` is small on purpose. Each implementation supplies the primitives its medium
decides (``put_many``, ``_read``, ``_borrow``, ``_stage``, the catalog queries, snapshots)
and declares what it can do in :class:`Capabilities`; everything built on the primitives
(``put``, ``get``, ``get_many``, ``names``, ``borrow_many``'s and ``stage_many``'s checks,
the prefetch front, the context manager) is written here, once. Callers decide from
``store.capabilities``, never by probing for methods.

The value types the interface speaks in (:class:`EntryInfo`, :class:`SnapshotInfo`,
:class:`FsckReport`, :class:`Borrowed`, :class:`Staged`) live here too; the rules for names,
kinds and tags, and the forms calls take keys in, are ``keys.py``'s.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .collector import paused
from .errors import StoreError
from .keys import (
    Device,
    Key,
    PutItems,
    StageEntry,
    check_key,
    prefetch_keys,
    read_keys,
    stage_entries,
)
from .sizes import parse_size

if TYPE_CHECKING:
    from .prefetch import DeviceQueues


# -- value types ------------------------------------------------------------------------
@dataclass(frozen=True)
class Capabilities:
    """What a store can do, declared rather than probed for.

    ``zero_copy``: ``borrow_many`` and ``stage_many`` lend the host cache's own memory
    without a copy (a local store with a host cache); elsewhere they work on copies.
    ``remote``: the store is served by a daemon in another process. ``backing``: the tier
    behind it (``"nvme"`` or ``"pmem"``). ``host_cache``: a host-memory cache sits in front
    of the backing tier (the daemon's, for a remote store). ``snapshots`` and
    ``device_prefetch``: the snapshot calls and the device prefetch queues work.
    """

    zero_copy: bool
    remote: bool
    backing: str
    host_cache: bool
    snapshots: bool = True
    device_prefetch: bool = True


@dataclass(frozen=True)
class EntryInfo:
    """What :meth:`Store.info` reports about one entry."""

    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    version: int
    checksum: str
    tier: str
    path: str | None
    offset: int | None


@dataclass(frozen=True)
class SnapshotInfo:
    tag: str
    created: float
    entries: int
    nbytes: int


@dataclass
class FsckReport:
    """``problems`` make ``tierstore fsck`` exit 1; ``notes`` are harmless findings."""

    entries: int = 0
    nbytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Meta:
    """What a cache slot (or a buffer read for one get) holds: the entry's dtype, shape,
    size and version."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int


class Borrowed:
    """Read-only views lent by :meth:`Store.borrow_many`; release once (or use ``with``).

    A released borrow may be :meth:`renew`-ed: a reader that takes the same entries again
    and again (a ring's layer, every token) pins them again at a fraction of a new borrow's
    cost, and keeps its tensors.
    """

    def __init__(self, tensors: dict[Any, torch.Tensor], release: Callable[[], None],
                 renew: Callable[[], bool] | None = None) -> None:
        self.tensors = tensors
        self._releaser = release
        self._release: Callable[[], None] | None = release
        self._renew = renew

    @property
    def renewable(self) -> bool:
        """Whether :meth:`renew` can ever succeed: every entry was lent from the host
        cache. A borrow that is not holds buffers of its own, which live as long as
        ``tensors``: drop it once released."""
        return self._renew is not None

    def release(self) -> None:
        """Unpin the views' slots: the views must not be read after this."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def renew(self) -> bool:
        """After :meth:`release`: pin the same entries again and return True if every one
        is still the cached version it was (same slot, dtype and shape; as a new borrow
        would, this counts as a cache hit), so ``tensors`` may be read again. False where
        any has changed, been evicted or was never cached (read into a buffer of its own):
        nothing is pinned and the caller borrows anew. Raises while the views are lent."""
        if self._release is not None:
            raise StoreError("renew() of a borrow that has not been released")
        if self._renew is None or not self._renew():
            return False
        self._release = self._releaser
        return True

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Staged:
    """New versions being written in place (:meth:`Store.stage_many`): fill ``tensors``,
    then :meth:`commit` (or :meth:`discard`). As a context manager, a block that raises
    discards and one that ends without committing discards too.

    ``commit`` and ``discard`` are the store's: the first makes the tensors the entries'
    new versions and returns them, the second gives back whatever the stage holds.
    """

    def __init__(self, tensors: dict[Key, torch.Tensor], commit: Callable[[], list[int]],
                 discard: Callable[[], None]) -> None:
        self.tensors = tensors
        self._commit = commit
        self._discard = discard
        self._open = True

    def commit(self) -> list[int]:
        """Make every staged tensor its entry's new version; returns the versions."""
        if not self._open:
            raise RuntimeError("this stage was already committed or discarded")
        self._open = False
        try:
            return self._commit()
        except BaseException:
            self._discard()
            raise

    def discard(self) -> None:
        if self._open:
            self._open = False
            self._discard()

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()



def status_figures(stats: dict[str, Any] | None, backing: str,
                   queues: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The part of ``status()`` a local store and the daemon share: hit rate, the cache's
    and tiers' figures, bytes per tier and the prefetch queues' depths and stalls, from
    ``stats()`` (None once closed) and the figures of the prefetch queues in use."""
    depth = {"queued": 0.0, "in_flight": 0.0, "resident": 0.0}
    device_bytes = stall = 0.0
    for q in queues:
        for k in depth:
            depth[k] += q.get(k, 0)
        device_bytes += q.get("in_use_bytes", 0)
        stall += q.get("stall_s", 0)
    cache = stats["cache"] if stats else None
    return {
        "hit_rate": cache["hit_rate"] if cache else 0.0,
        "cache": cache,
        "tiers": stats["tiers"] if stats else {},
        "tier_bytes": {
            "device": int(device_bytes),
            "host": cache["bytes_resident"] if cache else 0,
            backing: stats["bytes_stored"] if stats else 0,
        },
        "queues": {f"prefetch_{k}": int(v) for k, v in depth.items()},
        "stall_s": stall,
    }


# -- the interface ----------------------------------------------------------------------
class Store(abc.ABC):
    """A tiered tensor store: tensors by ``(name, kind)``. Thread-safe.

    Open a local one with :func:`tierstore.open` (a :class:`tierstore.LocalStore`) or
    connect to a daemon's with :func:`tierstore.connect` (a :class:`tierstore.RemoteStore`);
    both are this. ``capabilities`` says where they differ.
    """

    path: str

    # -- what the store is ------------------------------------------------------------
    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this store can do; see :class:`Capabilities`."""

    @property
    def backing(self) -> str:
        """The backing tier: ``"nvme"`` or ``"pmem"``."""
        return self.capabilities.backing

    @abc.abstractmethod
    def describe(self) -> str:
        """The backing tier and the engine or library that moves its bytes."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` has run (reads, writes and queries then raise
        :class:`~tierstore.StoreClosedError`)."""

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raise :class:`~tierstore.StoreClosedError` once the store is closed."""

    # -- lifecycle --------------------------------------------------------------------
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Make what was put durable and let go of the store; idempotent."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Make every earlier ``put`` durable."""

    @abc.abstractmethod
    def tick(self) -> None:
        """Advance the cache policy's clock by one step (a training step, say)."""

    # -- writes -----------------------------------------------------------------------
    def put(self, name: str, tensor: torch.Tensor, kind: str = "param") -> int:
        """Store ``tensor`` as (name, kind); returns its new version (see ``put_many``)."""
        return self.put_many([(name, kind, tensor)])[0]

    @abc.abstractmethod
    def put_many(self, items: PutItems, kind: str = "param") -> list[int]:
        """Store several tensors; returns their versions. ``items`` maps names to tensors,
        or yields ``(name, tensor)`` or ``(name, kind, tensor)``."""

    def delete(self, name: str, kind: str = "param", *, missing_ok: bool = False) -> bool:
        """Remove an entry; its space is reused once no snapshot holds it. A missing entry
        raises :class:`~tierstore.EntryNotFoundError`, or with ``missing_ok`` returns
        False."""
        self._check_open()
        check_key(name, kind)
        return self._delete(name, kind, missing_ok)

    @abc.abstractmethod
    def _delete(self, name: str, kind: str, missing_ok: bool) -> bool:
        """``delete`` of a checked key."""

    def stage_many(self, items: Iterable[tuple[str, str, torch.dtype, Sequence[int]]]
                   ) -> Staged:
        """Room for new versions of several entries, to be written in place and committed.

        ``items`` are ``(name, kind, dtype, shape)``. The returned :class:`Staged` holds a
        writable tensor per entry (``staged.tensors[(name, kind)]``); fill them, then
        ``staged.commit()`` does what ``put_many`` of those tensors would do. Until the
        commit readers see the current versions; a discarded (or, in a ``with`` block,
        failed) stage leaves no trace. With ``capabilities.zero_copy`` the tensors are
        host-cache slots and the commit copies nothing.
        """
        self._check_open()
        return self._stage(stage_entries(items))

    @abc.abstractmethod
    def _stage(self, entries: list[StageEntry]) -> Staged:
        """``stage_many`` of checked entries."""

    # -- reads ------------------------------------------------------------------------
    def get(self, name: str, kind: str = "param", *, device: Device = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored tensor, checksum-verified where it was read from the backing tier.
        ``out`` receives it in place (same dtype and shape, any device); ``device`` puts
        the result there."""
        self._check_open()
        check_key(name, kind)
        return self._read([(name, kind)], device, [out])[0]

    @paused()
    def get_many(self, names: str | Iterable[str | Key], kind: str = "param", *,
                 device: Device = None,
                 out: Mapping[str | Key, torch.Tensor] | None = None,
                 cache: bool = True) -> dict[str | Key, torch.Tensor]:
        """Several tensors with their reads overlapped, keyed as asked (name or (name, kind)).

        ``out`` maps some of those keys to tensors that receive the values in place (as
        ``get``'s ``out=``): a caller that reads the same shapes every step reuses its
        buffers instead of paying for fresh allocations. ``cache=False`` leaves the host
        cache as it is: entries it holds are copied out of it, the others are read from the
        backing tier without taking a slot (into ``out`` itself where that is host memory
        aligned as the disk needs), for a reader that streams more than the cache holds
        into memory of its own.
        """
        self._check_open()
        asked, keys = read_keys(names, kind)
        if out is not None and not isinstance(out, Mapping):
            raise StoreError(f"out= maps the names asked for to tensors (a dict), got "
                             f"{type(out).__name__}")
        outs = [None] * len(keys) if not out else [out.get(a) for a in asked]
        if cache:  # the plain call, which every implementation's _read takes
            return dict(zip(asked, self._read(keys, device, outs)))
        return dict(zip(asked, self._read(keys, device, outs, cache=False)))

    @abc.abstractmethod
    def _read(self, keys: list[Key], device: Device, outs: list[torch.Tensor | None],
              cache: bool = True) -> list[torch.Tensor]:
        """The caller's own tensors of checked ``keys`` (``outs`` filled where given;
        ``cache=False``: see :meth:`get_many`)."""

    def borrow_many(self, names: Iterable[str | Key], kind: str = "param") -> Borrowed:
        """Read-only views of several entries' host bytes, keyed as asked, held until the
        returned :class:`Borrowed` is released (``with store.borrow_many(keys) as b:``
        releases it at the end of the block). Never write into the views: with
        ``capabilities.zero_copy`` they are the host cache's copy of the entry, which other
        readers share. A ``put`` of a borrowed entry makes a new version; the views keep
        showing the old one."""
        self._check_open()
        asked, keys = read_keys(names, kind)
        return self._borrow(asked, keys)

    @abc.abstractmethod
    def _borrow(self, asked: list[str | Key], keys: list[Key]) -> Borrowed:
        """``borrow_many`` of checked keys."""

    def view(self, name: str, kind: str = "param") -> torch.Tensor:
        """A read-only tensor over the stored bytes where the store can lend them without a
        copy, else a copy. Do not write into it."""
        self._check_open()
        check_key(name, kind)
        return self._view(name, kind)

    @abc.abstractmethod
    def _view(self, name: str, kind: str) -> torch.Tensor:
        """``view`` of a checked key."""

    # -- device prefetch --------------------------------------------------------------
    @abc.abstractmethod
    def _device_queues(self) -> DeviceQueues:
        """The store's prefetch queues (raises once the store is closed)."""

    def _prefetch_used(self) -> None:  # noqa: B027 (a hook; most stores need nothing here)
        """Called after a request, acquire or release: a store that reports its queues'
        figures somewhere does it here."""

    def prefetch(self, names: str | Iterable[str | Key], *, device: Device = None,
                 priority: float | tuple[float, ...] = 0,
                 kind: str = "param") -> list[Future[torch.Tensor]]:
        """Start moving entries to ``device`` (None: the CPU "device") and return one future
        per name, resolved with the device copy once it has landed.

        ``names`` holds names (of ``kind``) or ``(name, kind)`` pairs. ``priority`` says
        when they are needed, smaller is sooner: a number or a tuple such as
        ``(step, layer)``. A request for an entry already queued, in flight or resident
        shares its transfer and future (and raises its priority if this one is sooner).
        Transfers take the entry's bytes from the device's budget when they start and give
        them back on :meth:`release` or :meth:`cancel`. A failed read fails its future only.
        On the CPU "device", after :meth:`prefetch_views`, nothing is copied: the result is
        a read-only view (see there).
        """
        futs = self._device_queues().get(device).request(prefetch_keys(names, kind), priority)
        self._prefetch_used()
        return futs

    def acquire(self, name: str, *, device: Device = None, kind: str = "param",
                timeout: float | None = None) -> torch.Tensor:
        """The entry's copy on ``device``, waiting only while its transfer has not landed;
        an entry never prefetched is fetched now, ahead of every queued request. The time
        spent waiting is the stall reported in ``stats()["prefetch"]``. On CUDA the current
        stream waits on the copy's event, not the host. The copy holds its budget until
        :meth:`release`. ``timeout`` (seconds) raises TimeoutError rather than waiting for
        a budget that nothing releases. After :meth:`prefetch_views` on the CPU it is a
        read-only view, not a copy."""
        queues = self._device_queues()
        (key,) = prefetch_keys([(name, kind)], kind)
        t = queues.get(device).acquire(key, timeout)
        self._prefetch_used()
        return t

    def release(self, name: str, *, device: Device = None, kind: str = "param") -> bool:
        """Drop the device copy of an entry and give its bytes back to the budget (a queued
        or in-flight request is cancelled instead). Tensors already handed out stay valid;
        a later :meth:`acquire` transfers the entry again. Returns whether there was one."""
        queues = self._device_queues()
        (key,) = prefetch_keys([(name, kind)], kind)
        done = queues.get(device).drop([key], release=True) == 1
        self._prefetch_used()
        return done

    def cancel(self, names: str | Iterable[str | Key], *, device: Device = None,
               kind: str = "param") -> int:
        """Cancel requests: a queued one never takes budget and its future is cancelled; an
        in-flight one is cancelled and its budget comes back once its bytes have landed; a
        resident copy is dropped as by :meth:`release`. Returns how many were found."""
        return self._device_queues().get(device).drop(prefetch_keys(names, kind),
                                                      release=False)

    def prefetch_views(self, device: Device = None, enabled: bool = True) -> bool:
        """Make the prefetch queue of ``device`` lend read-only views instead of copies (or,
        ``enabled=False``, copy again); returns whether it lends views. Only the CPU
        "device" can, where device memory is host memory: a prefetched entry is then a view
        of its pinned host-cache slot (or of the buffer it was read into, where the cache
        did not take it), pinned while the queue holds it and while any tensor over it
        lives. It applies to every user of that queue, and none may write into what
        :meth:`acquire` returns. On CUDA stage 2 always copies: returns False."""
        return self._device_queues().get(device).set_zero_copy(enabled)

    def prefetch_budget(self, device: Device = None, nbytes: int | str | None = None) -> int:
        """The byte budget of ``device``'s prefetch queue; with ``nbytes`` (bytes or a size
        string), set it first. A caller that learns only after opening the store how much
        of a memory budget the queue may have (an inferencer, once its KV cache is sized)
        lowers it here; a lower budget holds new transfers back until what is held falls
        below it, and a request for an entry larger than it fails."""
        return self._device_queues().get(device).set_budget(
            None if nbytes is None else parse_size(nbytes))

    # -- catalog queries --------------------------------------------------------------
    @abc.abstractmethod
    def __contains__(self, key: str | Key) -> bool:
        """Whether an entry exists: a name (of kind ``param``) or a ``(name, kind)``."""

    @abc.abstractmethod
    def keys(self, prefix: str = "") -> list[Key]:
        """Every (name, kind) whose name starts with ``prefix``, sorted by name then kind."""

    def names(self, prefix: str = "", kind: str | None = None) -> list[str]:
        """Sorted distinct names starting with ``prefix`` (of one kind, if given)."""
        return list(dict.fromkeys(n for n, k in self.keys(prefix) if kind is None or k == kind))

    def info(self, name: str, kind: str = "param") -> EntryInfo:
        """dtype, shape, size, version, checksum and location of an entry."""
        self._check_open()
        check_key(name, kind)
        return self._info(name, kind)

    @abc.abstractmethod
    def _info(self, name: str, kind: str) -> EntryInfo:
        """``info`` of a checked key."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Entries and bytes stored, reads and writes per tier, the host cache's figures
        (``"cache"``) and the prefetch queues' (``"prefetch"``)."""

    @abc.abstractmethod
    def status(self) -> dict[str, Any]:
        """Hit rate, bytes per tier and queue depths (see :func:`status_figures`), with
        what the store adds (a daemon: its clients and leases)."""

    # -- snapshots and verification ---------------------------------------------------
    @abc.abstractmethod
    def snapshot(self, tag: str) -> SnapshotInfo:
        """Atomically record the current version of every entry under ``tag``."""

    @abc.abstractmethod
    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot, in tag order."""

    @abc.abstractmethod
    def restore(self, tag: str) -> SnapshotInfo:
        """Make the live entries exactly the snapshot's (entries made since are removed)."""

    @abc.abstractmethod
    def drop_snapshot(self, tag: str) -> None:
        """Forget a snapshot; space only it held becomes free."""

    @abc.abstractmethod
    def fsck(self, progress: Callable[[int], None] | None = None) -> FsckReport:
        """Flush, then verify every checksum, the reference counts and the free map;
        ``progress`` is called with the bytes verified so far."""
