"""`tierstore bench infer --peer llamacpp`: the option checks (everywhere), and, where
llama-cpp-python is installed (the `llamacpp` extra; CI does not install it), the study on a
tiny Mixtral saved with ``transformers``: llama.cpp's own converter to GGUF F32, llama.cpp's
run in a fresh process beside every tierstore mode, all giving transformers' greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tierstore.bench.commands import bench
from tierstore.bench.hf_models import write_hf_checkpoint
from tierstore.bench.llamacpp import RUNNER, converted, missing
from tierstore.bench.peers import TIERSTORE_MODES

NEW = 5


def test_llamacpp_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    got = runner.invoke(bench, ["infer", "--peer", "llamacpp", "--store", "."])
    assert got.exit_code == 2 and "not --store" in got.output
    got = runner.invoke(bench, ["infer", "--peer", "llamacpp", "--vocab", "100"])
    assert got.exit_code == 2 and "--vocab of at least" in got.output
    # Without llama-cpp-python (None in sys.modules: Python's own "cannot be imported"):
    # one line naming it and the extra, exit status 2, before any checkpoint is written.
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    got = runner.invoke(bench, ["infer", "--peer", "llamacpp", "--layers", "1"])
    assert got.exit_code == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "llama-cpp-python" in lines[0], got.stderr
    assert "tierstore[llamacpp]" in lines[0] and "minutes" in lines[0]
    # The runner refuses a missing model file with one line, before it imports llama.cpp.
    proc = subprocess.run([sys.executable, str(RUNNER), "run", "--gguf", "/nonexistent.gguf",
                           "--prompt-ids", "1,2", "--max-new-tokens", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["llamacpp_run.py: no such file: "
                                                "/nonexistent.gguf"]


@pytest.mark.skipif(missing() is not None, reason=str(missing()))
def test_llamacpp_and_every_mode_give_transformers_tokens(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    write_hf_checkpoint(str(hf), "mixtral", layers=2, experts=4, hidden=64, ffn=128,
                        vocab=320, seed=3)
    out = tmp_path / "peer.json"
    result = CliRunner().invoke(bench, [
        "infer", "--peer", "llamacpp", "--model-dir", str(hf), "--prefill-len", "8",
        "--decode-tokens", str(NEW), "--rounds", "1", "--warm", "--json", str(out)])
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    model = transformers_model(hf)
    ids = torch.tensor([res["prompt"]])
    want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
    runs = res["runs"]
    assert sorted(r["system"] for r in runs) == sorted(["llamacpp", *TIERSTORE_MODES])
    for r in runs:
        assert r["ok"], (r["system"], r["outcome"], r["stderr_tail"])
        assert r["tokens"] == want, r["system"]
        assert "--threads 1" in r["command"]  # the study's default with this peer, every run
        assert r["cold_start_s"] == pytest.approx(r["wall_s"] - r["prefill_s"] - r["decode_s"])
        assert 0 < r["cold_start_s"] < r["wall_s"]
    assert res["threads"] == 1
    assert res["tokens_equal"] and res["reference_system"] == "resident"
    # the checkpoint as llama.cpp's converter wrote it: F32 tensors only, cached beside it
    g = res["gguf"]
    assert g["architecture"] == "llama" and set(g["tensor_types"]) == {"F32"}
    assert g["made_up_tokenizer"] and not g["cached"]
    assert Path(g["path"]).parent == hf / "gguf"
    again = converted(str(hf), str(tmp_path), echo=lambda _: None)
    assert again["cached"] and again["path"] == g["path"]
    llama = next(r for r in runs if r["system"] == "llamacpp")
    assert llama["llama_cpp"] and llama["bytes_read_generating"] >= 0
    assert llama["bytes_read"] >= llama["bytes_read_generating"]
    peer = res["systems"]["llamacpp"]
    for name, s in res["systems"].items():
        assert s["completed"] == 1
        for phase in ("prefill", "decode"):
            assert s[f"{phase}_vs_llamacpp"] == pytest.approx(
                s[f"{phase}_tokens_per_s"] / peer[f"{phase}_tokens_per_s"]), name
        assert s["cold_start_vs_llamacpp"] == pytest.approx(s["cold_start_s"] / peer["cold_start_s"])
    assert "tokens equal across every completed run: True" in result.output


def transformers_model(path: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
