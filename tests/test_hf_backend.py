"""The experts backend against transformers, family by family.

The families are enumerated from the installed transformers (every causal-LM family whose
experts class dispatches through ``ExpertsInterface``), each as a tiny random checkpoint
made by ``save_pretrained`` (:mod:`hf_tiny`), imported with ``tierstore.hf.import_hf`` and
loaded in every mode. Each must give the resident transformers model's logits (fp32, to
1e-5) over a left-padded batch, the same greedy tokens with the same per-step logits
through the KV cache, and the same tokens when sampling with a seed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tierstore.hf as th  # noqa: E402
from hf_models import daemon_serving  # noqa: E402
from hf_tiny import TinyUnavailable, tiny_checkpoint  # noqa: E402

import tierstore  # noqa: E402

MODES = ("on-demand", "expert", "ring", "resident")
FAMILIES = th.causal_lm_families()
NEW = 5


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    # Tiny models' kernels are microseconds: a second thread only adds hand-offs.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is left-padded
    ids[1, :3] = 0
    return ids, mask


def _imported(family: str, root: Path) -> tuple[Any, Path]:
    try:
        ckpt = tiny_checkpoint(family, root / "hf")
    except TinyUnavailable as e:
        pytest.skip(f"cannot be built tiny on a CPU: {e}")
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    th.import_hf(ckpt, root / "store", progress=False)
    return ref, root / "store"


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Any:
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_in_every_mode(family: str, tmp_path: Path,
                                                   record_property: Any) -> None:
    ref, store = _imported(family, tmp_path)
    ids, mask = _batch(int(ref.config.get_text_config().vocab_size))
    with torch.no_grad():
        want_logits = ref(ids, attention_mask=mask).logits
    want = _generate(ref, ids, mask, do_sample=False)
    torch.manual_seed(11)
    want_sampled = _generate(ref, ids, mask, do_sample=True, top_k=0).sequences
    refused: list[str] = []
    record_property("refused", refused)  # scripts/family_matrix.py reports them
    for mode in MODES:
        try:
            model = th.load(store, mode=mode, device="cpu")
        except tierstore.StoreError as e:
            # A looped model runs some MoE layers twice a pass: a ring of layers in module
            # order does not fit it, and says so.
            assert mode == "ring" and "looped model" in str(e), (mode, e)
            refused.append(f"{mode}: {e}")
            continue
        try:
            assert type(model) is type(ref)
            with torch.no_grad():
                got_logits = model(ids, attention_mask=mask).logits
            torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0,
                                       msg=lambda m, mode=mode: f"{mode}: {m}")
            got = _generate(model, ids, mask, do_sample=False)
            assert torch.equal(got.sequences, want.sequences), mode
            for a, b in zip(got.logits, want.logits):  # each step, through the KV cache
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
            if mode == "expert":
                torch.manual_seed(11)
                sampled = _generate(model, ids, mask, do_sample=True, top_k=0).sequences
                assert torch.equal(sampled, want_sampled)
            # no expert parameter was ever allocated
            assert not any(".experts." in n and n.rsplit(".", 1)[-1] in th.backend.ROLES
                           for n, _ in model.named_parameters())
        finally:
            model.tierstore.close()


def test_every_decorated_family_is_enumerated_from_transformers() -> None:
    # The list is read off transformers itself: the families tierstore re-implemented
    # before and the ones it refused are all in it.
    for family in ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v3", "deepseek_v2",
                   "gpt_oss", "glm4_moe", "qwen3_next", "minimax", "phimoe", "granitemoe",
                   "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "flex_olmo"):
        assert family in FAMILIES
    for family in ("llama4", "dbrx", "jetmoe", "switch_transformers", "nllb_moe", "llama"):
        assert family not in FAMILIES


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierstore", *args], capture_output=True,
                          text=True, timeout=300)


def _undecorated_checkpoint(root: Path) -> Path:
    cfg = transformers.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                    num_key_value_heads=2, kv_channels=8, intermediate_size=32,
                                    num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(root)
    return root


def test_an_undecorated_family_is_refused_in_one_line(tmp_path: Path) -> None:
    ckpt = _undecorated_checkpoint(tmp_path / "jetmoe")
    r = _run_cli("import-hf", str(ckpt), "--store", str(tmp_path / "s"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "jetmoe" in lines[0] and "from memory" in lines[0]
    assert not (tmp_path / "s").exists()


def test_a_quantized_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    ckpt = tiny_checkpoint("mixtral", tmp_path / "hf")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    r = _run_cli("import-hf", str(ckpt), "--store", str(tmp_path / "s"))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "mxfp4" in r.stderr


def test_generate_cli_gives_transformers_tokens_and_says_what_auto_picked(tmp_path: Path) -> None:
    ref, store = _imported("deepseek_v3", tmp_path)
    ids = [5, 6, 7, 8]
    want = ref.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                        pad_token_id=0)[0, len(ids):].tolist()
    r = _run_cli("generate", "--store", str(store), "--prompt-ids", ",".join(map(str, ids)),
                 "--max-new-tokens", str(NEW), "--greedy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("mode auto: ")
    assert f"[0] {want}" in r.stdout
    r = _run_cli("generate", "--store", str(store), "--prompt-ids", ",".join(map(str, ids)),
                 "--max-new-tokens", str(NEW), "--greedy", "--json", "--mode", "ring")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens"] == [want] and out["mode"] == "ring"


def test_on_demand_reads_exactly_the_routed_experts_and_the_ring_whole_layers(
        tmp_path: Path) -> None:
    _, store = _imported("qwen2_moe", tmp_path)
    recorder_rows: list[tuple[int, int, list[int]]] = []

    class Rec:
        def record(self, step: int, layer: int, ids: list[int], nbytes: int) -> None:
            recorder_rows.append((step, layer, list(ids)))

    from tierstore.trainer.infer.generate import generate

    model = th.load(store, mode="on-demand", device="cpu")
    try:
        one = sum(model.tierstore.store.info(n).nbytes for n in
                  model.tierstore.served.expert_names(model.tierstore.served.moe_layers[0], 0))
        res = generate(model, [[5, 6, 7]], NEW, trace=Rec(), warm=False)
        routed = sum(len(ids) for _, _, ids in recorder_rows)
        assert res.source["bytes_moved"] == routed * one
    finally:
        model.tierstore.close()
    model = th.load(store, mode="ring", device="cpu", ring_slots=1)
    try:
        served = model.tierstore.served
        res = generate(model, [[5, 6, 7]], NEW, warm=False)
        layer = served.n_experts * one
        # one slot: every layer is read whole on every pass
        assert res.source["bytes_moved"] == NEW * len(served.moe_layers) * layer
    finally:
        model.tierstore.close()


def test_served_through_the_daemon(tmp_path: Path) -> None:
    ref, store = _imported("gpt_oss", tmp_path)
    sock = tmp_path / "d.sock"
    with daemon_serving(store, sock):
        ids, mask = _batch(int(ref.config.vocab_size))
        want = _generate(ref, ids, mask, do_sample=False)
        for mode in ("on-demand", "expert", "ring"):
            model = th.load(str(sock), mode=mode, device="cpu")
            try:
                assert model.tierstore.store.capabilities.remote
                got = _generate(model, ids, mask, do_sample=False)
                assert torch.equal(got.sequences, want.sequences), mode
            finally:
                model.tierstore.close()


def test_a_store_without_a_model_is_one_line(tmp_path: Path) -> None:
    tierstore.open(tmp_path / "empty", create=True, slab_size="8MiB").close()
    with pytest.raises(tierstore.StoreError, match="holds no model"):
        th.load(tmp_path / "empty")


@pytest.mark.parametrize("moe_every", [1, 2])
def test_a_trainer_run_is_served_as_the_transformers_model_it_computes(
        tmp_path: Path, moe_every: int) -> None:
    """A store ``tierstore train`` wrote is loaded as Mixtral (every layer MoE) or Qwen2-MoE
    (dense layers between, a zero shared expert) and computes what the trainer's own model
    computes, over a full sequence and through the KV cache."""
    from dataclasses import replace

    from tierstore.trainer.model import MoEModel
    from tierstore.trainer.presets import PRESETS
    from tierstore.trainer.train.checkpoint import latest_dense_state
    from tierstore.trainer.train.data import load_corpus
    from tierstore.trainer.train.resident import TrainConfig
    from tierstore.trainer.train.store_trainer import train_store

    cfg = replace(PRESETS["tiny"], moe_every=moe_every)
    tc = TrainConfig(batch_size=2, seq_len=16, eval_every=0, lr=1e-2)
    train_store(cfg, 3, seed=4, train=tc, corpus=load_corpus(max_bytes=64 * 1024),
                store_path=tmp_path / "st", host_cache="4MiB", slab_size="16MiB")
    model = th.load(tmp_path / "st", mode="on-demand", device="cpu")
    try:
        want_class = "MixtralForCausalLM" if moe_every == 1 else "Qwen2MoeForCausalLM"
        assert type(model).__name__ == want_class
        store = model.tierstore.store
        ref = MoEModel(cfg, seed=None, resident_experts=True)
        state = dict(latest_dense_state(store)["model"])
        state.update({n: store.get(n) for n in ref.state_dict() if ".experts." in n})
        ref.load_state_dict({k: v for k, v in state.items() if not k.startswith("rope_")},
                            strict=False)
        ref.eval()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 256, (2, 20), generator=g)
        with torch.no_grad():
            want = ref(ids)[0]
            torch.testing.assert_close(model(ids).logits, want, atol=1e-5, rtol=0)
            out = model(ids[:, :15], use_cache=True)
            steps = [out.logits]
            # transformers 5.25 renamed past_key_values to cache (the old name warns)
            name = "cache" if hasattr(out, "cache") else "past_key_values"
            for j in range(15, 20):
                out = model(ids[:, j:j + 1], **{name: getattr(out, name)}, use_cache=True)
                steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=0)
    finally:
        model.tierstore.close()


def test_the_docs_list_the_families_of_the_installed_transformers() -> None:
    """docs/inference.md's family list is written by scripts/family_matrix.py from this module's
    matrix; it must name exactly the families the installed transformers has."""
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "scripts" / "family_matrix.py"), "--check"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
