"""tierstore: a tiered store for Mixture-of-Experts parameter states.

>>> import tierstore, torch
>>> with tierstore.open("store", create=True) as st:
...     st.put("layers.0.experts.3.w1", torch.randn(1024, 4096))
...     w = st.get("layers.0.experts.3.w1")
"""

from . import lab, probes
from .daemon import RemoteStore, connect
from .errors import (
    CatalogError,
    CorruptEntryError,
    EntryNotFoundError,
    ImportFormatError,
    NotAStoreError,
    ShapeMismatchError,
    SnapshotError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    UnsupportedTensorError,
)
from .repair import RepairReport, repair_store
from .sizes import format_size, parse_size
from .store import KINDS, Borrowed, EntryInfo, FsckReport, SnapshotInfo, Staged, Store
from .store import open_store as open

__version__ = "0.1.0"

__all__ = [
    "KINDS",
    "Borrowed",
    "CatalogError",
    "CorruptEntryError",
    "EntryInfo",
    "EntryNotFoundError",
    "FsckReport",
    "ImportFormatError",
    "NotAStoreError",
    "RemoteStore",
    "RepairReport",
    "ShapeMismatchError",
    "SnapshotError",
    "SnapshotInfo",
    "Staged",
    "Store",
    "StoreClosedError",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
    "UnsupportedTensorError",
    "__version__",
    "connect",
    "format_size",
    "lab",
    "open",
    "parse_size",
    "probes",
    "repair_store",
]
