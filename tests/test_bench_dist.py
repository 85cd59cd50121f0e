"""`tierstore bench dist` on the tiny preset at its smallest: W = 1 and W = 2 (two "nodes" of
one rank, each with its own store and daemon), one batch size, 2 steps, both paradigms, as
real torchrun runs. The traffic is checked against what each paradigm may move and against
Janus's bound; timings are reported, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tierstore.trainer import PRESETS

import tierstore

pytestmark = pytest.mark.timeout(300)
KINDS = ("tokens", "experts", "grads")
WHERE = ("intra", "cross")


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tierstore", "bench", "dist", *args],
                          env=env, capture_output=True, text=True, timeout=280)


def test_bytes_moved_per_paradigm_and_janus_bound(tmp_path: Path) -> None:
    out = tmp_path / "dist.json"
    scratch = tmp_path / "scratch"
    done = _bench("--model", "tiny", "--batch-sizes", "2", "--seq-len", "32", "--steps", "2",
                  "--worlds", "1,2", "--host-cache", "16MiB", "--store", str(scratch),
                  "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[4/4] tiny B=2 W=2" in done.stdout  # progress
    assert "meas/Janus" in done.stdout and "step ms" in done.stdout  # the tables
    rows = json.loads(out.read_text())["rows"]
    got = {(r["world"], r["paradigm"]) for r in rows}
    assert got == {("1x1", "token"), ("1x1", "data"), ("2x1", "token"), ("2x1", "data")}
    cfg = PRESETS["tiny"]
    p_e = sum(a * b for a, b in cfg.expert_shapes().values())
    for r in rows:
        assert "error" not in r, r
        assert r["steps"] == 2 and len(r["step_times_s"]) == 2
        assert r["peak_rss_bytes"] > 0
        assert all(d is not None and d > 0 for d in r["daemon_peak_rss_bytes"])
        moved = {f"{k}_{w}": r[f"{k}_{w}_bytes"] for k in KINDS for w in WHERE}
        if r["world_size"] == 1:
            assert set(moved.values()) == {0}, moved  # nothing leaves a lone rank
            continue
        # two nodes of one rank: everything that moves crosses between nodes
        assert moved["tokens_intra"] == moved["experts_intra"] == moved["grads_intra"] == 0
        j = r["janus"]
        # R = 2*H*T / (n*P_e*E), with T = B*S*k and E experts per rank
        want = 2 * cfg.d_model * (2 * 32 * cfg.top_k) / (2 * p_e * (cfg.n_experts // 2))
        assert j["R"] == pytest.approx(want)
        if r["paradigm"] == "token":
            assert moved["experts_cross"] == moved["grads_cross"] == 0
            assert moved["tokens_cross"] > 0
        else:
            assert moved["tokens_cross"] == 0
            assert 0 < moved["experts_cross"] <= j["experts_cross_bytes"]
            assert r["max_step"]["experts_cross_bytes"] <= j["experts_cross_bytes"]
            # every pulled expert's gradient goes back once
            assert moved["grads_cross"] == moved["experts_cross"]
            assert r["measured_ratio"] is not None
    # every daemon was stopped, and the runs' stores removed
    assert not any(scratch.glob("run*/node*.run/daemon.sock"))
    for sock in scratch.glob("**/daemon.sock"):
        with pytest.raises((OSError, tierstore.StoreError)):
            tierstore.daemon_status(str(sock))


def test_a_world_the_experts_do_not_split_over_is_refused_in_one_line() -> None:
    done = _bench("--model", "tiny", "--worlds", "3", "--steps", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "tierstore bench dist: tiny's 8 experts do not split over world 3 (3 ranks)"]


@pytest.mark.slow  # three torchrun launches, 23 s on 2 cores: kept out of CI's budget
def test_imported_family_at_each_pipeline_granularity(tmp_path: Path) -> None:
    """A tiny Mixtral, imported into both nodes' stores, fine-tuned at W = 2 in 2 chunks and
    with auto: the counters' relations, the chunks asked for, the same traffic whatever the
    chunking, and the model's T(N) from the auto run's logged figures beside both."""
    out = tmp_path / "dist_hf.json"
    done = _bench("--family", "mixtral", "--pipeline", "2,auto", "--worlds", "2",
                  "--batch-sizes", "2", "--seq-len", "32", "--steps", "2", "--host-cache",
                  "16MiB", "--store", str(tmp_path / "scratch"), "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "hidden %" in done.stdout and "cannot rank the chunk counts" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["world"], r["pipeline"]) for r in rows] == [("2x1", 2), ("2x1", "auto")]
    fixed, auto = rows
    blocks = auto["model_blocks"]
    assert len(blocks) == 2  # tiny family: two MoE layers, each logged once by rank 0
    # auto picks among the chunk counts that divide the 4 experts each rank owns
    assert all(b["compute_s"] > 0 and b["bytes"] > 0 and b["auto_chunks"] in (1, 2, 4)
               for b in blocks)
    assert fixed["chunks_per_step"] == [2 * len(blocks)]
    # a block auto leaves unchunked takes the plain exchange, which counts no chunks
    assert auto["chunks_per_step"] == [sum(b["auto_chunks"] for b in blocks
                                           if b["auto_chunks"] > 1)]
    for r in rows:
        assert "error" not in r, r
        assert 0 <= r["pipeline_hidden_s"] <= r["pipeline_overlapped_s"] \
            <= r["pipeline_compute_s"]
        assert 0 <= r["hidden_frac"] <= 1
        assert r["comm_time_s"] >= r["pipeline_hidden_s"]
        assert r["moved_bytes"] == r["cross_bytes"] > 0  # two nodes of one rank
        assert len(r["model_T_s_per_block"]) == 2 and r["model_T_s"] > 0
    # chunks regroup the rows, they do not add any
    assert fixed["moved_bytes"] == auto["moved_bytes"]
    # Per block: the chunks it ran in, its counters' relations, its bytes (they add up to
    # the run's), the next chunk's experts fetched while a chunk computed (once per pass in
    # 2 chunks, never unchunked), and the model's T(N) beside the measured one.
    assert "measured T ms" in done.stdout and "fetch hidden %" in done.stdout
    names = [b["block"] for b in blocks]
    for r in rows:
        assert [b["block"] for b in r["blocks"]] == names
        assert sum(b["bytes"] for b in r["blocks"]) == pytest.approx(r["moved_bytes"])
        for b in r["blocks"]:
            assert b["calls"] >= 1 and b["bytes"] > 0 and b["measured_T_s"] > 0
            assert 0 <= b["hidden_s"] <= b["overlapped_s"] <= b["compute_s"]
            assert 0 <= b["hidden_frac"] <= 1 and 0 <= b["fetch_hidden_frac"] <= 1
            assert b["model_T_s"] > 0
    assert all(b["n"] == [2] and b["fetches_ahead"] == b["calls"] for b in fixed["blocks"])
    for b, m in zip(auto["blocks"], blocks):
        assert b["n"] == [m["auto_chunks"]]
        assert b["fetches_ahead"] == b["calls"] * (m["auto_chunks"] - 1)


def test_pipeline_settings_are_checked_in_one_line(tmp_path: Path) -> None:
    done = _bench("--pipeline", "2", "--worlds", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "tierstore bench dist: --pipeline chunks an imported model: give --model-dir or "
        "--family"]
    done = _bench("--family", "mixtral", "--pipeline", "3", "--worlds", "2",
                  "--store", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "tierstore bench dist: 3 chunks do not split the 4 experts each rank owns at world 2"]
