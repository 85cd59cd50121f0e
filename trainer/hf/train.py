"""Fine-tuning a stored model in a training loop of the user's own: the experts' optimizer,
the global-norm clip, and a wrapper for ``transformers.Trainer``.

``tierstore.hf.load(store, trainable=True)`` (:func:`load_trainable`) returns the model with
its dense weights as fp32 parameters and its experts served by the store trainer's
:class:`~tierstore.trainer.train.expert_states.ExpertStates`: each forward fetches the routed
experts as fp32 leaves that require grad, shared by every forward until the next
:meth:`ExpertAdamW.step` (so micro-batches accumulate into one gradient per expert, and a
gradient checkpointing recomputation reuses them and writes nothing). None of them is a
parameter of the model: ``model.parameters()`` yields the dense weights only, for any torch
optimizer, and the experts' fp32 masters, AdamW moments and step counts stay in the store.

One step of a plain loop::

    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    tierstore.hf.clip_grad_norm_(model, 1.0)   # dense and expert gradients, one norm
    dense_opt.step(); expert_opt.step()        # expert_opt = tierstore.hf.ExpertAdamW(model)
    dense_opt.zero_grad(); expert_opt.zero_grad()

:meth:`ExpertAdamW.step` is the step's end for the experts: it runs the store trainer's
AdamW (:meth:`ExpertStates.update`, the arithmetic of
:func:`tierstore.trainer.train.optim.adamw_step`) on the step's experts, writes the new
weights, moments and step counts to the store, and gives the leaves back; the next forward
fetches the updated weights.

Two update rules (``ExpertAdamW(model, rule=...)``):

- ``dense`` (the default): exactly ``torch.optim.AdamW(model.parameters())`` on
  ``transformers``' own model, whose fused ``[E, ...]`` expert parameters give an expert no
  token reached a zero gradient: its moments decay, weight decay shrinks it and the Adam
  update of its decayed moments moves it; all experts share the global step count. Only
  the routed experts are read and written each step: an expert is caught up on the steps
  it missed (each with that step's learning rate, kept in the store) when it is next
  fetched, and every expert by :func:`save` and ``export-hf``
  (:mod:`tierstore.trainer.train.dense_rule`).
- ``lazy``: an expert no token reached is left as it is (``torch.optim.AdamW`` over one
  parameter per expert, an unrouted one's ``.grad`` None); each expert has its own step
  count, and expert biases take no weight decay.

A store keeps the rule its experts were first trained with.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# The module, not its names: hf_finetune imports tierstore.hf, whose __init__ imports this
# module, so when the trainer is imported first hf_finetune is still half made here.
from tierstore.trainer.train import hf_finetune
from tierstore.trainer.train.checkpoint import STEP_KIND, initialise_imported
from tierstore.trainer.train.dense_rule import rule_of
from tierstore.trainer.train.expert_states import ExpertStates
from tierstore.trainer.train.fetch import resolve_fetch_mode
from tierstore.trainer.train.resident import TrainConfig
from torch import Tensor, nn

import tierstore

from .loader import Loaded, open_store
from .node_stores import merge_rank_entries
from .quant_train import build_trainable


def load_trainable(store: str | os.PathLike[str] | tierstore.Store, *,
                   device: torch.device, host_cache: int | str | None = None,
                   device_budget: int | str | None = None, fetch: str = "auto",
                   process_group: Any = None, paradigm: str = "auto",
                   pipeline: int | str = "auto") -> Any:
    """What ``tierstore.hf.load(store, trainable=True)`` returns: the model in training
    mode, dense weights fp32, experts trained through the store (see the module docstring).

    The first time a store is loaded trainable its experts become trainable as ``tierstore
    train`` makes them (fp32 masters, cast up exactly from a bf16 or fp16 import, dequantized
    as ``transformers`` does from a quantized one, whose ``export-hf`` packs them again:
    :mod:`tierstore.hf.quant_train`; zero moments and step counts); a store that has them already (trained before, by this or by
    ``tierstore train``) keeps them, so training continues from its moments. ``fetch``: how
    experts reach ``device`` (``queue``, ``direct`` or ``auto``, as ``tierstore train
    --fetch``); ``device_budget`` also bounds the expert weights one step may hold.

    ``process_group``: expert parallelism under torchrun (``torch.distributed.group.WORLD``,
    or ``True`` to initialise it from torchrun's environment). ``store`` is then this node's
    store (``import-hf`` of the same checkpoint on every node; its daemon's socket where the
    node's ranks share it), this rank trains only the experts it owns (E/W of every MoE
    layer), and every experts module sends its routed rows to their owners and back
    (:mod:`tierstore.trainer.dist.hf_parallel`). Each rank feeds its own rows; call
    :func:`reduce_gradients` after the backward pass, before clipping and stepping.
    ``paradigm`` and ``pipeline`` are ``tierstore train --distributed``'s: each MoE block
    sends its rows to the experts' owners (``token``), pulls the experts to its rows
    (``data``) or, with ``auto``, chooses by Janus's ratio for the tokens of its first
    call; a token-centric block runs in ``pipeline`` chunks (MPMoE; bit-identical to 1) or
    as MPMoE's model of its first call's times chooses (``auto``). Each choice is printed
    once by rank 0, and ``model.tierstore.parallel`` holds them.
    """
    mode = resolve_fetch_mode(fetch, device)
    world = None
    if process_group is not None:
        from tierstore.trainer.dist.hf_parallel import join_world

        world = join_world(process_group, device)
    st, owns = open_store(store, host_cache=host_cache, device_budget=device_budget)
    try:
        # A quantized store's packed weights become fp32 masters (tierstore.hf.quant_train).
        model, loaded = build_trainable(st, owns, device, world)
        if loaded.stored.dense_state is not None:
            raise tierstore.StoreError(f"store {st.path} holds a run of a trainer preset, "
                                       "which `tierstore train --resume` continues; a "
                                       "trainable load needs a store import-hf filled")
        if world is None:  # a node store holding every expert: a single process's now
            merge_rank_entries(st, loaded.stored)
        layout = hf_finetune.served_layout(loaded.served, st)
        mine = None
        if world is not None:
            from tierstore.trainer.dist.hf_parallel import owned_layout

            layout, mine = owned_layout(layout, world)
        if not all((layout.counts_name(k), STEP_KIND) in st for k in layout.keys):
            # Counts are written after their layer's experts: one missing means an
            # interrupted or never-run start, which is simply run (again).
            initialise_imported(st, layout, mine)
        # Sized for a step that touches every expert: the loop's batch is not known here.
        # The rule the store's experts were trained with, dense for a new fine-tune (the
        # forward may run before an ExpertAdamW says which, and must see caught-up experts).
        agree = None
        if world is not None:
            from tierstore.trainer.dist.hf_parallel import any_rank

            agree = any_rank(world)
        states = ExpertStates(st, layout, device, mode, tokens_per_step=layout.n_experts,
                              budget=device_budget, rule=rule_of(st, layout) or "dense",
                              agree=agree)
        states.begin(1)
        parallel = None
        if world is not None:
            from tierstore.trainer.dist.hf_parallel import HFExpertParallel, install_router_loss

            parallel = HFExpertParallel(world, states, layout.n_experts, paradigm, pipeline)
            install_router_loss(model, world)
        loaded.attach_trainable(states, parallel)
    except BaseException:
        if owns:
            st.close()
        raise
    return model


def _loaded(model: nn.Module) -> Loaded:
    """The tierstore side of ``model`` (or of the model a wrapper such as DDP holds) with
    trainable experts."""
    for m in (model, getattr(model, "module", None)):
        loaded = getattr(m, "tierstore", None)
        if isinstance(loaded, Loaded) and loaded.experts is not None:
            return loaded
    raise ValueError(f"{type(model).__name__} has no experts trained through a store: load it "
                     "with tierstore.hf.load(store, trainable=True)")


def expert_tensors(model: nn.Module) -> list[Tensor]:
    """The experts' fp32 leaves this step has fetched so far (their ``.grad`` is each
    routed expert's gradient); empty after :meth:`ExpertAdamW.step`."""
    return _loaded(model).experts.tensors()


def reduce_gradients(model: nn.Module) -> None:
    """After the backward pass of an expert-parallel model (``load(...,
    process_group=...)``): the dense gradients averaged over the ranks, and each owned
    expert's gradient (the sum of every rank's, as the exchanges' backward delivers it)
    divided by the world size. Then every gradient is the mean loss's over the global
    batch, each rank's batch being one slice of it, as one process computes it. Nothing to
    do without a process group."""
    loaded = _loaded(model)
    if loaded.parallel is not None:
        loaded.parallel.reduce_gradients(list(model.parameters()))


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the dense parameters and the experts
    experts together: one global norm (returned, before clipping) and one factor for all.
    Expert-parallel, the norm is the global batch's: the dense part (the same on every rank,
    after :func:`reduce_gradients`) and every rank's own experts (L2 only).

    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` alone cannot see the
    experts' gradients: they belong to leaves the store hands each step, which are not
    parameters of the model. Clipping the dense part by its own norm and skipping the
    experts gives another update than the model trained in memory."""
    loaded = _loaded(model)
    if loaded.parallel is not None:
        if norm_type != 2.0:
            raise ValueError("an expert-parallel model clips by the L2 norm")
        dense = [p.grad for p in model.parameters() if p.grad is not None]
        return loaded.parallel.clip(dense, loaded.experts.grads(), max_norm)
    params = [*model.parameters(), *expert_tensors(model)]
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                          error_if_nonfinite=error_if_nonfinite,
                                          foreach=foreach)


class ExpertAdamW(torch.optim.Optimizer):
    """AdamW for the experts of a model loaded with ``tierstore.hf.load(store,
    trainable=True)``, beside any optimizer of its dense parameters (the defaults are
    ``torch.optim.AdamW``'s).

    ``rule="dense"`` (the default): :meth:`step` is ``torch.optim.AdamW`` on the model's
    fused ``[E, ...]`` expert parameters as ``transformers`` has them: an expert no token
    reached takes the zero-gradient update (moments decay, weight decay, the Adam update of
    the decayed moments), weight decay applies to every expert tensor (biases included: the
    fused parameter is no vector), and every expert counts the global step. The missed
    updates of an expert are applied when it is next fetched (one elementwise AdamW pass per
    missed step), and of every expert by :func:`save` and ``export-hf``.

    ``rule="lazy"``: :meth:`step` updates each expert some token reached since the last step
    (its leaf has a gradient), with its own step count, exactly as ``torch.optim.AdamW`` does
    one parameter per expert; an expert no token reached (``.grad`` None there) is left as it
    is, moments and step count included. Weight decay applies to an expert's matrices, not
    to its biases.

    A store whose experts took steps under one rule refuses the other (one ValueError line).
    The new fp32 weights, the moments and the step counts go to the store, and the next
    forward computes with them. A step in which no expert has a gradient changes nothing.

    There are no parameters: ``param_groups`` holds one group with no ``params`` whose
    ``lr``, ``betas``, ``eps`` and ``weight_decay`` the step reads, so learning-rate
    schedulers work on it. The state lives in the store: :meth:`state_dict` holds the
    hyperparameters and says where the moments are.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, rule: str = "dense") -> None:
        self.loaded = _loaded(model)
        try:
            self.loaded.experts.set_rule(rule)
        except tierstore.StoreError as e:
            raise ValueError(str(e)) from None
        self.rule = rule
        super().__init__([{"params": []}],
                         {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.steps = 0

    @property
    def experts(self) -> ExpertStates:
        return self.loaded.experts

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        tc = TrainConfig(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                         weight_decay=group["weight_decay"])
        experts = self.experts
        experts.forward_done()  # whatever runs from here on is not the step's forward
        experts.update(group["lr"], tc)
        experts.end()  # leaves given back: the next forward fetches the new weights
        self.steps += 1
        experts.begin(self.steps + 1)
        self.loaded.store.tick()
        return loss

    def settle(self) -> int:
        """Bring every expert up to date with the steps taken so far, as a snapshot of the
        user's own or an export needs it (:func:`tierstore.hf.save_checkpoint`,
        :func:`save` and ``export-hf`` do it themselves). Under the lazy rule an expert that
        missed a step owes nothing. Returns how many experts moved."""
        return self.experts.catch_up_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for w in self.experts.tensors():
            if set_to_none:
                w.grad = None
            elif w.grad is not None:
                w.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["tierstore"] = {"store": str(self.loaded.store.path), "steps": self.steps,
                           "states": "expert masters, exp_avg, exp_avg_sq and per-expert step "
                                     "counts are entries of the store"}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        own = state_dict.get("tierstore", {})
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "tierstore"})
        self.steps = int(own.get("steps", self.steps))


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one, with the global-norm clip of :func:`clip_grad_norm_`
    first where ``max_grad_norm`` is given: what ``transformers.Trainer`` takes as
    ``optimizers=(CombinedOptimizer(dense, ExpertAdamW(model), max_grad_norm=1.0),
    scheduler)`` with ``TrainingArguments(max_grad_norm=0)`` (the Trainer's own clip sees the
    dense gradients only; see docs/trainer.md).

    ``param_groups`` is every optimizer's groups, the same dicts, so a scheduler built on
    this one sets every learning rate. ``last_grad_norm`` is the last step's global norm."""

    def __init__(self, *optimizers: torch.optim.Optimizer,
                 max_grad_norm: float | None = None) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        super().__init__([{"params": []}], {})
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.max_grad_norm = max_grad_norm
        experts = [o for o in optimizers if isinstance(o, ExpertAdamW)]
        if max_grad_norm is not None and not experts:
            raise ValueError("max_grad_norm needs an ExpertAdamW among the optimizers: the "
                             "global norm is taken over its model")
        self.model = experts[0].loaded.served.model if experts else None
        self.last_grad_norm: Tensor | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            assert self.model is not None
            self.last_grad_norm = clip_grad_norm_(self.model, self.max_grad_norm)
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for o, sd in zip(self.optimizers, state_dict["optimizers"], strict=True):
            o.load_state_dict(sd)
        # torch's load_state_dict gives each optimizer new group dicts: share those now, or
        # a scheduler would set learning rates nobody reads (accelerate's prepare() loads
        # the state it has just saved, so every Trainer run goes through here).
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


def save(model: nn.Module) -> None:
    """Write a trainable model's dense weights to their store entries (fp32) and flush the
    store, so that it holds the fine-tuned model whole: ``tierstore.hf.load`` and
    ``tierstore export-hf`` then give what ``model`` computes. The experts are there
    already (every :meth:`ExpertAdamW.step` writes them); under the dense rule every expert
    is first caught up to the last step."""
    loaded = _loaded(model)
    loaded.experts.catch_up_all()
    hf_finetune.write_dense(loaded.store,
                            hf_finetune.dense_entries(loaded.served.model, loaded.stored))
    loaded.store.flush()
