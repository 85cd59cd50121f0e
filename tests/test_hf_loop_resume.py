"""A user's own training loop killed with SIGKILL and resumed from its checkpoints
(``tierstore.hf.save_checkpoint`` / ``load_checkpoint``) ends bit for bit where the
uninterrupted loop does: per-step losses and gradient norms, every entry of the store (dense
weights, every expert's master, moments and step counts) and the dense optimizer's state,
the schedulers' and the RNGs'; ``fsck`` is clean.

The loop is tests/loop_child.py (a tiny DeepSeek-V3 with attention dropout, rows drawn by
numpy, Python and torch, dense AdamW + ExpertAdamW + a LambdaLR on each, a checkpoint every
two steps). Each run is a process of its own, forked from a server that imported torch and
transformers once, and killed by SIGKILL at a named point of a step or of a checkpoint (one
after another, each resuming from what the previous left). ``TIERSTORE_RESUME_KILLS=N`` adds
a campaign of N kills at random instants; ``TIERSTORE_RESUME_FAMILIES=deepseek_v3,mixtral``
runs the named families (Mixtral fetches its experts through the prefetch queue)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.hf.resume import LOOP_ENTRY
from tierstore.trainer.train.checkpoint import checkpoint_steps, unpack

import tierstore

transformers = pytest.importorskip("transformers")
import loop_child  # noqa: E402
from hf_models import make_hf_model  # noqa: E402

STEPS, EVERY = 6, 2
FAMILIES = os.environ.get("TIERSTORE_RESUME_FAMILIES", "deepseek_v3").split(",")
RANDOM_KILLS = int(os.environ.get("TIERSTORE_RESUME_KILLS", "0"))
FETCH = {"deepseek_v3": "direct", "mixtral": "queue"}
EXPERTS = {"deepseek_v3": {"n_routed_experts": 8}, "mixtral": {"num_local_experts": 8}}
# Each kill resumes from what the one before left: mid-step (nothing applied; the dense
# weights stepped but not the experts; both stepped, the schedules not) and mid-checkpoint
# (the dense weights written; the write-back done, the snapshot's commit not; the oldest
# dropped; committed, the old ones not dropped), the first one inside the initial loop-0.
CHAIN = ["ckpt-flush@0", "backward@1", "ckpt-dense@2", "ckpt-flush@2", "dense@3",
         "ckpt-drop@4", "experts@5", "ckpt-commit@6"]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    """Processes forked from one that has imported torch, transformers and tierstore."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["loop_child",
                                "transformers.models.deepseek_v3.modeling_deepseek_v3",
                                "transformers.models.mixtral.modeling_mixtral"])
    yield ctx


def run(ctx: Any, store: Path, log: Path, kill: str = "", family: str = "deepseek_v3") -> int:
    p = ctx.Process(target=loop_child.run,
                    args=(str(store), str(log), STEPS, EVERY, kill, FETCH[family]))
    p.start()
    p.join(300)
    assert p.exitcode is not None, f"run {kill!r} hung"
    return int(p.exitcode)


@pytest.fixture(scope="module")
def reference(server: Any, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[dict[str, tuple[Path, Path, list[dict[str, Any]]]]]:
    """Per family: the model saved for import, and the uninterrupted run's store and log."""
    root = tmp_path_factory.mktemp("loop-resume")
    out = {}
    for family in FAMILIES:
        hf = root / family / "hf"
        make_hf_model(family, hf, attention_dropout=0.1, **EXPERTS[family])  # saved to hf
        tierstore.hf.import_hf(hf, root / family / "ref", progress=False)
        log = root / family / "ref.log"
        assert run(server, root / family / "ref", log, family=family) == 0
        out[family] = (hf, root / family / "ref", lines(log))
        assert [m["step"] for m in out[family][2]] == list(range(1, STEPS + 1))
    yield out
    shutil.rmtree(root, ignore_errors=True)


def lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(s) for s in log.read_text().splitlines(keepends=True) if s.endswith("\n")]


def assert_same(a: Any, b: Any, where: str) -> None:
    """Equal, tensors bit for bit, through dicts, lists and tuples."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            if k != "store":  # ExpertAdamW's state names its store's path
                assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "dtype") and hasattr(a, "shape"):  # numpy's RNG state
        assert a.tolist() == b.tolist(), where
    else:
        assert a == b, where


def assert_same_run(ref: Path, ref_log: list[dict[str, Any]], store: Path,
                    logs: list[dict[str, Any]]) -> None:
    want = {m["step"]: m for m in ref_log}
    assert {m["step"] for m in logs} == set(want)
    for m in logs:  # every run of a step, the re-runs after a resume included
        assert m == want[m["step"]], (m, want[m["step"]])
    with tierstore.open(ref, host_cache=0) as a, tierstore.open(store, host_cache=0) as b:
        keys = sorted(a.keys())
        assert keys == sorted(b.keys())
        assert checkpoint_steps(b, "loop")[-1] == STEPS
        for key in keys:
            if key == LOOP_ENTRY:  # pickled: compared as what it holds
                assert_same(unpack(a.get(*key)), unpack(b.get(*key)), "payload")
            else:
                x, y = a.get(*key), b.get(*key)
                assert x.dtype == y.dtype and torch.equal(x, y), key
        assert b.fsck().ok


def fresh(hf: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A fresh import of the model for a run of kills, and the run's log."""
    store = tmp_path / "st"
    tierstore.hf.import_hf(hf, store, progress=False)
    return store, tmp_path / "run.log"


