"""``bench tiers``: the side-by-side measurement of small entries against large ones, and
the command's JSON, on a real store and real fio (small totals; no figure is asserted)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import weakref

import pytest
import torch
from click.testing import CliRunner
from tierstore.bench.tiers import _write_source, _young_heap, measure_entry_sizes

import tierstore
from tierstore.cli import main

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")


@pytest.mark.parametrize("nbytes", [256 << 10, 3 << 20])
def test_the_store_writes_from_memory_made_for_io(nbytes: int) -> None:
    """The store's write rows write from a buffer of their own as fio and DeepNVMe do: the
    same bytes, in a ``read_buffer`` of at least 2 MiB that starts on a 2 MiB boundary (where
    transparent huge pages can back it), not in torch's allocator's memory."""
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    src = _write_source(data)
    assert torch.equal(src, data) and src.data_ptr() != data.data_ptr()
    assert src.data_ptr() % (2 << 20) == 0
    assert src.untyped_storage().nbytes() >= 2 << 20


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_timed_work_leaves_older_objects_out_of_the_collectors_reach() -> None:
    """A full collection scans every object of the process: the timed work is spared
    scanning what existed before its clock started, yet its own garbage is collected."""
    old = _Node()
    old.other = old  # a cycle that exists before the clock
    old_ref = weakref.ref(old)
    with _young_heap():
        assert gc.get_freeze_count() > 0
        new = _Node()
        new.other = new
        new_ref = weakref.ref(new)
        del old, new  # both cycles are garbage now
        gc.collect()
        # Only the one made under the clock is collected; the older one waits.
        assert new_ref() is None and old_ref() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None


@pytest.mark.parametrize("engine", ["auto", "posix-direct"])
def test_entry_sizes_alternate_both_sizes_in_one_store_and_report_their_ratio(
        tmp_path, engine: str) -> None:
    small, large = 256 << 10, 2 << 20
    got = measure_entry_sizes(str(tmp_path), engine, threads=2, total=4 << 20, repeats=3,
                              small=small, large=large)
    assert (got["small_bytes"], got["large_bytes"], got["repeats"]) == (small, large, 3)
    for op in ("read", "write"):
        res = got[op]
        # Every round times each size twice (there and back), in one store.
        assert len(res["small_runs"]) == len(res["large_runs"]) == 6
        assert all(x > 0 for x in res["small_runs"] + res["large_runs"])
        assert res["small_gbps"] == pytest.approx(statistics.median(res["small_runs"]), abs=1e-3)
        # The runs are kept to 3 decimals: at a few tenths of a GB/s (a loaded machine)
        # that alone moves a ratio of them by up to 0.4 %.
        assert res["ratio"] == pytest.approx(
            statistics.median(res["small_runs"]) / statistics.median(res["large_runs"]),
            rel=1e-2)
    assert os.listdir(tmp_path) == []  # its store is removed


@needs_fio
def test_bench_tiers_writes_the_table_and_the_entry_size_comparison(tmp_path) -> None:
    out = tmp_path / "tiers.json"
    result = CliRunner().invoke(main, [
        "bench", "tiers", "--tiers", "nvme", "--engines", "posix-direct", "--blocks", "1MiB",
        "--threads", "1", "--total", "4MiB", "--repeat", "1", "--store", str(tmp_path / "b"),
        "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "entries against 16.0 MiB ones, side by side: read" in result.output
    data = json.loads(out.read_text())
    assert {(r["op"], r["block_bytes"]) for r in data["results"]} == {
        ("write", 1 << 20), ("read", 1 << 20)}
    assert all(r["ceiling"] and r["ceiling_gbps"] > 0 for r in data["results"])
    # Beside the write row (rewrites), the same writes into never-written space, for the
    # store and each of the same ceilings.
    (write,) = [r for r in data["results"] if r["op"] == "write"]
    assert set(write["fresh_ceilings"]) == set(write["ceilings"])
    assert write["fresh_ratio"] == pytest.approx(
        write["write_fresh_gbps"] / write["fresh_ceilings"][write["fresh_ceiling"]],
        rel=1e-2)  # both kept to 3 decimals (see above)
    assert "into never-written (fallocated) space:" in result.output
    assert "nvme  fresh posix-direct" in result.output
    # The user's call too: a read and a write row per kind of caller's memory.
    assert {(r["op"], r["kind"]) for r in data["memory_kinds"]} >= {
        (op, k) for op in ("read", "write") for k in ("torch.empty", "slices at +100")}
    assert "worst:" in result.output
    (sizes,) = data["entry_sizes"]
    assert (sizes["engine"], sizes["small_bytes"], sizes["large_bytes"]) == (
        "posix-direct", 256 << 10, 16 << 20)
    assert len(sizes["read"]["small_runs"]) == 2


def test_the_pmem_ceiling_is_the_durable_copy_the_pool_makes(tmp_path) -> None:
    """``DurableCopy`` copies every byte into its file and makes it durable the way the
    pool makes its own writes durable (a copy and msync where the file is not persistent
    memory: a cache-flushing copy alone would persist nothing there), and removes its file."""
    from tierstore.pmem.dax import really_pmem

    from tierstore import probes

    path = str(tmp_path / "ceiling.pool")
    c = probes.DurableCopy(path, 3 << 20, threads=2)
    try:
        assert c.write() > 0
        with open(path, "rb") as f:
            assert f.read() == b"\1" * (3 << 20)
        assert c.name == ("pmem_memcpy_persist" if really_pmem(path) else
                          "memcpy+pmem_msync" if _libpmem_loads() else "memcpy+msync")
    finally:
        c.close()
    assert not os.path.exists(path)


def _libpmem_loads() -> bool:
    from tierstore.pmem.libpmem import load

    return load() is not None


def test_the_pmem_rows_time_rewrites_against_the_durable_copy(tmp_path) -> None:
    """The PMem rows: writes rewriting space written before, beside the durable copy of
    the same bytes (its runs and the store's each ``repeats`` long, the ratio of their
    medians), the first writes into never-written space beside; reads into reused memory,
    fresh results beside."""
    from tierstore.bench.tiers_memory import measure_pmem

    write, read = measure_pmem(str(tmp_path), str(tmp_path), 1 << 20, 1, 4 << 20, repeats=3)
    assert write["ceiling"] in ("pmem_memcpy_persist", "memcpy+pmem_msync", "memcpy+msync")
    assert len(write["store_runs"]) == len(write["ceiling_runs"][write["ceiling"]]) == 3
    assert write["gbps"] == pytest.approx(statistics.median(write["store_runs"]), abs=1e-3)
    assert write["ratio"] == pytest.approx(write["gbps"] / write["ceiling_gbps"], rel=1e-2)
    assert write["fresh_ceiling"] == write["ceiling"] and write["write_fresh_gbps"] > 0
    assert read["ceiling"] == "memcpy" and len(read["read_fresh_runs"]) == 3
    for row in (write, read):  # the same, from and into a caller's torch.empty tensors
        assert len(row["torch_empty_runs"]) == 3 and row["torch_empty_gbps"] > 0
        assert row["torch_empty_ratio"] == pytest.approx(
            row["torch_empty_gbps"] / row["gbps"], rel=1e-2)
    assert os.listdir(tmp_path) == []  # the store, its pool and the ceiling's file are gone


def test_peer_deepnvme_says_in_one_line_what_is_missing(monkeypatch) -> None:
    from tierstore.bench import deepnvme

    monkeypatch.setattr(deepnvme, "unavailable",
                        lambda: "deepspeed is not installed (pip install 'tierstore[peers]')")
    got = CliRunner().invoke(main, ["bench", "tiers", "--peer", "deepnvme", "--total", "4MiB"])
    assert got.exit_code == 2
    lines = got.output.strip().splitlines()
    assert len(lines) == 1 and "pip install '.[peers]'" in lines[0] and "libaio-dev" in lines[0]


def test_kinds_of_memory_asked_for_are_the_rows_and_an_unknown_one_is_refused(
        tmp_path, monkeypatch) -> None:
    from tierstore.bench import deepnvme, tiers_kinds

    monkeypatch.setattr(deepnvme, "unavailable", lambda: None)
    measured: list[list[str] | None] = []
    monkeypatch.setattr(tiers_kinds, "measure_kinds",
                        lambda *a, kinds=None, **k: measured.append(kinds) or [])
    cmd = ["bench", "tiers", "--peer", "deepnvme", "--blocks", "1MiB", "--engines", "auto", "--store",
           str(tmp_path / "s")]
    got = CliRunner().invoke(main, [*cmd, "--kinds", "slices at +512,torch.empty"])
    assert got.exit_code == 0, got.output
    assert measured == [["slices at +512", "torch.empty"]]
    got = CliRunner().invoke(main, [*cmd, "--kinds", "torch.empty,slices at +7"])
    assert got.exit_code == 2 and len(measured) == 1
    assert got.output.strip().splitlines() == [
        "tierstore: no kind of memory 'slices at +7' here; the kinds: "
        + ", ".join(tiers_kinds.memory_kinds(1, 1))]


@needs_fio
def test_each_kind_of_callers_memory_is_a_row_and_the_worst_leads(tmp_path,
                                                                  monkeypatch) -> None:
    from tierstore.bench import deepnvme
    from tierstore.bench.tiers_kinds import EXTRA_KINDS, memory_kinds, report_kinds, run_kinds

    from tierstore import landing

    monkeypatch.setattr(deepnvme, "unavailable", lambda: "not measured in this test")
    # Reads ask for --read-call bytes of entries at a time, puts --write-call.
    asked: list[int] = []
    put: list[int] = []
    from tierstore.local import LocalStore

    get_many, put_many = tierstore.Store.get_many, LocalStore.put_many
    monkeypatch.setattr(tierstore.Store, "get_many", lambda st, names, *a, **k: (
        asked.append(len(names)), get_many(st, names, *a, **k))[1])
    monkeypatch.setattr(LocalStore, "put_many", lambda st, items, *a, **k: (
        put.append(len(items)), put_many(st, items, *a, **k))[1])
    # The engine asked for (bench tiers --engines) is the one the rows measure.
    # Each kind once per path asked for (bench tiers --paths), the rule restored after.
    rows = run_kinds(str(tmp_path), [1 << 20], 2, 4 << 20, repeats=1, progress=False,
                     engines=("posix-direct",), paths=("batch", "workers"), read_call=2 << 20,
                     write_call=1 << 20)
    assert asked and set(asked) == {2}
    assert put[:2] == [4, 4] and set(put[2:]) == {1}  # after the untimed setup's puts
    assert all(r["read_call_bytes"] == 2 << 20 and r["write_call_bytes"] == 1 << 20
               for r in rows)
    kinds = {f"{k} [{p}]" for k in memory_kinds(1 << 20, 1) for p in ("batch", "workers")
             if k not in EXTRA_KINDS}
    assert landing.ROUTE is None
    for op in ("read", "write"):
        mine = [r for r in rows if r["op"] == op]
        assert {r["kind"] for r in mine} == kinds
        assert all(r["kind"].endswith(f"[{r['path']}]") for r in mine)
        assert all(r["reference"].startswith("fio") and r["gbps"] > 0 for r in mine)
        assert all(r["engine"] == "posix-direct" and r["engine_described"].startswith("posix")
                   and r["cpu_s_per_gb"] > 0 for r in mine)
        assert all(r["paired_ratio"] == pytest.approx(
            r["runs"][0] / r["peer_runs"][r["reference"]][0], rel=1e-2) for r in mine)
    out: list[str] = []
    report_kinds(rows, out.append)
    worst = min((r for r in rows if r["op"] == "read"), key=lambda r: r["ratio"])
    assert f"worst: {worst['kind']}" in next(line for line in out if line.startswith("read"))


def test_deepnvme_buffer_segments_count_runs_of_adjacent_page_frames() -> None:
    """Each 1 MiB block of DeepNVMe's buffer reaches the disk as one segment per run of
    physically adjacent pages; the rows report the average (None where frames are hidden)."""
    import numpy as np
    from tierstore.bench import deepnvme

    frames = np.array([5, 6, 7, 100, 101, 9], dtype=np.uint64)
    assert deepnvme.mean_runs(frames, 3) == 1.5  # one run, then two
    assert deepnvme.mean_runs(np.zeros(6, dtype=np.uint64), 3) is None
    buf = tierstore.read_buffer(2 << 20)
    buf.fill_(1)  # present
    got = deepnvme.segments_per_block(buf.data_ptr(), 2 << 20)
    assert got is None or 1 <= got <= deepnvme.BLOCK // deepnvme.PAGE
