"""``tierstore export-hf``: tiny random checkpoints of every supported family, imported and
exported again, load in ``transformers`` and compute our logits (1e-5); the export holds the
checkpoint's own tensors under their own names (per-expert, fused, transposed fused), and
importing it gives back the same store entries. A ``tierstore train`` run exports as Mixtral
or Qwen2-MoE and computes what the run computes. Errors are one line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from test_hf_models import SENTENCES, make_hf_model, prompt_ids
from tierstore.trainer.infer.hf_export import HFExportError, export_hf, trainer_hf_config
from tierstore.trainer.infer.hf_import import import_hf
from tierstore.trainer.infer.loading import MODEL_ENTRY, json_entry, load_model, model_info
from tierstore.trainer.infer.sources import ResidentSource
from tierstore.trainer.model import ModelConfig, MoEModel
from tierstore.trainer.presets import PRESETS, MoEConfig

import tierstore
from tierstore.cli import main

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe"]


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def store_entries(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    with tierstore.open(path) as store:
        keys = store.keys()
        return {k: store.get(*k) for k in keys}


def ours(store_path: Path, ids: torch.Tensor) -> torch.Tensor:
    with tierstore.open(store_path) as store:
        model = load_model(store, "cpu", torch.float32)
        return model(ids, ResidentSource(store, model))


def theirs(model_dir: Path, ids: torch.Tensor, **kw: Any) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              **kw)
    with torch.no_grad():
        return model(ids).logits


def export_cli(*args: str, code: int = 0) -> str:
    r = CliRunner().invoke(main, ["export-hf", *args])
    assert r.exit_code == code, r.output
    return r.output


def check_round_trip(tmp_path: Path, family: str, **kw: Any) -> None:
    """Import, export (small shards: several files and the index), then: the same tensors
    under the same names as the original files, the same config.json, transformers' logits
    equal to ours, and an import of the export equal to the first store, entry by entry."""
    make_hf_model(family, tmp_path / "hf", **kw)
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    out = export_cli(str(tmp_path / "out"), "--store", str(tmp_path / "st"), "--shard-size",
                     "40KB")
    assert f"exported {family} as {family}" in out
    files = os.listdir(tmp_path / "out")
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    original, exported = read_checkpoint(tmp_path / "hf"), read_checkpoint(tmp_path / "out")
    assert sorted(exported) == sorted(original) == sorted(index["weight_map"])
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    assert (json.loads((tmp_path / "out" / "config.json").read_text())
            == json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert ((tmp_path / "out" / "tokenizer.json").read_bytes()
            == (tmp_path / "hf" / "tokenizer.json").read_bytes())
    ids = prompt_ids(2, 12, 160)
    torch.testing.assert_close(theirs(tmp_path / "out", ids), ours(tmp_path / "st", ids),
                               atol=ATOL, rtol=0)
    import_hf(tmp_path / "out", tmp_path / "st2", progress=False)
    first, second = store_entries(tmp_path / "st"), store_entries(tmp_path / "st2")
    assert sorted(first) == sorted(second)
    for key, t in first.items():
        assert second[key].dtype == t.dtype and torch.equal(second[key], t), key


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_per_expert(tmp_path: Path, family: str) -> None:
    """save_pretrained's default layout: one tensor per expert weight (Mixtral's w1/w2/w3,
    the others' gate_proj/up_proj/down_proj)."""
    check_round_trip(tmp_path, family)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_round_trip_fused(tmp_path: Path, family: str) -> None:
    """transformers 5's own layout: experts fused into [E, 2*ffn, hidden] and
    [E, hidden, ffn] tensors; the export writes them fused again."""
    check_round_trip(tmp_path, family, save_original_format=False)