@pytest.mark.parametrize("family", FAMILIES)
def test_sigkill_at_each_point_then_resume_is_bit_identical(
        family: str, server: Any, reference: Any, tmp_path: Path) -> None:
    hf, ref, ref_log = reference[family]
    store, log = fresh(hf, tmp_path)
    for kill in CHAIN:
        assert run(server, store, log, kill, family) == -9, f"no kill at {kill}"
    assert run(server, store, log, family=family) == 0
    assert_same_run(ref, ref_log, store, lines(log))
    # The payload says what a resume continues with.
    with tierstore.open(store, host_cache=0) as st:
        payload = unpack(st.get(*LOOP_ENTRY))
    assert payload["step"] == STEPS and payload["extra"] == {"rows_seen": STEPS * 2 * 2}
    assert len(payload["optimizers"]) == 2 and payload["optimizers"][0]["state"]
    assert payload["schedulers"][0]["last_epoch"] == STEPS


@pytest.mark.skipif(RANDOM_KILLS == 0, reason="set TIERSTORE_RESUME_KILLS=N for N random kills")
@pytest.mark.parametrize("family", FAMILIES)
def test_sigkill_at_random_instants_then_resume_is_bit_identical(
        family: str, server: Any, reference: Any, tmp_path: Path) -> None:
    hf, ref, ref_log = reference[family]
    store, log = fresh(hf, tmp_path)
    killed = 0
    for seed in range(RANDOM_KILLS):
        code = run(server, store, log, f"random:{seed}", family)
        assert code in (0, -9), code
        killed += code == -9
        if code == 0:  # finished before its instant came: start the next campaign over
            assert_same_run(ref, ref_log, store, lines(log))
            shutil.rmtree(store)
            log.unlink()
            fresh(hf, tmp_path)
    assert run(server, store, log, family=family) == 0
    assert_same_run(ref, ref_log, store, lines(log))
    assert killed > 0


# --------------------------------------------------------------------------- transformers.Trainer


class Crash(transformers.TrainerCallback):
    """Stops the run at the end of a step, the store already past the last checkpoint."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.at:
            raise KeyboardInterrupt


def trainer_run(store: Path, out: Path, rows: torch.Tensor, crash: int | None = None,
                resume: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``transformers.Trainer`` over ``store`` with :class:`CheckpointCallback`: four steps
    of two micro-batches, a checkpoint every two; returns the losses logged and the dense
    weights."""
    torch.manual_seed(0)
    model = tierstore.hf.load(store, trainable=True, device="cpu", host_cache="64KiB")
    opt = tierstore.hf.CombinedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                         tierstore.hf.ExpertAdamW(model, lr=3e-3),
                                         max_grad_norm=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=4, max_grad_norm=0.0, save_strategy="steps", save_steps=2, report_to=[],
        logging_strategy="steps", logging_steps=1, use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=5)
    callbacks = [tierstore.hf.CheckpointCallback(model), *([Crash(crash)] if crash else [])]
    trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, sched),
                                   train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                                   callbacks=callbacks)
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        model.tierstore.close()
    return losses, dense


def test_trainer_with_the_callback_resumes_to_the_uninterrupted_run(tmp_path: Path) -> None:
    """``transformers.Trainer``'s own checkpoints (``save_steps``) with
    :class:`tierstore.hf.CheckpointCallback`: a run stopped after step 3 (its experts updated
    past ``checkpoint-2``) and resumed with ``resume_from_checkpoint=True`` ends where the
    uninterrupted run does: losses, dense weights and every store entry bit for bit."""
    from hf_models import COMMON, prompt_ids

    make_hf_model("mixtral", tmp_path / "hf", num_local_experts=8, attention_dropout=0.1)
    for name in ("whole", "cut"):
        tierstore.hf.import_hf(tmp_path / "hf", tmp_path / name, progress=False)
    rows = prompt_ids(8, 8, COMMON["vocab_size"], seed=5)
    want, want_dense = trainer_run(tmp_path / "whole", tmp_path / "out-whole", rows)
    assert len(want) == 4
    with pytest.raises(KeyboardInterrupt):
        trainer_run(tmp_path / "cut", tmp_path / "out-cut", rows, crash=3)
    assert sorted(os.listdir(tmp_path / "out-cut")) == ["checkpoint-2"]
    got, dense = trainer_run(tmp_path / "cut", tmp_path / "out-cut", rows, resume=True)
    assert got == want, (got, want)  # the first two from checkpoint-2's log history
    for name, t in want_dense.items():
        assert torch.equal(dense[name], t), name
    with tierstore.open(tmp_path / "whole", host_cache=0) as a, \
            tierstore.open(tmp_path / "cut", host_cache=0) as b:
        keys = sorted(set(a.keys()) - {LOOP_ENTRY})  # the Trainer's payload holds no state
        assert keys == sorted(set(b.keys()) - {LOOP_ENTRY})
        for key in keys:
            assert torch.equal(a.get(*key), b.get(*key)), key
        assert checkpoint_steps(b, "loop") == [2, 4] and b.fsck().ok
