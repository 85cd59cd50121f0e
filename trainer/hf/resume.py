"""Checkpoints of a training loop of the user's own, as store snapshots, and the bit-identical
resume from them (``tierstore.hf.save_checkpoint`` / ``tierstore.hf.load_checkpoint``, and
:class:`CheckpointCallback` for ``transformers.Trainer``).

A checkpoint is one store snapshot, ``loop-{step}``, taken by the same commit as ``tierstore
train``'s ``step-{n}`` (:func:`tierstore.trainer.train.checkpoint.commit_checkpoint`). Right
before it, the dense weights go to their ``dense.*`` entries (as :func:`tierstore.hf.save`
puts them) and everything else a step depends on goes to one entry, :data:`LOOP_ENTRY`: every
optimizer's and scheduler's ``state_dict()``, the RNG states (torch's CPU generator, CUDA's
where there is one, Python's ``random``, numpy's) and the caller's ``extra`` (a data
position, a sampler's state). The experts' fp32 masters, moments and step counts are in the
store already. The snapshot's single catalog transaction records all of them at once: a crash
before it leaves the previous checkpoint current, a crash after it this one, never a mix.

:func:`load_checkpoint` restores the latest one (the live entries, which a killed run may have
moved past it, become the snapshot's), copies its dense weights into the model in place, and
loads the optimizers, schedulers and RNGs. A store with no checkpoint of a loop gets
``loop-0`` of its present state instead, so that a run killed before its first checkpoint
starts over from the same weights rather than from experts a lost step has updated.

``transformers.Trainer`` checkpoints into directories of its own (``checkpoint-{n}``: the
dense weights, optimizer, scheduler, RNG and data position) and restores them with
``train(resume_from_checkpoint=...)``; :class:`CheckpointCallback` keeps the store in step
with them: snapshot ``loop-{n}`` right before the Trainer writes ``checkpoint-{n}``, and
the store restored to the snapshot of the step a resumed Trainer starts from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tierstore.trainer.train import hf_finetune
from tierstore.trainer.train.checkpoint import (
    KEEP_CHECKPOINTS,
    checkpoint_steps,
    checkpoint_tag,
    commit_checkpoint,
    restore_checkpoint,
)
from tierstore.trainer.train.resident import rng_state, set_rng_state
from torch import nn
from transformers.trainer_callback import TrainerCallback

from .train import CombinedOptimizer, ExpertAdamW, _loaded

SERIES = "loop"  # snapshots loop-{step}; `tierstore train`'s are step-{n}
LOOP_ENTRY = ("trainer.loop", "checkpoint")
VERSION = 1

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
Schedulers = Any  # an LR scheduler (anything with state_dict / load_state_dict) or a sequence


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` resumed from: the step the checkpoint was taken after,
    the ``extra`` saved with it (None for the start, ``loop-0``), and its snapshot's tag."""

    step: int
    extra: Any
    tag: str


