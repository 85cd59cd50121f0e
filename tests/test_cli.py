"""The ``tierstore`` command line, through click's runner (the same entry point)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import tierstore
from tierstore.cli import main


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_every_command_has_help() -> None:
    for cmd in ("init", "info", "ls", "fsck", "export", "import", "snapshot", "restore",
                "drop-snapshot", "demo", "train", "bench"):
        assert "Usage:" in run(cmd, "--help")
    for cmd in ("tiers", "cache", "prefetch"):
        assert "Usage:" in run("bench", cmd, "--help")


def test_store_lifecycle(tmp_path) -> None:
    store = str(tmp_path / "s")
    assert "created" in run("init", store, "--slab-size", "8MiB")
    run("init", store, code=2)  # already a store: one clear line, exit 2
    with tierstore.open(store) as st:
        st.put("layers.0.experts.0.w1", torch.ones(64, 64))
        st.put("layers.0.experts.0.w1", torch.zeros(64, 64), kind="exp_avg")
    assert "layers.0.experts.0.w1  [exp_avg]" in run("ls", store)
    assert "float32\t[64, 64]" in run("ls", store, "layers.", "-l")
    assert "snapshot first" in run("snapshot", store, "first")
    assert "first" in run("snapshot", store)
    info = json.loads(run("info", store, "--json"))
    assert info["entries"] == 2 and info["snapshot_list"][0]["tag"] == "first"
    assert info["backend"].startswith("nvme:")
    with tierstore.open(store) as st:
        st.put("later", torch.ones(3))
    assert "restored first" in run("restore", store, "first")
    assert "later" not in run("ls", store)
    assert "dropped first" in run("drop-snapshot", store, "first")
    assert "clean" in run("fsck", store)


def test_export_import_and_fsck_failure(tmp_path) -> None:
    src = str(tmp_path / "s")
    with tierstore.open(src, create=True, slab_size="8MiB") as st:
        for e in range(3):
            st.put(f"layers.0.experts.{e}.w1", torch.full((32, 32), float(e)))
    for fmt, out in (("zarr", "z"), ("safetensors", "m.safetensors")):
        run("export", src, str(tmp_path / out), "--format", fmt)
        dst = str(tmp_path / f"from-{fmt}")
        assert "imported 3 tensors" in run("import", str(tmp_path / out), "--store", dst)
        with tierstore.open(dst) as st:
            assert torch.equal(st.get("layers.0.experts.2.w1"), torch.full((32, 32), 2.0))
    with tierstore.open(src) as st:
        where = st.info("layers.0.experts.1.w1")
    with open(where.path, "r+b") as f:
        f.seek(where.offset + 100)
        byte = f.read(1)
        f.seek(where.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = run("fsck", src, code=1)
    assert "PROBLEM" in out and "layers.0.experts.1.w1" in out


def test_errors_are_one_line(tmp_path) -> None:
    (tmp_path / "plain").mkdir()
    out = run("info", str(tmp_path / "plain"), code=2)
    assert out.strip().startswith("tierstore:") and "not a tierstore store" in out


def test_init_pmem_names_the_backend(tmp_path) -> None:
    store = str(tmp_path / "p")
    run("init", store, "--backing", "pmem", "--pmem-path", str(tmp_path / "pool"),
        "--pmem-size", "16MiB")
    assert "pmem:" in json.loads(run("info", store, "--json"))["backend"]


def test_demo_runs_small(tmp_path) -> None:
    out = run("demo", "--store", str(tmp_path / "d"), "--layers", "2", "--experts", "2",
              "--hidden", "64", "--ffn", "64", "--model", "tiny", "--train-steps", "4",
              "--new-tokens", "5")
    assert "0 mismatches" in out and "clean" in out
    assert "over 4 steps" in out and "step-2, step-4" in out
    assert "generate (ring" in out and "generate (expert" in out
    assert (tmp_path / "d-model" / "TIERSTORE").exists()
    skipped = run("demo", "--store", str(tmp_path / "e"), "--layers", "2", "--experts", "2",
                  "--hidden", "64", "--ffn", "64", "--train-steps", "0")
    assert "training:" not in skipped


@pytest.mark.parametrize("policies", ["all"])
def test_bench_cache_writes_the_documented_json(tmp_path, policies: str) -> None:
    out = tmp_path / "c.json"
    run("bench", "cache", "--synthetic", "zipf:layers=2,experts=8,steps=20,seed=1",
        "--capacity", "0.25,0.5", "--policies", policies, "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    assert {r["policy"] for r in rows} == set(tierstore.lab.POLICIES)
    for r in rows:
        assert {"policy", "capacity_fraction", "hit_rate", "opt_fraction", "bytes_read",
                "bytes_written"} <= r.keys()
        if r["policy"] != "belady":
            assert r["hit_rate"] <= next(
                b["hit_rate"] for b in rows
                if b["policy"] == "belady" and b["capacity_fraction"] == r["capacity_fraction"])


def test_bench_cache_bad_policy_arguments_are_one_line_errors() -> None:
    common = ("bench", "cache", "--synthetic", "zipf:layers=2,experts=4,steps=5",
              "--capacity", "0.5", "--policies", "lfu-decay", "--policy-arg")
    for arg, says in (("lfu-decay:beta=2", "beta must be in (0, 1)"),
                      ("lfu-decay:turn=0.5", "turn must be 0"),
                      ("lfu-decay:nope=1", "nope"),
                      ("beta=0.5", "unknown policies")):
        out = run(*common, arg, code=2)
        assert says in out and len(out.strip().splitlines()) == 1, out
