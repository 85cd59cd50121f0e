"""Faults a user can cause end in one line that names the file or entry (exit 2 from the
CLI), and a full disk loses nothing: a flush makes progress in batches, and a failed flush or
close leaves the store open with every unflushed entry in it, ready for a retry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_store_catalog_loss import cli, one_line_error  # noqa: E402 (the CLI's error shape)

import tierstore
from tierstore.cli import main
from tierstore.opening import memory_limit


def t(x: float, n: int = 50_000) -> torch.Tensor:
    return torch.full((n,), x)


@pytest.mark.parametrize("field", ["backing", "format", "slab_bytes"])
def test_a_marker_missing_a_field_is_a_clear_error(tmp_path: Path, field: str) -> None:
    path = tmp_path / "st"
    with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
    marker = json.loads((path / "TIERSTORE").read_text())
    if field == "slab_bytes":
        del marker["backing"]["slab_bytes"]
    else:
        del marker[field]
    (path / "TIERSTORE").write_text(json.dumps(marker))
    with pytest.raises(tierstore.NotAStoreError, match="TIERSTORE|format"):
        tierstore.open(path)
    one_line_error(cli("info", str(path)))


def two_slabs(path: Path) -> Path:
    """A store with "a" in the first slab and "big" alone in the second; returns the second."""
    with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
        st.put("a", t(1.0))
        st.put("big", t(2.0, 400_000))
        st.snapshot("s")
        seg = Path(st.info("big").path)
    assert seg.name == "slab-000001.dat"
    return seg


def test_a_deleted_slab_file_fails_only_its_entries(tmp_path: Path) -> None:
    path = tmp_path / "st"
    seg = two_slabs(path)
    seg.unlink()
    with tierstore.open(path, host_cache="16MiB") as st:
        assert torch.equal(st.get("a"), t(1.0))  # the rest of the store is usable
        with pytest.raises(tierstore.CorruptEntryError, match=r"'big'.*slab-000001.dat"):
            st.get("big")
        st.put("new", t(3.0, 400_000))  # never into the missing slab
        assert torch.equal(st.get("new"), t(3.0, 400_000))
        report = st.fsck()
    assert not report.ok and any("slab-000001.dat" in p and "missing" in p for p in report.problems)
    r = cli("fsck", str(path))
    assert r.returncode == 1 and "missing" in r.stdout
    one_line_error(cli("export", str(path), str(tmp_path / "out"), "--format", "safetensors"),
                   "'big'")


def test_a_truncated_slab_names_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "st"
    seg = two_slabs(path)
    os.truncate(seg, 4096)
    with tierstore.open(path, host_cache=0) as st:
        assert torch.equal(st.get("a"), t(1.0))
        with pytest.raises(tierstore.CorruptEntryError, match=r"'big'.*slab-000001.dat"):
            st.get("big")
        assert not st.fsck().ok
    one_line_error(cli("export", str(path), str(tmp_path / "out"), "--format", "zarr"), "'big'")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_store_of_another_user_is_a_clear_error() -> None:
    root = Path(tempfile.mkdtemp(prefix="tierstore-perm-"))
    try:
        os.chmod(root, 0o755)
        path = root / "st"
        with tierstore.open(path, create=True, slab_size="1MiB", host_cache=0) as st:
            st.put("a", t(1.0))
        for p in [path, *path.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)  # readable by all, writable by root
        os.seteuid(65534)  # nobody, for this block only
        try:
            with pytest.raises(tierstore.StoreError, match="permission denied"):
                tierstore.open(path)
            r = CliRunner().invoke(main, ["info", str(path)])
        finally:
            os.seteuid(0)
        assert r.exit_code == 2, r.output
        assert r.output.count("\n") == 1 and "permission denied" in r.output, r.output
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_name_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    bad = b"layers.0.\xff.w1".decode("utf-8", "surrogateescape")
    with tierstore.open(tmp_path / "st", create=True, slab_size="1MiB") as st:
        for call in (lambda: st.put(bad, t(1.0)), lambda: st.get(bad),
                     lambda: st.delete(bad), lambda: st.put_many({bad: t(1.0)})):
            with pytest.raises(tierstore.StoreError, match="UTF-8"):
                call()
        assert st.keys() == []


def test_a_host_cache_larger_than_the_machine_is_refused(tmp_path: Path) -> None:
    too_big = memory_limit() + (1 << 30)
    with pytest.raises(tierstore.StoreError, match="host cache"):
        tierstore.open(tmp_path / "st", create=True, host_cache=too_big)
    assert not (tmp_path / "st").exists()  # refused before anything was made
    tierstore.open(tmp_path / "st", create=True, slab_size="1MiB").close()
    one_line_error(cli("generate", "--store", str(tmp_path / "st"), "--host-cache", "1TiB",
                       "--max-new-tokens", "1", "--prompt-ids", "1"),
                   "host cache")


# -- a full disk with the host cache on ---------------------------------------------------------
FULL_CHILD = textwrap.dedent("""
    import json, resource, signal, sys, torch, tierstore, tierstore.writes
    path, limit = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    tierstore.writes.FLUSH_BATCH_BYTES = 256 << 10  # small batches, so some fit the space left
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    out = {}
    st = tierstore.open(path, host_cache="64MiB")
    for i in range(120):
        st.put(f"e.{i}", torch.full((16384,), float(i)))  # 64 KiB each: 7.5 MiB, unflushed
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    dirty = lambda: st.stats()["cache"]["dirty_entries"]
    try:
        st.flush()
        out["flush"] = "ok"
    except tierstore.StoreFullError as e:
        out["flush"] = str(e)
    out["dirty_after_flush"] = dirty()
    try:
        st.close()
        out["close"] = "ok"
    except tierstore.StoreFullError as e:
        out["close"] = str(e)
    out["readable"] = all(float(st.get(f"e.{i}")[0]) == i for i in range(120))
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space is back
    st.close()
    out["closed"] = True
    print(json.dumps(out))
""")


def test_a_full_disk_loses_no_unflushed_put(make_store) -> None:
    st = make_store(slab_size="8MiB", pmem_size="8MiB")
    st.put("fill", torch.zeros(3 << 18))  # 3 MiB: what is left of the 7 MiB limit holds 4
    path = st.path
    st.close()
    r = subprocess.run([sys.executable, "-c", FULL_CHILD, path, str(7 << 20)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["flush"] != "ok" and path in out["flush"], out
    assert 0 < out["dirty_after_flush"] < 120, "the flush made no progress in batches"
    assert "stays open" in out["close"] and "close() again" in out["close"], out
    assert out["readable"] and out["closed"]
    st = make_store(path, reopen=True)
    assert len(st.keys()) == 121
    for i in range(120):
        assert torch.equal(st.get(f"e.{i}"), torch.full((16384,), float(i)))
    assert st.fsck().ok


def test_serve_refuses_a_host_cache_larger_than_the_machine(tmp_path: Path) -> None:
    one_line_error(cli("serve", "--store", str(tmp_path / "st"), "--socket",
                       str(tmp_path / "sock"), "--host-cache", "1TiB"), "host cache")
    assert not (tmp_path / "st").exists()
