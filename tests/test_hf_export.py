"""``tierstore export-hf``: a store's model written back as the checkpoint ``save_pretrained``
writes for its family, through ``transformers``' reverse conversion mapping.

For tiny random checkpoints of MoE families (:mod:`hf_tiny`; every family the installed
``transformers`` serves with ``TIERSTORE_EXPORT_FAMILIES=all``): import, export (small
shards), then the export holds the original tensors bit for bit under the original names,
``from_pretrained`` of it computes the original logits, every experts module was converted
one expert at a time, and ``import-hf`` of it gives the same entries. A trainer run exports
as Mixtral or Qwen2-MoE and computes the trainer model's logits. Then dtypes, shards,
one-line errors, and the leftovers of a SIGKILLed export.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

import tierstore.hf as th  # noqa: E402
from hf_tiny import TinyUnavailable, tiny_checkpoint, tiny_config  # noqa: E402
from tierstore.hf.exporter import HFExportError, export_hf, plan_export  # noqa: E402

import tierstore  # noqa: E402
from tierstore.cli import main  # noqa: E402

ATOL = 1e-5
# Per-expert checkpoints with a Concatenate (mixtral's w1/w3, the gate_proj/up_proj of the
# others), gpt_oss's fused, transposed, biased experts, granitemoe's fused ones under other
# names.
FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss",
            "granitemoe"]
if os.environ.get("TIERSTORE_EXPORT_FAMILIES") == "all":
    FAMILIES = list(th.causal_lm_families())
TINY_PARAMS = 20_000_000  # a config hf_tiny cannot shrink below this is not tiny


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def store_entries(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    with tierstore.open(path) as store:
        return {k: store.get(*k) for k in store.keys()}  # noqa: SIM118  (keys, not names)


def assert_same_entries(a: Path, b: Path) -> None:
    first, second = store_entries(a), store_entries(b)
    assert sorted(first) == sorted(second)
    for key, t in first.items():
        assert second[key].dtype == t.dtype and torch.equal(second[key], t), key


def logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits


def ids_for(vocab: int, n: int = 2, t: int = 9) -> torch.Tensor:
    return torch.randint(3, vocab, (n, t), generator=torch.Generator().manual_seed(5))


def export_cli(*args: str, code: int = 0) -> str:
    r = CliRunner().invoke(main, ["export-hf", *args])
    assert r.exit_code == code, r.output
    return r.output


def tiny(family: str, where: Path) -> Path:
    try:
        from tierstore.hf.config import meta_model

        n = sum(p.numel() for p in meta_model(tiny_config(family), family).parameters())
        if n > TINY_PARAMS:
            pytest.skip(f"{family}: {n} parameters at hf_tiny's sizes")
        return tiny_checkpoint(family, where)
    except TinyUnavailable as e:
        pytest.skip(f"cannot be built tiny on a CPU: {e}")
    except tierstore.StoreError as e:  # meta_model's one-line refusal of the config
        pytest.skip(str(e))
    except RuntimeError as e:  # save_pretrained's own reverse mapping fails at these sizes
        pytest.skip(f"{family}: save_pretrained cannot write it tiny: {e}")


def imported(ck: Path, store: Path) -> None:
    try:
        th.import_hf(ck, store, progress=False)
    except tierstore.StoreError as e:
        if "cannot be served" not in str(e):
            raise
        pytest.skip(str(e))


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(tmp_path: Path, family: str) -> None:
    """The original checkpoint back, bit for bit, in several shards; its logits; the same
    entries again on import."""
    ck = tiny(family, tmp_path / "hf")
    imported(ck, tmp_path / "st")
    with tierstore.open(tmp_path / "st") as store:
        plan = plan_export(store)
    experts = [g for g in plan.groups if any(n in plan.params for n in g.source_names())]
    assert experts and all(g.experts for g in experts)  # one expert at a time, every one
    out = export_cli(str(tmp_path / "out"), "--store", str(tmp_path / "st"),
                     "--shard-size", "40KB")
    saved = json.loads((ck / "config.json").read_text())["model_type"]  # a text model's own
    assert f"exported {saved} as {saved}" in out
    files = sorted(os.listdir(tmp_path / "out"))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    original, exported = read_checkpoint(ck), read_checkpoint(tmp_path / "out")
    assert sorted(exported) == sorted(original) == sorted(index["weight_map"])
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    for side in ("config.json", "generation_config.json"):
        if (ck / side).exists():
            assert (json.loads((tmp_path / "out" / side).read_text())
                    == json.loads((ck / side).read_text())), side
    ids = ids_for(int(tiny_config(family).get_text_config().vocab_size))
    torch.testing.assert_close(logits(tmp_path / "out", ids), logits(ck, ids), atol=ATOL, rtol=0)
    th.import_hf(tmp_path / "out", tmp_path / "st2", progress=False)
    assert_same_entries(tmp_path / "st", tmp_path / "st2")


def test_fused_checkpoint_exports_in_the_family_layout(tmp_path: Path) -> None:
    """A checkpoint saved fused (transformers' own parameter layout) exports in the
    family's checkpoint layout, per expert, and imports to the same entries."""
    ck = tiny("qwen3_moe", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in read_checkpoint(tmp_path / "fused")
    th.import_hf(tmp_path / "fused", tmp_path / "st", progress=False)
    export_hf(tmp_path / "st", tmp_path / "out", progress=False)
    exported = read_checkpoint(tmp_path / "out")
    assert sorted(exported) == sorted(read_checkpoint(ck))
    ids = ids_for(128)
    torch.testing.assert_close(logits(tmp_path / "out", ids), logits(ck, ids), atol=ATOL, rtol=0)
    th.import_hf(tmp_path / "out", tmp_path / "st2", progress=False)
    a, b = store_entries(tmp_path / "st"), store_entries(tmp_path / "st2")
    a.pop(("model.json", "meta"))
    b.pop(("model.json", "meta"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_export_writes_the_stored_values(tmp_path: Path) -> None:
    """What the store holds now (a fine-tune's values) is what is written, expert slices
    included: from_pretrained of the export computes the stored model's logits."""
    ck = tiny("mixtral", tmp_path / "hf")
    th.import_hf(ck, tmp_path / "st", progress=False)
    gen = torch.Generator().manual_seed(1)
    with tierstore.open(tmp_path / "st") as store:
        name = "model.layers.1.mlp.experts.3.gate_up_proj"
        gate_up = torch.randn(store.info(name).shape, generator=gen)
        store.put(name, gate_up)
        emb = "dense.model.embed_tokens.weight"
        store.put(emb, torch.randn(store.info(emb).shape, generator=gen))
    export_hf(tmp_path / "st", tmp_path / "out", progress=False)
    sd = read_checkpoint(tmp_path / "out")
    ffn = gate_up.shape[0] // 2
    assert torch.equal(sd["model.layers.1.block_sparse_moe.experts.3.w1.weight"], gate_up[:ffn])
    assert torch.equal(sd["model.layers.1.block_sparse_moe.experts.3.w3.weight"], gate_up[ffn:])
    ids = ids_for(128)
    model = th.load(tmp_path / "st", mode="resident", device="cpu")
    try:
        with torch.no_grad():
            want = model(ids).logits
    finally:
        model.tierstore.close()
    torch.testing.assert_close(logits(tmp_path / "out", ids), want, atol=ATOL, rtol=0)
    assert not torch.allclose(logits(ck, ids), want, atol=1e-3)


# --------------------------------------------------------------------------- trainer runs


def _corpus(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "héllo", "wörld"]
    text = " ".join(words[i] for i in torch.randint(len(words), (4000,), generator=g).tolist())
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(text)
    return tmp_path / "corpus"


def trainer_logits(run: Path, ids: torch.Tensor) -> torch.Tensor:
    """The trainer's own model, its weights as the run left them (latest checkpoint's
    dense state, the experts' entries)."""
    from tierstore.trainer.model import MoEModel
    from tierstore.trainer.presets import MoEConfig
    from tierstore.trainer.train.checkpoint import latest_dense_state

    with tierstore.open(run) as store:
        payload = latest_dense_state(store)
        assert payload is not None
        net = MoEModel(MoEConfig.from_dict(payload["model_config"]).model_config(), seed=None)
        state = dict(payload["model"])
        state.update(store.get_many([n for n, _ in net.expert_parameters()]))
    missing, _ = net.load_state_dict(state, strict=False)
    assert not missing
    with torch.no_grad():
        return net.eval()(ids)[0]


def check_trainer_export(run: Path, out: Path, arch: str) -> None:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == arch
    with torch.no_grad():
        got = model.eval()(ids).logits
    torch.testing.assert_close(got, trainer_logits(run, ids), atol=ATOL, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "héllo, wörld"
    assert tok(text)["input_ids"] == list(text.encode())
    assert tok.decode(list(text.encode())) == text


def test_trainer_run_exports_as_mixtral(tmp_path: Path) -> None:
    """`tierstore train` (every layer MoE), then export-hf: Mixtral with the trainer
    model's logits and a byte-level tokenizer; imported again, the same experts."""
    r = CliRunner().invoke(main, [
        "train", "--store", str(tmp_path / "run"), "--model", "tiny", "--steps", "2",
        "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--device", "cpu",
        "--host-cache", "64MiB", "--corpus", str(_corpus(tmp_path))])
    assert r.exit_code == 0, r.output
    out = export_cli(str(tmp_path / "out"), "--store", str(tmp_path / "run"))
    assert "exported tierstore as mixtral" in out
    check_trainer_export(tmp_path / "run", tmp_path / "out", "MixtralForCausalLM")
    th.import_hf(tmp_path / "out", tmp_path / "again", progress=False)
    with tierstore.open(tmp_path / "run") as run, tierstore.open(tmp_path / "again") as again:
        w1, w3 = run.get("layers.1.experts.5.w1"), run.get("layers.1.experts.5.w3")
        assert torch.equal(again.get("model.layers.1.mlp.experts.5.gate_up_proj"),
                           torch.cat([w1, w3]))


def test_trainer_run_with_dense_layers_exports_as_qwen2_moe(tmp_path: Path) -> None:
    """A run with dense layers between MoE ones: Qwen2-MoE, the dense layers as
    mlp_only_layers and a shared expert of zeros."""
    from tierstore.trainer.presets import MoEConfig
    from tierstore.trainer.train.resident import TrainConfig
    from tierstore.trainer.train.store_trainer import train_store

    cfg = MoEConfig(d_model=32, n_layers=4, n_heads=4, d_ff=48, d_ff_dense=40, n_experts=4,
                    top_k=2, moe_every=2, max_seq_len=64)
    train_store(cfg, 2, 0, TrainConfig(batch_size=2, seq_len=32, eval_every=0),
                store_path=str(tmp_path / "run"), host_cache="64MiB", slab_size="64MiB",
                corpus_paths=[str(_corpus(tmp_path))], device="cpu")
    s = export_hf(tmp_path / "run", tmp_path / "out", progress=False)
    assert (s["source"], s["family"], s["dtype"]) == ("tierstore", "qwen2_moe", "float32")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["mlp_only_layers"] == [0, 2] and hf["intermediate_size"] == 40
    sd = read_checkpoint(tmp_path / "out")
    assert not sd["model.layers.1.mlp.shared_expert.down_proj.weight"].any()
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in sd
    check_trainer_export(tmp_path / "run", tmp_path / "out", "Qwen2MoeForCausalLM")


# --------------------------------------------------------------------------- dtypes, shards


def test_dtypes_and_shards(tmp_path: Path) -> None:
    """The stored dtype by default, --dtype casts every float tensor and says so in
    config.json; shards hold at most --shard-size bytes unless one tensor is larger; a
    progress callable sees every byte."""
    ck = tiny("olmoe", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16ck")
    th.import_hf(tmp_path / "bf16ck", tmp_path / "st", progress=False)
    original = read_checkpoint(tmp_path / "bf16ck")
    seen: list[int] = []
    s = export_hf(tmp_path / "st", tmp_path / "bf16", progress=seen.append, shard_size="20KB")
    assert s["dtype"] == "bfloat16" and sum(seen) == s["bytes"]
    exported = read_checkpoint(tmp_path / "bf16")
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], t)
               for n, t in original.items())
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == s["bytes"] == sum(
        t.numel() * 2 for t in original.values())
    for f in {*index["weight_map"].values()}:
        held = [n for n, g in index["weight_map"].items() if g == f]
        size = sum(exported[n].numel() * 2 for n in held)
        assert size <= 20_000 or len(held) == 1, f
    for flag, dt in (("fp32", torch.float32), ("fp16", torch.float16)):
        export_cli(str(tmp_path / flag), "--store", str(tmp_path / "st"), "--dtype", flag)
        got = read_checkpoint(tmp_path / flag)
        assert all(got[n].dtype == dt and torch.equal(got[n], t.to(dt))
                   for n, t in original.items())
        assert json.loads((tmp_path / flag / "config.json").read_text())["dtype"] == \
            str(dt).removeprefix("torch.")
    ids = ids_for(128)
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16ck")
    with torch.no_grad():
        ref = want.to(torch.float32).eval()(ids).logits
    torch.testing.assert_close(logits(tmp_path / "fp32", ids), ref, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- errors, out dir


def test_errors_and_out_dir(tmp_path: Path) -> None:
    """One-line errors (exit 2); a non-empty OUT only with --force, whose stale weight
    files go; an interrupted export leaves nothing behind."""
    ck = tiny("qwen2_moe", tmp_path / "hf")
    th.import_hf(ck, tmp_path / "st", progress=False)
    tierstore.open(tmp_path / "empty", create=True, slab_size="64MiB").close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(HFExportError, match="is not a directory"):
        export_hf(tmp_path / "st", tmp_path / "file", force=True, progress=False)
    for args, what in (([str(tmp_path / "o"), "--store", str(tmp_path / "missing")],
                        "no such store"),
                       ([str(tmp_path / "o"), "--store", str(tmp_path / "empty")],
                        "holds no model"),
                       ([str(ck), "--store", str(tmp_path / "st")], "not empty; pass --force")):
        out = export_cli(*args, code=2)
        assert what in out and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "o").exists()
    with pytest.raises(HFExportError, match="cannot export in"):
        export_hf(tmp_path / "st", tmp_path / "o", dtype="int8", progress=False)
    # --force into the original checkpoint's directory: its model.safetensors (which
    # transformers would load instead of the index) goes, its README stays.
    (ck / "README.md").write_text("mine")
    export_cli(str(ck), "--store", str(tmp_path / "st"), "--force")
    files = os.listdir(ck)
    assert "model.safetensors" not in files and "model-00001-of-00001.safetensors" in files
    assert (ck / "README.md").read_text() == "mine"

    def interrupt(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_hf(tmp_path / "st", tmp_path / "cut", progress=interrupt)
    assert not (tmp_path / "cut").exists()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".export-hf")]
    with tierstore.open(tmp_path / "st") as store:
        gone = sorted(n for n in store.names("model.layers.") if n.endswith(".4.down_proj"))[-1]
        store.delete(gone)
    out = export_cli(str(tmp_path / "o"), "--store", str(tmp_path / "st"), code=2)
    assert f"{gone} is missing" in out
    assert len(out.strip().splitlines()) == 1



CHILD = """
import sys
from tierstore.hf.exporter import export_hf

def progress(n, said=[]):
    if not said:
        said.append(1)
        print("writing", flush=True)
        sys.stdin.readline()  # held here, mid-export, until the test says go

export_hf(sys.argv[1], sys.argv[2], progress=progress)
print("done", flush=True)
"""


def _paused_export(store: Path, out: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store), str(out)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline() == "writing\n", child.stderr.read() if child.stderr else ""
    return child


def _hidden(parent: Path) -> set[str]:
    return {f for f in os.listdir(parent) if f.endswith(".export-hf")}


def test_killed_export_leaves_nothing_and_a_later_one_removes_it(tmp_path: Path) -> None:
    """An export under way keeps its hidden directory through another export to the same
    OUT; SIGKILLed, it leaves that directory and nothing under OUT, and the next export
    removes it."""
    ck = tiny("mixtral", tmp_path / "hf")
    th.import_hf(ck, tmp_path / "st", progress=False)
    shutil.copytree(tmp_path / "st", tmp_path / "st2")  # a store has one user at a time
    out = tmp_path / "out"
    child = _paused_export(tmp_path / "st2", out)
    running = _hidden(tmp_path)
    assert len(running) == 1 and not out.exists()
    s = export_hf(tmp_path / "st", out, progress=False)
    assert s["removed"] == [] and _hidden(tmp_path) == running
    child.kill()
    assert child.wait() == -9
    assert _hidden(tmp_path) == running
    s = export_hf(tmp_path / "st", out, force=True, progress=False)
    assert [os.path.basename(p) for p in s["removed"]] == sorted(running)
    assert not _hidden(tmp_path)
    assert sorted(read_checkpoint(out)) == sorted(read_checkpoint(ck))


def test_export_never_moves_over_one_that_finished_meanwhile(tmp_path: Path) -> None:
    """OUT filled while an export runs (another export finished first): without --force
    the export stops with its files removed and OUT as the other left it."""
    ck = tiny("olmoe", tmp_path / "hf")
    th.import_hf(ck, tmp_path / "st", progress=False)
    out = tmp_path / "out"

    def other_finishes(n: int, done: list[int] = []) -> None:  # noqa: B006
        if not done:
            done.append(1)
            out.mkdir()
            (out / "config.json").write_text("{}")

    with pytest.raises(HFExportError, match="is not empty; pass --force"):
        export_hf(tmp_path / "st", out, progress=other_finishes)
    assert os.listdir(out) == ["config.json"] and not _hidden(tmp_path)
