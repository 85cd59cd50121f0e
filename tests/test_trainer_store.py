"""The store-backed trainer: equal to the resident reference, lazy AdamW, checkpoints and
resume (including after SIGKILL), and ``tierstore train``."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from tierstore.trainer.model import EXPERT_WEIGHTS, expert_name, init_expert
from tierstore.trainer.presets import PRESETS, MoEConfig
from tierstore.trainer.train.checkpoint import (
    DENSE_ENTRY,
    MOMENTS,
    STEP_KIND,
    TrainerError,
    checkpoint_steps,
    step_counts_name,
)
from tierstore.trainer.train.data import Corpus, load_corpus
from tierstore.trainer.train.fetch import RoutingPredictor
from tierstore.trainer.train.metrics import MetricsLog
from tierstore.trainer.train.resident import (
    TrainConfig,
    load_checkpoint,
    param_groups,
    train_resident,
)
from tierstore.trainer.train.store_trainer import train_store

import tierstore
from tierstore.cli import main

TC = TrainConfig(batch_size=4, seq_len=32, grad_accum=2, eval_every=3, eval_batches=2,
                 lr=3e-3, warmup_steps=2, decay_steps=10)
SEED, STEPS = 3, 6
# tiny's expert states are 4.5 MiB; this cache holds a few dozen of its 32 KiB entries.
SMALL_CACHE = "256KiB"
SLAB = "16MiB"


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(max_bytes=1024 * 1024)


@pytest.fixture(scope="module")
def resident(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference run: its per-step metrics and its final checkpoint."""
    d = tmp_path_factory.mktemp("resident")
    hist = train_resident("tiny", STEPS, seed=SEED, train=TC, corpus=corpus, checkpoint_dir=d)
    ckpt = load_checkpoint(d)
    assert ckpt is not None
    return {"history": hist, "ckpt": ckpt}


