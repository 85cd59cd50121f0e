"""`tierstore bench train`: both trainers run on the same model and the report says so."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tierstore.cli import main


def test_bench_train_reports_both_sides(tmp_path) -> None:
    out = tmp_path / "train.json"
    result = CliRunner().invoke(main, [
        "bench", "train", "--model", "tiny", "--steps", "2", "--warmup", "1", "--rounds", "1",
        "--host-cache", "64MiB", "--batch-size", "2", "--seq-len", "16",
        "--engine", "posix-direct",
        "--store", str(tmp_path / "scratch"), "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    # the engine named is the one the store ran on
    assert report["engine"] == "posix-direct" and report["backend"].startswith("nvme: posix")
    assert report["model"] == "tiny" and report["batch_tokens"] == 32
    for side in ("resident", "store"):
        assert report[side]["steps_measured"] == 2 and report[side]["step_time_s"] > 0
    assert report["store"]["hit_rate"] is not None and 0 <= report["store"]["stall_frac"] < 1
    assert report["step_time_ratio"] == (report["store"]["step_time_s"]
                                         / report["resident"]["step_time_s"])
    assert "store / resident step time" in result.output


def test_bench_train_rejects_an_unknown_model(tmp_path) -> None:
    result = CliRunner().invoke(main, ["bench", "train", "--model", "nope", "--store",
                                       str(tmp_path / "s")])
    assert result.exit_code == 2 and "nope" in result.output
