"""Expert-parallel fine-tuning of a model ``tierstore import-hf`` put in every node's store.

What :func:`~.trainer.train_distributed` runs when the node stores hold an imported model
(``tierstore train --distributed --store NODE_STORE`` without ``--model``). Every node's
store is filled by ``import-hf`` of the same checkpoint. On every rank the family's own
``transformers`` model is built from the node's store (:class:`HFNet`, dense weights as fp32
parameters), and its experts modules are served by :class:`.hf_parallel.HFExpertParallel`
(token-centric blocks, or data-centric ones, :mod:`.hf_pull`, per layer by Janus's ratio):

- rank ``r`` owns experts ``[r*E/W, (r+1)*E/W)`` of every MoE layer. At the first start it
  makes them trainable in its node's store (fp32 masters, zero moments, its own step-count
  entry per layer, since the node's ranks share the store; a store imported compact is
  first unpacked by the node's ranks together, :mod:`tierstore.hf.quant_train`); their
  masters and moments are read and written there only, through the node's daemon. The
  node's copies of the other experts are never read;
- dense parameters are replicated: their gradients are summed over the ranks;
- the global batch is ``W x batch_size`` rows, rank ``r`` training the r-th slice; every
  rank's loss is its batch's mean, and the gradients summed over the ranks and divided by
  ``W`` are the single process's (:meth:`.hf_parallel.HFExpertParallel.reduce_gradients`);
  the router loss is the global batch's (:func:`.hf_parallel.global_router_loss`);
- one global norm clips dense and expert gradients (dense squares plus the owned experts'
  squares summed over the ranks); each owner runs the store trainer's AdamW
  (:class:`~trainer.train.expert_states.ExpertStates`) on its experts, under the dense rule
  (the default; each rank keeps its own history beside its step counts, and every rank
  takes every global step) or the lazy one.

So a step computes what ``tierstore train --store`` computes on the global batch, but for the
order of floating-point sums. Checkpoints are the distributed trainer's (:mod:`.checkpoint`):
each node leader writes the dense weights to their entries, then the snapshot and manifest
protocol. Resuming on another world (fewer ranks, fewer nodes: the departing nodes' stores
named by ``node_stores``) moves the experts' states first (:mod:`.hf_reshard`) and takes a
checkpoint in the new layout.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import tierstore

from ..train.checkpoint import DENSE_ENTRY, RUN_ENTRY, initialise_imported, unpack
from ..train.data import Corpus
from ..train.expert_states import ExpertStates
from ..train.hf_finetune import HFNet, model_corpus, write_dense
from ..train.metrics import MetricsLog, run_steps, store_counters
from ..train.resident import (
    Metrics,
    TrainConfig,
    corpus_for,
    param_groups,
    set_rng_state,
    training_batches,
)
from . import records
from .checkpoint import PhaseHook, claim_stores, rank_rng, write_checkpoint
from .hf_parallel import (
    RULES,
    HFExpertParallel,
    any_rank,
    choose,
    global_router_loss,
    owned_layout,
)
from .hf_reshard import close_all, departed_stores, move_states
from .manifests import FORMAT
from .stepmetrics import step_record
from .world import AgreedError, World, barrier, check_divides

PathLike = str | os.PathLike[str]


def train_imported(world: World, store: tierstore.Store, run_dir: Path, steps: int,
                   seed: int | None, tc: TrainConfig, *, resume: bool, checkpoint_every: int,
                   paradigm: str = "token", rule: str | None = None,
                   metrics_path: PathLike | None = None, corpus: Corpus | None = None,
                   corpus_paths: PathLike | Sequence[PathLike] | None = None,
                   on_step: Callable[[Metrics], None] | None = None,
                   on_phase: PhaseHook | None = None, watch: Any = None,
                   pipeline: int | str = "auto",
                   node_stores: Sequence[PathLike] = ()) -> list[Metrics]:
    """Fine-tune the node stores' imported model on every rank (module docstring) until
    ``steps`` steps are done; ``tc.batch_size`` is the per-rank batch. ``paradigm``:
    ``token``, ``data`` or ``auto`` (per MoE layer, by Janus's ratio). ``rule``: the
    experts' AdamW rule (:data:`.hf_parallel.RULES`; None: a resumed run's own, else
    ``dense``). ``pipeline``: the chunks of a
    token-centric block, or ``auto`` (:mod:`.pipeline`). ``watch``: the run's
    :class:`~.faults.FaultWatch`, told when training begins. ``node_stores``: where this
    node reaches the stores of nodes that a resumed checkpoint had and this world has not
    (:mod:`.hf_reshard`)."""
    stored = _stored(store)
    saved = records.read(store, RUN_ENTRY) if resume else None
    saved = saved if isinstance(saved, dict) else {}
    if seed is None:  # a resumed run's own
        seed = int(saved.get("seed", 0))
    if rule is None:  # a resumed run's own (runs recorded before the dense rule: lazy)
        rule = str(saved.get("rule", "lazy")) if saved else "dense"
    if rule not in RULES:
        raise AgreedError(f"the experts' update rule is one of {', '.join(RULES)}, not {rule!r}")
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    net = HFNet(store, stored, tc, world.device, world)
    check_divides(net.layout.n_experts, world.size)
    layout, mine = owned_layout(net.layout, world)
    if corpus is None:
        corpus = corpus_for(tc, corpus_paths)
    corpus = model_corpus(corpus, net.tokenizer(store), net.module.config)
    global_tc = replace(tc, batch_size=tc.batch_size * world.size)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    sampler, _ = training_batches(global_tc, seed, corpus)
    opt = torch.optim.AdamW(param_groups(list(net.module.named_parameters()), tc.weight_decay),
                            lr=tc.lr, betas=tc.betas, eps=tc.eps)
    ident = {"format": FORMAT, "imported": stored.family, "hf_config": stored.hf_config,
             "train_config": asdict(global_tc), "seed": seed, "rule": rule}
    # The stores are checked for the run (its rule among its identity) and restored before
    # the experts' states are read: their rule and history are the checkpoint's.
    start, number, moved = _start(world, store, run_dir, layout, mine, ident, resume, net,
                                  opt, sampler, node_stores, on_phase)
    tokens = tc.grad_accum * global_tc.batch_size * tc.seq_len
    states = ExpertStates(store, layout, world.device, "direct", tokens, read_ahead=False,
                          zero_copy=False, rule=rule, agree=any_rank(world))
    source = None
    try:
        hidden = int(net.module.config.get_text_config().hidden_size)
        paradigms = choose(layout, hidden, paradigm, tc.batch_size * tc.seq_len, world)
        source = HFExpertParallel(world, states, layout.n_experts, paradigms, pipeline)
        net.loaded.attach_trainable(states, source)
        if watch is not None:
            watch.training = True
        if world.rank == 0:
            print(f"distributed: {world.size} ranks on {world.n_nodes} node(s), fine-tuning "
                  f"an imported {stored.family} model, {len(mine)} of {layout.n_experts} "
                  f"experts per rank per MoE layer, {rule} AdamW, paradigm per MoE layer: "
                  + ", ".join(f"{k}={v}" for k, v in paradigms.items()), flush=True)
        loop = _Loop(world, store, run_dir, net, opt, states, source, sampler, tc,
                     global_tc, ident, checkpoint_every, on_phase, number)
        if moved:  # the new layout's checkpoint: the move's commit point
            loop.checkpoint(start, {"step": start})
        path = (None if metrics_path is None
                else f"{os.fspath(metrics_path)}.rank{world.rank}")
        log = MetricsLog(path, start, None) if path is not None else None
        with global_router_loss(net.module, world):
            return run_steps(range(start, steps), lambda s: loop.step(s, steps), log, on_step)
    finally:
        if source is not None:  # its fetch thread first: it uses the states
            source.close()
        states.close()


def _stored(store: tierstore.Store) -> Any:
    from ..train.hf_finetune import imported

    stored = imported(store)
    if stored is None:
        raise AgreedError(f"store {store.path} holds no imported model")
    return stored


def _start(world: World, store: tierstore.Store, run_dir: Path, layout: Any, mine: range,
           ident: dict[str, Any], resume: bool, net: HFNet, opt: torch.optim.Optimizer,
           sampler: Any, node_stores: Sequence[PathLike], on_phase: PhaseHook | None
           ) -> tuple[int, int, bool]:
    """Bring the stores, model, optimizer and sampler to where training starts: ``(first
    step, next checkpoint number, whether experts were re-sharded)``."""
    manifest = claim_stores(world, store, run_dir, ident, resume, layout.n_experts,
                            lambda saved: "another model, batch, seed or update rule",
                            fewer_nodes=True)
    if manifest is None:
        initialise_imported(store, layout, mine)
        barrier(world)
        return 0, 1, False
    same = manifest["world_size"] == world.size and manifest["nodes"] == world.nodes
    if len(manifest["nodes"]) < world.n_nodes:
        raise AgreedError(f"checkpoint {manifest['number']} was taken on "
                          f"{len(manifest['nodes'])} node(s): an imported model's fine-tune "
                          "resumes on as many nodes or fewer")
    if world.is_node_leader:
        store.restore(manifest["tag"])
    barrier(world)  # the node's snapshot is back before anyone reads it
    if not same:
        departed = departed_stores(world, manifest, node_stores)
        try:
            move_states(world, store, net.layout, manifest, departed, on_phase)
        finally:
            close_all(departed)
        barrier(world)
    box: list[Any] = [unpack(store.get(*DENSE_ENTRY)) if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    payload = box[0]
    net.load_dense(store, {})
    opt.load_state_dict(payload["optimizer"])
    sampler.load_state_dict(payload["sampler"])
    set_rng_state(rank_rng(payload["rng"], world.rank))  # on any world (rank_rng)
    return int(manifest["step"]), int(manifest["number"]) + 1, not same


class _Loop:
    def __init__(self, world: World, store: tierstore.Store, run_dir: Path, net: HFNet,
                 opt: torch.optim.Optimizer, states: ExpertStates, source: HFExpertParallel,
                 sampler: Any, tc: TrainConfig, global_tc: TrainConfig, ident: dict[str, Any],
                 checkpoint_every: int, on_phase: PhaseHook | None, number: int) -> None:
        self.world, self.store, self.run_dir, self.net, self.opt = world, store, run_dir, net, opt
        self.states, self.source, self.sampler = states, source, sampler
        self.tc, self.global_tc, self.ident = tc, global_tc, ident
        self.checkpoint_every, self.on_phase, self.number = checkpoint_every, on_phase, number
        self.dense = [p for _, p in net.module.named_parameters()]

    def step(self, step: int, steps: int) -> Metrics:
        tc, world, states = self.tc, self.world, self.states
        before = store_counters(self.store)
        t0 = time.perf_counter()
        lr = tc.lr_for(step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        states.begin(step + 1)
        self.source.begin()
        sums = torch.zeros(3, dtype=torch.float64)
        b, r = tc.batch_size, world.rank
        for micro in range(tc.grad_accum):
            x, y = self.sampler.next_batch()
            x, y = x[r * b:(r + 1) * b].to(world.device), y[r * b:(r + 1) * b].to(world.device)
            loss, parts = self.net.losses(x, y, states)
            if micro == tc.grad_accum - 1:
                states.forward_done()
            (loss / tc.grad_accum).backward()
            sums += torch.tensor([float(parts["ce"]), float(parts["aux_loss"]),
                                  float(parts["z_loss"])], dtype=torch.float64)
        if self.on_phase is not None:  # mid-step: the gradients are in, nothing written
            self.on_phase("backward", step + 1)
        dense = self.source.reduce_gradients(self.dense)
        norm = self.source.clip(dense, states.grads(), tc.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        touched = states.update(lr, tc)
        states.end()
        self.store.tick()
        figures = self.source.step_figures()
        m = step_record(world, self.store, step, tc, self.global_tc, t0, sums, norm, lr,
                        touched, before, figures)
        done = step + 1
        if (self.checkpoint_every > 0 and done % self.checkpoint_every == 0) or done == steps:
            self.checkpoint(done, m)
        return m

    def checkpoint(self, step: int, m: Metrics) -> None:
        # Dense rule: each rank brings its experts to the step, so the snapshot holds them
        # current and its history empty.
        self.states.catch_up_all()
        if self.world.is_node_leader:  # into the snapshot the checkpoint takes next
            write_dense(self.store, self.net.entries)
        payload = {"format": FORMAT, "identity": self.ident,
                   "model_config": {"n_experts": self.net.layout.n_experts},
                   "optimizer": self.opt.state_dict(), "sampler": self.sampler.state_dict(),
                   "metrics": dict(m)}
        m["checkpoint"] = write_checkpoint(self.world, self.store, self.run_dir, self.number,
                                           step, payload, self.on_phase)
        self.number += 1

