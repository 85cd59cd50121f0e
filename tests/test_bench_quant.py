"""`tierstore bench infer --peer accelerate --quantized mxfp4|fp8`: the synthetic quantized
checkpoints and their bf16 twins (tierstore.bench.quant_models) hold the same values, and
the study runs end to end on a tiny one, compact store, bf16 store and accelerate giving
the same tokens; `tierstore bench dequant`'s options are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tierstore.bench.commands import bench
from tierstore.bench.quant_models import write_quantized_checkpoints
from tierstore.hf import import_hf
from tierstore.hf.layout import MODEL_ENTRY, read_json_entry
from tierstore.hf.quant import Dequantizer

import tierstore

pytest.importorskip("transformers")


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_the_quantized_checkpoint_and_its_bf16_twin_hold_the_same_experts(
        tmp_path: Path, fmt: str) -> None:
    sizes = write_quantized_checkpoints(str(tmp_path / "q"), str(tmp_path / "b"), fmt,
                                        layers=2, experts=2, hidden=256, ffn=128, vocab=300)
    assert sizes["quant_bytes"] < sizes["bf16_bytes"]
    import_hf(str(tmp_path / "q"), str(tmp_path / "sq"), progress=False)
    import_hf(str(tmp_path / "b"), str(tmp_path / "sb"), progress=False)
    deq = Dequantizer()
    with tierstore.open(tmp_path / "sq") as sq, tierstore.open(tmp_path / "sb") as sb:
        info = read_json_entry(sq, *MODEL_ENTRY)
        assert info["quant"] == fmt
        checked = 0
        for m in info["experts"]:
            for attr, f in m["formats"].items():
                parts = dict(m["params"])[attr]
                for e in range(m["num_experts"]):
                    packed, scales = (sq.get(f"{m['prefix']}.{e}.{p}") for p in parts)
                    twin = sb.get(f"{m['prefix']}.{e}.{attr}")
                    assert twin.dtype == torch.bfloat16
                    got = deq(f, packed, scales, torch.bfloat16)
                    assert torch.equal(got.view(torch.int16), twin.view(torch.int16))
                    checked += 1
        # MoE layers (DeepSeek's first is dense) x experts x (gate_up, down)
        assert checked == (2 if fmt == "mxfp4" else 1) * 2 * 2
        dense = sb.names("dense.")
        assert dense and dense == sq.names("dense.")  # the rest is bf16 in both
        for name in dense:
            assert torch.equal(sq.get(name), sb.get(name)), name


@pytest.mark.slow  # a benchmark run end to end, 25 s on 2 cores: kept out of CI's budget
def test_the_quantized_study_runs_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    out = tmp_path / "q.json"
    got = CliRunner().invoke(bench, [
        "infer", "--peer", "accelerate", "--quantized", "fp8", "--layers", "2", "--experts",
        "4", "--hidden", "256", "--ffn", "128", "--vocab", "300", "--prefill-len", "6",
        "--decode-tokens", "3", "--rounds", "1", "--threads", "1", "--warm", "--json",
        str(out)])
    assert got.exit_code == 0, got.output
    res = json.loads(out.read_text())
    assert sorted(res["systems"]) == ["accelerate", "expert", "expert bf16", "resident"]
    for name, s in res["systems"].items():
        assert s["completed"] == 1, (name, s["outcomes"])
    assert res["tokens_equal"], res["token_mismatches"]
    q = res["quantized"]
    assert q["format"] == "fp8" and q["shape"] == "deepseek_v3"
    assert q["byte_ratio"] == q["bf16_expert_bytes"] / q["expert_bytes"]
    assert 1.9 < q["byte_ratio"] < 2.0  # a byte a weight and 4 per 128x128 block, against 2
    # the limit's fraction and the checkpoint the peer loads are the bf16 twin's
    assert res["model"]["checkpoint_bytes"] == q["bf16_checkpoint_bytes"]
    row = q["modes"]["expert"]
    assert row["target_tokens_per_s"] == pytest.approx(
        0.8 * q["byte_ratio"] * res["systems"]["expert bf16"]["decode_tokens_per_s"])
    # the compact store read fewer expert bytes than its twin for the same tokens
    assert res["systems"]["expert"]["bytes_read"] < res["systems"]["expert bf16"]["bytes_read"]


def test_quantized_options_are_checked() -> None:
    runner = CliRunner()
    got = runner.invoke(bench, ["infer", "--quantized", "fp8"])
    assert got.exit_code == 2 and "--quantized applies to" in got.output
    got = runner.invoke(bench, ["infer", "--peer", "accelerate", "--quantized", "fp8",
                                "--hidden", "200"])
    assert got.exit_code == 2 and "multiples of 128" in got.output
    got = runner.invoke(bench, ["infer", "--peer", "accelerate", "--quantized", "mxfp4",
                                "--model-dir", "."])
    assert got.exit_code == 2 and "--quantized writes its own" in got.output


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dequant_bench_checks_both_functions_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    from tierstore.bench import dequant

    # The shipped models' shapes take seconds on 2 cores; the comparison is per code.
    monkeypatch.setattr(dequant, "SHAPES", {"mxfp4": ("mxfp4", 256, 128),
                                            "fp8": ("fp8", 256, 128)})
    out = tmp_path / "d.json"
    res = dequant.run_dequant(repeats=1, device=device, workdir=str(tmp_path),
                              json_out=str(out), echo=lambda _: None)
    assert res["device"].startswith(device) and json.loads(out.read_text())["shapes"]
    for name, row in res["shapes"].items():
        assert row["bit_equal"] is True, name
        assert row["compact_bytes"] < row["bf16_bytes"] and row["transfer_s"] > 0