def test_round_trip_fused_transposed(tmp_path: Path) -> None:
    """Fused experts stored input-major ([E, hidden, 2*ffn], [E, ffn, hidden]) go back so."""
    from safetensors.torch import load_file, save_file

    make_hf_model("olmoe", tmp_path / "hf", save_original_format=False)
    path = tmp_path / "hf" / "model.safetensors"
    sd = {k: v.transpose(1, 2).contiguous() if v.dim() == 3 else v
          for k, v in load_file(path).items()}
    save_file(sd, path, metadata={"format": "pt"})
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    export_hf(tmp_path / "st", tmp_path / "out", progress=False)
    exported = read_checkpoint(tmp_path / "out")
    assert sorted(exported) == sorted(sd)
    for name, t in sd.items():
        assert torch.equal(exported[name], t), name
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 32, 96)
    import_hf(tmp_path / "out", tmp_path / "st2", progress=False)
    a, b = store_entries(tmp_path / "st"), store_entries(tmp_path / "st2")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_dtypes(tmp_path: Path) -> None:
    """A bf16 checkpoint exports in bf16 unless asked otherwise; --dtype casts every tensor
    and config.json says so; a progress callable sees every byte written."""
    hf = make_hf_model("mixtral", tmp_path / "hf")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    seen: list[int] = []
    s = export_hf(tmp_path / "st", tmp_path / "bf16", progress=seen.append)
    assert s["dtype"] == "bfloat16" and sum(seen) == s["bytes"]
    original = read_checkpoint(tmp_path / "hf")
    exported = read_checkpoint(tmp_path / "bf16")
    assert all(t.dtype == torch.bfloat16 and torch.equal(exported[n], t)
               for n, t in original.items())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    for flag, dt in (("fp32", torch.float32), ("fp16", torch.float16)):
        export_cli(str(tmp_path / flag), "--store", str(tmp_path / "st"), "--dtype", flag)
        exported = read_checkpoint(tmp_path / flag)
        assert all(exported[n].dtype == dt and torch.equal(exported[n], t.to(dt))
                   for n, t in original.items())
        cfg = json.loads((tmp_path / flag / "config.json").read_text())
        assert cfg["dtype"] == str(dt).removeprefix("torch.")
    ids = prompt_ids(2, 8, 160)
    # fp32 of bf16 values: exactly the bf16 weights, computed in fp32 on both sides.
    with tierstore.open(tmp_path / "st") as store:
        model = load_model(store, "cpu", torch.float32)
        mine = model(ids, ResidentSource(store, model))
    torch.testing.assert_close(theirs(tmp_path / "fp32", ids), mine, atol=ATOL, rtol=0)


def test_store_imported_without_a_layout(tmp_path: Path) -> None:
    """A store whose model.json predates recorded layouts exports in the per-expert layout
    save_pretrained writes by default, and still computes the same logits."""
    make_hf_model("qwen2_moe", tmp_path / "hf", save_original_format=False)
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    with tierstore.open(tmp_path / "st") as store:
        info = model_info(store)
        del info["hf_layout"]
        store.put(MODEL_ENTRY[0], json_entry(info), kind=MODEL_ENTRY[1])
    export_hf(tmp_path / "st", tmp_path / "out", progress=False)
    names = set(read_checkpoint(tmp_path / "out"))
    assert "model.layers.0.mlp.experts.5.gate_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    ids = prompt_ids(2, 10, 160)
    torch.testing.assert_close(theirs(tmp_path / "out", ids), ours(tmp_path / "st", ids),
                               atol=ATOL, rtol=0)


def _corpus(tmp_path: Path) -> Path:
    words = " ".join(SENTENCES).split()
    g = torch.Generator().manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(len(words), (6000,), generator=g).tolist())
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(text)
    return tmp_path / "corpus"


