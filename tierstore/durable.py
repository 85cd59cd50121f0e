"""Replacing a small file so that a crash leaves the old one or the new one, never a torn
one: write a temporary file beside it, fsync it, rename it over the old name, fsync the
folder (without the last fsync the rename itself may be lost, and a later step that assumed
the new file would run on the old). For the files that sit beside a store or a run:
markers, manifests, checkpoints of the dense state, export metadata."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO

from tierstore.nvme import fsync_dir

__all__ = ["fsync_dir", "replace_file"]


def replace_file(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object] | bytes,
                 *, tmp: str | os.PathLike[str] | None = None) -> None:
    """Make ``path`` hold what ``write`` writes into the file object it is given (or the
    bytes ``write``), atomically and durably. ``tmp``: the temporary file's path (default
    ``path`` + ``.tmp``), in the same folder so that the rename stays within one file
    system."""
    path = os.fspath(path)
    tmp_path = os.fspath(tmp) if tmp is not None else path + ".tmp"
    with open(tmp_path, "wb") as f:
        if isinstance(write, bytes | bytearray | memoryview):
            f.write(write)
        else:
            write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