@pytest.fixture(scope="module", params=["direct", "queue", "zero-copy"])
def over_store(request: pytest.FixtureRequest, corpus: Corpus,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same run over a store whose host cache is far smaller than the expert states,
    with experts fetched by ``get_many``, or through the device prefetch queue with the
    moments read ahead on a thread (what an accelerator run does), or lent straight out of
    the cache with new states staged in it (zero-copy: the lent leaves pin their slots for
    the step, so the cache is a little larger, to leave evictable room)."""
    mode = request.param
    d = tmp_path_factory.mktemp(f"store-{mode}")
    hist = train_store("tiny", STEPS, seed=SEED, train=TC, corpus=corpus, store_path=d / "st",
                       host_cache="1MiB" if mode == "zero-copy" else SMALL_CACHE,
                       slab_size=SLAB, device_budget="12MiB",
                       fetch="queue" if mode == "queue" else "direct",
                       read_ahead=mode == "queue", zero_copy=mode == "zero-copy")
    return {"history": hist, "store": d / "st", "mode": mode}


def _expert_states(store_path: Path, cfg: MoEConfig) -> dict[tuple[str, str], torch.Tensor]:
    with tierstore.open(store_path) as st:
        keys = [(expert_name(layer, e, w), k) for layer in cfg.moe_layers
                for e in range(cfg.n_experts) for w in EXPERT_WEIGHTS
                for k in ("param", *MOMENTS)]
        keys += [(step_counts_name(layer), STEP_KIND) for layer in cfg.moe_layers]
        return {k: v for k, v in st.get_many(keys).items()}  # type: ignore[misc]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_over_the_store_matches_resident_with_evictions_every_step(
        resident: dict[str, Any], over_store: dict[str, Any]) -> None:
    ref, got = resident["history"], over_store["history"]
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        for key in ("loss", "aux_loss", "z_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
        assert b["lr"] == a["lr"]
        assert ("val_loss" in a) == ("val_loss" in b)
        if "val_loss" in a:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
        assert b["cache_misses"] > 0, b
        # Lent leaves stay pinned for the step, so with zero-copy in a cache this small
        # a step may find nothing evictable; copies leave every slot evictable.
        assert b["evictions"] > 0 or over_store["mode"] == "zero-copy", b
        for key in ("tokens_per_s", "stall_frac", "hit_rate"):
            assert b[key] is not None and math.isfinite(b[key]) and b[key] >= 0
        assert 0 <= b["stall_frac"] < 1 and 0 < b["experts_touched"] <= 16
    assert got[-1]["checkpoint"] == f"step-{STEPS}"
    assert sum(m["evictions"] for m in got) > 0
    if "prefetched" in got[0]:  # queue mode predicts from the routing history
        assert got[0]["prefetched"] == 0  # no history yet
        assert all(m["prefetched"] > 0 and m["prefetch_accuracy"] > 0.5 for m in got[1:])
    states = _expert_states(over_store["store"], PRESETS["tiny"])
    for name, want in resident["ckpt"]["model"].items():
        if ".experts." in name:
            assert _rel(states[(name, "param")], want) < 1e-5, name
    with tierstore.open(over_store["store"]) as st:
        assert st.fsck().ok


def _torch_adamw_state(ckpt: dict[str, Any], weight_decay: float) -> dict[str, Any]:
    """A resident checkpoint's torch.optim.AdamW state by parameter name (the optimizer
    numbers parameters in :func:`param_groups` order)."""
    named = [(n, torch.nn.Parameter(t)) for n, t in ckpt["model"].items()]
    by_id = {id(p): n for n, p in named}
    order = [by_id[id(p)] for g in param_groups(named, weight_decay) for p in g["params"]]
    return {order[i]: s for i, s in ckpt["optimizer"]["state"].items()}


def test_expert_updates_equal_torch_adamw_when_every_expert_trains_every_step(
        corpus: Corpus, tmp_path: Path) -> None:
    # Four experts, two per token, 256 tokens a step: every expert gets tokens every step.
    cfg = replace(PRESETS["tiny"], n_experts=4)
    tc, steps = replace(TC, eval_every=0), 4
    train_resident(cfg, steps, seed=SEED, train=tc, corpus=corpus,
                   checkpoint_dir=tmp_path / "res")
    train_store(cfg, steps, seed=SEED, train=tc, corpus=corpus, store_path=tmp_path / "st",
                host_cache=SMALL_CACHE, slab_size=SLAB, trace_path=tmp_path / "trace.csv")
    trace = tierstore.lab.read_trace(tmp_path / "trace.csv")
    for step in range(1, steps + 1):
        for layer in cfg.moe_layers:
            rows = (trace.step == step) & (trace.layer == layer)
            assert sorted(trace.expert[rows].tolist()) == list(range(cfg.n_experts))
    ckpt = load_checkpoint(tmp_path / "res")
    assert ckpt is not None
    states = _expert_states(tmp_path / "st", cfg)
    checked = 0
    for name, s in _torch_adamw_state(ckpt, tc.weight_decay).items():
        if ".experts." not in name:
            continue
        assert int(s["step"]) == steps
        assert _rel(states[(name, "param")], ckpt["model"][name]) < 1e-5, name
        for kind in MOMENTS:
            assert _rel(states[(name, kind)], s[kind]) < 1e-5, (name, kind)
        checked += 1
    assert checked == len(cfg.moe_layers) * cfg.n_experts * len(EXPERT_WEIGHTS)
    for layer in cfg.moe_layers:
        assert states[(step_counts_name(layer), STEP_KIND)].tolist() == [steps] * cfg.n_experts


def test_routing_predictor_follows_decayed_counts() -> None:
    p = RoutingPredictor([0, 1], n_experts=6, decay=0.5)
    assert p.predict(0) == []
    p.observe(0, [1, 2, 3])
    p.observe(0, [3, 4])
    assert p.predict(0) == [3, 4]  # as many as last step, the highest decayed counts
    p.observe(0, [5, 0, 1])
    assert p.predict(0) == [0, 1, 5]  # 1: 1.25, 0 and 5: 1.0, ahead of 3: 0.75
    assert p.predict(1) == []


def test_metrics_log_keeps_what_the_checkpoint_covers(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    # Killed after step 3's snapshot but before its line was written, mid-way through 5.
    path.write_text("".join(json.dumps({"step": n}) + "\n" for n in (1, 2, 4)) + '{"st')
    log = MetricsLog(path, 3, last={"step": 3, "checkpoint": "step-3"})
    log.write({"step": 4, "loss": 1.0})
    log.close()
    assert _lines(path) == [{"step": 1}, {"step": 2}, {"step": 3, "checkpoint": "step-3"},
                            {"step": 4, "loss": 1.0}]
    MetricsLog(path, 0).close()  # a fresh run starts the file over
    assert path.read_text() == ""


def test_lazy_adamw_leaves_unrouted_experts_alone(corpus: Corpus, tmp_path: Path) -> None:
    """Few tokens, many experts: most experts sit out most steps. Their states and step
    counts stay put, and the run still equals the resident one."""
    cfg = replace(PRESETS["tiny"], n_experts=16, top_k=1)
    tc = replace(TC, batch_size=1, seq_len=8, grad_accum=1, eval_every=0)
    steps = 4
    ref = train_resident(cfg, steps, seed=1, train=tc, corpus=corpus,
                         checkpoint_dir=tmp_path / "res")
    got = train_store(cfg, steps, seed=1, train=tc, corpus=corpus, store_path=tmp_path / "st",
                      host_cache="1MiB", slab_size=SLAB, trace_path=tmp_path / "trace.csv")
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    trace = tierstore.lab.read_trace(tmp_path / "trace.csv")
    states = _expert_states(tmp_path / "st", cfg)
    ckpt = load_checkpoint(tmp_path / "res")
    assert ckpt is not None
    idle = 0
    for layer in cfg.moe_layers:
        counts = states[(step_counts_name(layer), STEP_KIND)].tolist()
        for e in range(cfg.n_experts):
            touched = int(((trace.layer == layer) & (trace.expert == e)).sum())
            assert counts[e] == touched
            for w, init in zip(EXPERT_WEIGHTS, init_expert(cfg, 1, layer, e)):
                name = expert_name(layer, e, w)
                assert _rel(states[(name, "param")], ckpt["model"][name]) < 1e-5
                if touched == 0:
                    idle += 1
                    assert torch.equal(states[(name, "param")], init)
                    assert not states[(name, "exp_avg")].any()
                    assert not states[(name, "exp_avg_sq")].any()
    assert idle > 0
    assert any(0 < c < steps for layer in cfg.moe_layers
               for c in states[(step_counts_name(layer), STEP_KIND)].tolist())


def test_resume_equals_uninterrupted(corpus: Corpus, tmp_path: Path) -> None:
    kw = {"seed": 5, "train": TC, "corpus": corpus, "host_cache": SMALL_CACHE,
          "slab_size": SLAB, "checkpoint_every": 2}
    whole = train_store("tiny", STEPS, store_path=tmp_path / "whole", **kw)
    first = train_store("tiny", 3, store_path=tmp_path / "split", fetch="queue", **kw)
    rest = train_store("tiny", STEPS, store_path=tmp_path / "split", resume=True, **kw)
    assert [m["step"] for m in rest] == [4, 5, 6]
    for a, b in zip(whole, first + rest):
        for key in ("step", "loss", "aux_loss", "z_loss", "grad_norm", "lr"):
            assert a[key] == b[key], (a["step"], key)
        assert a.get("val_loss") == b.get("val_loss")
    assert [m.get("checkpoint") for m in whole] == [None, "step-2", None, "step-4", None,
                                                   "step-6"]
    a, b = _expert_states(tmp_path / "whole", PRESETS["tiny"]), _expert_states(
        tmp_path / "split", PRESETS["tiny"])
    for key, t in a.items():
        assert torch.equal(t, b[key]), key
    for path in ("whole", "split"):
        with tierstore.open(tmp_path / path) as st:
            assert checkpoint_steps(st) == [4, 6]  # the latest two
            assert st.fsck().ok
    # a finished run has nothing left to do
    assert train_store("tiny", STEPS, store_path=tmp_path / "split", resume=True, **kw) == []


def test_resume_before_the_first_checkpoint_starts_over(corpus: Corpus, tmp_path: Path) -> None:
    kw = {"seed": 2, "train": replace(TC, eval_every=0), "corpus": corpus,
          "host_cache": SMALL_CACHE, "slab_size": SLAB}
    fresh = train_store("tiny", 3, store_path=tmp_path / "a", **kw)

    def crash(m: dict[str, Any]) -> None:
        if m["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_store("tiny", 3, store_path=tmp_path / "b", on_step=crash, **kw)
    again = train_store("tiny", 3, store_path=tmp_path / "b", resume=True, **kw)
    assert [m["loss"] for m in again] == [m["loss"] for m in fresh]


def test_a_store_is_only_reused_to_resume_its_own_run(corpus: Corpus, tmp_path: Path) -> None:
    kw = {"train": replace(TC, eval_every=0), "corpus": corpus, "host_cache": SMALL_CACHE,
          "slab_size": SLAB}
    train_store("tiny", 1, seed=0, store_path=tmp_path / "st", **kw)
    with pytest.raises(TrainerError, match="already holds a training run"):
        train_store("tiny", 2, seed=0, store_path=tmp_path / "st", **kw)
    with pytest.raises(TrainerError, match="seed 0, not 1"):
        train_store("tiny", 2, seed=1, store_path=tmp_path / "st", resume=True, **kw)
    with pytest.raises(TrainerError, match="different model"):
        train_store(replace(PRESETS["tiny"], n_experts=4), 2, seed=0,
                    store_path=tmp_path / "st", resume=True, **kw)
    with pytest.raises(TrainerError, match="hyperparameters: lr="):
        train_store("tiny", 2, seed=0, store_path=tmp_path / "st", resume=True,
                    **{**kw, "train": replace(kw["train"], lr=1e-3)})
    with tierstore.open(tmp_path / "foreign", create=True, slab_size=SLAB) as st:
        st.put("layers.0.experts.0.w1", torch.zeros(2))
    with pytest.raises(TrainerError, match="no training run"):
        train_store("tiny", 1, store_path=tmp_path / "foreign", **kw)
    for fetch in ("queue", "direct"):
        with pytest.raises(TrainerError, match="--device-budget 256.0 KiB is below"):
            train_store("tiny", 1, store_path=tmp_path / f"tight-{fetch}", fetch=fetch,
                        device_budget="256KiB", **kw)


def test_bfloat16_compute_over_the_store(corpus: Corpus, tmp_path: Path) -> None:
    tc = replace(TC, dtype="bfloat16", eval_every=0)
    hist = train_store("tiny", 2, seed=0, train=tc, corpus=corpus, store_path=tmp_path / "st",
                       host_cache=SMALL_CACHE, slab_size=SLAB)
    assert all(math.isfinite(m["loss"]) for m in hist)
    with tierstore.open(tmp_path / "st") as st:  # master weights stay fp32
        assert st.info(expert_name(0, 0, "w1")).dtype == torch.float32


# --------------------------------------------------------------------------- the CLI

CLI_OPTS = ["--batch-size", "4", "--seq-len", "32", "--slab-size", SLAB, "--device", "cpu"]
REQUIRED_KEYS = {"step", "loss", "tokens_per_s", "hit_rate", "stall_frac"}


def _lines(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines (a line cut short by a kill is skipped)."""
    out = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):
            out.append(json.loads(line))
    return out


