"""tierstore: a tiered store for Mixture-of-Experts parameter states.

>>> import tierstore, torch
>>> with tierstore.open("store", create=True) as st:
...     st.put("layers.0.experts.3.w1", torch.randn(1024, 4096))
...     w = st.get("layers.0.experts.3.w1")
"""

# First: imported from a source tree, the subpackages that sibling folders hold are mapped
# before anything imports them (see _source_tree).
from . import _source_tree  # noqa: F401

# isort: split
from . import lab, probes
from .daemon import RemoteStore, connect
from .daemon.control import probe as probe_daemon
from .daemon.control import status as daemon_status
from .daemon.control import stop as stop_daemon
from .daemon.identity import DaemonIdentityError
from .daemon.identity import make_private_dir as private_dir
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
from .interface import Borrowed, Capabilities, EntryInfo, FsckReport, SnapshotInfo, Staged, Store
from .keys import KINDS
from .local import LocalStore
from .opening import open_store as open
from .repair import RepairReport, repair_store
from .sizes import format_size, memory_limit, parse_size
from .tensors import read_buffer

__version__ = "0.1.0"

__all__ = [
    "KINDS",
    "Borrowed",
    "Capabilities",
    "CatalogError",
    "CorruptEntryError",
    "DaemonIdentityError",
    "EntryInfo",
    "EntryNotFoundError",
    "FsckReport",
    "ImportFormatError",
    "LocalStore",
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
    "daemon_status",
    "format_size",
    "lab",
    "memory_limit",
    "open",
    "parse_size",
    "private_dir",
    "probe_daemon",
    "probes",
    "read_buffer",
    "repair_store",
    "stop_daemon",
]
