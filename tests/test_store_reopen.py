"""Persistence across close/open (with only the path), and the I/O engines: buffered POSIX,
and the O_DIRECT engine's buffered fallback on tmpfs."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tierstore


def sample() -> dict[tuple[str, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    return {
        ("layers.0.experts.0.w1", "param"): torch.randn(256, 96, generator=gen).to(torch.bfloat16),
        ("layers.0.experts.0.w1", "exp_avg"): torch.randn(256, 96, generator=gen),
        ("layers.0.experts.0.w1", "exp_avg_sq"): torch.rand(256, 96, generator=gen),
        ("layers.0.experts.1.w1", "param"): torch.randint(-128, 127, (5000,), dtype=torch.int8),
        ("step", "param"): torch.tensor(17),
        ("empty", "param"): torch.empty(0, 7, dtype=torch.float16),
        ("big", "master"): torch.randn(3 << 18, generator=gen),  # 3 MiB
    }


def write_sample(st: tierstore.Store) -> dict[tuple[str, str], torch.Tensor]:
    data = sample()
    st.put_many([(n, k, t) for (n, k), t in data.items()])
    return data


def check_sample(st: tierstore.Store, data: dict[tuple[str, str], torch.Tensor]) -> None:
    assert sorted(st.keys()) == sorted(data)
    for (n, k), t in data.items():
        got = st.get(n, k)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8) if got.numel() else got,
                           t.reshape(-1).view(torch.uint8) if t.numel() else t)
    report = st.fsck()
    assert report.ok, report.problems


def test_data_persists_across_reopen_with_only_the_path(make_store, backing, cache_kw) -> None:
    st = make_store(**cache_kw)
    data = write_sample(st)
    st.put("layers.0.experts.1.w1", torch.arange(10, dtype=torch.int8))  # overwrite
    data[("layers.0.experts.1.w1", "param")] = torch.arange(10, dtype=torch.int8)
    st.snapshot("ckpt")
    infos = {k: st.info(*k) for k in data}
    stats = st.stats()
    last_version = max(i.version for i in infos.values())
    st.close()

    st = make_store(st.path, reopen=True)  # nothing but the path
    assert st.backing == backing
    check_sample(st, data)
    for k, info in infos.items():
        again = st.info(*k)
        assert (again.version, again.checksum, again.nbytes, again.dtype, again.shape) == (
            info.version, info.checksum, info.nbytes, info.dtype, info.shape)
        assert (again.path, again.offset) == (info.path, info.offset)
    after = st.stats()
    for key in ("entries", "bytes_stored", "snapshots", "capacity_bytes", "free_bytes"):
        assert after[key] == stats[key], key
    assert [s.tag for s in st.snapshots()] == ["ckpt"]
    # versions continue past the ones from before the reopen
    assert st.put("new", torch.ones(3)) > last_version


def test_reopen_many_times_with_writes_in_between(make_store, cache_kw) -> None:
    """close() alone (no explicit flush) must persist everything."""
    st = make_store(slab_size="4MiB", pmem_size="32MiB", **cache_kw)
    expected: dict[str, torch.Tensor] = {}
    for round_ in range(6):
        for j in range(3):
            t = torch.full((50_000 + round_ * 1000 + j,), round_ * 10 + j, dtype=torch.int32)
            name = f"e{(round_ + j) % 5}"
            st.put(name, t)
            expected[name] = t
        if round_ % 2:
            st.delete(f"e{round_ % 5}", missing_ok=True)
            expected.pop(f"e{round_ % 5}", None)
        st.close()
        st = make_store(st.path, reopen=True, **cache_kw)
        assert sorted(st.names()) == sorted(expected)
        for name, t in expected.items():
            assert torch.equal(st.get(name), t)
        assert st.fsck().ok


def test_reopen_with_other_chunk_size_and_threads(make_store) -> None:
    """Records keep their own chunking: a store reopened with another chunk_size reads them."""
    st = make_store(chunk_size="64KiB")
    data = write_sample(st)
    st.close()
    st = make_store(st.path, reopen=True, chunk_size="1MiB", io_threads=1)
    check_sample(st, data)
    st.put("written.with.1MiB", torch.randn(700_000))
    st.close()
    st = make_store(st.path, reopen=True, chunk_size="4KiB", io_threads=3)
    check_sample(st, {**data, ("written.with.1MiB", "param"): st.get("written.with.1MiB")})


def test_create_on_existing_store_opens_it(make_store) -> None:
    st = make_store()
    data = write_sample(st)
    st.close()
    st = make_store()  # create=True again, same path: must not wipe anything
    check_sample(st, data)


def test_nvme_slab_files_live_in_the_store(make_store, backing) -> None:
    st = make_store()
    st.put("a", torch.randn(1000))
    st.flush()
    info = st.info("a")
    if backing == "nvme":
        assert Path(info.path).resolve().is_relative_to(Path(st.path).resolve())
    else:
        assert Path(info.path).resolve() == (make_store.tmp_path / "pool").resolve()


# -- engines -----------------------------------------------------------------------------------
def test_posix_buffered_engine(make_store, backing) -> None:
    st = make_store(engine="posix-buffered")
    data = write_sample(st)
    if backing == "nvme":
        assert "buffered" in st.describe()
    check_sample(st, data)
    st.close()
    # bytes written by the buffered engine read back through the O_DIRECT one, and back again
    st = make_store(st.path, reopen=True, engine="posix-direct")
    check_sample(st, data)
    st.put("direct", torch.arange(12345))
    st.close()
    st = make_store(st.path, reopen=True, engine="posix-buffered")
    assert torch.equal(st.get("direct"), torch.arange(12345))
    check_sample(st, {**data, ("direct", "param"): torch.arange(12345)})


def test_unknown_engine_refused(make_store) -> None:
    with pytest.raises(tierstore.StoreError, match="unknown I/O engine"):
        make_store(engine="carrier-pigeon")


def test_the_kvikio_engine_without_kvikio_is_one_line_and_makes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)  # as on a machine without it
    with pytest.raises(tierstore.StoreError, match=r"needs kvikio .*tierstore\[gpu\]"):
        tierstore.open(tmp_path / "st", create=True, engine="kvikio")
    assert not (tmp_path / "st").exists()


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="tierstore-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _refuses_o_direct(directory: Path) -> bool:
    probe = directory / "o_direct.probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return True
    os.close(fd)
    probe.unlink()
    return False


def test_store_on_tmpfs(make_store, backing, shm_dir) -> None:
    """The default engine works on tmpfs; where tmpfs refuses O_DIRECT (kernels before 6.6)
    it says it fell back to buffered I/O, elsewhere it must not claim a fallback."""
    refuses = _refuses_o_direct(shm_dir)
    st = make_store(shm_dir / "store")  # default engine
    try:
        data = write_sample(st)
        check_sample(st, data)
        desc = st.describe()
        assert desc.startswith(backing)
        if backing == "nvme" and "kvikio" not in desc:
            assert ("buffered" in desc) == refuses, desc
        st.close()
        st = make_store(shm_dir / "store", reopen=True)
        check_sample(st, data)
        if backing == "nvme" and "kvikio" not in desc:
            assert ("buffered" in st.describe()) == refuses
    finally:
        st.close()


def test_filesystem_refusing_o_direct_falls_back_to_buffered(make_store, backing, monkeypatch):
    """A filesystem that answers O_DIRECT with EINVAL (tmpfs before Linux 6.6, some overlay
    filesystems): the store still works, and describe() says it fell back."""
    real_open = os.open
    store_dir = str(make_store.default_path)

    def refusing_open(path, flags, *args, **kw):
        if flags & os.O_DIRECT and os.fspath(path).startswith(store_dir):
            raise OSError(errno.EINVAL, "O_DIRECT not supported", os.fspath(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    st = make_store(engine="posix-direct")
    data = write_sample(st)
    check_sample(st, data)
    if backing == "nvme":
        assert "buffered" in st.describe(), st.describe()
    st.close()
    st = make_store(st.path, reopen=True, engine="posix-direct")
    check_sample(st, data)
    if backing == "nvme":
        assert "buffered" in st.describe(), st.describe()
    monkeypatch.undo()
    st.close()
    st = make_store(st.path, reopen=True, engine="posix-direct")  # real O_DIRECT again
    check_sample(st, data)