def check_trainer_export(run: Path, out: Path, arch: str, cfg: MoEConfig) -> None:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    got = theirs(out, ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == arch
    torch.testing.assert_close(got, ours(run, ids), atol=ATOL, rtol=0)
    # The trained values were written, not the initial ones.
    sd = read_checkpoint(out)
    initial = MoEModel(cfg, seed=0)
    assert not torch.equal(sd["model.embed_tokens.weight"], initial.tok_emb.weight)
    layer = cfg.moe_layers[0]
    w1 = next(t for n, t in sd.items() if n.startswith(f"model.layers.{layer}.")
              and ".experts.0." in n and n.endswith(("w1.weight", "gate_proj.weight")))
    assert w1.shape == initial.layers[layer].experts[0].w1.shape
    assert not torch.equal(w1, initial.layers[layer].experts[0].w1)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "héllo, wörld"
    assert tok(text)["input_ids"] == list(text.encode())
    assert tok.decode(list(text.encode())) == text


def test_trainer_run_exports_as_mixtral(tmp_path: Path) -> None:
    """`tierstore train` (every layer MoE), then `tierstore export-hf`: MixtralForCausalLM
    with our logits, a byte-level tokenizer, and an import of it that computes the same."""
    r = CliRunner().invoke(main, [
        "train", "--store", str(tmp_path / "run"), "--model", "tiny", "--steps", "2",
        "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--device", "cpu",
        "--host-cache", "64MiB", "--corpus", str(_corpus(tmp_path))])
    assert r.exit_code == 0, r.output
    out = export_cli(str(tmp_path / "out"), "--store", str(tmp_path / "run"))
    assert "exported tierstore as mixtral" in out
    check_trainer_export(tmp_path / "run", tmp_path / "out", "MixtralForCausalLM",
                         PRESETS["tiny"])
    import_hf(tmp_path / "out", tmp_path / "again", progress=False)
    ids = prompt_ids(1, 16, 256)
    torch.testing.assert_close(ours(tmp_path / "again", ids), ours(tmp_path / "run", ids),
                               atol=ATOL, rtol=0)


def test_trainer_run_with_dense_layers_exports_as_qwen2_moe(tmp_path: Path) -> None:
    """A run with a dense layer between MoE layers: Qwen2-MoE, the dense layers as
    mlp_only_layers and a shared expert of zeros."""
    from tierstore.trainer.train.resident import TrainConfig
    from tierstore.trainer.train.store_trainer import train_store

    cfg = MoEConfig(d_model=32, n_layers=4, n_heads=4, d_ff=48, d_ff_dense=40, n_experts=4,
                    top_k=2, moe_every=2, max_seq_len=64)
    train_store(cfg, 2, 0, TrainConfig(batch_size=2, seq_len=32, eval_every=0),
                store_path=str(tmp_path / "run"), host_cache="64MiB",
                corpus_paths=[str(_corpus(tmp_path))], device="cpu")
    s = export_hf(tmp_path / "run", tmp_path / "out", progress=False)
    assert (s["source"], s["family"], s["dtype"]) == ("tierstore", "qwen2_moe", "float32")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["mlp_only_layers"] == [0, 2] and hf["intermediate_size"] == 40
    zeros = read_checkpoint(tmp_path / "out")["model.layers.1.mlp.shared_expert.down_proj.weight"]
    assert not zeros.any()
    check_trainer_export(tmp_path / "run", tmp_path / "out", "Qwen2MoeForCausalLM", cfg)


def test_trainer_config_mapping_is_checked() -> None:
    """A feature neither Mixtral nor Qwen2-MoE has is named, not silently dropped."""
    base = MoEConfig(d_model=32, n_layers=2, n_heads=4, d_ff=48, n_experts=4).model_config()
    hf, zeros = trainer_hf_config(base, "float32")
    assert hf["model_type"] == "mixtral" and not zeros
    for change, field in (({"qk_norm": "head"}, "qk_norm"),
                          ({"sliding_windows": (16, 16)}, "sliding_windows"),
                          ({"o_bias": True}, "o_bias")):
        cfg = ModelConfig.from_dict({**base.to_dict(), **change})
        with pytest.raises(HFExportError, match=f"no exact transformers counterpart: {field}"):
            trainer_hf_config(cfg, "float32")


def test_out_dir_and_errors(tmp_path: Path) -> None:
    """One-line errors; a non-empty OUT_DIR only with --force, whose stale weight files go;
    an interrupted export leaves nothing behind."""
    make_hf_model("olmoe", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    tierstore.open(tmp_path / "empty", create=True).close()
    for args, what in (([str(tmp_path / "o"), "--store", str(tmp_path / "missing")],
                        "no such store"),
                       ([str(tmp_path / "o"), "--store", str(tmp_path / "empty")],
                        "holds no model"),
                       ([str(tmp_path / "hf"), "--store", str(tmp_path / "st")],
                        "not empty; pass --force")):
        out = export_cli(*args, code=2)
        assert what in out and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "o").exists()
    # --force into the original checkpoint's directory: its model.safetensors (which
    # transformers would load instead of the index) is replaced by the export's shards.
    export_cli(str(tmp_path / "hf"), "--store", str(tmp_path / "st"), "--force")
    files = os.listdir(tmp_path / "hf")
    assert "model.safetensors" not in files and "model-00001-of-00001.safetensors" in files
    ids = prompt_ids(1, 8, 160)
    torch.testing.assert_close(theirs(tmp_path / "hf", ids), ours(tmp_path / "st", ids),
                               atol=ATOL, rtol=0)

    def interrupt(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_hf(tmp_path / "st", tmp_path / "cut", progress=interrupt)
    assert not (tmp_path / "cut").exists()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".export-hf")]
    assert "export-hf" in CliRunner().invoke(main, ["--help"]).output
    assert "--shard-size" in export_cli("--help")


