"""`tierstore bench infer --peer accelerate` on a tiny Mixtral saved with ``transformers``:
real accelerate with its disk offload folder and every tierstore mode, each a fresh
process, all giving ``transformers``' own greedy tokens; and the memory-limit runner, which
must tell a child killed for memory from one that stayed under its limit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tierstore.bench.commands import bench
from tierstore.bench.hf_models import write_hf_checkpoint
from tierstore.bench.memlimit import cgroup_available, run_limited
from tierstore.bench.peers import TIERSTORE_MODES, resolve_limit

import tierstore

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

NEW = 5


@pytest.mark.slow  # a benchmark run end to end, 28 s on 2 cores: kept out of CI's budget
def test_every_mode_and_accelerate_give_transformers_tokens(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    write_hf_checkpoint(str(hf), "mixtral", layers=2, experts=4, hidden=64, ffn=128, vocab=200,
                        seed=3)
    out = tmp_path / "peer.json"
    result = CliRunner().invoke(bench, [
        "infer", "--peer", "accelerate", "--model-dir", str(hf), "--prefill-len", "8",
        "--decode-tokens", str(NEW), "--rounds", "1", "--memory-limit", "4GiB", "--warm",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    # transformers' own greedy generation, no offloading, on the prompt the study used
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ids = torch.tensor([res["prompt"]])
    want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(want) == NEW
    runs = res["runs"]
    assert sorted(r["system"] for r in runs) == sorted(["accelerate", *TIERSTORE_MODES])
    for r in runs:
        assert r["ok"], (r["system"], r["outcome"], r["stderr_tail"])
        assert r["tokens"] == want, r["system"]
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["peak_rss_bytes"] > 0
    assert res["tokens_equal"] and res["reference_tokens"] == want
    acc = next(r for r in runs if r["system"] == "accelerate")
    assert acc["offloaded_modules"] == 2  # each layer's experts went to the offload folder
    # the limit applies to the offloading runs; resident, the compute reference, runs without
    no_cgroup = cgroup_available()
    assert res["limit_applied"] == (no_cgroup is None)
    assert res["limit_skipped"] == no_cgroup
    for r in runs:
        assert r["limit_applied"] == (no_cgroup is None and r["system"] != "resident")
    for name, s in res["systems"].items():
        assert s["completed"] == 1 and s["peak_rss_bytes"] > 0
        for phase in ("prefill", "decode"):
            assert s[f"{phase}_tokens_per_s"] > 0
            assert s[f"{phase}_vs_accelerate"] == pytest.approx(
                s[f"{phase}_tokens_per_s"] / res["systems"]["accelerate"][
                    f"{phase}_tokens_per_s"]), name
            assert s[f"{phase}_vs_accelerate_runs"] == [s[f"{phase}_vs_accelerate"]]
    # measured before and after the round; the faster counts
    assert [b["when"] for b in res["bandwidth_runs"]] == ["before", "after"]
    assert res["bandwidth_bytes_per_s"] == max(b["bytes_per_s"] for b in res["bandwidth_runs"])
    rp = res["ring_prefill"]
    assert rp["limit_s"] == max(rp["compute_s"], rp["transfer_s"])
    assert rp["bytes"] == res["model"]["expert_bytes_total"]
    assert rp["ring_vs_limit"] == pytest.approx(rp["limit_s"] / rp["ring_prefill_s"])
    assert not res["cold"] and res["cache"] == ["warm (--warm)"]
    # accelerate's hooks bring every expert of a fused layer in; the routed ones are 2 of 4
    per_token = res["bytes_per_token"]
    assert per_token["accelerate_fused_layers"] == res["model"]["expert_bytes_total"]
    assert per_token["routed_minimum"] == 2 * 2 * res["model"]["expert_bytes"]
    assert "tokens equal across every completed run: True" in result.output


def test_peer_options_are_checked() -> None:
    runner = CliRunner()
    got = runner.invoke(bench, ["infer", "--memory-limit", "0.75"])
    assert got.exit_code == 2 and "--memory-limit applies" in got.output
    got = runner.invoke(bench, ["infer", "--peer", "accelerate", "--store", "."])
    assert got.exit_code == 2 and "not --store" in got.output
    assert resolve_limit("0.75", 1000) == 750
    assert resolve_limit("1GiB", 1000) == 1 << 30
    assert resolve_limit(None, 1000) is None
    with pytest.raises(tierstore.StoreError, match="fraction"):
        resolve_limit("lots", 1000)


def test_memory_limit_kills_a_child_over_it_and_spares_one_under() -> None:
    why = cgroup_available()
    if why is not None:
        pytest.skip(why)
    limit = 256 << 20
    # touch every page, so that the bytes are really charged
    alloc = "b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); print('done')"
    over = run_limited([sys.executable, "-c", alloc.format(n=3 * limit)], limit, timeout=60)
    assert not over.ok and over.oom_killed and over.limit_applied
    assert over.returncode < 0 and "done" not in over.stdout
    assert over.outcome().startswith("killed by the kernel for memory")
    under = run_limited([sys.executable, "-c", alloc.format(n=limit // 4)], limit, timeout=60)
    assert under.ok and not under.oom_killed and under.stdout.strip() == "done"
    assert under.limit_applied and under.outcome() == "ok"
    # the child's own peak, not the test process's (a bare launcher forks it)
    assert limit // 4 <= under.peak_rss_bytes < limit
    assert under.cgroup_peak_bytes is not None and under.cgroup_peak_bytes <= limit
