"""Borrow and stage: a local store's zero-copy access to its host cache.

``borrow_many`` lends read-only views of the entries' cache slots, pinned until released;
``stage_many`` hands out fresh slots to write new versions into, which the commit makes the
entries' versions without a copy. Without a host cache (or where it has no room) both work
on buffers of their own, with the same semantics.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .interface import Borrowed, Meta, Staged
from .keys import Key, StageEntry
from .reads import ReadPath
from .tensors import as_bytes, dtype_from_name, dtype_name, from_bytes
from .writes import WritePath


class BorrowStage(ReadPath, WritePath):
    """Borrow and stage of :class:`tierstore.LocalStore`: the read path fills what is
    lent, the write path commits what was staged."""

    def _borrow(self, asked: list[str | Key], keys: list[Key]) -> Borrowed:
        """Hits are views of the pinned cache slots; misses are read from the backing tier
        (crc32c-verified) into cache slots, or into buffers of their own where the cache
        does not take them. The slots stay pinned (not evicted, not reused) until the
        borrow is released; a ``put`` of a borrowed entry makes a new version in a new
        slot."""
        found, handles = self._host_bytes(keys)
        slots = {h.key: h for h in handles}
        tensors = {}
        for a, key in zip(asked, keys):
            meta, raw = found[key]
            h = slots.get(key)
            memo = h.memo if h is not None else None
            if memo is not None and memo[0] is meta:
                typed = memo[1]
            else:
                typed = from_bytes(raw, dtype_from_name(meta.dtype), meta.shape)
                if h is not None:
                    # The slot never moves: one typed view per entry and meta (an
                    # overwrite in place brings a new meta).
                    h.memo = (meta, typed)
            # A fresh alias each time, so that nothing one borrower sets on its tensor
            # (requires_grad, say) reaches the next.
            tensors[a] = typed.detach()
        renew = None
        if self._cache is not None and len(handles) == len(found):  # every one cached
            hs = [slots[key] for key in found]
            metas = [found[key][0] for key in found]
            renew = functools.partial(self._cache.renew_many, hs, metas)
        return Borrowed(tensors, functools.partial(self._release_handles, handles), renew)

    def _stage(self, entries: list[StageEntry]) -> Staged:
        """A fresh host-cache slot per entry where the cache has room, else a plain tensor;
        the commit does what ``put_many`` of those tensors would do (new versions, dirty
        cache entries written back later, or written through), without copying them."""
        handles: dict[Key, Any] = {}
        tensors: dict[Key, torch.Tensor] = {}
        cached = [(key, nbytes) for key, _, _, nbytes in entries if nbytes]
        with self._ops.shared():  # making room may write dirty victims back
            slots = (dict(zip((k for k, _ in cached), self._cache.stage_many(cached)))
                     if self._cache is not None and cached else {})
        for key, dtype, shape, _ in entries:
            h = slots.get(key)
            if h is not None:
                handles[key] = h
                tensors[key] = from_bytes(h.view, dtype, shape)
            else:
                tensors[key] = torch.empty(shape, dtype=dtype)
        return Staged(tensors, functools.partial(self._commit_staged, tensors, handles),
                      functools.partial(self._discard_staged, handles))

    def _discard_staged(self, handles: dict[Key, Any]) -> None:
        cache = self._cache
        for h in handles.values():
            if cache is not None:
                cache.discard_staged(h)  # a no-op for slots already committed

    def _commit_staged(self, tensors: dict[Key, torch.Tensor], handles: dict[Key, Any]) -> list[int]:
        """``Staged.commit``: the staged slots become the entries' new versions."""
        self._check_open()
        keys = list(tensors)
        plain = []
        with self._ops.shared(), self._key_locks(keys if self._cache is not None else []):
            versions = self._next_versions(len(keys))  # under the locks, as in put_many
            swaps = []
            for (name, k), v in zip(keys, versions):
                t = tensors[(name, k)]
                meta = Meta(dtype_name(t.dtype), tuple(t.shape), t.nbytes, v)
                h = handles.get((name, k))
                if h is None:  # the cache had no slot to stage it in: a plain put
                    plain.append((name, k, as_bytes(t), meta))
                else:
                    swaps.append((h, meta))
            if swaps:
                self._cache.commit_staged_many(swaps)
            if plain and self._cache is not None:
                self._land(plain)
            elif plain:
                self._write_through(plain)
        return versions
