"""Training across processes and machines: expert parallelism over one store per node.

Run under torchrun (``env://``), one process per rank. With world size W:

- every rank owns E/W experts of every MoE layer (:mod:`.world`); their fp32 masters, AdamW
  moments and step counts live in the node's store, behind the node's daemon
  (:mod:`.sidecar`), and only there;
- dense parameters are replicated: every rank starts from the same seed, and after the
  backward pass their gradients are summed over the ranks (one flat all-reduce), so every
  replica takes the same AdamW step;
- the data: every rank draws the same global batch of ``W x batch_size`` rows (the
  sampler's position is global, so the data order does not depend on W) and trains on its
  own ``batch_size`` rows, rank r the r-th slice;
- MoE layers run token-centric or data-centric per block (:mod:`.exchange`).

One step computes what :func:`trainer.train.store_trainer.train_store` computes on the
global batch: the same losses (each rank's batch mean, averaged), the load-balancing loss
from the global batch's routing (counts summed over ranks), the same gradients (each rank's
loss divided by W, gradients summed), one global norm for clipping (dense norms plus the
owned experts' norms summed over ranks) and the lazy AdamW of each expert at its owner.
Only the order of floating-point sums differs.

Checkpoints are all-or-nothing over the nodes (:mod:`.checkpoint`).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

import tierstore

from ..model import MoEModel
from ..presets import TrainModel, config_from_dict
from ..train.data import Corpus
from ..train.metrics import MetricsLog, run_steps, store_counters
from ..train.resident import (
    Metrics,
    TrainConfig,
    param_groups,
    resolve_model_config,
    training_batches,
)
from .checkpoint import PhaseHook, dense_payload, saved_identity, start_run, write_checkpoint
from .collectives import all_reduce_sum_, clip_global, sum_over_ranks
from ..train.hf_finetune import imported
from .exchange import ExpertParallel, choose_paradigms, janus_ratio
from .hf_trainer import train_imported
from .faults import SILENT_AFTER_S, FaultWatch
from .owned import OwnedExperts
from .sidecar import DaemonSettings, default_run_dir, start_node_daemon
from .stepmetrics import step_record
from .world import (
    AgreedError,
    DistributedError,
    World,
    check_divides,
    close_world,
    init_world,
    node_barrier,
)

PathLike = str | os.PathLike[str]


def train_distributed(
    model: TrainModel | str | None,
    steps: int,
    seed: int | None = 0,
    train: TrainConfig | None = None,
    *,
    store_path: PathLike,
    run_dir: PathLike | None = None,
    connect: str | None = None,
    host_cache: int | None = 256 << 20,
    backing: str | None = None,
    pmem_path: PathLike | None = None,
    pmem_size: int | None = None,
    slab_size: int | None = None,
    paradigm: str = "auto",
    credits: int | None = None,
    hierarchical: bool = False,
    checkpoint_every: int = 0,
    resume: bool = False,
    metrics_path: PathLike | None = None,
    corpus: Corpus | None = None,
    corpus_paths: PathLike | Sequence[PathLike] | None = None,
    device: str = "cpu",
    overrides: dict[str, Any] | None = None,
    on_step: Callable[[Metrics], None] | None = None,
    on_phase: PhaseHook | None = None,
    rule: str | None = None,
    pipeline: int | str | None = None,
    failure_timeout_s: float = SILENT_AFTER_S,
    node_stores: Sequence[PathLike] = (),
) -> list[Metrics]:
    """Train ``model`` on every rank of the torchrun world until ``steps`` steps are done;
    returns this rank's metrics of the steps this call ran.

    ``store_path`` is this node's store (created if missing) and ``run_dir`` its run
    directory (default ``store_path + '.run'``): the daemon's socket and log, and the
    checkpoint manifests. ``connect`` uses a daemon the user runs instead of starting one.
    ``host_cache``, ``backing``, ``pmem_path``, ``pmem_size`` and ``slab_size`` are the
    node daemon's and its store's (``tierstore serve``'s options; None: not asked, and a
    daemon or store already there is not checked for it); one that differs from what is
    there is refused.
    ``train.batch_size`` is the per-rank batch; the global batch is W times it.
    ``model=None`` with ``resume`` continues the run the stores hold with its own model,
    hyperparameters (the per-rank batch being its global batch over W) and seed
    (``seed=None``); ``overrides`` are :class:`TrainConfig` fields set on top, which must
    agree with the run's.
    ``paradigm``: ``token``, ``data`` or ``auto`` (per block, by Janus's ratio).
    ``credits``: the most pulled experts a rank may hold at once in data-centric blocks.
    ``hierarchical``: token-centric exchanges in two stages, inside each node first (the
    same numbers; fewer, larger messages between nodes).
    ``metrics_path``: one JSON object per step per rank, ``{path}.rank{r}``.
    ``failure_timeout_s``: a rank (or its host) silent this long counts as gone
    (:mod:`.faults`; one that dies, or whose node daemon dies, is seen at once).
    ``on_phase(phase, n)`` is called at the points of a checkpoint (``snapshot``,
    ``manifest``) and of a re-shard (``moved``, ``sent``): see :mod:`.reshard`; fine-tuning
    an import, also mid-step ``n``, after its backward passes (``backward``).

    ``model=None`` where the node stores hold a model ``tierstore import-hf`` put there (the
    same checkpoint in every node's store) fine-tunes it expert-parallel through its own
    ``transformers`` class (:mod:`.hf_trainer`); ``rule`` is the experts' AdamW rule there
    (or ``overrides["update_rule"]``; None: a resumed run's own, else ``dense``), and
    ``pipeline`` the chunks of its token-centric blocks (``auto`` by default;
    :mod:`.pipeline`), which a preset's run refuses. ``node_stores``: where this node reaches
    the stores of nodes that the checkpoint resumed had and this world has not (a shared
    path, or a copy of the store directory): their experts' states move into the remaining
    nodes' stores (:mod:`.hf_reshard`; an imported model's fine-tune only).
    """
    if steps < 0 or checkpoint_every < 0:
        raise ValueError("steps and checkpoint_every must be >= 0")
    try:
        world = init_world(device)
    except RuntimeError as e:  # gloo's or the rendezvous's, as one line
        raise DistributedError(
            "the ranks did not form a process group ("
            + " ".join(str(e).split("\n")[0].split())[:200] + "): a rank failed or did not "
            "start (its node's torchrun output says which); rerun with --resume") from None
    run = Path(run_dir) if run_dir is not None else default_run_dir(store_path)
    settings = DaemonSettings(host_cache, backing, None if pmem_path is None
                              else os.fspath(pmem_path), pmem_size, slab_size)
    # From here on a rank that fails tells the others, and they end with one line naming
    # it instead of gloo's traceback, or instead of waiting on it (:mod:`.faults`).
    watch = FaultWatch.start(world, failure_timeout_s)
    try:
        daemon = start_node_daemon(world, store_path, run, settings, connect)
        store = daemon.connect()
    except BaseException as e:
        raise watch.failed(e) from None
    # The node's daemon ending under the run ends this rank at once, naming it (whatever
    # the main thread is doing), and so every rank.
    watch.watch_daemon(daemon.pidfd, daemon.lost())
    finished = False
    try:
        stored = imported(store)
        if stored is not None and model is not None:
            raise AgreedError(f"store {store.path} holds an imported {stored.family} model, "
                              "which is what it trains: drop --model")
        if stored is not None:
            # The node stores hold an import: the family's own transformers model, fine-tuned
            # expert-parallel over the tierstore experts backend (.hf_trainer).
            if credits is not None or hierarchical:
                raise AgreedError("--credits and --hierarchical-a2a shape a preset's "
                                  "exchanges; an imported model's blocks take neither")
            tc = replace(train or TrainConfig(), **(overrides or {}))
            history = train_imported(
                world, store, run, steps, seed, replace(tc, update_rule=None), resume=resume,
                checkpoint_every=checkpoint_every, paradigm=paradigm,
                rule=rule if rule is not None else tc.update_rule,
                metrics_path=metrics_path, corpus=corpus, corpus_paths=corpus_paths,
                on_step=on_step, on_phase=on_phase, watch=watch,
                pipeline="auto" if pipeline is None else pipeline, node_stores=node_stores)
            watch.close()
            finished = True
            return history
        if node_stores:
            raise AgreedError("--node-store moves the experts of an imported model's "
                              "fine-tune (a store import-hf filled) off departing nodes; a "
                              "preset's run resumes on at least as many nodes")
        if pipeline is not None:
            raise AgreedError("--pipeline splits the token-centric blocks of an imported "
                              "model (a store import-hf filled); a preset's are not split")
        asked = rule or (overrides or {}).get("update_rule") or (train and train.update_rule)
        if asked not in (None, "lazy"):
            raise AgreedError(f"update rule {asked!r} is for fine-tuning imported models; a "
                              "preset trains with the lazy rule")
        overrides = {k: v for k, v in (overrides or {}).items() if k != "update_rule"}
        if model is None and not resume:
            model = "tiny"
        cfg, tc, seed = _settings(world, store, model, train, seed, resume, overrides or {})
        check_divides(cfg.n_experts, world.size)
        global_tc = replace(tc, batch_size=tc.batch_size * world.size)
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        sampler, val_batches = training_batches(global_tc, seed, corpus, corpus_paths)
        net = MoEModel(cfg, seed=seed, resident_experts=False).to(world.device)
        net.train()
        opt = torch.optim.AdamW(param_groups(list(net.named_parameters()), tc.weight_decay),
                                lr=tc.lr, betas=tc.betas, eps=tc.eps)
        experts = OwnedExperts(store, cfg, world, world.device)
        tokens = tc.batch_size * tc.seq_len
        paradigms = choose_paradigms(cfg, paradigm, tokens, world)
        source = ExpertParallel(world, cfg, experts, paradigms, credits, hierarchical)
        start, number, resharded = start_run(world, store, run, experts, cfg, global_tc, seed,
                                             resume, net, opt, sampler, on_phase)
        watch.training = True
        if resume and start == 0 and world.rank == 0:
            # Not an error: a preemptible job is launched with --resume from its first start.
            print(f"tierstore train: {run} holds no checkpoint to resume; training starts "
                  "at step 0", file=sys.stderr, flush=True)
        loop = _Loop(world, store, run, net, opt, source, sampler, val_batches, cfg, tc,
                     global_tc, seed, checkpoint_every, metrics_path, on_step, on_phase,
                     number)
        if world.rank == 0:
            ratio = janus_ratio(cfg, tokens, world)
            print(f"distributed: {world.size} ranks on {world.n_nodes} node(s), "
                  f"{cfg.n_experts // world.size} experts per rank per layer, Janus R = "
                  f"{ratio:.2f}, paradigm per MoE layer: "
                  + ", ".join(f"{k}={v}" for k, v in paradigms.items()), flush=True)
        if resharded:
            loop.checkpoint(start, {"step": start})
        history = loop.train(start, steps)
        watch.close()
        finished = True
        return history
    except BaseException as e:
        raise watch.failed(daemon.explain(e)) from None
    finally:
        store.close()
        # After a failure the other ranks may be anywhere (torchrun stops them): no
        # collective, and the daemon stays up for the run's resumption.
        if finished:
            daemon.release()  # (the watcher thread, which looks at it, has ended)
            node_barrier(world)
            if world.is_node_leader:
                daemon.stop()
            close_world(world)


def _settings(world: World, store: tierstore.Store, model: TrainModel | str | None,
              train: TrainConfig | None, seed: int | None, resume: bool,
              overrides: dict[str, Any]) -> tuple[TrainModel, TrainConfig, int]:
    """The model, per-rank hyperparameters and seed: as given, or (``model=None`` when
    resuming) the run's own, read by rank 0 from node 0's store."""
    if model is not None:
        tc = replace(train or TrainConfig(), **overrides)
        return resolve_model_config(model, tc), tc, 0 if seed is None else seed
    box: list[Any] = [saved_identity(store) if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    saved = box[0]
    if saved is None or not resume:
        raise AgreedError("name the model to train (--model), or --resume a run these "
                          "stores hold")
    tc = TrainConfig.from_dict(saved["train_config"])
    if tc.batch_size % world.size:
        raise AgreedError(f"the run's global batch of {tc.batch_size} rows does not "
                          f"split over {world.size} ranks")
    tc = replace(tc, batch_size=tc.batch_size // world.size, **overrides)
    return (resolve_model_config(config_from_dict(saved["model_config"]), tc), tc,
            int(saved["seed"]) if seed is None else seed)


class _Loop:
    def __init__(self, world: World, store: tierstore.Store, run_dir: Path, net: MoEModel,
                 opt: torch.optim.Optimizer, source: ExpertParallel, sampler: Any,
                 val_batches: list[tuple[Tensor, Tensor]], cfg: TrainModel, tc: TrainConfig,
                 global_tc: TrainConfig, seed: int, checkpoint_every: int,
                 metrics_path: PathLike | None, on_step: Callable[[Metrics], None] | None,
                 on_phase: PhaseHook | None, number: int) -> None:
        self.world, self.store, self.run_dir = world, store, run_dir
        self.net, self.opt, self.source, self.sampler = net, opt, source, sampler
        self.val_batches, self.cfg, self.tc, self.global_tc = val_batches, cfg, tc, global_tc
        self.seed, self.checkpoint_every = seed, checkpoint_every
        self.metrics_path, self.on_step, self.on_phase = metrics_path, on_step, on_phase
        self.number = number
        self.dense = [p for _, p in net.named_parameters()]

    def _mine(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        b, r = self.tc.batch_size, self.world.rank
        dev = self.world.device
        return x[r * b:(r + 1) * b].to(dev), y[r * b:(r + 1) * b].to(dev)

    def train(self, start: int, steps: int) -> list[Metrics]:
        path = (None if self.metrics_path is None
                else f"{os.fspath(self.metrics_path)}.rank{self.world.rank}")
        log = MetricsLog(path, start, None) if path is not None else None
        return run_steps(range(start, steps), lambda s: self.step(s, steps), log,
                         self.on_step)

    def step(self, step: int, steps: int) -> Metrics:
        tc, world, net, source = self.tc, self.world, self.net, self.source
        before = store_counters(self.store)
        t0 = time.perf_counter()
        lr = tc.lr_for(step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        source.begin(grad=True)
        sums = torch.zeros(3, dtype=torch.float64)
        for _ in range(tc.grad_accum):
            x, y = self._mine(*self.sampler.next_batch())
            _, loss, info = net(x, y, experts=source)
            assert loss is not None
            (loss / (tc.grad_accum * world.size)).backward()
            sums += torch.tensor([float(info["ce"]), float(info["aux_loss"]),
                                  float(info["z_loss"])], dtype=torch.float64)
        source.reduce_grads()
        dense_grads = []
        for p in self.dense:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dense_grads.append(p.grad)
        all_reduce_sum_(dense_grads)
        norm = clip_global(dense_grads, source.owned.grads(), world, tc.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        touched = source.owned.update(lr, tc)
        figures = source.step_figures()
        source.end()
        self.store.tick()
        m = step_record(world, self.store, step, tc, self.global_tc, t0, sums, norm, lr,
                        touched, before, figures)
        done = step + 1
        if tc.eval_every > 0 and (done % tc.eval_every == 0 or done == steps):
            m["val_loss"] = self.evaluate()
        if (self.checkpoint_every > 0 and done % self.checkpoint_every == 0) or done == steps:
            self.checkpoint(done, m)
        return m

    @torch.no_grad()
    def evaluate(self) -> float:
        was = self.net.training
        self.net.eval()
        total = torch.zeros(1, dtype=torch.float64)
        try:
            for x, y in self.val_batches:
                self.source.begin(grad=False)
                xb, yb = self._mine(x, y)
                _, _, info = self.net(xb, yb, experts=self.source)
                total += float(info["ce"])
                self.source.end()
        finally:
            self.net.train(was)
        total = sum_over_ranks(total, self.world)
        return float(total[0]) / (self.world.size * max(1, len(self.val_batches)))

    def checkpoint(self, step: int, m: Metrics) -> None:
        payload = dense_payload(self.cfg, self.global_tc, self.seed, self.net, self.opt,
                                self.sampler, m)
        m["checkpoint"] = write_checkpoint(self.world, self.store, self.run_dir, self.number,
                                           step, payload, self.on_phase)
        self.number += 1