# An export that stops for good once it has begun writing: it says so, then waits to be
# killed (its hidden directory made and locked, its process alive).
STUCK_EXPORT = r"""
import os, sys, time
from tierstore.trainer.infer.hf_export import export_hf

def stop(n):
    os.write(1, b"writing\n")
    time.sleep(3600)

export_hf(sys.argv[1], sys.argv[2], progress=stop)
"""


def test_an_export_removes_what_killed_exports_left(tmp_path: Path) -> None:
    """A SIGKILLed export leaves its hidden directory; the next export into the same
    directory removes it, while a live export's directory is left alone."""
    import shutil
    import signal
    import subprocess
    import sys

    make_hf_model("mixtral", tmp_path / "hf")
    tierstore.open(tmp_path / "a", create=True, slab_size="8MiB").close()
    import_hf(tmp_path / "hf", tmp_path / "a", progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # a stuck export keeps its store open
    out = tmp_path / "out"
    out.mkdir()
    (out / ".notes").mkdir()  # not an export's
    child = subprocess.Popen([sys.executable, "-c", STUCK_EXPORT, str(tmp_path / "a"),
                              str(out / "m1")], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"writing\n"

        def hidden() -> list[str]:
            return sorted(f for f in os.listdir(out) if f.endswith(".export-hf"))

        live = hidden()
        assert len(live) == 1 and live[0].startswith(f".m1.{child.pid}.")
        export_hf(tmp_path / "b", out / "m2", progress=False)
        assert hidden() == live  # a live export's
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert hidden() == live  # left behind by the kill
    export_cli(str(out / "m3"), "--store", str(tmp_path / "b"))
    assert hidden() == []
    assert sorted(os.listdir(out)) == [".notes", "m2", "m3"]


def test_finetuned_bf16_checkpoint_exports_its_fp32_masters(tmp_path: Path) -> None:
    """A bf16 checkpoint fine-tuned with `tierstore train` keeps fp32 masters in the store;
    the export writes them cast to bf16 by default, exactly with --dtype fp32, and what it
    writes is the trained model, not the imported one."""
    hf = make_hf_model("mixtral", tmp_path / "hf")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "st", progress=False)
    r = CliRunner().invoke(main, [
        "train", "--store", str(tmp_path / "st"), "--steps", "2", "--batch-size", "2",
        "--seq-len", "16", "--eval-every", "0", "--device", "cpu", "--host-cache", "64MiB",
        "--corpus", str(_corpus(tmp_path))])
    assert r.exit_code == 0, r.output
    export_cli(str(tmp_path / "bf16"), "--store", str(tmp_path / "st"))
    export_cli(str(tmp_path / "fp32"), "--store", str(tmp_path / "st"), "--dtype", "fp32")
    original = read_checkpoint(tmp_path / "hf")
    bf16, fp32 = read_checkpoint(tmp_path / "bf16"), read_checkpoint(tmp_path / "fp32")
    assert sorted(bf16) == sorted(fp32) == sorted(original)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(t.dtype == torch.float32 for t in fp32.values())
    assert all(torch.equal(bf16[n], fp32[n].to(torch.bfloat16)) for n in original)
    # Training moved the fp32 masters off the bf16 grid: the fp32 export is not the import.
    changed = [n for n in original if not torch.equal(fp32[n], original[n].float())]
    assert any(".experts." in n for n in changed) and "model.embed_tokens.weight" in changed
    with tierstore.open(tmp_path / "st") as store:
        w1 = store.get("layers.0.experts.0.w1")
        assert w1.dtype == torch.float32
        assert torch.equal(fp32["model.layers.0.block_sparse_moe.experts.0.w1.weight"], w1)
    ids = prompt_ids(2, 10, 160)
    torch.testing.assert_close(theirs(tmp_path / "fp32", ids), ours(tmp_path / "st", ids),
                               atol=ATOL, rtol=0)
