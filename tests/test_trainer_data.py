"""The text corpus and the resumable batch sampler."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tierstore.trainer.train.data import (
    BatchSampler,
    CorpusError,
    decode,
    default_corpus_root,
    encode,
    load_corpus,
)

MiB = 1024 * 1024


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_default_corpus_is_the_standard_library() -> None:
    t0 = time.perf_counter()
    c = load_corpus(max_bytes=MiB)
    assert time.perf_counter() - t0 < 10
    assert c.roots == [str(default_corpus_root())]
    assert c.n_bytes == MiB  # the stdlib has far more than 1 MiB of source
    assert c.train.dtype == np.uint8 and c.val.dtype == np.uint8
    assert 0.05 < c.val.size / c.n_bytes < 0.3
    assert all(f.endswith(".py") for f in c.train_files + c.val_files)
    assert not any("site-packages" in f for f in c.train_files + c.val_files)
    assert b"def " in c.train.tobytes() and b"import " in c.val.tobytes()


def test_split_is_disjoint_and_deterministic() -> None:
    a = load_corpus(max_bytes=MiB)
    b = load_corpus(max_bytes=MiB)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert not set(a.train_files) & set(a.val_files)
    # a larger cap keeps the order: the smaller corpus's files come first
    big = load_corpus(max_bytes=2 * MiB)
    files = big.train_files + big.val_files
    small = a.train_files + a.val_files
    assert files[: len(small) - 1] == small[:-1]


def test_directory_corpus_recurses_and_skips_binary(tmp_path: Path) -> None:
    write(tmp_path / "a.txt", b"alpha " * 200)
    write(tmp_path / "sub" / "deeper" / "b.md", b"beta " * 200)
    write(tmp_path / "sub" / "c.rst", b"gamma " * 200)
    write(tmp_path / "blob.bin", b"\x00\x01\x02" * 100)
    write(tmp_path / ".hidden" / "d.txt", b"hidden " * 100)
    c = load_corpus(tmp_path, max_bytes=None, val_fraction=0.3)
    files = sorted(c.train_files + c.val_files)
    assert files == ["a.txt", "sub/c.rst", "sub/deeper/b.md"]
    assert c.n_bytes == 1200 + 1000 + 1200
    assert b"\x00" not in c.train.tobytes() + c.val.tobytes()


def test_named_files_and_suffix_filter(tmp_path: Path) -> None:
    f1 = write(tmp_path / "one.py", b"x = 1\n" * 100)
    f2 = write(tmp_path / "two.txt", b"y = 2\n" * 100)
    c = load_corpus([f1, f2], max_bytes=None)
    assert sorted(c.train_files + c.val_files) == ["one.py", "two.txt"]
    only_py = load_corpus(tmp_path, max_bytes=None, suffixes=(".py",), val_fraction=0.5)
    assert only_py.n_bytes == 600


def test_single_file_holds_out_its_tail(tmp_path: Path) -> None:
    data = bytes(range(32, 127)) * 50
    f = write(tmp_path / "only.txt", data)
    c = load_corpus(f, max_bytes=None, val_fraction=0.2)
    assert c.train.tobytes() + c.val.tobytes() == data
    assert c.val.size == int(len(data) * 0.2)


def test_max_bytes_caps_the_read(tmp_path: Path) -> None:
    for i in range(5):
        write(tmp_path / f"f{i}.txt", bytes([65 + i]) * 1000)
    c = load_corpus(tmp_path, max_bytes=2500)
    assert c.n_bytes == 2500


def test_empty_or_missing_corpus_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="no non-empty text files.*empty"):
        load_corpus(empty)
    binary = tmp_path / "binary"
    write(binary / "x.bin", b"\x00" * 64)
    with pytest.raises(CorpusError, match="no non-empty text files"):
        load_corpus(binary)
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    with pytest.raises(CorpusError, match="too small"):
        load_corpus(write(tmp_path / "one.txt", b"a"), max_bytes=None)


def _special_files(where: Path) -> dict[str, Path]:
    """A FIFO and a socket at ``where``, and a symbolic link to nothing."""
    import os
    import socket

    where.mkdir(parents=True, exist_ok=True)
    os.mkfifo(where / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(where / "sock"))
    (where / "dangling").symlink_to(where / "nowhere")
    return {"fifo": where / "fifo", "sock": where / "sock", "dangling": where / "dangling"}


@pytest.mark.parametrize(("name", "says"), [
    ("fifo", "is a FIFO (named pipe), not a text file or a directory"),
    ("sock", "is a socket, not a text file"),
    ("/dev/zero", "is a character device, not a text file"),
    ("/dev/null", "is a character device, not a text file"),
    ("dangling", "is a symbolic link to nothing"),
    ("missing", "does not exist"),
])
def test_a_corpus_path_that_is_no_text_says_what_it_is(tmp_path: Path, name: str,
                                                       says: str) -> None:
    """Named, a FIFO is refused (reading one would wait for a writer), a device too
    (/dev/zero never ends), each by what it is, not as missing."""
    special = _special_files(tmp_path)
    path = special.get(name, Path(name) if name.startswith("/") else tmp_path / name)
    with pytest.raises(CorpusError, match=re.escape(f"{str(path)!r} {says}")):
        load_corpus(path)


def test_a_corpus_directory_skips_what_is_no_regular_file(tmp_path: Path) -> None:
    """Inside a directory, FIFOs, sockets and links to devices are passed over like binary
    files, without opening (and waiting on) any of them."""
    _special_files(tmp_path)
    (tmp_path / "zero").symlink_to("/dev/zero")
    write(tmp_path / "a.txt", b"alpha " * 200)
    c = load_corpus(tmp_path, max_bytes=None, val_fraction=0.5)
    assert c.train_files + c.val_files == ["a.txt", "a.txt"] and c.n_bytes == 1200


def test_a_huge_max_bytes_reads_what_there_is(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", b"alpha " * 200)
    assert load_corpus(f, max_bytes=10**23).n_bytes == 1200  # not a 10**23-byte buffer


def test_sampler_batches() -> None:
    tokens = np.frombuffer(bytes(range(256)) * 8, dtype=np.uint8)
    s = BatchSampler(tokens, batch_size=4, seq_len=16, seed=0)
    x, y = s.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((x[:, :1] + 1) % 256, y[:, :1])
    x2, _ = s.next_batch()
    assert not torch.equal(x, x2)
    other = BatchSampler(tokens, batch_size=4, seq_len=16, seed=1).next_batch()[0]
    assert not torch.equal(x, other)


def test_sampler_state_round_trips_and_resumes_exactly() -> None:
    c = load_corpus(max_bytes=MiB // 4)
    s = BatchSampler(c.train, batch_size=3, seq_len=32, seed=11)
    for _ in range(3):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))
    expected = [s.next_batch() for _ in range(5)]
    resumed = BatchSampler(c.train, batch_size=3, seq_len=32, seed=0)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    for (x, y), (rx, ry) in zip(expected, (resumed.next_batch() for _ in range(5))):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    wrong_shape = BatchSampler(c.train, batch_size=4, seq_len=32, seed=11)
    with pytest.raises(ValueError, match="batch_size"):
        wrong_shape.load_state_dict(state)


def test_fixed_batches_repeat_and_leave_the_stream_alone() -> None:
    tokens = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    s = BatchSampler(tokens, batch_size=2, seq_len=8, seed=3)
    a, b = s.fixed_batches(3), s.fixed_batches(3)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert s.state_dict()["batches_drawn"] == 0


def test_sampler_rejects_a_split_shorter_than_a_window() -> None:
    with pytest.raises(CorpusError, match="shorter than one window"):
        BatchSampler(np.zeros(8, dtype=np.uint8), batch_size=1, seq_len=8)


def test_byte_tokens_round_trip() -> None:
    text = "héllo, wörld ✓\n"
    t = encode(text)
    assert t.dtype == torch.int64 and t.numel() == len(text.encode())
    assert decode(t) == text
    assert decode([0xFF, 0x41]) == "\ufffdA"
