"""The libpmem binding, DAX detection and the engine choice, against real files.

Each bound function is called for real on a file under tmp_path (ext4 or whatever /tmp is
here) and, where it matters, on tmpfs. Cases that need the real library skip where it is
not installed; the fallback cases always run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierstore.pmem import dax
from tierstore.pmem.libpmem import ENV_HIDE, PMEM_FILE_CREATE, PMEM_FILE_EXCL, Libpmem, PmemError

from tierstore import pmem

REPO = Path(__file__).resolve().parents[1]
MAP_LEN = 1 << 20


@pytest.fixture
def lib(monkeypatch: pytest.MonkeyPatch) -> Libpmem:
    monkeypatch.delenv(ENV_HIDE, raising=False)
    binding = pmem.load()
    if binding is None:
        pytest.skip("libpmem is not installed")
    return binding


@pytest.fixture
def mapped(lib: Libpmem, tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    path = tmp_path / "mapped.bin"
    addr, length, _ = lib.map_file(path, MAP_LEN, PMEM_FILE_CREATE | PMEM_FILE_EXCL, 0o600)
    yield addr, length, path
    lib.unmap(addr, length)


def _file_bytes(path: Path, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _run_script(script: str, *args: str, env: dict[str, str]) -> dict:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_version_is_read_from_the_loaded_library(lib: Libpmem) -> None:
    assert os.path.isfile(lib.path)
    assert "libpmem" in os.path.basename(lib.path)
    assert lib.api_version[0] == 1
    assert lib.version is not None and lib.version[0] == 1
    assert lib.version_string == f"libpmem {lib.version[0]}.{lib.version[1]}"
    assert pmem.libpmem_version() == lib.version_string


def test_check_version_accepts_1_0_and_rejects_a_huge_major(lib: Libpmem) -> None:
    assert lib.check_version(1, 0) is None
    assert lib.check_version(*lib.api_version) is None
    reason = lib.check_version(1000, 0)
    assert reason is not None and "major" in reason
    assert lib.check_version(1, lib.api_version[1] + 1) is not None


def test_map_file_creates_maps_and_unmap_releases(lib: Libpmem, tmp_path: Path) -> None:
    path = tmp_path / "new.bin"
    addr, length, is_pmem = lib.map_file(path, MAP_LEN, PMEM_FILE_CREATE, 0o600)
    assert addr and length == MAP_LEN
    assert path.stat().st_size == MAP_LEN
    if dax.FORCE_ENV not in os.environ:
        assert is_pmem is False
    lib.unmap(addr, length)
    # Without PMEM_FILE_CREATE the whole existing file is mapped.
    addr, length, _ = lib.map_file(path)
    assert length == MAP_LEN
    lib.unmap(addr, length)


def test_unmap_failure_raises_with_errno(lib: Libpmem, mapped: tuple[int, int, Path]) -> None:
    addr, _, _ = mapped
    with pytest.raises(PmemError) as info:
        lib.unmap(addr + 1, 4096)  # not page aligned
    assert info.value.errno == errno.EINVAL


@pytest.mark.skipif(dax.FORCE_ENV in os.environ, reason="PMEM_IS_PMEM_FORCE is set")
@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
def test_is_pmem_false_on_ordinary_files(lib: Libpmem, tmp_path: Path, where: str) -> None:
    base = tmp_path if where == "tmp_path" else Path(where)
    if not base.is_dir():
        pytest.skip(f"{where} does not exist")
    path = base / f"is_pmem-{os.getpid()}-{tmp_path.name}.bin"
    addr, length, reported = lib.map_file(path, MAP_LEN, PMEM_FILE_CREATE, 0o600)
    try:
        assert reported is False
        assert lib.is_pmem(addr, length) is False
    finally:
        lib.unmap(addr, length)
        path.unlink()


def test_flush_drain_persist_store_the_bytes(lib: Libpmem, mapped: tuple[int, int, Path]) -> None:
    addr, _, path = mapped
    ctypes.memmove(addr, b"flushed!", 8)
    lib.flush(addr, 8)
    lib.drain()
    ctypes.memmove(addr + 4096, b"persisted", 9)
    lib.persist(addr + 4096, 9)
    assert _file_bytes(path, 0, 8) == b"flushed!"
    assert _file_bytes(path, 4096, 9) == b"persisted"


def test_msync_writes_back(lib: Libpmem, mapped: tuple[int, int, Path]) -> None:
    addr, _, path = mapped
    ctypes.memmove(addr + 8192 + 100, b"msynced", 7)
    lib.msync(addr + 8192 + 100, 7)  # not page aligned: libpmem widens it
    assert _file_bytes(path, 8192 + 100, 7) == b"msynced"


def test_memcpy_persist_copies_the_right_bytes(lib: Libpmem, mapped: tuple[int, int, Path]) -> None:
    addr, _, path = mapped
    src = os.urandom(300_000)
    lib.memcpy_persist(addr + 4096, ctypes.cast(src, ctypes.c_void_p).value, len(src))
    assert ctypes.string_at(addr + 4096, len(src)) == src
    assert _file_bytes(path, 4096, len(src)) == src


def test_memcpy_nodrain_copies_the_right_bytes(lib: Libpmem, mapped: tuple[int, int, Path]) -> None:
    addr, length, path = mapped
    src = os.urandom(200_001)
    lib.memcpy_nodrain(addr + 12345, ctypes.cast(src, ctypes.c_void_p).value, len(src))
    lib.drain()
    lib.msync(addr, length)
    assert ctypes.string_at(addr + 12345, len(src)) == src
    assert _file_bytes(path, 12345, len(src)) == src


def test_errormsg_after_a_failed_map(lib: Libpmem, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "pool"
    with pytest.raises(PmemError) as info:
        lib.map_file(missing, 4096, PMEM_FILE_CREATE, 0o600)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(missing)
    msg = lib.errormsg()
    assert msg
    assert msg in info.value.strerror


def test_env_hides_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_HIDE, "1")
    assert pmem.load() is None
    assert pmem.libpmem_available() is False
    assert pmem.libpmem_version() is None
    assert ENV_HIDE in (pmem.unavailable_reason() or "")
    monkeypatch.setenv(ENV_HIDE, "0")
    assert pmem.libpmem_available() is (ctypes.util.find_library("pmem") is not None)


def test_ordinary_files_are_not_dax(tmp_path: Path) -> None:
    path = tmp_path / "plain.bin"
    path.write_bytes(b"\0" * 8192)
    assert dax.statx_dax(path) in (False, None)
    assert dax.file_is_dax(path) is False
    assert dax.map_sync_supported(path) is False
    assert dax.device_dax(path) is False
    assert dax.really_pmem(path) is False


MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 259:1 / /mnt/pmem rw,relatime shared:5 - ext4 /dev/pmem0 rw,dax=always
41 27 259:2 / /mnt/pm\040two rw,relatime - xfs /dev/pmem1 rw,dax
42 27 259:3 / /mnt/inode rw - xfs /dev/pmem2 rw,dax=inode
43 40 0:50 / /mnt/pmem/over rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/mnt/pmem/pool", True),
        ("/mnt/pm two/pool", True),
        ("/mnt/inode/pool", False),
        ("/mnt/pmem/over/pool", False),
        ("/mnt/pmemx/pool", False),
        ("/home/pool", False),
    ],
)
def test_mount_dax_option(path: str, expected: bool) -> None:
    assert dax.mount_dax(path, MOUNTINFO) is expected


_FORCE_SCRIPT = """
import json, os, sys
from tierstore import pmem
from tierstore.pmem.libpmem import PMEM_FILE_CREATE
from tierstore.pmem.mapping import LibpmemMapping

