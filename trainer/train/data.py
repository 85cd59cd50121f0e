"""A real text corpus as byte-level tokens, and a resumable batch sampler.

The default corpus is the Python standard library's own source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``): it exists wherever Python does, is a few tens of MB of
real text, and needs no download. Reading is capped (``max_bytes``, 8 MiB by default) so it
loads in well under a second.

Files are taken in a fixed pseudo-random order (by a hash of their relative path), so a capped
read samples the whole tree rather than its alphabetically first directories, and the same
tree always gives the same corpus. The validation split holds out whole files from the end of
that order (or, with a single file, the tail of it), so no text is in both splits.

The sampler draws batch ``n`` from a generator seeded by ``(seed, n)``: its entire state is
the number of batches drawn, which makes exact resumption a matter of storing one integer.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}
_SNIFF = 8192


class CorpusError(ValueError):
    """The named paths hold no usable text."""


@dataclass
class Corpus:
    """Tokens of the two splits and the files each came from (relative to its root).

    As read, the tokens are bytes (``uint8``); :func:`trainer.train.hf_finetune.tokenize_corpus`
    turns them into a model tokenizer's ids (``int32``). ``train_lengths`` and
    ``val_lengths`` are the byte lengths of the documents the splits join, in order (a
    tokenizer encodes each on its own)."""

    train: np.ndarray  # uint8 bytes, or int32 token ids
    val: np.ndarray
    train_files: list[str]
    val_files: list[str]
    roots: list[str]
    train_lengths: list[int] = field(default_factory=list)
    val_lengths: list[int] = field(default_factory=list)

    @property
    def is_bytes(self) -> bool:
        """Whether the splits are bytes (not yet a model tokenizer's ids)."""
        return self.train.dtype == np.uint8

    @property
    def n_bytes(self) -> int:
        return int(self.train.size + self.val.size)

    def describe(self) -> str:
        return (f"{len(self.train_files) + len(self.val_files)} files under "
                f"{', '.join(self.roots)}: {self.train.size:,} train / {self.val.size:,} val bytes")


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_text_file(path: Path) -> bool:
    """Text if the first 8 KiB hold no NUL byte (the test git and grep use)."""
    try:
        with _open_regular(path) as f:
            head = f.read(_SNIFF)
    except OSError:
        return False
    return b"\x00" not in head


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file: without blocking on a FIFO
    (opening one waits for a writer) and before reading an endless device (``/dev/zero``).
    Anything else is an ``OSError`` saying what it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{file_kind(mode)}, not a text file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a FIFO (named pipe)"``)."""
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((what for test, what in kinds if test(mode)), "a special file")


def _walk(root: Path, suffixes: tuple[str, ...] | None) -> Iterable[Path]:
    def unreadable(e: OSError) -> None:
        if e.filename is not None and os.path.abspath(e.filename) == os.path.abspath(root):
            raise CorpusError(f"corpus directory {str(root)!r} cannot be read: "
                              f"{e.strerror}") from e

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        # Installed packages are not the standard library; hidden and cache dirs are not text.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            if suffixes is None or name.endswith(suffixes):
                yield Path(dirpath) / name  # FIFOs, sockets and devices: skipped on reading


def _order_key(rel: str) -> bytes:
    return hashlib.sha1(rel.encode("utf-8", "surrogateescape")).digest()


def find_files(paths: Sequence[str | os.PathLike[str]],
               suffixes: tuple[str, ...] | None = None) -> list[tuple[Path, str]]:
    """``(path, label)`` of every candidate file under ``paths`` in the corpus order.

    A named file is taken as is; a directory is searched recursively (for ``suffixes`` when
    given). Labels are paths relative to the named directory, which keeps the order and the
    split independent of where the tree is installed.
    """
    found: list[tuple[Path, str]] = []
    for raw in paths:
        p = Path(raw).expanduser()
        try:
            mode = p.stat().st_mode
        except OSError as e:
            what = ("does not exist" if e.errno == errno.ENOENT and not p.is_symlink() else
                    "is a symbolic link to nothing" if e.errno == errno.ENOENT else
                    f"cannot be read: {e.strerror}")
            raise CorpusError(f"corpus path {str(p)!r} {what}") from e
        if stat.S_ISREG(mode):
            if not os.access(p, os.R_OK):
                raise CorpusError(f"corpus file {str(p)!r} cannot be read: permission denied")
            found.append((p, p.name))
        elif stat.S_ISDIR(mode):
            found.extend((f, f.relative_to(p).as_posix()) for f in _walk(p, suffixes))
        else:
            raise CorpusError(f"corpus path {str(p)!r} is {file_kind(mode)}, not a text file "
                              "or a directory of them")
    found.sort(key=lambda fl: (_order_key(fl[1]), fl[1]))
    return found


def load_corpus(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
                *, max_bytes: int | None = DEFAULT_MAX_BYTES, val_fraction: float = 0.1,
                suffixes: tuple[str, ...] | None = None) -> Corpus:
    """Read a corpus: ``paths`` (files and/or directories), or the standard library's ``*.py``.

    At most ``max_bytes`` are read in total (``None``: no cap); binary files are skipped.
    About ``val_fraction`` of the bytes go to validation. Raises :class:`CorpusError` when
    nothing readable is found or a split would be empty.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if paths is None:
        roots: list[str | os.PathLike[str]] = [default_corpus_root()]
        suffixes = suffixes or (".py",)
    elif isinstance(paths, (str, os.PathLike)):
        roots = [paths]
    else:
        roots = list(paths)
    if not roots:
        raise CorpusError("no corpus paths given")
    chunks: list[tuple[str, bytes]] = []
    total = 0
    for path, label in find_files(roots, suffixes):
        if max_bytes is not None and total >= max_bytes:
            break
        if not is_text_file(path):
            continue
        try:
            with _open_regular(path) as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read(size if max_bytes is None else min(size, max_bytes - total))
        except OSError:
            continue
        if data:
            chunks.append((label, data))
            total += len(data)
    where = ", ".join(str(r) for r in roots)
    if not chunks:
        what = f" matching {', '.join(suffixes)}" if suffixes else ""
        raise CorpusError(f"no non-empty text files{what} found under {where}")
    train, val, train_files, val_files, lengths = _split(chunks, val_fraction)
    if not train.size or not val.size:
        raise CorpusError(f"corpus under {where} is too small to split ({total} bytes)")
    return Corpus(train, val, train_files, val_files, [str(r) for r in roots], *lengths)


def _split(chunks: list[tuple[str, bytes]], val_fraction: float
           ) -> tuple[np.ndarray, np.ndarray, list[str], list[str], tuple[list[int], list[int]]]:
    total = sum(len(d) for _, d in chunks)
    target = max(1, int(total * val_fraction))
    if len(chunks) == 1:
        label, data = chunks[0]
        cut = len(data) - target
        arr = np.frombuffer(data, dtype=np.uint8)
        return arr[:cut].copy(), arr[cut:].copy(), [label], [label], ([cut], [target])
    # Whole files from the end of the order until the target is reached, keeping at least
    # one file for training.
    n_val, val_bytes = 0, 0
    while val_bytes < target and n_val < len(chunks) - 1:
        n_val += 1
        val_bytes += len(chunks[-n_val][1])
    train_chunks, val_chunks = chunks[: len(chunks) - n_val], chunks[len(chunks) - n_val:]

    def join(cs: list[tuple[str, bytes]]) -> np.ndarray:
        return np.frombuffer(b"".join(d for _, d in cs), dtype=np.uint8).copy()

    return (join(train_chunks), join(val_chunks),
            [label for label, _ in train_chunks], [label for label, _ in val_chunks],
            ([len(d) for _, d in train_chunks], [len(d) for _, d in val_chunks]))


def encode(text: str | bytes) -> torch.Tensor:
    """Byte-level tokens (int64) of a string (UTF-8) or bytes."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """Text of byte tokens; invalid UTF-8 is replaced rather than raised on (samples from an
    untrained model are not valid UTF-8)."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from one split, as ``(x, y)`` int64 pairs.

    Batch ``n`` depends only on ``(seed, n)``; ``state_dict()`` is a small JSON-serialisable
    dict and ``load_state_dict()`` continues the exact sequence. Validation uses
    :meth:`fixed_batches`, the same batches at every evaluation so losses are comparable.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0) -> None:
        if tokens.size < seq_len + 1:
            raise CorpusError(f"split of {tokens.size} tokens is shorter than one window "
                              f"of seq_len + 1 = {seq_len + 1}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError("batch_size and seq_len must be positive")
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.batches_drawn = 0

    def _batch(self, stream: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, stream, n])
        starts = rng.integers(0, self.tokens.size - self.seq_len, size=self.batch_size)
        window = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        t = torch.from_numpy(window.astype(np.int64))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._batch(0, self.batches_drawn)
        self.batches_drawn += 1
        return batch

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def fixed_batches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` batches from a separate stream, identical on every call."""
        return [self._batch(1, i) for i in range(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "batches_drawn": self.batches_drawn,
                "batch_size": self.batch_size, "seq_len": self.seq_len,
                "n_tokens": int(self.tokens.size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("batch_size", "seq_len", "n_tokens"):
            if state[key] != mine[key]:
                raise ValueError(f"sampler state is for {key}={state[key]}, this sampler has "
                                 f"{mine[key]}: the corpus or batch shape changed since")
        self.seed = int(state["seed"])
        self.batches_drawn = int(state["batches_drawn"])
