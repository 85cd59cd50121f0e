"""The directory an export writes: a hidden working directory beside ``OUT``, moved into
place at the end, so nothing partial is ever under ``OUT``.

The working directory is ``.{OUT}.{pid}-{random}.export-hf`` and its writer holds an
exclusive ``flock`` on it for as long as it lives; the kernel drops the lock when the process
dies, however it dies. An export first removes the working directories of earlier exports
to the same ``OUT`` whose lock it can take: their writers are gone (a SIGKILL, a power cut).
A live export's directory is locked and left alone. A directory is only used once its writer
holds the lock and finds it still in place, so a cleaner that took it in between (and
removed it) costs a retry, never a write into a removed directory.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
from typing import Any

import tierstore
from tierstore.durable import fsync_dir

SUFFIX = ".export-hf"
# Weight files a previous export or checkpoint in the directory could leave behind, which
# transformers would load instead of (or besides) the new ones.
STALE = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


class HFExportError(tierstore.StoreError):
    """The store cannot be exported as asked (reported by the CLI as one line)."""


def _parent_and_base(out_dir: str) -> tuple[str, str]:
    full = os.path.abspath(out_dir)
    return os.path.dirname(full), os.path.basename(full)


def _pattern(base: str) -> re.Pattern[str]:
    # {pid}-{8 hex} now; 8 characters of tempfile's alphabet from releases before the lock
    return re.compile(rf"\.{re.escape(base)}\.(?:\d+-)?[a-z0-9_]{{8}}{re.escape(SUFFIX)}")


def _lock(path: str, block: bool) -> int | None:
    """An open descriptor of directory ``path`` holding its exclusive lock, or None where
    another process holds it (``block=False``) or the directory is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _same(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remove_leftovers(out_dir: str) -> list[str]:
    """Remove the working directories of earlier exports to ``out_dir`` that no live
    process holds; returns their paths."""
    parent, base = _parent_and_base(out_dir)
    pattern = _pattern(base)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted(names):
        if not pattern.fullmatch(name):
            continue
        path = os.path.join(parent, name)
        fd = _lock(path, block=False)
        if fd is None:
            continue
        try:
            if _same(path, fd):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


class WorkDir:
    """A fresh locked working directory beside ``out_dir`` (see the module docstring)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        parent, base = _parent_and_base(out_dir)
        os.makedirs(parent, exist_ok=True)
        while True:
            path = os.path.join(parent, f".{base}.{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}")
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                continue
            fd = _lock(path, block=True)
            if fd is not None and _same(path, fd):
                break
            if fd is not None:  # a cleaner removed it before the lock was ours
                os.close(fd)
        self.path, self._fd = path, fd

    def __enter__(self) -> WorkDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove the directory if it was not moved into place, and drop the lock."""
        if self._fd is None:
            return
        if _same(self.path, self._fd):
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None

    def move_into_place(self, force: bool) -> None:
        """The finished export becomes ``out_dir``: renamed whole where ``out_dir`` is
        missing or empty, else (``force``) its stale weight files removed and the new files
        moved in, ``config.json`` last."""
        out_dir = self.out_dir
        fsync_dir(self.path)
        check_out_dir(out_dir, force)  # again: another export may have filled it meanwhile
        if os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
        if not os.path.exists(out_dir):
            os.rename(self.path, out_dir)
        else:
            for name in os.listdir(out_dir):
                path = os.path.join(out_dir, name)
                if name.endswith(STALE) and os.path.isfile(path):
                    os.remove(path)
            for name in sorted(os.listdir(self.path), key=lambda n: n == "config.json"):
                os.replace(os.path.join(self.path, name), os.path.join(out_dir, name))
            os.rmdir(self.path)
        fsync_dir(out_dir)
        fsync_dir(os.path.dirname(os.path.abspath(out_dir)))


def check_out_dir(out_dir: str, force: bool) -> None:
    """``out_dir`` can take the export: missing, an empty directory, or (``force``) any
    directory."""
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise HFExportError(f"{out_dir} exists and is not a directory")
    if os.listdir(out_dir) and not force:
        raise HFExportError(f"{out_dir} is not empty; pass --force to write the export into it "
                          "(its weight files are replaced)")
