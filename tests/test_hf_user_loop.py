"""Fine-tuning an imported model in a training loop of the user's own (``tierstore.hf.load(
store, trainable=True)``, :class:`tierstore.hf.ExpertAdamW`, :func:`tierstore.hf.clip_grad_norm_`,
:class:`tierstore.hf.CombinedOptimizer`).

A plain PyTorch loop (dense ``torch.optim.AdamW`` beside ``ExpertAdamW``, the global clip, a
``LambdaLR`` on both, two micro-batches a step) is held to the same ``transformers`` model
trained in memory by one ``torch.optim.AdamW`` over one parameter per expert, an unrouted
expert's ``.grad`` None (:func:`tierstore.trainer.train.hf_resident.train_hf_resident`), and
``transformers.Trainer`` with the wrapper to that plain loop."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tierstore.hf
import torch
from tierstore.hf.layout import stored_model
from tierstore.trainer.train.checkpoint import MOMENTS, STEP_KIND
from tierstore.trainer.train.data import Corpus
from tierstore.trainer.train.hf_finetune import hf_losses
from tierstore.trainer.train.hf_resident import train_hf_resident
from tierstore.trainer.train.resident import TrainConfig, param_groups, training_batches

import tierstore

transformers = pytest.importorskip("transformers")
from hf_models import COMMON, count_expert_calls, make_hf_model, prompt_ids  # noqa: E402

# Two micro-batches of 4 tokens a step over 8 experts, so that some experts get no token in
# a step (the lazy rule is exercised); a clip far below the gradients' norm, so it scales
# every step; a fine-tuning learning rate (see test_finetune_hf.py's TC for why).
TC = TrainConfig(batch_size=1, seq_len=4, grad_accum=2, lr=1e-4, min_lr=1e-5, warmup_steps=1,
                 decay_steps=4, clip=0.5, eval_every=0)
STEPS, SEED = 3, 3
EXPERTS = {"mixtral": {"num_local_experts": 8, "output_router_logits": True,
                       "router_aux_loss_coef": 0.05},
           "deepseek_v3": {"n_routed_experts": 8}}
# Mixtral's experts come through the store's (threaded) prefetch queue, DeepSeek-V3's with
# get_many; both through a host cache far smaller than the expert states.
HOW = {"mixtral": {"fetch": "queue"}, "deepseek_v3": {"fetch": "direct"}}
SMALL_CACHE = "64KiB"


@pytest.fixture(autouse=True)
def _remove_stores(tmp_path: Path) -> Iterator[None]:
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def random_corpus() -> Corpus:
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, COMMON["vocab_size"], size=4096).astype(np.int32)
    return Corpus(train=tokens, val=tokens[:64], train_files=[], val_files=[], roots=[])


def imported(family: str, root: Path, *names: str, **over: Any) -> Any:
    """A tiny ``family`` model saved under ``root / "hf"`` and imported into each of
    ``root / name``; returns the ``transformers`` model (fp32)."""
    hf = make_hf_model(family, root / "hf", **{**EXPERTS.get(family, {}), **over})
    for name in names:
        tierstore.hf.import_hf(root / "hf", root / name, progress=False)
    return hf


def plain_loop(model: Any, steps: int, tc: TrainConfig, corpus: Corpus,
               rule: str = "lazy") -> list[dict[str, float]]:
    """The loop a user writes: the dense parameters with ``torch.optim.AdamW`` (weight decay
    on matrices), the experts with ``ExpertAdamW`` (the lazy rule unless ``rule`` says
    otherwise; the dense rule's family matrix is test_hf_finetune_families.py), one global
    clip, one schedule on both."""
    sampler, _ = training_batches(tc, SEED, corpus)
    dense = torch.optim.AdamW(param_groups(list(model.named_parameters()), tc.weight_decay),
                              lr=tc.lr, betas=tc.betas, eps=tc.eps)
    experts = tierstore.hf.ExpertAdamW(model, lr=tc.lr, betas=tc.betas, eps=tc.eps,
                                       weight_decay=tc.weight_decay, rule=rule)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: tc.lr_for(s) / tc.lr)
                 for o in (dense, experts)]
    history = []
    for _ in range(steps):
        ce = aux = 0.0
        for _ in range(tc.grad_accum):
            x, y = sampler.next_batch()
            loss, parts = hf_losses(model, x, y, autocast=False)
            (loss / tc.grad_accum).backward()
            ce += float(parts["ce"]) / tc.grad_accum
            aux += float(parts["aux_loss"]) / tc.grad_accum
        norm = tierstore.hf.clip_grad_norm_(model, tc.clip)
        dense.step()
        experts.step()
        for s in schedules:
            s.step()
        dense.zero_grad()
        experts.zero_grad()
        history.append({"loss": ce, "aux_loss": aux, "grad_norm": float(norm)})
    return history


def expert_states(store: tierstore.Store, kinds: tuple[str, ...] = ("param", *MOMENTS),
                  counts: bool = True) -> dict[tuple[str, str], torch.Tensor]:
    """The expert entries of a store, by (name, kind): weights and moments, and each
    layer's step counts."""
    sm = stored_model(store)
    keys = [(m.prefix, STEP_KIND) for m in sm.experts] if counts else []
    keys += [(f"{m.prefix}.{e}.{part}", kind) for m in sm.experts for e in range(m.num_experts)
             for _, parts in m.params for part in parts for kind in kinds]
    return {k: v.clone() for k, v in store.get_many(keys).items()}


def stored_states(path: Path, **kw: Any) -> dict[tuple[str, str], torch.Tensor]:
    with tierstore.open(path) as st:
        return expert_states(st, **kw)


def assert_same_states(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor],
                       atol: float = 0.0) -> None:
    assert sorted(a) == sorted(b)
    for k, t in a.items():
        torch.testing.assert_close(b[k], t, atol=atol, rtol=0, msg=str(k))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_plain_loop_matches_transformers_with_adamw_in_memory(family: str,
                                                             tmp_path: Path) -> None:
    hf = imported(family, tmp_path, "st")
    start = stored_states(tmp_path / "st", kinds=("param",), counts=False)
    corpus = random_corpus()
    model = tierstore.hf.load(tmp_path / "st", trainable=True, device="cpu",
                              host_cache=SMALL_CACHE, **HOW[family])
    assert model.training
    # The experts are no parameters of the model: any torch optimizer sees the dense ones.
    loaded = model.tierstore
    modules = [layer.module_name + "." for layer in loaded.served.layers.values()]
    names = [n for n, _ in model.named_parameters()]
    assert names and not [n for n in names if n.startswith(tuple(modules))]
    assert len(names) == len([n for n, _ in hf.named_parameters()]) - 2 * len(modules)

    got = plain_loop(model, STEPS, TC, corpus)
    ref, per_expert = train_hf_resident(hf, STEPS, SEED, TC, corpus=corpus)
    for a, b in zip(ref, got, strict=True):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(b[key] - a[key]) < 1e-5, (key, a[key], b[key])
        assert b["grad_norm"] > 2 * TC.clip  # the clip scaled every step
    if family == "mixtral":
        assert all(m["aux_loss"] > 0.5 for m in got)

    # Weights, dense and expert alike, and what the model computes.
    dense = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), dense[name].detach(), atol=1e-5, rtol=0,
                                   msg=name)
    x = prompt_ids(2, 6, COMMON["vocab_size"])
    model.eval()
    hf.eval()
    with torch.no_grad():
        mine, want = model(x).logits, hf(x).logits
    torch.testing.assert_close(mine, want, atol=1e-5, rtol=0)
    tierstore.hf.save(model)  # the dense weights into the store beside the experts
    loaded.close()

    states = stored_states(tmp_path / "st")
    for name, t in per_expert.weights().items():
        torch.testing.assert_close(states[(name, "param")], t, atol=1e-5, rtol=0, msg=name)
    counts = torch.stack([t for (_, kind), t in states.items() if kind == STEP_KIND])
    # Lazy: some expert missed a step (its count says so), none was updated more often.
    assert int(counts.min()) < STEPS and int(counts.max()) == STEPS, counts
    moved = max(float((states[k] - t).abs().max()) for k, t in start.items())
    assert moved > 20 * 1e-5  # the comparison is far finer than what training changed

    # The store holds the trained model whole, and is sound.
    served = tierstore.hf.load(tmp_path / "st", device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(served(x).logits, mine, atol=1e-5, rtol=0)
    served.tierstore.close()
    with tierstore.open(tmp_path / "st") as st:
        assert st.fsck().ok


def test_step_and_zero_grad_change_only_what_a_backward_reached(tmp_path: Path) -> None:
    """A step with no backward since the last (none at all, or a forward only) leaves the
    store as it is; ``zero_grad`` drops the experts' gradients, so the step after it is one
    with no gradients (and ``set_to_none=False`` zeroes them: AdamW with a zero gradient,
    as torch's)."""
    imported("mixtral", tmp_path, "st")
    model = tierstore.hf.load(tmp_path / "st", trainable=True, device="cpu")
    opt = tierstore.hf.ExpertAdamW(model, lr=1e-2)
    x = prompt_ids(1, 8, COMMON["vocab_size"])
    store = tmp_path / "st"

    def states() -> dict[tuple[str, str], torch.Tensor]:
        return {k: v.clone() for k, v in expert_states(model.tierstore.store).items()}

    model(input_ids=x, labels=x).loss.backward()
    assert tierstore.hf.train.expert_tensors(model)  # the step's leaves, with gradients
    opt.step()
    assert tierstore.hf.train.expert_tensors(model) == []
    after = states()
    opt.step()  # no backward since
    assert_same_states(after, states())
    model(input_ids=x)  # a forward only
    opt.step()
    assert_same_states(after, states())

    model(input_ids=x, labels=x).loss.backward()
    leaves = tierstore.hf.train.expert_tensors(model)
    assert leaves and all(w.grad is not None for w in leaves)
    opt.zero_grad()
    assert all(w.grad is None for w in leaves)
    opt.step()
    assert_same_states(after, states())

    model(input_ids=x, labels=x).loss.backward()
    leaves = tierstore.hf.train.expert_tensors(model)
    opt.zero_grad(set_to_none=False)
    assert leaves and all(w.grad is not None and not bool(w.grad.any()) for w in leaves)
    opt.step()  # zero gradients: the routed experts' moments decay and their counts advance
    now = states()
    changed = [k for k in after if not torch.equal(after[k], now[k])]
    assert any(k[1] == STEP_KIND for k in changed) and any(k[1] == MOMENTS[1] for k in changed)
    sd = opt.state_dict()
    assert sd["tierstore"]["store"] == str(store) and sd["param_groups"][0]["params"] == []
    opt.load_state_dict(sd)
    model.tierstore.close()


def test_gradient_checkpointing_recomputes_experts_without_store_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``transformers``' activation checkpointing runs every decoder layer again in
    backward, experts included: in the user's loop too the recomputation reuses the step's
    leaves, and the store sees exactly the writes of a loop without it (no host cache:
    every write reaches the backing tier within its step)."""
    imported("qwen3_moe", tmp_path, "off", "on")
    calls = count_expert_calls(monkeypatch)
    corpus, written, seen, runs = random_corpus(), {}, {}, {}
    for name in ("off", "on"):
        model = tierstore.hf.load(tmp_path / name, trainable=True, device="cpu", host_cache=0)
        if name == "on":
            model.activation_checkpointing_enable()
        calls.clear()
        before = backing_written(model)
        runs[name] = plain_loop(model, 2, TC, corpus)
        written[name], seen[name] = backing_written(model) - before, len(calls)
        model.tierstore.close()
    assert seen["on"] == 2 * seen["off"] > 0
    assert written["on"] == written["off"] > 0
    for a, b in zip(runs["off"], runs["on"], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6
    assert_same_states(stored_states(tmp_path / "off"), stored_states(tmp_path / "on"),
                       atol=1e-6)


def backing_written(model: Any) -> int:
    return sum(t["bytes_written"] for t in model.tierstore.store.stats()["tiers"].values())


def test_transformers_trainer_with_the_wrapper_matches_the_plain_loop(tmp_path: Path) -> None:
    """``transformers.Trainer`` given ``CombinedOptimizer`` (dense AdamW, ExpertAdamW, the
    global clip) and a schedule, with its own clip off (``max_grad_norm=0``), trains as the
    plain loop with ``clip_grad_norm_`` does: two steps of two micro-batches."""
    imported("mixtral", tmp_path, "plain", "trainer", output_router_logits=False)
    rows = prompt_ids(4, 8, COMMON["vocab_size"], seed=5)
    lr, clip, lam = 1e-3, 0.5, (lambda s: 1.0 / (1 + s))

    plain = tierstore.hf.load(tmp_path / "plain", trainable=True, device="cpu")
    dense = torch.optim.AdamW(plain.parameters(), lr=lr)
    experts = tierstore.hf.ExpertAdamW(plain, lr=lr)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in (dense, experts)]
    norms = []
    for step in range(2):
        for i in (2 * step, 2 * step + 1):
            x = rows[i:i + 1]
            (plain(input_ids=x, labels=x).loss / 2).backward()
        norms.append(float(tierstore.hf.clip_grad_norm_(plain, clip)))
        for o in (dense, experts):
            o.step()
        for s in schedules:
            s.step()
        dense.zero_grad()
        experts.zero_grad()
    assert min(norms) > clip

    model = tierstore.hf.load(tmp_path / "trainer", trainable=True, device="cpu")
    opt = tierstore.hf.CombinedOptimizer(torch.optim.AdamW(model.parameters(), lr=lr),
                                         tierstore.hf.ExpertAdamW(model, lr=lr),
                                         max_grad_norm=clip)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=1,
        gradient_accumulation_steps=2, max_steps=2, max_grad_norm=0.0,
        train_sampling_strategy="sequential", report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    data = [{"input_ids": r, "labels": r} for r in rows]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lam)))
    trainer.train()
    assert opt.last_grad_norm is not None and abs(float(opt.last_grad_norm) - norms[-1]) < 1e-5

    want = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name].detach(), atol=1e-6, rtol=0, msg=name)
    got, ref = expert_states(model.tierstore.store), expert_states(plain.tierstore.store)
    assert_same_states(ref, got, atol=1e-6)
    assert int(sum(t.sum() for k, t in got.items() if k[1] == STEP_KIND)) > 0
    model.tierstore.close()
    plain.tierstore.close()


def test_what_a_trainable_load_and_the_expert_optimizer_refuse(tmp_path: Path) -> None:
    """Inference modes, a dtype other than fp32 and a store holding a preset's trainer run
    are refused by a trainable load; ExpertAdamW and clip_grad_norm_ refuse a model whose
    experts do not train through a store, an unknown update rule, and the other rule than
    the one a store's experts took steps with. Each is one ValueError or StoreError line."""
    from tierstore.trainer.presets import MoEConfig
    from tierstore.trainer.train.store_trainer import train_store

    imported("mixtral", tmp_path, "st", "lazy", "dense")
    x = prompt_ids(1, 8, COMMON["vocab_size"])
    for rule, other in (("lazy", "dense"), ("dense", "lazy")):
        model = tierstore.hf.load(tmp_path / rule, trainable=True, device="cpu")
        with pytest.raises(ValueError, match="update rule must be one of dense, lazy"):
            tierstore.hf.ExpertAdamW(model, rule="eager")
        tierstore.hf.ExpertAdamW(model, rule=other)  # no step taken yet: either rule
        opt = tierstore.hf.ExpertAdamW(model, rule=rule)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        with pytest.raises(ValueError, match=f"trained with the {rule} update rule") as e:
            tierstore.hf.ExpertAdamW(model, rule=other)
        assert "\n" not in str(e.value)
        model.tierstore.close()
        again = tierstore.hf.load(tmp_path / rule, trainable=True, device="cpu")
        with pytest.raises(ValueError, match=f"trained with the {rule} update rule"):
            tierstore.hf.ExpertAdamW(again, rule=other)
        again.tierstore.close()
    with pytest.raises(ValueError, match="serves inference"):
        tierstore.hf.load(tmp_path / "st", trainable=True, mode="ring")
    with pytest.raises(ValueError, match="fp32"):
        tierstore.hf.load(tmp_path / "st", trainable=True, dtype="bfloat16")
    served = tierstore.hf.load(tmp_path / "st", device="cpu")
    for use in (tierstore.hf.ExpertAdamW, lambda m: tierstore.hf.clip_grad_norm_(m, 1.0)):
        with pytest.raises(ValueError, match="trainable=True"):
            use(served)
    served.tierstore.close()

    cfg = MoEConfig(d_model=32, n_layers=2, n_heads=4, d_ff=48, n_experts=4, top_k=2,
                    max_seq_len=32)
    data = np.random.default_rng(0).integers(0, 256, size=4096).astype(np.uint8)
    train_store(cfg, 1, 0, TrainConfig(batch_size=1, seq_len=16, eval_every=0),
                store_path=tmp_path / "run", host_cache="16MiB", slab_size="16MiB",
                corpus=Corpus(train=data, val=data[:256], train_files=[], val_files=[],
                              roots=[]), device="cpu")
    with pytest.raises(tierstore.StoreError, match="trainer preset"):
        tierstore.hf.load(tmp_path / "run", trainable=True, device="cpu")


def expert_parallel_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tmp_path/ep``: Mixtral trained ``STEPS`` dense-rule steps by ``load(...,
    process_group=...)`` in a gloo group of one, in this process, ending without ``save``;
    ``tmp_path/one``: the same import, untrained."""
    import socket

    import torch.distributed as dist

    imported("mixtral", tmp_path, "ep", "one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo")
    try:
        model = tierstore.hf.load(tmp_path / "ep", trainable=True, host_cache=SMALL_CACHE,
                                  process_group=dist.group.WORLD)
        plain_loop(model, STEPS, TC, random_corpus(), rule="dense")
        model.tierstore.close()
    finally:
        dist.destroy_process_group()


# A load in a child process that SIGKILLs itself right after its n-th committed delete.
KILLED_LOAD = """
import os, signal, sys
import tierstore.hf
from tierstore.writes import WritePath
real, done = WritePath._delete, [0]
def _delete(self, *args):
    out = real(self, *args)
    done[0] += 1
    if done[0] == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    return out
WritePath._delete = _delete
tierstore.hf.load(sys.argv[1], trainable=True, host_cache="64KiB")
"""


def test_a_node_store_load_killed_midway_is_finished_by_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The merge of a node store's per-rank entries (a trainable load without a process
    group) SIGKILLed after each of its deletes: the store is fsck-clean and the next load
    ends in the uninterrupted merge's state, never refusing the store as partial."""
    import subprocess
    import sys

    expert_parallel_store(tmp_path, monkeypatch)
    for name in ("whole", "k1", "k2", "k3"):
        shutil.copytree(tmp_path / "ep", tmp_path / name)
    tierstore.hf.load(tmp_path / "whole", trainable=True, host_cache=SMALL_CACHE).tierstore.close()
    want = stored_states(tmp_path / "whole")
    for n in (1, 2, 3):  # a layer's counts; both layers' (history left); the history too
        path = tmp_path / f"k{n}"
        got = subprocess.run([sys.executable, "-c", KILLED_LOAD, str(path), str(n)])
        assert got.returncode == -9
        with tierstore.open(path) as st:
            assert st.fsck().ok
            assert ("trainer.ranks_merged", "meta") in st
        tierstore.hf.load(path, trainable=True, host_cache=SMALL_CACHE).tierstore.close()
        assert_same_states(want, stored_states(path))
        with tierstore.open(path) as st:
            assert st.names("trainer.dense_rule") == ["trainer.dense_rule"]
            assert "trainer.ranks_merged" not in st.names("trainer.")
            assert not [x for x in st.names(kind=STEP_KIND) if ".owned" in x]


def test_an_expert_parallel_store_keeps_its_rank_history_and_export_catches_it_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load(..., process_group=...)`` (a gloo group of one, in this process) trains under
    the dense rule by default, with the rank's own history beside its own step counts, and
    a loop that ends without ``save`` leaves experts behind the last step. ``export-hf``
    catches them up from that history: the store then holds, expert for expert, what the
    same loop without a process group holds after ``save``. Loaded trainable without a
    process group (the store holds every expert: a world of one node), the store becomes a
    single process's: its experts caught up the same way, and the rank's counts and history
    under the store-wide names, each equal to the single process's."""
    expert_parallel_store(tmp_path, monkeypatch)
    one = tierstore.hf.load(tmp_path / "one", trainable=True, host_cache=SMALL_CACHE)
    plain_loop(one, STEPS, TC, random_corpus(), rule="dense")
    tierstore.hf.save(one)
    one.tierstore.close()
    with tierstore.open(tmp_path / "ep") as st:
        assert st.names("trainer.dense_rule") == ["trainer.dense_rule.owned0-7"]
        counts = [st.get(f"{m.prefix}.owned0-7", kind=STEP_KIND) for m in stored_model(st).experts]
        assert any(int(c.min()) < STEPS for c in counts)  # some expert missed the last step
    shutil.copytree(tmp_path / "ep", tmp_path / "ep2")  # the same store, for the load below
    tierstore.hf.export_hf(tmp_path / "ep", tmp_path / "out", progress=False)
    with tierstore.open(tmp_path / "ep") as st:
        counts = [st.get(f"{m.prefix}.owned0-7", kind=STEP_KIND) for m in stored_model(st).experts]
        assert all(int(c.min()) == STEPS for c in counts)
    assert_same_states(stored_states(tmp_path / "one", counts=False),
                       stored_states(tmp_path / "ep", counts=False), atol=1e-6)
    # Loaded without a process group: the rank's counts and history become the store's.
    model = tierstore.hf.load(tmp_path / "ep2", trainable=True, host_cache=SMALL_CACHE)
    model.tierstore.close()
    with tierstore.open(tmp_path / "ep2") as st:
        assert st.names("trainer.dense_rule") == ["trainer.dense_rule"]
        assert not [n for n in st.names(kind=STEP_KIND) if ".owned" in n]
        assert "trainer.ranks_merged" not in st.names("trainer.")
        history = st.get("trainer.dense_rule", "steps")
    with tierstore.open(tmp_path / "one") as st:
        assert torch.equal(history, st.get("trainer.dense_rule", "steps"))
    assert_same_states(stored_states(tmp_path / "one"), stored_states(tmp_path / "ep2"),
                       atol=1e-6)
