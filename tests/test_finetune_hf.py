"""Fine-tuning imported Hugging Face checkpoints over the store: tiny random models of every
supported family, made with ``transformers``, imported, and fine-tuned with a host cache far
smaller than their expert states, against ``transformers``' own model trained in memory with
``torch.optim.AdamW`` on the same batches; bf16 checkpoints train fp32 masters; a fine-tune
killed with SIGKILL resumes to the uninterrupted run's result."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from tierstore.trainer.infer.hf_import import import_hf
from tierstore.trainer.infer.loading import DENSE_PREFIX, load_model, model_info
from tierstore.trainer.infer.sources import ResidentSource
from tierstore.trainer.model import EXPERT_WEIGHTS, expert_name
from tierstore.trainer.train.checkpoint import (
    MOMENTS,
    STEP_KIND,
    checkpoint_steps,
    step_counts_name,
)
from tierstore.trainer.train.data import BatchSampler, Corpus, load_corpus
from tierstore.trainer.train.resident import TrainConfig, param_groups
from tierstore.trainer.train.store_trainer import train_store

import tierstore
from tierstore.cli import main

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_hf_models import hf_config  # noqa: E402 (the families' tiny configs)

VOCAB = 320
AUX_COEF = 0.05
# A fine-tuning learning rate. Two implementations sum in different orders, and AdamW moves
# a weight whose gradient is mostly rounding noise by up to the learning rate whichever sign
# the noise has; at 1e-4 such a weight stays well within the comparison's 1e-5.
TC = TrainConfig(batch_size=4, seq_len=32, lr=1e-4, min_lr=1e-5, warmup_steps=1, decay_steps=6,
                 eval_every=0)
STEPS, SEED = 4, 3
# The families' expert states (fp32 weights and two moments) are 0.4-1.0 MiB of 4-9 KiB
# entries; this cache holds about a dozen of them.
SMALL_CACHE = "96KiB"
SLAB = "16MiB"
FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe"]


@pytest.fixture(autouse=True)
def _remove_stores(tmp_path: Path) -> Iterator[None]:
    """Imports preallocate 1 GiB slab files: gone once a test is over."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """The default corpus (the standard library's sources), capped."""
    return load_corpus(max_bytes=96 * 1024)


def make_tokenizer(model_dir: Path, corpus: Corpus) -> None:
    """A byte-level BPE tokenizer of VOCAB ids trained on the corpus (<pad> 0, <s> 1,
    </s> 2: the tiny configs' special ids), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus.train.tobytes().decode("utf-8", errors="replace")], trainer)
    tok.save(str(model_dir / "tokenizer.json"))


def make_model(family: str, model_dir: Path, corpus: Corpus, dtype: torch.dtype = torch.float32,
               **over: Any) -> Any:
    """A random ``family`` model whose config asks for the router loss, saved with its
    tokenizer. Weights are drawn larger than the default init so routing is far from
    uniform."""
    torch.manual_seed(0)
    cfg = hf_config(family, vocab_size=VOCAB, output_router_logits=True,
                    router_aux_loss_coef=AUX_COEF, **over)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model = model.to(dtype)
    model.save_pretrained(model_dir)
    make_tokenizer(model_dir, corpus)
    return model


def hf_batches(model_dir: Path, corpus: Corpus, eos: int, steps: int) -> list[Any]:
    """The batches of a fine-tune, made independently of the trainer's tokenization: each
    training document encoded by ``transformers``' tokenizer, an end-of-sequence token
    after it, all packed into one stream, windows drawn as the trainer's sampler draws them."""
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    bounds = np.cumsum([0, *corpus.train_lengths])
    stream: list[int] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        text = corpus.train[a:b].tobytes().decode("utf-8", errors="replace")
        stream += tok(text)["input_ids"] + [eos]
    sampler = BatchSampler(np.asarray(stream), TC.batch_size, TC.seq_len, SEED)
    return [sampler.next_batch() for _ in range(steps)]


def train_reference(hf: Any, batches: list[Any], tc: TrainConfig) -> list[dict[str, float]]:
    """``transformers``' model trained in memory: its own loss (cross-entropy plus the
    configured router loss), one global-norm clip, ``torch.optim.AdamW`` with weight decay on
    matrices, the trainer's learning-rate schedule."""
    hf.train()
    opt = torch.optim.AdamW(param_groups(list(hf.named_parameters()), tc.weight_decay),
                            lr=tc.lr, betas=tc.betas, eps=tc.eps)
    out_rows = []
    for step, (x, y) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = tc.lr_for(step)
        out = hf(input_ids=x, labels=y, shift_labels=y, output_router_logits=True)
        ce = F.cross_entropy(out.logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        out.loss.backward()
        assert tc.clip is not None
        torch.nn.utils.clip_grad_norm_(hf.parameters(), tc.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out_rows.append({"loss": float(ce.detach()), "aux_loss": float(out.aux_loss.detach()),
                         "total": float(out.loss.detach())})
    return out_rows


def weights(store_path: Path) -> dict[str, torch.Tensor]:
    """Every weight of the model a store holds: experts and dense entries of kind param."""
    with tierstore.open(store_path) as st:
        names = st.names("layers.", kind="param") + st.names(DENSE_PREFIX, kind="param")
        return {str(k): v for k, v in st.get_many(names).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_finetune_matches_transformers_trained_in_memory(family: str, corpus: Corpus,
                                                         tmp_path: Path) -> None:
    # Four experts, two per token, 128 tokens a step: every expert gets tokens every step.
    experts = {"num_local_experts" if family == "mixtral" else "num_experts": 4}
    hf = make_model(family, tmp_path / "hf", corpus, **experts)
    for path in ("st", "imported"):
        import_hf(tmp_path / "hf", tmp_path / path, progress=False)
    with tierstore.open(tmp_path / "st") as st:
        info = model_info(st)
    eos = info["config"]["eos_token_ids"][0]
    fetch = "queue" if family == "mixtral" else "direct"
    got = train_store(None, STEPS, seed=SEED, train=TC, corpus=corpus,
                      store_path=tmp_path / "st", host_cache=SMALL_CACHE, slab_size=SLAB,
                      fetch=fetch, read_ahead=fetch == "queue", trace_path=tmp_path / "trace.csv")
    ref = train_reference(hf, hf_batches(tmp_path / "hf", corpus, eos, STEPS), TC)

    # Every expert received tokens in every step, so the lazy updates of the store trainer
    # and AdamW's updates of transformers' fused or per-expert tensors are the same rule.
    trace = tierstore.lab.read_trace(tmp_path / "trace.csv")
    n_experts = info["config"]["n_experts"]
    for step in range(1, STEPS + 1):
        for layer in info["config"]["moe_layers"]:
            rows = (trace.step == step) & (trace.layer == layer)
            assert sorted(trace.expert[rows].tolist()) == list(range(n_experts)), (step, layer)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert abs(b["loss"] - a["loss"]) < 1e-5, (b["step"], a, b["loss"])
        assert abs(b["aux_loss"] - a["aux_loss"]) < 1e-5, (b["step"], a, b["aux_loss"])
        assert abs(b["loss"] + AUX_COEF * b["aux_loss"] - a["total"]) < 1e-5
        assert b["cache_misses"] > 0 and b["evictions"] > 0, b
    assert got[-1]["checkpoint"] == f"step-{STEPS}"

    # The final weights: transformers' trained model, saved and imported, against the
    # fine-tuned store's expert and dense entries (fp32 masters).
    hf.save_pretrained(tmp_path / "hf-trained")
    import_hf(tmp_path / "hf-trained", tmp_path / "ref", progress=False)
    mine, want = weights(tmp_path / "st"), weights(tmp_path / "ref")
    assert sorted(mine) == sorted(want)
    for name, t in want.items():
        assert mine[name].dtype == torch.float32, name
        torch.testing.assert_close(mine[name], t, atol=1e-5, rtol=0, msg=name)
    start = weights(tmp_path / "imported")
    moved = max(float((want[n] - start[n]).abs().max()) for n in want)
    assert moved > 20 * 1e-5  # the comparison is far finer than what training changed
    with tierstore.open(tmp_path / "st") as st:
        assert st.fsck().ok
        for layer in info["config"]["moe_layers"]:
            counts = st.get(step_counts_name(layer), STEP_KIND)
            assert counts.tolist() == [STEPS] * n_experts
        assert st.info(expert_name(info["config"]["moe_layers"][0], 0, "w1"),
                       MOMENTS[1]).dtype == torch.float32
        # Inference reads the fine-tuned model as it is: the trained model's logits.
        model = load_model(st, "cpu", torch.float32)
        ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        hf.eval()
        torch.testing.assert_close(model(ids, ResidentSource(st, model)), hf(ids).logits,
                                   atol=1e-4, rtol=0)


def test_bf16_checkpoint_trains_fp32_masters(corpus: Corpus, tmp_path: Path) -> None:
    make_model("qwen3_moe", tmp_path / "hf", corpus, dtype=torch.bfloat16)
    for path in ("st", "imported"):
        import_hf(tmp_path / "hf", tmp_path / path, progress=False)
    imported = weights(tmp_path / "imported")
    assert all(t.dtype == torch.bfloat16 for t in imported.values())
    hist = train_store(None, 2, seed=SEED, train=TC, corpus=corpus, store_path=tmp_path / "st",
                       host_cache=SMALL_CACHE, slab_size=SLAB)
    assert all(np.isfinite(m["loss"]) for m in hist)
    trained = weights(tmp_path / "st")
    assert sorted(trained) == sorted(imported)
    assert all(t.dtype == torch.float32 for t in trained.values())
    assert any(not torch.equal(trained[n], imported[n].float()) for n in imported)
    with tierstore.open(tmp_path / "st") as st:
        assert model_info(st)["config"]["dtype"] == "bfloat16"  # what export writes
        assert checkpoint_steps(st) == [0, 2]
        st.restore("step-0")  # the start: the imported weights, cast up exactly
    start = weights(tmp_path / "st")
    for name, t in imported.items():
        assert start[name].dtype == torch.float32 and torch.equal(start[name], t.float()), name


# --------------------------------------------------------------------------- the CLI

CLI_OPTS = ["--batch-size", "4", "--seq-len", "32", "--slab-size", SLAB, "--device", "cpu",
            "--host-cache", SMALL_CACHE, "--eval-every", "0"]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n")]


def test_sigkill_then_resume_equals_the_uninterrupted_finetune(corpus: Corpus,
                                                              tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(corpus.train.tobytes())
    make_model("mixtral", tmp_path / "hf", corpus)
    for path in ("st", "whole"):
        import_hf(tmp_path / "hf", tmp_path / path, progress=False)
    runner = CliRunner()
    res = runner.invoke(main, ["train", "--store", str(tmp_path / "st"), "--model", "tiny",
                               "--steps", "2", *CLI_OPTS])
    assert res.exit_code == 2 and "imported mixtral model" in res.output, res.output

    store, metrics = tmp_path / "st", tmp_path / "m.jsonl"
    every = 3
    cmd = [sys.executable, "-m", "tierstore.cli", "train", "--store", str(store), "--seed", "7",
           "--checkpoint-every", str(every), "--metrics", str(metrics), "--corpus", str(text),
           *CLI_OPTS]
    log = tmp_path / "child.log"
    with open(log, "w") as err:
        child = subprocess.Popen([*cmd, "--steps", "100000"], stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + 120
        ckpts: list[int] = []
        while time.monotonic() < deadline and child.poll() is None:
            seen = _lines(metrics) if metrics.exists() else []
            ckpts = [m["step"] for m in seen if "checkpoint" in m]
            if ckpts and seen[-1]["step"] >= ckpts[0] + 1:  # between checkpoints
                break
            time.sleep(0.05)
        assert child.poll() is None, log.read_text()
        assert ckpts, "no checkpoint within 120 s"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    before = {m["step"]: m for m in _lines(metrics)}
    target = max(before) + 3
    done = subprocess.run([*cmd, "--steps", str(target), "--resume"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = re.search(r"steps (\d+)-(\d+)", done.stdout)
    assert found is not None, done.stdout
    resumed_from = int(found.group(1)) - 1
    assert resumed_from % every == 0 and resumed_from < max(before)
    after = _lines(metrics)
    assert [m["step"] for m in after] == list(range(1, target + 1))

    tc = replace(TrainConfig(), batch_size=4, seq_len=32, eval_every=0)
    whole = train_store(None, target, seed=7, train=tc, corpus_paths=[text],
                        store_path=tmp_path / "whole", host_cache=SMALL_CACHE, slab_size=SLAB)
    assert [m["loss"] for m in whole] == [m["loss"] for m in after]
    a, b = weights(tmp_path / "whole"), weights(store)
    assert sorted(a) == sorted(b)
    for name, t in a.items():
        assert torch.equal(t, b[name]), name
    with tierstore.open(store) as st:
        assert st.fsck().ok and checkpoint_steps(st)[-1] == target
        for layer in model_info(st)["config"]["moe_layers"]:
            for e in range(2):
                for w in EXPERT_WEIGHTS:
                    for kind in MOMENTS:
                        assert st.get(expert_name(layer, e, w), kind).abs().sum() > 0


def test_bench_train_on_an_imported_checkpoint(corpus: Corpus, tmp_path: Path) -> None:
    make_model("olmoe", tmp_path / "hf", corpus)
    out = tmp_path / "train.json"
    res = CliRunner().invoke(main, [
        "bench", "train", "--model-dir", str(tmp_path / "hf"), "--steps", "1", "--warmup", "0",
        "--rounds", "1", "--host-cache", SMALL_CACHE, "--batch-size", "2", "--seq-len", "16",
        "--store", str(tmp_path / "scratch"), "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["model_dir"] == str(tmp_path / "hf") and report["config"]["family"] == "olmoe"
    cfg = report["config"]
    assert report["expert_state_bytes"] == (len(cfg["moe_layers"]) * cfg["n_experts"] * 3
                                            * 3 * cfg["hidden_size"] * cfg["moe_ffn"] * 4)
    for side in ("resident", "store"):
        assert report[side]["steps_measured"] == 1 and report[side]["step_time_s"] > 0
    assert report["store"]["hit_rate"] is not None and report["store"]["peak_rss_bytes"] > 0
    assert "store / resident step time" in res.output
