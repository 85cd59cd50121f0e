"""``tierstore import-hf``: layouts (per-expert, fused, transposed fused, sharded), what the
store holds afterwards, and the errors for directories it cannot import."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_hf_models import ATOL, SENTENCES, make_hf_model, prompt_ids
from tierstore.trainer.infer.hf_config import SUPPORTED_FAMILIES
from tierstore.trainer.infer.hf_import import import_hf
from tierstore.trainer.infer.loading import load_model, load_tokenizer, model_info, tokenizer_files
from tierstore.trainer.infer.sources import ResidentSource
from tierstore.trainer.model import expert_names

import tierstore
from tierstore.cli import main

pytest.importorskip("transformers")


def _logits_match(hf, store_path: Path) -> None:
    with tierstore.open(store_path) as store:
        model = load_model(store, "cpu", torch.float32)
        ids = prompt_ids(2, 10, model.cfg.vocab_size)
        torch.testing.assert_close(model(ids, ResidentSource(store, model)), hf(ids).logits,
                                   atol=ATOL, rtol=0)


def test_store_contents(tmp_path: Path) -> None:
    hf = make_hf_model("qwen2_moe", tmp_path / "hf")
    with open(tmp_path / "hf" / "generation_config.json") as f:
        gen = json.load(f)
    gen["eos_token_id"] = [2, 7]
    with open(tmp_path / "hf" / "generation_config.json", "w") as f:
        json.dump(gen, f)
    info = import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    assert info["family"] == "qwen2_moe"
    assert "tokenizer.json" in info["tokenizer"] and "generation_config.json" in info["tokenizer"]
    with tierstore.open(tmp_path / "st") as store:
        stored = model_info(store)
        assert stored["hf_config"]["model_type"] == "qwen2_moe"
        assert stored["config"]["eos_token_ids"] == [2, 7]
        assert stored["dense_prefix"] == "dense."
        files = tokenizer_files(store)
        assert files["tokenizer.json"] == (tmp_path / "hf" / "tokenizer.json").read_bytes()
        tok = load_tokenizer(store)
        assert tok is not None and tok.decode(tok.encode(SENTENCES[1]).ids) == SENTENCES[1]
        # Experts: exactly the MoE layers' experts, each as the checkpoint holds it.
        cfg = load_model(store, "cpu").cfg
        layers = {int(n.split(".")[1]) for n in store.names("layers.")}
        assert layers == set(cfg.moe_layers) == {0, 2}
        assert len(store.names("layers.")) == 2 * 6 * 3
        sd = hf.state_dict()
        for layer in cfg.moe_layers:
            for e in (0, 5):
                w1, w2, w3 = (store.get(n) for n in expert_names(layer, e))
                gate_up = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
                torch.testing.assert_close(w1, gate_up[:24], atol=0, rtol=0)
                torch.testing.assert_close(w3, gate_up[24:], atol=0, rtol=0)
                torch.testing.assert_close(
                    w2, sd[f"model.layers.{layer}.mlp.experts.down_proj"][e], atol=0, rtol=0)
        assert not any(".experts." in n for n in store.names("dense."))
        assert "dense.layers.0.shared.w1" in store.names("dense.")
        assert "dense.layers.1.mlp.w1" in store.names("dense.")


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = make_hf_model("mixtral", tmp_path / "hf", max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").exists()
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    _logits_match(hf, tmp_path / "st")


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_fused_transposed_layout(tmp_path: Path, family: str) -> None:
    """Fused experts stored [E, hidden, 2*ffn] / [E, ffn, hidden] (input-major)."""
    from safetensors.torch import load_file, save_file

    hf = make_hf_model(family, tmp_path / "hf", save_original_format=False)
    path = tmp_path / "hf" / "model.safetensors"
    sd = load_file(path)
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    sd = {k: v.transpose(1, 2).contiguous() if k.endswith(("gate_up_proj", "down_proj"))
          and v.dim() == 3 else v for k, v in sd.items()}
    save_file(sd, path, metadata={"format": "pt"})
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    _logits_match(hf, tmp_path / "st")


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path: Path) -> None:
    hf = make_hf_model("mixtral", tmp_path / "hf")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    with tierstore.open(tmp_path / "st") as store:
        assert store.get(expert_names(0, 0)[0]).dtype == torch.bfloat16
        model = load_model(store, "cpu")
        assert model.dtype == torch.bfloat16 and model.cfg.dtype == "bfloat16"
        ids = prompt_ids(1, 6, model.cfg.vocab_size)
        out = model(ids, ResidentSource(store, model))
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        with torch.no_grad():
            ref = hf(ids).logits.float()
        # bf16 end to end: close to transformers' bf16 forward, not equal.
        assert (out - ref).abs().max() < 0.1 * ref.abs().max()


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
    (empty / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    out = _cli_error(tmp_path, empty)
    assert "LlamaForCausalLM" in out and all(f in out for f in SUPPORTED_FAMILIES)
    (empty / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert "config.json lacks" in _cli_error(tmp_path, empty)
    # A supported config without weights.
    make_hf_model("mixtral", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    assert "no *.safetensors" in _cli_error(tmp_path, tmp_path / "hf")
    # Garbled weights.
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "unreadable safetensors" in _cli_error(tmp_path, tmp_path / "hf")
    # Nothing was written for any of these.
    assert not (tmp_path / "st-err").exists()


def test_load_model_on_a_store_without_model(tmp_path: Path) -> None:
    with tierstore.open(tmp_path / "st", create=True) as store, \
            pytest.raises(tierstore.StoreError, match="holds no model"):
        load_model(store, "cpu")


KILL_AFTER = r"""
import os, signal, sys
from tierstore.trainer.infer.hf_import import import_hf
calls = [0]
def progress(n):  # called once an expert's put_many has returned
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
import_hf(sys.argv[1], sys.argv[2], progress=progress)
"""


def test_import_killed_part_way_resumes(tmp_path: Path) -> None:
    """An import SIGKILLed after five experts keeps those five (each committed with its
    three tensors); a plain import into that store is refused with a pointer to --resume,
    a resume from another checkpoint is refused, and --resume keeps the five as they are,
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
        kept = {n: store.info(n).version for n in store.names("layers.")}
        assert ("model.json", "meta") not in store
    assert len(kept) == 5 * 3  # whole experts only
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
        assert len(store.names("layers.")) == 3 * 6 * 3
        assert ("import.json", "meta") not in store
    _logits_match(hf, st)
