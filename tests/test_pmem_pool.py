"""PoolMedium over both engines: real libpmem and the mmap fallback.

The libpmem cases skip where the library is not installed; the mmap cases always run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tierstore.pmem import HEADER_SIZE, PoolFormatError, PoolMedium
from tierstore.pmem.libpmem import ENV_HIDE

from tierstore import pmem

REPO = Path(__file__).resolve().parents[1]
KiB = 1024
MiB = 1024 * KiB


@pytest.fixture(params=["libpmem", "mmap"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv(ENV_HIDE, raising=False)
    if request.param == "libpmem" and not pmem.libpmem_available():
        pytest.skip("libpmem is not installed")
    return request.param


@pytest.fixture
def make_pool(engine: str, tmp_path: Path) -> Iterator[Callable[..., PoolMedium]]:
    opened: list[PoolMedium] = []

    def make(name: str = "test.pool", **kw: object) -> PoolMedium:
        kw.setdefault("create", True)
        pool = PoolMedium(tmp_path / name, engine=engine, **kw)  # type: ignore[arg-type]
        opened.append(pool)
        return pool

    yield make
    for pool in opened:
        pool.close()


def _mappings_of(path: Path) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(str(path)))


def _write(pool: PoolMedium, seg: int, offset: int, data: bytes) -> None:
    pool.pwrite(seg, offset, memoryview(data)).result()


def _read(pool: PoolMedium, seg: int, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    pool.pread(seg, offset, memoryview(buf)).result()
    return bytes(buf)


def test_satisfies_the_medium_protocol(make_pool: Callable[..., PoolMedium]) -> None:
    # Loaded from its file so that only media.py (stdlib-only) runs, not tierstore/__init__.
    spec = importlib.util.spec_from_file_location("_media", REPO / "tierstore" / "media.py")
    assert spec is not None and spec.loader is not None
    media = importlib.util.module_from_spec(spec)
    sys.modules["_media"] = media
    try:
        spec.loader.exec_module(media)
    finally:
        del sys.modules["_media"]
    pool = make_pool()
    assert isinstance(pool, media.Medium)
    assert pool.kind == "pmem"
    seg = media.Segment(*pool.create_segment(0, 1))
    assert seg.base % media.ALIGNMENT == 0 and seg.size == media.ALIGNMENT


def test_describe_names_the_engine(make_pool: Callable[..., PoolMedium], engine: str) -> None:
    pool = make_pool(threads=2)
    text = pool.describe()
    if engine == "libpmem" and pool.durability == "persist":
        assert text == f"{pmem.libpmem_version()}, DAX: persist, 2 threads"
    elif engine == "libpmem":
        forced = " (PMEM_IS_PMEM_FORCE ignored)" if "FORCE" in text else ""
        assert text == f"{pmem.libpmem_version()}, not DAX{forced}: msync, 2 threads"
    else:
        assert text == "mmap fallback (requested): msync, 2 threads"


def test_segments_use_pool_space_then_grow(
    make_pool: Callable[..., PoolMedium], tmp_path: Path
) -> None:
    pool = make_pool(size=64 * KiB)
    assert pool.size == 64 * KiB == (tmp_path / "test.pool").stat().st_size
    s0 = pool.create_segment(0, 5000)
    assert s0 == (0, str(tmp_path / "test.pool"), HEADER_SIZE, 8 * KiB)
    s1 = pool.create_segment(1, 52 * KiB)  # exactly fills the pool
    assert s1[2] == HEADER_SIZE + 8 * KiB and pool.size == 64 * KiB
    s2 = pool.create_segment(2, 3 * MiB + 1)
    assert s2[2] == 64 * KiB and s2[3] == 3 * MiB + 4 * KiB
    assert pool.size == s2[2] + s2[3] == (tmp_path / "test.pool").stat().st_size
    assert pool.location(2, 100) == (str(tmp_path / "test.pool"), 64 * KiB + 100)
    with pytest.raises(ValueError, match="already exists"):
        pool.create_segment(1, 4096)
    with pytest.raises(ValueError):
        pool.create_segment(3, 0)


def test_round_trip_and_reopen(make_pool: Callable[..., PoolMedium], engine: str) -> None:
    rng = np.random.default_rng(1)
    pool = make_pool(size=256 * KiB)
    segs = [pool.create_segment(0, 128 * KiB), pool.create_segment(1, 1 * MiB)]
    writes = {
        (0, 0): rng.bytes(4 * KiB),
        (0, 64 * KiB): rng.bytes(64 * KiB),
        (1, 12 * KiB): rng.bytes(512 * KiB),
    }
    for (seg, off), data in writes.items():
        _write(pool, seg, off, data)
    pool.sync([0, 1])
    for (seg, off), data in writes.items():
        assert _read(pool, seg, off, len(data)) == data
    pool.close()

    pool = make_pool(create=False)
    pool.attach(segs)
    for (seg, off), data in writes.items():
        assert _read(pool, seg, off, len(data)) == data
        assert bytes(pool.view(seg, off, len(data))) == data


def test_writes_from_any_contiguous_buffer(make_pool: Callable[..., PoolMedium]) -> None:
    pool = make_pool()
    pool.create_segment(0, 64 * KiB)
    arr = np.arange(4096, dtype=np.float32).reshape(64, 64)
    pool.pwrite(0, 0, memoryview(arr)).result()
    pool.pwrite(0, 16 * KiB, memoryview(arr.tobytes()).toreadonly()).result()
    out = np.empty_like(arr)
    pool.pread(0, 16 * KiB, memoryview(out)).result()
    assert np.array_equal(out, arr)
    assert _read(pool, 0, 0, arr.nbytes) == arr.tobytes()
    with pytest.raises(TypeError, match="read-only"):
        pool.pread(0, 0, memoryview(bytes(4096)))
    with pytest.raises(ValueError, match="contiguous"):
        pool.pwrite(0, 0, memoryview(arr[:, ::2]))


def test_large_copies_are_split_across_threads(make_pool: Callable[..., PoolMedium]) -> None:
    pool = make_pool(threads=3)
    pool.create_segment(0, 20 * MiB)
    data = np.random.default_rng(2).bytes(14 * MiB + 4 * KiB)
    _write(pool, 0, 4 * KiB, data)
    pool.sync([0])
    assert _read(pool, 0, 4 * KiB, len(data)) == data
    assert pool.pwrite(0, 0, memoryview(b"")).result() is None


def test_growth_keeps_views_valid(
    make_pool: Callable[..., PoolMedium], tmp_path: Path, engine: str
) -> None:
    torch = pytest.importorskip("torch")
    pool = make_pool(size=64 * KiB)
    pool.create_segment(0, 32 * KiB)
    data = np.arange(8 * KiB, dtype=np.float32).tobytes()  # 32 KiB
    _write(pool, 0, 0, data)
    pool.sync([0])
    view = pool.view(0, 0, len(data))
    assert view.readonly and len(view) == len(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "buffer is not writable"
        tensor = torch.frombuffer(view, dtype=torch.float32)
    mapped_before = _mappings_of(tmp_path / "test.pool")

    for i in range(1, 4):  # each of these grows the file and maps it anew
        pool.create_segment(i, 4 * MiB)
        _write(pool, i, 0, b"x" * 4096)
    assert pool.size > 12 * MiB
    assert _mappings_of(tmp_path / "test.pool") > mapped_before
    assert bytes(view) == data
    assert torch.equal(tensor, torch.arange(8 * KiB, dtype=torch.float32))

    # Old and new mappings are views of one file: a write after growth shows in both.
    _write(pool, 0, 0, b"\xff" * 8)
    assert bytes(view[:8]) == b"\xff" * 8
    assert bytes(pool.view(0, 0, 8)) == b"\xff" * 8


def test_views_outlive_close_then_the_mapping_goes(
    make_pool: Callable[..., PoolMedium], tmp_path: Path
) -> None:
    path = tmp_path / "test.pool"
    pool = make_pool()
    pool.create_segment(0, 8 * KiB)
    _write(pool, 0, 0, b"kept alive")
    view = pool.view(0, 0, 10)
    pool.close()
    assert bytes(view) == b"kept alive"
    assert _mappings_of(path) >= 1
    del view
    assert _mappings_of(path) == 0


def test_close_is_idempotent_and_final(
    make_pool: Callable[..., PoolMedium], tmp_path: Path
) -> None:
    pool = make_pool()
    pool.create_segment(0, 4096)
    pool.close()
    pool.close()
    assert _mappings_of(tmp_path / "test.pool") == 0
    buf = memoryview(bytearray(4096))
    for call in (
        lambda: pool.pread(0, 0, buf),
        lambda: pool.pwrite(0, 0, buf),
        lambda: pool.view(0, 0, 16),
        lambda: pool.location(0, 0),
        lambda: pool.sync([0]),
        lambda: pool.create_segment(1, 4096),
        lambda: pool.attach([]),
    ):
        with pytest.raises(ValueError, match="closed"):
            call()
    with make_pool(create=False) as again:  # the lock went with close()
        assert again.size == pool.size


def test_one_open_pool_per_file(make_pool: Callable[..., PoolMedium], tmp_path: Path) -> None:
    make_pool()
    with pytest.raises(BlockingIOError, match="already open"):
        make_pool(create=False)
    with pytest.raises(FileExistsError):
        make_pool()
    with pytest.raises(FileNotFoundError):
        make_pool("missing.pool", create=False)


def test_bounds_and_unknown_segments(make_pool: Callable[..., PoolMedium]) -> None:
    pool = make_pool()
    pool.create_segment(0, 8 * KiB)
    buf = memoryview(bytearray(4096))
    with pytest.raises(KeyError):
        pool.pread(9, 0, buf)
    with pytest.raises(KeyError):
        pool.sync([9])
    with pytest.raises(ValueError, match="outside"):
        pool.pwrite(0, 8 * KiB - 4095, buf)
    with pytest.raises(ValueError, match="outside"):
        pool.view(0, -1, 1)
    with pytest.raises(ValueError, match="outside"):
        pool.location(0, 8 * KiB + 1)
    assert pool.location(0, 8 * KiB)[1] == HEADER_SIZE + 8 * KiB


def test_sync_covers_completed_writes(make_pool: Callable[..., PoolMedium]) -> None:
    pool = make_pool()
    pool.create_segment(0, 64 * KiB)
    pool.create_segment(1, 64 * KiB)
    _write(pool, 0, 0, b"a" * 8192)
    _write(pool, 0, 4096, b"b" * 8192)
    _write(pool, 1, 0, b"c" * 4096)
    pool.sync([0])
    assert 0 not in pool._dirty and 1 in pool._dirty
    pool.sync([])
    pool.sync([0, 1])
    assert not pool._dirty
    assert pool.durability in ("msync", "persist")


@pytest.mark.parametrize("nbytes", [0, 4096, 12 << 20])
def test_blocking_copies_on_the_calling_thread_or_split_alike(
        make_pool: Callable[..., PoolMedium], nbytes: int) -> None:
    """The blocking ``write``/``read`` (the store's) copy a buffer too small to split on the
    calling thread, a large one across the pool's threads: either way the bytes round-trip,
    the written range waits for ``sync``, and an empty buffer leaves nothing to sync."""
    pool = make_pool(size=32 << 20, threads=2)
    pool.create_segment(0, 16 << 20)
    data = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    pool.write(0, 4096, memoryview(data))
    assert pool._dirty == ({0: [(HEADER_SIZE + 4096, HEADER_SIZE + 4096 + nbytes)]}
                           if nbytes else {})
    back = np.zeros(nbytes, dtype=np.uint8)
    pool.read(0, 4096, memoryview(back))
    assert np.array_equal(back, data)
    pool.sync([0])
    assert not pool._dirty
    with pytest.raises(ValueError, match="outside"):
        pool.write(0, (16 << 20) - 4096, memoryview(np.zeros(8192, dtype=np.uint8)))


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("not_a_pool", "not a tierstore pmem pool"),
        ("too_small", "too small"),
        ("layout_version", "layout version 99, this build reads version 1"),
        ("checksum", "checksum mismatch"),
        ("truncated", "truncated"),
        ("assigned_end", "corrupt pool header"),
    ],
)
def test_header_validation(
    make_pool: Callable[..., PoolMedium], tmp_path: Path, damage: str, message: str
) -> None:
    path = tmp_path / "test.pool"
    make_pool(size=64 * KiB).close()
    if damage == "not_a_pool":
        path.write_bytes(os.urandom(64 * KiB))
    elif damage == "too_small":
        path.write_bytes(b"TSPMPOOL")
    elif damage == "layout_version":
        _patch(path, 8, struct.pack("<I", 99))
    elif damage == "checksum":
        _patch(path, 30, b"\x00\x01")
    elif damage == "truncated":
        os.truncate(path, 32 * KiB)
    else:
        _patch(path, 72, struct.pack("<Q", 5000))
    with pytest.raises(PoolFormatError, match=message) as info:
        make_pool(create=False)
    assert isinstance(info.value, ValueError)


def test_attach_validates_segments(make_pool: Callable[..., PoolMedium], tmp_path: Path) -> None:
    pool = make_pool(size=64 * KiB)
    seg = pool.create_segment(0, 8 * KiB)
    pool.attach([seg])  # the same extent again is fine
    path = seg[1]
    bad = {
        "elsewhere": (1, str(tmp_path / "other.pool"), 16 * KiB, 4096),
        "misaligned": (1, path, 16 * KiB + 1, 4096),
        "in the header": (1, path, 0, 4096),
        "past the end": (1, path, 60 * KiB, 8 * KiB),
        "overlapping": (1, path, 8 * KiB, 8 * KiB),
        "conflicting": (0, path, 16 * KiB, 4096),
    }
    for name, item in bad.items():
        with pytest.raises(ValueError):
            pool.attach([item])
        assert 1 not in pool._segments, name


def test_attach_reclaims_space_the_catalog_never_recorded(
    make_pool: Callable[..., PoolMedium],
) -> None:
    pool = make_pool(size=1 * MiB)
    s0 = pool.create_segment(0, 64 * KiB)
    s1 = pool.create_segment(1, 64 * KiB)  # a crash before the catalog recorded it
    pool.close()
    pool = make_pool(create=False)
    pool.attach([s0])
    assert pool.create_segment(1, 16 * KiB)[2] == s1[2]


def test_create_before_attach_never_reuses_space(make_pool: Callable[..., PoolMedium]) -> None:
    pool = make_pool(size=1 * MiB)
    s0 = pool.create_segment(0, 64 * KiB)
    s1 = pool.create_segment(1, 64 * KiB)
    pool.close()
    pool = make_pool(create=False)
    s2 = pool.create_segment(2, 4096)
    assert s2[2] >= s1[2] + s1[3]
    pool.attach([s0, s1, s2])
    assert pool.create_segment(3, 4096)[2] == s2[2] + s2[3]



def test_a_file_grown_before_a_crash_is_recorded_before_its_space_is_used(
    make_pool: Callable[..., PoolMedium], tmp_path: Path
) -> None:
    """A crash after the file grew and before the header recorded it leaves a file longer
    than the pool; the segment that then uses that space records it, so the pool opens."""
    pool = make_pool(size=64 * KiB)
    s0 = pool.create_segment(0, 60 * KiB)
    pool.close()
    os.truncate(tmp_path / "test.pool", 1 * MiB)  # grown; the header still says 64 KiB
    pool = make_pool(create=False)
    s1 = pool.create_segment(1, 256 * KiB)
    assert s1[2] == 64 * KiB and pool.size == 1 * MiB
    pool.close()
    pool = make_pool(create=False)
    pool.attach([s0, s1])
    assert pool.create_segment(2, 4096)[2] == s1[2] + s1[3]

_GROWTH_FAILURE_SCRIPT = """
import errno, json, os, resource, signal, sys
from tierstore import pmem
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = sys.argv[1] + "/limited.pool"
pool = pmem.PoolMedium(path, create=True, size=256 << 10, engine=sys.argv[2])
seg = pool.create_segment(0, 64 << 10)
pool.pwrite(0, 0, memoryview(b"precious" * 512)).result()
pool.sync([0])
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    pool.create_segment(1, 4 << 20)
    err = None
except OSError as exc:
    err = exc.errno
size_ok = os.path.getsize(path) == 256 << 10 == pool.size
again = pool.create_segment(1, 64 << 10)
buf = bytearray(4096)
pool.pread(0, 0, memoryview(buf)).result()
pool.close()
pool = pmem.PoolMedium(path, create=False, engine=sys.argv[2])
pool.attach([seg, again])
intact = bytes(pool.view(0, 0, 4096)) == b"precious" * 512 == bytes(buf)
pool.close()
print(json.dumps({"errno": err, "size_ok": size_ok, "intact": intact,
                  "next_base": again[2], "seg_end": seg[2] + seg[3]}))
"""


def test_failed_growth_leaves_the_pool_intact(engine: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _GROWTH_FAILURE_SCRIPT, str(tmp_path), engine],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errno"] is not None, "growth past RLIMIT_FSIZE must raise OSError"
    assert out["size_ok"] and out["intact"]
    assert out["next_base"] == out["seg_end"]


_blocks = st.integers(min_value=0, max_value=15)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 2), _blocks, st.integers(1, 4), st.integers(0, 255)),
        min_size=1,
        max_size=12,
    )
)
def test_random_writes_match_a_model(engine: str, ops: list[tuple[int, int, int, int]]) -> None:
    seg_bytes = 16 * 4096
    model = {s: bytearray(seg_bytes) for s in range(3)}
    with tempfile.TemporaryDirectory() as d:
        pool = PoolMedium(Path(d) / "p.pool", create=True, size=40 * KiB, engine=engine)
        try:
            for s in range(3):  # the second and third grow the pool
                pool.create_segment(s, seg_bytes)
                _write(pool, s, 0, bytes(seg_bytes))
            views = {s: pool.view(s, 0, seg_bytes) for s in range(3)}
            for seg, block, nblocks, value in ops:
                off = block * 4096
                n = min(nblocks * 4096, seg_bytes - off)
                _write(pool, seg, off, bytes([value]) * n)
                model[seg][off : off + n] = bytes([value]) * n
            pool.sync(range(3))
            for s in range(3):
                assert _read(pool, s, 0, seg_bytes) == model[s]
                assert bytes(views[s]) == model[s]
        finally:
            pool.close()
