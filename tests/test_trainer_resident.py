"""The resident reference trainer and the optimizer arithmetic it shares."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tierstore.trainer.model import ExpertWeights, MoEModel, init_expert
from tierstore.trainer.presets import PRESETS, MoEConfig
from tierstore.trainer.train.data import BatchSampler, Corpus, load_corpus
from tierstore.trainer.train.optim import adamw_step, clip_grads_, lr_at
from tierstore.trainer.train.resident import (
    CHECKPOINT_NAME,
    TrainConfig,
    load_checkpoint,
    param_groups,
    train_resident,
)

SMALL_TC = TrainConfig(batch_size=4, seq_len=32, grad_accum=2, eval_every=3, eval_batches=2,
                       lr=3e-3, warmup_steps=2, decay_steps=10)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(max_bytes=1024 * 1024)


def test_tiny_model_learns_the_default_corpus(corpus: Corpus) -> None:
    tc = TrainConfig(batch_size=8, seq_len=64, eval_every=30, eval_batches=4, lr=3e-3)
    seen: list[int] = []
    hist = train_resident("tiny", 30, seed=0, train=tc, corpus=corpus,
                          on_step=lambda m: seen.append(m["step"]))
    assert [m["step"] for m in hist] == seen == list(range(1, 31))
    losses = [m["loss"] for m in hist]
    assert abs(losses[0] - math.log(256)) < 0.3
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 1.0
    assert hist[-1]["val_loss"] < math.log(256) - 1.0
    assert "val_loss" not in hist[0]
    for m in hist:
        assert m["tokens"] == 8 * 64 and m["tokens_per_s"] > 0 and m["lr"] == 3e-3
        assert math.isfinite(m["grad_norm"]) and m["aux_loss"] > 0 and m["z_loss"] > 0


def test_resume_reproduces_the_uninterrupted_run(corpus: Corpus, tmp_path: Path) -> None:
    whole = train_resident("tiny", 8, seed=5, train=SMALL_TC, corpus=corpus,
                           checkpoint_dir=tmp_path / "whole", checkpoint_every=4)
    first = train_resident("tiny", 4, seed=5, train=SMALL_TC, corpus=corpus,
                           checkpoint_dir=tmp_path / "split")
    assert (tmp_path / "split" / CHECKPOINT_NAME).exists()
    rest = train_resident("tiny", 8, seed=5, train=SMALL_TC, corpus=corpus,
                          checkpoint_dir=tmp_path / "split", resume=True)
    assert [m["step"] for m in rest] == [5, 6, 7, 8]
    for a, b in zip(whole, first + rest):
        for key in ("step", "loss", "aux_loss", "z_loss", "grad_norm", "lr"):
            assert a[key] == b[key], (a["step"], key)
    assert [m.get("val_loss") for m in whole[4:]] == [m.get("val_loss") for m in rest]
    a, b = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "split")
    assert a is not None and b is not None and a["step"] == b["step"] == 8
    assert a["sampler"] == b["sampler"]
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    # resuming a finished run does nothing
    assert train_resident("tiny", 8, seed=5, train=SMALL_TC, corpus=corpus,
                          checkpoint_dir=tmp_path / "split", resume=True) == []


def test_resume_refuses_a_different_setup(corpus: Corpus, tmp_path: Path) -> None:
    train_resident("tiny", 1, seed=0, train=SMALL_TC, corpus=corpus, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="seed"):
        train_resident("tiny", 2, seed=1, train=SMALL_TC, corpus=corpus,
                       checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match="hyperparameters"):
        train_resident("tiny", 2, seed=0, train=replace(SMALL_TC, lr=1e-3), corpus=corpus,
                       checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match="model configuration"):
        train_resident(replace(PRESETS["tiny"], n_experts=4), 2, seed=0, train=SMALL_TC,
                       corpus=corpus, checkpoint_dir=tmp_path, resume=True)


def test_resume_without_a_checkpoint_starts_fresh(corpus: Corpus, tmp_path: Path) -> None:
    a = train_resident("tiny", 2, seed=2, train=SMALL_TC, corpus=corpus)
    b = train_resident("tiny", 2, seed=2, train=SMALL_TC, corpus=corpus,
                       checkpoint_dir=tmp_path / "none", resume=True)
    assert [m["loss"] for m in a] == [m["loss"] for m in b]


def test_bfloat16_training_runs(corpus: Corpus) -> None:
    hist = train_resident("tiny", 3, seed=0, train=replace(SMALL_TC, dtype="bfloat16"),
                          corpus=corpus)
    assert all(math.isfinite(m["loss"]) for m in hist)


def test_unrouted_experts_are_left_alone_by_adamw() -> None:
    cfg = MoEConfig(d_model=32, n_layers=1, n_heads=2, d_ff=32, n_experts=8, top_k=1,
                    max_seq_len=16)
    model = MoEModel(cfg, seed=0)
    opt = torch.optim.AdamW(param_groups(list(model.named_parameters()), 0.1), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.expert_parameters()}
    idx = torch.randint(0, 256, (1, 3))
    _, loss, info = model(idx, idx)
    assert loss is not None
    loss.backward()
    opt.step()
    routed = set(info["routing"][0].flatten().tolist())
    assert len(routed) < cfg.n_experts
    for name, p in model.expert_parameters():
        e = int(name.split(".")[3])
        if e in routed:
            assert not torch.equal(p, before[name]) and opt.state[p]["step"] == 1
        else:
            assert torch.equal(p, before[name]) and p not in opt.state


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_step_equals_torch_adamw(weight_decay: float) -> None:
    g = torch.Generator().manual_seed(0)
    lr, betas, eps = 1e-2, (0.9, 0.95), 1e-8
    shapes = [(16, 8), (8, 16), (5,)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = torch.optim.AdamW(ref, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    mine = [(p.detach().clone(), torch.zeros(p.shape), torch.zeros(p.shape)) for p in ref]
    counts = [0] * len(ref)
    for step in range(12):
        for i, p in enumerate(ref):
            # Parameter 2 sits out every third step: lazy semantics on both sides.
            if i == 2 and step % 3 == 1:
                p.grad = None
                continue
            p.grad = torch.randn(p.shape, generator=g) * (1 + step)
        opt.step()
        for i, p in enumerate(ref):
            if p.grad is None:
                continue
            counts[i] += 1
            param, m, v = mine[i]
            adamw_step(param, p.grad, m, v, counts[i], lr, betas, eps, weight_decay)
        for i, p in enumerate(ref):
            param, m, v = mine[i]
            torch.testing.assert_close(param, p.detach(), atol=1e-6, rtol=0)
            if p in opt.state:
                st = opt.state[p]
                assert int(st["step"]) == counts[i]
                torch.testing.assert_close(m, st["exp_avg"], atol=1e-6, rtol=0)
                torch.testing.assert_close(v, st["exp_avg_sq"], atol=1e-6, rtol=0)
    assert counts == [12, 12, 8]
    with pytest.raises(ValueError):
        adamw_step(torch.zeros(3), torch.ones(3), torch.zeros(3), torch.zeros(3), 0, lr)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_step_out_of_place_gives_the_same_bits(weight_decay: float) -> None:
    g = torch.Generator().manual_seed(3)
    p, m, v = (torch.randn(32, 16, generator=g) for _ in range(3))
    v = v.abs()
    grad = torch.randn(32, 16, generator=g)
    inputs = [t.clone() for t in (p, m, v)]
    out = tuple(torch.full_like(t, float("nan")) for t in (p, m, v))
    adamw_step(*inputs[:1], grad, *inputs[1:], 3, 1e-2, (0.9, 0.95), 1e-8, weight_decay,
               out=out)
    for before, after in zip((p, m, v), inputs):  # the inputs are left alone
        assert torch.equal(before, after)
    adamw_step(p, grad, m, v, 3, 1e-2, (0.9, 0.95), 1e-8, weight_decay)
    for a, b in zip((p, m, v), out):
        assert torch.equal(a, b)


def test_clip_grads_equals_torch_clip_grad_norm() -> None:
    g = torch.Generator().manual_seed(1)
    for max_norm in (0.5, 1e6):
        ref = [torch.nn.Parameter(torch.zeros(s)) for s in ((10, 4), (7,), (3, 3))]
        for p in ref:
            p.grad = torch.randn(p.shape, generator=g)
        grads = [p.grad.clone() for p in ref]  # type: ignore[union-attr]
        want = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        got = clip_grads_(grads, max_norm)
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
        for p, gr in zip(ref, grads):
            torch.testing.assert_close(gr, p.grad, atol=1e-7, rtol=1e-6)


def test_lr_schedule() -> None:
    assert lr_at(0, 1.0, warmup_steps=4) == 0.25
    assert lr_at(3, 1.0, warmup_steps=4) == 1.0
    assert lr_at(100, 1.0, warmup_steps=4) == 1.0
    assert lr_at(4, 1.0, warmup_steps=4, decay_steps=10, min_lr=0.1) == 1.0
    assert lr_at(9, 1.0, warmup_steps=4, decay_steps=10, min_lr=0.1) == pytest.approx(0.55)
    assert lr_at(14, 1.0, warmup_steps=4, decay_steps=10, min_lr=0.1) == pytest.approx(0.1)
    assert lr_at(99, 1.0, warmup_steps=4, decay_steps=10, min_lr=0.1) == pytest.approx(0.1)


def test_explicit_weights_training_loop_matches_resident(corpus: Corpus) -> None:
    """The loop a store-backed trainer runs, with a dict standing in for the store: experts
    fetched per step through the provider, one global clipping norm over dense and expert
    gradients, torch AdamW for dense parameters and lazy ``adamw_step`` for touched experts."""
    cfg, seed, steps = PRESETS["tiny"], 3, 6
    tc = replace(SMALL_TC, eval_every=0)
    ref = train_resident(cfg, steps, seed=seed, train=tc, corpus=corpus)

    net = MoEModel(cfg, seed=seed, resident_experts=False)
    dense = list(net.named_parameters())
    opt = torch.optim.AdamW(param_groups(dense, tc.weight_decay), lr=tc.lr, betas=tc.betas,
                            eps=tc.eps)
    shapes = list(cfg.expert_shapes().values())
    states = {
        (layer, e): {"param": list(init_expert(cfg, seed, layer, e)),
                     "exp_avg": [torch.zeros(s) for s in shapes],
                     "exp_avg_sq": [torch.zeros(s) for s in shapes], "step": 0}
        for layer in cfg.moe_layers for e in range(cfg.n_experts)
    }
    # One set of leaves per step, so micro-batches accumulate into the same gradients.
    leaves: dict[tuple[int, int], ExpertWeights] = {}

    def provider(layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        for e in ids:
            if (layer, e) not in leaves:
                w1, w2, w3 = (t.clone().requires_grad_(True) for t in states[(layer, e)]["param"])
                leaves[(layer, e)] = (w1, w2, w3)
        return {e: leaves[(layer, e)] for e in ids}

    sampler = BatchSampler(corpus.train, tc.batch_size, tc.seq_len, seed)
    for step in range(steps):
        lr = tc.lr_for(step)
        for group in opt.param_groups:
            group["lr"] = lr
        leaves.clear()
        ce = 0.0
        for _ in range(tc.grad_accum):
            x, y = sampler.next_batch()
            _, loss, info = net(x, y, experts=provider)
            assert loss is not None
            (loss / tc.grad_accum).backward()
            ce += float(info["ce"]) / tc.grad_accum
        grads = [p.grad for _, p in dense if p.grad is not None]
        grads += [w.grad for ws in leaves.values() for w in ws if w.grad is not None]
        assert tc.clip is not None
        clip_grads_(grads, tc.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for key, ws in leaves.items():
            st = states[key]
            st["step"] += 1
            for i, w in enumerate(ws):
                assert w.grad is not None
                adamw_step(st["param"][i], w.grad, st["exp_avg"][i], st["exp_avg_sq"][i],
                           st["step"], lr, tc.betas, tc.eps, tc.weight_decay)
        assert ce == pytest.approx(ref[step]["loss"], rel=1e-5)