def test_cli_train_writes_metrics_and_resumes(tmp_path: Path) -> None:
    runner = CliRunner()
    metrics = tmp_path / "m.jsonl"
    args = ["train", "--store", str(tmp_path / "st"), "--model", "tiny", "--steps", "3",
            "--metrics", str(metrics), "--host-cache", SMALL_CACHE, *CLI_OPTS]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    lines = _lines(metrics)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(m.keys() >= REQUIRED_KEYS for m in lines)
    assert "checkpoint step-3" in res.output
    # the same store again: refused without --resume, in one line
    res = runner.invoke(main, args)
    assert res.exit_code == 2 and "pass --resume" in res.output
    # --resume needs no option the run started with
    res = runner.invoke(main, ["train", "--store", str(tmp_path / "st"), "--steps", "4",
                               "--resume", "--metrics", str(metrics)])
    assert res.exit_code == 0, res.output
    assert [m["step"] for m in _lines(metrics)] == [1, 2, 3, 4]


def test_cli_train_resume_without_a_run_says_it_starts_at_step_0(tmp_path: Path) -> None:
    """A preemptible job passes --resume from its first launch: that launch trains from
    scratch, and says so on stderr."""
    runner = CliRunner()
    store = tmp_path / "st"
    args = ["train", "--store", str(store), "--model", "tiny", "--host-cache", SMALL_CACHE,
            "--resume", *CLI_OPTS]
    res = runner.invoke(main, [*args, "--steps", "1"])
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stderr.splitlines() if "to resume" in line]
    assert notes == [f"tierstore train: store {store} holds no training run to resume; "
                     "training starts at step 0"], res.stderr
    assert "steps 1-1" in res.stdout
    # Relaunched, it resumes the run the first launch started, and has nothing to say.
    res = runner.invoke(main, [*args, "--steps", "2"])
    assert res.exit_code == 0, res.output
    assert "to resume" not in res.stderr and "steps 2-2" in res.stdout, res.output


