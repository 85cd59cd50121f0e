"""Every error the store raises derives from :class:`StoreError`."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of tierstore's errors."""


class NotAStoreError(StoreError):
    """The path exists but holds no tierstore catalog (or one of an unknown layout)."""


class StoreLockedError(StoreError):
    """Another process has the store open; a store has one owner at a time."""


class StoreClosedError(StoreError):
    """The store was closed."""


class EntryNotFoundError(StoreError, KeyError):
    """No entry of that name and kind."""

    def __init__(self, name: str, kind: str = "param") -> None:
        super().__init__(f"no entry {name!r} (kind {kind!r})")
        self.name, self.kind = name, kind

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class CorruptEntryError(StoreError):
    """The bytes read back do not match the checksum recorded at write time."""

    def __init__(self, name: str, kind: str, detail: str) -> None:
        super().__init__(f"entry {name!r} (kind {kind!r}) is corrupt: {detail}")
        self.name, self.kind = name, kind


class ShapeMismatchError(StoreError, ValueError):
    """``out=`` does not have the stored entry's dtype and shape."""


class UnsupportedTensorError(StoreError, TypeError):
    """A tensor the store cannot hold (quantized, sparse, ...)."""


class StoreFullError(StoreError):
    """The backing tier or the catalog ran out of space; committed entries are intact."""


class SnapshotError(StoreError):
    """A snapshot tag that is missing, already taken, or not a valid name."""


class CatalogError(NotAStoreError):
    """The store's catalog is missing, damaged, or belongs to another store. Nothing was
    changed; ``tierstore fsck --repair`` brings the store back to its latest snapshot."""


class ImportFormatError(StoreError, ValueError):
    """A source to import (or an export just written) that tierstore cannot read faithfully:
    malformed, inconsistent, or holding what a store cannot."""
