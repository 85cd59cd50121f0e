"""The DeepSpeed peer on the smallest preset: each variant either trains (positive step time,
and bytes in the NVMe swap folder where NVMe offload ran) or is refused by a named DeepSpeed
check. Runs DeepSpeed's CPU accelerator in a single-process gloo world."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tierstore.bench import peer_deepspeed_moe as peer

SMALLEST = "tiny"


def test_clean_result_without_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    res = peer.run_peer(SMALLEST, 2)
    assert res["cannot_run"] == "deepspeed is not installed"
    assert res["step_time_s"] is None and res["runs"] == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown model preset"):
        peer.run_peer("no-such-preset", 2)
    with pytest.raises(ValueError, match="steps"):
        peer.run_peer(SMALLEST, 0)
    with pytest.raises(ValueError, match="variants"):
        peer.run_peer(SMALLEST, 2, variants=["zero9"])


def test_native_moe_under_zero3_is_refused_by_named_check(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    res = peer.run_peer(SMALLEST, 2, variants=["native-moe-zero3"], nvme_dir=str(tmp_path),
                        timeout=600)
    (run,) = res["runs"]
    if run["ran"]:  # a DeepSpeed that lifts the check must then really measure
        assert run["step_time_s"] > 0
        return
    (refusal,) = res["refused"]
    assert refusal["type"] == "AssertionError", refusal
    assert refusal["raised_at"] and "_validate_zero3_moe_compatibility" in refusal["raised_at"]
    assert "ZeRO Stage 3" in refusal["message"]
    assert res["step_time_s"] is None and "native-moe-zero3" in res["cannot_run"]


@pytest.mark.slow  # a fresh machine JIT-builds DeepSpeed's async_io and cpu_adam ops (minutes)
def test_peer_measures_or_names_refusals(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    res = peer.run_peer(SMALLEST, 2, nvme_dir=str(tmp_path), timeout=900)
    assert [r["variant"] for r in res["runs"]] == list(peer.VARIANTS)
    for run in res["runs"]:
        if run["ran"]:
            assert run["step_time_s"] > 0 and len(run["losses"]) == 2
            assert run["peak_rss_bytes"] > 0
            if run["nvme_offload"]:
                assert run["bytes_written_nvme"] > 0 and run["swap_dir_bytes"] > 0
        else:
            assert run["refused"], run
            assert all(r["type"] and r["message"] for r in run["refused"])
    if res["config"] is not None:  # the headline is a run whose states went to NVMe
        assert res["step_time_s"] > 0 and res["bytes_written_nvme"] > 0
        assert res["peak_rss_bytes"] > 0
    else:
        assert res["cannot_run"].startswith("no variant trained with NVMe offload")
    # Every refusal names what refused: a DeepSpeed source line or the measurement itself.
    for r in res["refused"]:
        assert r["raised_at"] or r["type"] in ("NoNVMeWrites", "TimeoutExpired"), r


# -- the Hugging Face checkpoint beside `bench train --model-dir` ---------------------------


def test_hf_peer_is_a_clean_result_without_deepspeed(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    from tierstore.bench.peer_deepspeed_hf import run_hf_peer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    res = run_hf_peer(str(tmp_path), [], 1, 1e-4, 0, str(tmp_path / "scratch"))
    assert res == {"system": "deepspeed", "ran": False, "refused": [],
                   "cannot_run": "deepspeed is not installed"}
    assert not (tmp_path / "scratch").exists()  # nothing made


def test_bench_train_peer_needs_a_model_dir() -> None:
    from click.testing import CliRunner

    from tierstore.cli import main

    res = CliRunner().invoke(main, ["bench", "train", "--model", "tiny", "--peer", "deepspeed"])
    assert res.exit_code == 2 and "--peer deepspeed needs --model-dir" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow  # DeepSpeed's ZeRO-3 start and its JIT-built ops take minutes on 2 cores
def test_bench_train_with_the_deepspeed_peer_measures_or_names_its_refusal(
        tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    import json

    from click.testing import CliRunner
    from hf_models import make_hf_model

    from tierstore.cli import main

    make_hf_model("deepseek_v3", tmp_path / "hf", n_routed_experts=8, hidden_size=256,
                  moe_intermediate_size=512, intermediate_size=512)
    out = tmp_path / "train.json"
    res = CliRunner().invoke(main, [
        "bench", "train", "--model-dir", str(tmp_path / "hf"), "--steps", "2", "--warmup", "1",
        "--rounds", "1", "--host-cache", "1MiB", "--batch-size", "2", "--seq-len", "16",
        "--store", str(tmp_path / "scratch"), "--peer", "deepspeed", "--json", str(out)],
        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    ds = json.loads(out.read_text())["deepspeed"]
    assert ds["model_class"] == "DeepseekV3ForCausalLM"
    if ds["ran"]:
        assert ds["step_time_s"] > 0 and len(ds["losses"]) == 3 and ds["nvme_offload"]
        assert ds["peak_rss_bytes"] > 0 and "deepspeed / store step time" in res.output
    else:  # refused by a check of DeepSpeed's own, named with its source line
        (refusal,) = ds["refused"]
        assert refusal["raised_at"].startswith("deepspeed/"), refusal
        assert "did not run" in res.output