def test_cli_train_resident_and_usage_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    metrics = tmp_path / "r.jsonl"
    res = runner.invoke(main, ["train", "--resident", "--model", "tiny", "--steps", "2",
                               "--metrics", str(metrics), *CLI_OPTS])
    assert res.exit_code == 0, res.output
    lines = _lines(metrics)
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m.keys() >= REQUIRED_KEYS for m in lines)
    res = runner.invoke(main, ["train", "--model", "tiny", "--steps", "2"])
    assert res.exit_code == 2 and "--store or --connect is required" in res.output
    res = runner.invoke(main, ["train", "--resident", "--model", "huge", "--steps", "2"])
    assert res.exit_code == 2 and "unknown model preset 'huge'" in res.output


def test_sigkill_then_resume_continues_from_the_last_checkpoint(tmp_path: Path) -> None:
    store, metrics = tmp_path / "st", tmp_path / "m.jsonl"
    every = 3
    cmd = [sys.executable, "-m", "tierstore.cli", "train", "--store", str(store),
           "--model", "tiny", "--seed", "7", "--checkpoint-every", str(every),
           "--host-cache", SMALL_CACHE, "--eval-every", "0", "--metrics", str(metrics),
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
            if ckpts and seen[-1]["step"] >= ckpts[0] + 2:  # mid-way between checkpoints
                break
            time.sleep(0.05)
        assert child.poll() is None, log.read_text()
        assert ckpts, "no checkpoint within 120 s"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    before = {m["step"]: m for m in _lines(metrics)}
    target = max(before) + 4  # beyond any checkpoint the child may have taken
    done = subprocess.run([*cmd, "--steps", str(target), "--resume"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    after = _lines(metrics)
    assert [m["step"] for m in after] == list(range(1, target + 1))
    found = re.search(r"steps (\d+)-(\d+)", done.stdout)
    assert found is not None, done.stdout
    resumed_from = int(found.group(1)) - 1
    assert resumed_from % every == 0 and resumed_from >= min(
        m["step"] for m in before.values() if "checkpoint" in m)
    for m in after[:resumed_from]:  # what the checkpoint covers is kept as it was written
        assert m == before.get(m["step"], m)
    assert after[resumed_from - 1]["checkpoint"] == f"step-{resumed_from}"
    for m in after[resumed_from:]:  # steps run again after the kill agree with the first try
        if m["step"] in before:
            assert m["loss"] == before[m["step"]]["loss"], m["step"]
    with tierstore.open(store) as st:
        assert st.fsck().ok
        assert checkpoint_steps(st)[-1] == target
        assert st.get(*DENSE_ENTRY).numel() > 0