lib = pmem.load()
raw = sys.argv[1] + "/raw.bin"
addr, length, reported = lib.map_file(raw, 1 << 16, PMEM_FILE_CREATE, 0o600)
is_pmem = lib.is_pmem(addr, length)
lib.unmap(addr, length)
m = LibpmemMapping(lib, raw)
durability, forced = m.durability, m.forced
m.release()
pool = pmem.PoolMedium(sys.argv[1] + "/forced.pool", create=True, size=1 << 20,
                       engine="libpmem")
print(json.dumps({"reported": reported, "is_pmem": is_pmem, "durability": durability,
                  "forced": forced, "pool": pool.durability, "describe": pool.describe()}))
pool.close()
"""


def test_pmem_is_pmem_force_does_not_fake_durability(lib: Libpmem, tmp_path: Path) -> None:
    out = _run_script(_FORCE_SCRIPT, str(tmp_path), env={dax.FORCE_ENV: "1", ENV_HIDE: "0"})
    # The variable took effect: libpmem itself now calls this ordinary file pmem...
    assert out["reported"] is True and out["is_pmem"] is True
    # ...but the mapping checked with the kernel and kept msync.
    assert out["forced"] is True
    assert out["durability"] == "msync"
    assert out["pool"] == "msync"
    assert "not DAX (PMEM_IS_PMEM_FORCE ignored): msync" in out["describe"]


_FALLBACK_SCRIPT = """
import json, os, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from tierstore import pmem
    d = sys.argv[1]
    pool = pmem.PoolMedium(d + "/a.pool", create=True, size=64 << 10)
    second = pmem.PoolMedium(d + "/b.pool", create=True)
    second.close()
seg = pool.create_segment(0, 40 << 10)
data = os.urandom(40 << 10)
pool.pwrite(0, 0, memoryview(data)).result()
pool.sync([0])
view = pool.view(0, 0, len(data))
grown = pool.create_segment(1, 1 << 20)
pool.pwrite(1, 4096, memoryview(data)).result()
pool.sync([0, 1])
old_view_ok = bytes(view) == data
describe, engine, durability = pool.describe(), pool.engine, pool.durability
grew = pool.size > 64 << 10
pool.close()
pool.close()
pool = pmem.PoolMedium(d + "/a.pool", create=False)
pool.attach([seg, grown])
buf = bytearray(len(data))
pool.pread(1, 4096, memoryview(buf)).result()
reread = bytes(buf) == data and bytes(pool.view(0, 0, len(data))) == data
pool.close()
ours = [str(w.message) for w in caught if issubclass(w.category, pmem.PmemFallbackWarning)]
print(json.dumps({"load": pmem.load() is None, "available": pmem.libpmem_available(),
                  "warnings": ours, "describe": describe, "engine": engine,
                  "durability": durability, "old_view_ok": old_view_ok, "reread": reread,
                  "grew": grew}))
"""


def test_fallback_when_libpmem_is_hidden(tmp_path: Path) -> None:
    out = _run_script(_FALLBACK_SCRIPT, str(tmp_path), env={ENV_HIDE: "1"})
    assert out["load"] is True and out["available"] is False
    assert len(out["warnings"]) == 1, "warned once for two pools"
    assert ENV_HIDE in out["warnings"][0] and "mmap" in out["warnings"][0]
    assert out["engine"] == "mmap" and out["durability"] == "msync"
    assert out["describe"].startswith(f"mmap fallback (libpmem hidden by {ENV_HIDE}=1): msync")
    assert out["grew"] and out["old_view_ok"] and out["reread"]
