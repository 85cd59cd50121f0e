"""``tierstore import-hf``: what the store holds afterwards, checkpoints in other layouts
(sharded, fused, transposed), the dtype kept, interruptions resumed, and the errors for
directories it cannot import. (Every family round-trips in ``test_hf_backend.py``.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hf_models import ATOL, SENTENCES, make_hf_model, prompt_ids
from tierstore.hf import import_hf, load
from tierstore.hf.layout import MODEL_ENTRY, read_json_entry
from tierstore.hf.tokenizer import load_tokenizer, tokenizer_files

import tierstore
from tierstore.cli import main

pytest.importorskip("transformers")


def _logits_match(hf: Any, store_path: Path) -> None:
    model = load(store_path, mode="resident", device="cpu", dtype=torch.float32)
    try:
        ids = prompt_ids(2, 10, model.config.vocab_size)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)
    finally:
        model.tierstore.close()


def test_store_contents(tmp_path: Path) -> None:
    hf = make_hf_model("qwen2_moe", tmp_path / "hf")
    with open(tmp_path / "hf" / "generation_config.json") as f:
        gen = json.load(f)
    gen["eos_token_id"] = [2, 7]
    with open(tmp_path / "hf" / "generation_config.json", "w") as f:
        json.dump(gen, f)
    info = import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    assert info["family"] == "qwen2_moe" and info["format"] == 2
    assert "tokenizer.json" in info["tokenizer"] and "generation_config.json" in info["tokenizer"]
    with tierstore.open(tmp_path / "st") as store:
        stored = read_json_entry(store, *MODEL_ENTRY)
        assert stored["hf_config"]["model_type"] == "qwen2_moe"
        assert stored["generation_config"]["eos_token_id"] == [2, 7]
        files = tokenizer_files(store)
        assert files["tokenizer.json"] == (tmp_path / "hf" / "tokenizer.json").read_bytes()
        tok = load_tokenizer(store)
        assert tok is not None and tok.decode(tok.encode(SENTENCES[1]).ids) == SENTENCES[1]
        # Experts: each expert's slice of each fused parameter, as transformers holds it,
        # in the MoE layers only (layer 1 is dense: mlp_only_layers).
        modules = [m["module"] for m in stored["experts"]]
        assert modules == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
        sd = hf.state_dict()
        experts = [n for n in store.names("model.layers.")]
        assert len(experts) == 2 * 6 * 2
        for module in modules:
            for e in (0, 5):
                for attr in ("gate_up_proj", "down_proj"):
                    torch.testing.assert_close(store.get(f"{module}.{e}.{attr}"),
                                               sd[f"{module}.{attr}"][e], atol=0, rtol=0)
        dense = store.names("dense.")
        assert not any(".experts." in n for n in dense)
        assert "dense.model.layers.0.mlp.shared_expert.gate_proj.weight" in dense
        assert "dense.model.layers.1.mlp.gate_proj.weight" in dense
    model = load(tmp_path / "st", device="cpu")
    try:
        assert model.generation_config.eos_token_id == [2, 7]
        assert type(model).__name__ == "Qwen2MoeForCausalLM"
    finally:
        model.tierstore.close()


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = make_hf_model("mixtral", tmp_path / "hf", max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").exists()
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    _logits_match(hf, tmp_path / "st")


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_fused_checkpoints_import_one_expert_at_a_time(tmp_path: Path, family: str) -> None:
    """A checkpoint saved in transformers' own fused layout ([E, 2*ffn, hidden]) is read one
    expert's slice at a time and stored per expert, as a per-expert checkpoint would be."""
    from safetensors.torch import load_file

    hf = make_hf_model(family, tmp_path / "hf", save_original_format=False)
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    with tierstore.open(tmp_path / "st") as store:
        name = next(n for n in store.names("model.layers.") if n.endswith(".3.gate_up_proj"))
        torch.testing.assert_close(store.get(name), sd[name.replace(".3.", ".")][3])
    _logits_match(hf, tmp_path / "st")


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path: Path) -> None:
    hf = make_hf_model("mixtral", tmp_path / "hf")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    with tierstore.open(tmp_path / "st") as store:
        name = next(iter(store.names("model.layers.0.mlp.experts.0.")))
        assert store.get(name).dtype == torch.bfloat16
    model = load(tmp_path / "st", device="cpu", mode="on-demand")
    try:
        assert model.dtype == torch.bfloat16
        ids = prompt_ids(1, 6, model.config.vocab_size)
        with torch.no_grad():
            out = model(ids).logits.float()
            ref = hf(ids).logits.float()
        assert torch.isfinite(out).all()
        # bf16 end to end, through another experts implementation: close, not equal.
        assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    finally:
        model.tierstore.close()