def _listed(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


def _expert_optimizers(optimizers: list[torch.optim.Optimizer]) -> list[ExpertAdamW]:
    found: list[ExpertAdamW] = []
    for o in optimizers:
        inner = o.optimizers if isinstance(o, CombinedOptimizer) else [o]
        found += [x for x in inner if isinstance(x, ExpertAdamW)]
    return found


def _check_between_steps(model: nn.Module) -> None:
    """A checkpoint holds weights and optimizer states, not gradients: one taken while a
    step's gradients wait for their optimizer step would resume without them."""
    loaded = _loaded(model)
    pending = [w for w in loaded.experts.tensors() if w.grad is not None and bool(w.grad.any())]
    pending += [p for p in model.parameters() if p.grad is not None and bool(p.grad.any())]
    if pending:
        raise ValueError("a checkpoint is taken between steps: the model holds gradients no "
                         "optimizer step has applied yet; save after step() and zero_grad()")


def save_checkpoint(model: nn.Module, step: int, *, optimizers: Optimizers = (),
                    schedulers: Schedulers = (), extra: Any = None,
                    keep: int = KEEP_CHECKPOINTS) -> str:
    """Checkpoint a trainable model's training after ``step`` steps as snapshot
    ``loop-{step}`` of its store; returns the tag.

    ``optimizers``: every optimizer of the loop (the dense one, :class:`ExpertAdamW`, or a
    :class:`CombinedOptimizer`), ``schedulers`` every LR scheduler, each saved by its
    ``state_dict()``; ``extra``: anything else the loop needs to go on (picklable: a data
    position, a sampler's ``state_dict()``). The RNG states are saved too. The latest
    ``keep`` checkpoints of the loop are kept. Call it between steps (after the optimizers'
    ``step()`` and ``zero_grad()``): gradients are not saved, and pending ones are refused.
    """
    if step < 0:
        raise ValueError(f"step {step} is negative")
    if keep < 1:
        raise ValueError(f"keep {keep} must be at least 1")
    loaded = _loaded(model)
    opts = _listed(optimizers)
    _check_between_steps(model)
    # Under the dense rule the experts no step reached since their last fetch owe the
    # zero-gradient updates of the steps they missed; a checkpoint holds them paid, as an
    # export does (a Trainer's callback passes no optimizers, so this is not their hook).
    loaded.experts.catch_up_all()
    store = loaded.store
    hf_finetune.write_dense(store, hf_finetune.dense_entries(loaded.served.model, loaded.stored))
    payload = {"version": VERSION, "step": step, "extra": extra, "rng": rng_state(),
               "optimizers": [o.state_dict() for o in opts],
               "schedulers": [s.state_dict() for s in _listed(schedulers)]}
    return commit_checkpoint(store, step, LOOP_ENTRY, payload, SERIES, keep)


def load_checkpoint(model: nn.Module, *, optimizers: Optimizers = (),
                    schedulers: Schedulers = ()) -> Checkpoint:
    """Resume a trainable model's training from the latest ``loop-{n}`` checkpoint of its
    store: the store's live entries become the snapshot's (experts, their moments and step
    counts, dense weights), the dense weights are copied into ``model`` in place, and
    ``optimizers``, ``schedulers`` (the same ones, in the order :func:`save_checkpoint` was
    given them) and the RNG states are loaded. Returns the step and ``extra``.

    Where the store holds no checkpoint of a loop yet, its present state is checkpointed as
    ``loop-0`` and step 0 returned (``extra`` None), so that a run killed before its first
    checkpoint of its own starts over from exactly where this one started. Call it once,
    before the first step, after building the optimizers and schedulers."""
    loaded = _loaded(model)
    opts, scheds = _listed(optimizers), _listed(schedulers)
    store = loaded.store
    if not checkpoint_steps(store, SERIES):
        save_checkpoint(model, 0, optimizers=opts, schedulers=scheds)
    payload = _restore(loaded, None)
    tag = checkpoint_tag(int(payload["step"]), SERIES)
    for what, mine, saved in (("optimizers", opts, payload["optimizers"]),
                              ("schedulers", scheds, payload["schedulers"])):
        if len(mine) != len(saved):
            raise ValueError(f"checkpoint {tag} holds {len(saved)} {what}, {len(mine)} given: "
                             "pass those save_checkpoint was given, in the same order")
    for o, sd in zip(opts, payload["optimizers"], strict=True):
        o.load_state_dict(sd)
    for s, sd in zip(scheds, payload["schedulers"], strict=True):
        s.load_state_dict(sd)
    set_rng_state(payload["rng"])
    steps = max([o.steps for o in _expert_optimizers(opts)], default=0)
    loaded.experts.begin(steps + 1)
    return Checkpoint(int(payload["step"]), payload["extra"], tag)


def _restore(loaded: Any, step: int | None) -> dict[str, Any]:
    """The store back to checkpoint ``loop-{step}`` (the latest for None), the dense weights
    read back into the model in place; returns the checkpoint's payload."""
    loaded.experts.drop_all()  # prefetched copies are of the live versions the restore replaces
    payload = restore_checkpoint(loaded.store, LOOP_ENTRY, SERIES, step)
    assert payload is not None
    loaded.experts.set_rule(loaded.experts.rule)  # the dense rule's history as restored
    hf_finetune.read_dense(loaded.store,
                           hf_finetune.dense_entries(loaded.served.model, loaded.stored))
    return payload


class CheckpointCallback(TrainerCallback):
    """Keeps a trainable model's store in step with ``transformers.Trainer``'s checkpoints::

        trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, sched),
                                       callbacks=[tierstore.hf.CheckpointCallback(model)])
        trainer.train(resume_from_checkpoint=True)   # or a checkpoint-{n} directory

    - Whenever the Trainer is about to save ``checkpoint-{n}``, the store takes snapshot
      ``loop-{n}`` (:func:`save_checkpoint`: the experts' states and the dense weights; the
      Trainer's directory holds the optimizers, scheduler, RNG and data position). The
      snapshot comes first, so every complete ``checkpoint-{n}`` directory has its snapshot.
    - When training begins at step ``n`` (a resume), the store is restored to ``loop-{n}``
      and the dense weights are read back from it. At step 0 it is restored to ``loop-0``
      if there is one (the run starts over), else ``loop-0`` is taken.

    ``keep``: the snapshots kept (default: ``args.save_total_limit``, else 2); a directory
    the Trainer keeps beyond them cannot be resumed from.
    """

    def __init__(self, model: nn.Module, keep: int | None = None) -> None:
        self.model, self.keep = model, keep
        _loaded(model)  # refuse a model without trainable experts now

    def _keep(self, args: Any) -> int:
        return self.keep or getattr(args, "save_total_limit", None) or KEEP_CHECKPOINTS

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        loaded = _loaded(self.model)
        step, store = int(state.global_step), loaded.store
        steps = checkpoint_steps(store, SERIES)
        if step == 0 and not steps:
            save_checkpoint(self.model, 0, keep=self._keep(args))
            return
        if step not in steps:
            have = ", ".join(f"loop-{s}" for s in steps) or "none"
            raise ValueError(f"store {store.path} has no snapshot loop-{step} for the Trainer's "
                             f"step {step} (it holds {have}); resume from a checkpoint it "
                             "has, or drop them to start a new run")
        _restore(loaded, step)
        loaded.experts.begin(step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if control.should_save:
            save_checkpoint(self.model, int(state.global_step), keep=self._keep(args))