def test_cli_import_hf(tmp_path: Path) -> None:
    make_hf_model("olmoe", tmp_path / "hf")
    r = CliRunner().invoke(main, ["import-hf", str(tmp_path / "hf"), "--store",
                                  str(tmp_path / "st")])
    assert r.exit_code == 0, r.output
    assert "imported olmoe" in r.output
    # A second import into the same store is refused in one line.
    r = CliRunner().invoke(main, ["import-hf", str(tmp_path / "hf"), "--store",
                                  str(tmp_path / "st")])
    assert r.exit_code == 2 and "already holds a model" in r.output
    assert "import-hf" in CliRunner().invoke(main, ["--help"]).output
    r = CliRunner().invoke(main, ["import-hf", "--list"])
    assert r.exit_code == 0 and "deepseek_v3" in r.output and "mixtral" in r.output


def _cli_error(tmp_path: Path, model_dir: Path, store: Path | None = None,
               *extra: str) -> str:
    r = CliRunner().invoke(main, ["import-hf", str(model_dir), "--store",
                                  str(store or tmp_path / "st-err"), *extra])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    return r.output


def test_errors(tmp_path: Path) -> None:
    assert "no such model directory" in _cli_error(tmp_path, tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in _cli_error(tmp_path, empty)
    (empty / "config.json").write_text("{not json")
    assert "unreadable config" in _cli_error(tmp_path, empty)
    (empty / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    assert "no model_type" in _cli_error(tmp_path, empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "not-a-family"}))
    assert "not a family the installed transformers knows" in _cli_error(tmp_path, empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "no *.safetensors" in _cli_error(tmp_path, empty)
    # A dense family: no experts to store.
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(empty / "model.safetensors"))
    assert "no mixture-of-experts layers" in _cli_error(tmp_path, empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "mixtral",
                                                   "num_hidden_layers": 10 ** 9}))
    assert "num_hidden_layers" in _cli_error(tmp_path, empty)
    # A supported config without weights.
    make_hf_model("mixtral", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    assert "no *.safetensors" in _cli_error(tmp_path, tmp_path / "hf")
    # Garbled weights.
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "unreadable safetensors" in _cli_error(tmp_path, tmp_path / "hf")
    # Nothing was written for any of these.
    assert not (tmp_path / "st-err").exists()


def test_checkpoint_that_does_not_fit_its_config(tmp_path: Path) -> None:
    """Shapes and dtypes are checked against the model the config builds, through the
    conversion, before anything is written; each misfit is one line naming the tensor."""
    from safetensors.torch import load_file, save_file

    make_hf_model("mixtral", tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    good = load_file(path)
    w1 = "model.layers.0.mlp.experts.3.gate_proj.weight"
    if w1 not in good:  # the checkpoint's own per-expert names
        w1 = next(k for k in good if ".experts.3." in k and "w1" in k)
    cases = {
        "shape": {**good, w1: good[w1][:-1]},
        "int32": {**good, w1: good[w1].to(torch.int32)},
        "missing": {k: v for k, v in good.items() if k != w1},
    }
    for what, sd in cases.items():
        save_file(sd, path, metadata={"format": "pt"})
        out = _cli_error(tmp_path, tmp_path / "hf")
        assert "Traceback" not in out, what
        if what == "missing":
            assert "lacks expert 3" in out, out
        else:
            assert w1 in out or "expert" in out, out
    assert not (tmp_path / "st-err").exists()


KILL_AFTER = r"""
import os, signal, sys
from tierstore.hf import import_hf
calls = [0]
def progress(n):  # called once an expert's put_many has returned
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
import_hf(sys.argv[1], sys.argv[2], progress=progress)
"""


def test_import_killed_part_way_resumes(tmp_path: Path) -> None:
    """An import SIGKILLed after five experts keeps those five (each committed with its
    tensors); a plain import into that store is refused with a pointer to --resume, a
    resume from another checkpoint is refused, and --resume keeps the five as they are,
    imports the rest and yields the model transformers computes."""
    import shutil
    import subprocess
    import sys

    hf = make_hf_model("mixtral", tmp_path / "hf")
    st = tmp_path / "st"
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", KILL_AFTER, str(tmp_path / "hf"), str(st), "5"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr
    with tierstore.open(st) as store:
        kept = {n: store.info(n).version for n in store.names("model.layers.")}
        assert MODEL_ENTRY not in store
    assert len(kept) == 5 * 2  # whole experts only: gate_up_proj and down_proj each
    out = _cli_error(tmp_path, tmp_path / "hf", st)
    assert "interrupted import" in out and "--resume" in out
    other = tmp_path / "hf-other"
    shutil.copytree(tmp_path / "hf", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-5) * 2
    (other / "config.json").write_text(json.dumps(cfg))
    out = _cli_error(tmp_path, other, st, "--resume")
    assert "another checkpoint" in out
    r = CliRunner().invoke(main, ["import-hf", str(tmp_path / "hf"), "--store", str(st),
                                  "--resume"])
    assert r.exit_code == 0, r.output
    with tierstore.open(st) as store:
        assert {n: store.info(n).version for n in kept} == kept  # not written again
        assert len(store.names("model.layers.")) == 3 * 6 * 2
        assert ("import.json", "meta") not in store
    _logits_match(hf, st)
