"""Store-backed MoE training: dense parameters on the device, experts in a tierstore Store.

What lives where
- Dense parameters (embeddings, attention, norms, routers, dense FFNs) are a normal torch
  module on the device, trained by ``torch.optim.AdamW`` exactly as in
  :mod:`trainer.train.resident`.
- Every expert weight's fp32 master copy, its two AdamW moments and the per-expert step
  counts live in the store (the layout: :mod:`trainer.train.checkpoint`). A step fetches the
  experts its routers pick and writes their new states back
  (:class:`~.expert_states.ExpertStates`, through one of the fetch modes of
  :mod:`trainer.train.fetch`); dense ``opt.step()`` runs as usual, and ``store.tick()``
  advances the cache policy's clock after each step.

A checkpoint is one store snapshot, ``step-{n}``, holding the dense state and every expert
entry; ``resume=True`` restores the latest and continues to ``steps`` total. A store is only
reused to resume the run it holds (see :mod:`trainer.train.checkpoint`).

A store that holds a model imported by ``tierstore import-hf`` is fine-tuned: the model is
the imported one (:mod:`trainer.train.finetune`), its experts' entries become the fp32
masters, and the text is encoded by its own tokenizer.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

import tierstore
from tierstore.devices import normalize_device
from tierstore.prefetch import DEFAULT_CUDA_FRACTION

from ..infer.budget import check_budget_fits
from ..model import ModelConfig, MoEModel
from ..presets import TrainModel
from .budget import check_step_fits, train_budget
from .checkpoint import TrainerError, start_run, write_checkpoint
from .data import BatchSampler, Corpus
from .expert_states import ExpertStates
from .fetch import resolve_fetch_mode
from .finetune import finetune_config, imported_model, tokenize_corpus
from .metrics import MetricsLog, peak_rss, run_steps, store_counters, store_metrics
from .optim import clip_grads_, grad_norms, total_norm
from .resident import (
    Metrics,
    TrainConfig,
    corpus_for,
    param_groups,
    resolve_model_config,
    step_metrics,
    training_batches,
)

PathLike = str | os.PathLike[str]


@torch.no_grad()
def evaluate_store(net: MoEModel, batches: Sequence[tuple[Tensor, Tensor]],
                   experts: ExpertStates, step: int, device: torch.device) -> float:
    """Mean cross-entropy over ``batches`` (as :func:`trainer.train.resident.evaluate`),
    fetching each batch's experts and giving them back before the next."""
    was_training = net.training
    net.eval()
    total = 0.0
    try:
        for x, y in batches:
            experts.begin(step, grad=False)
            _, _, info = net(x.to(device), y.to(device), experts=experts)
            total += float(info["ce"])
            experts.drop_all()
    finally:
        net.train(was_training)
    return total / max(1, len(batches))


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def train_store(
    model: TrainModel | str | None,
    steps: int,
    seed: int = 0,
    train: TrainConfig | None = None,
    *,
    store_path: PathLike | None,
    host_cache: int | str | None,
    device_budget: int | str | None = None,
    backing: str | None = None,
    pmem_path: PathLike | None = None,
    pmem_size: int | str | None = None,
    slab_size: int | str = "1GiB",
    checkpoint_every: int = 0,
    resume: bool = False,
    metrics_path: PathLike | None = None,
    trace_path: PathLike | None = None,
    corpus: Corpus | None = None,
    corpus_paths: PathLike | Sequence[PathLike] | None = None,
    device: str | torch.device = "cpu",
    fetch: str = "auto",
    read_ahead: bool | None = None,
    on_step: Callable[[Metrics], None] | None = None,
    zero_copy: bool | None = None,
    store: tierstore.Store | None = None,
) -> list[Metrics]:
    """Train ``model`` (a config or preset name) over the store at ``store_path`` until
    ``steps`` optimizer steps are done; returns the metrics of the steps this call ran.
    ``model=None`` fine-tunes the model the store holds (imported by ``tierstore
    import-hf``; a store holding one accepts nothing else): ``corpus`` or ``corpus_paths``
    is then text encoded by the model's tokenizer (:mod:`trainer.train.finetune`), and
    ``seed`` fixes the batch order.

    The store is created if missing (``backing``: ``nvme`` by default, or ``pmem`` with
    ``pmem_path`` and ``pmem_size``; ``slab_size`` sizes NVMe slab files) and opened with a
    host cache of ``host_cache`` bytes and a device prefetch budget of ``device_budget``
    (the store's default when ``None``), which also bounds the expert weights one step may
    hold on the device in ``direct`` mode. ``fetch`` picks how experts reach ``device``:
    ``queue`` (the prefetch queue), ``direct`` (``get_many``) or ``auto`` (see
    :func:`~.fetch.resolve_fetch_mode`). ``read_ahead`` reads the next layer's AdamW moments
    on a thread while the current layer is updated (``None``: on accelerators only, where
    the host's cores are free). ``zero_copy`` (CPU, direct mode) lends expert states
    straight out of the host cache and stages new ones in it instead of copying them
    (``None``: when the cache is at least four times the weights a step can touch).
    ``store``: an open store to train over instead of opening ``store_path`` (a
    ``tierstore.connect`` client of a daemon, say; left open). A checkpoint is taken every
    ``checkpoint_every`` steps and after the last one; ``resume`` continues from the latest
    (see :mod:`trainer.train.checkpoint`).

    Each step's metrics are those of :func:`trainer.train.resident.train_resident` plus
    ``hit_rate`` (host cache, over the step; ``None`` without a cache), ``cache_hits``,
    ``cache_misses``, ``evictions``, ``bytes_read``/``bytes_written`` (backing tier),
    ``stall_s``/``stall_frac`` (time waiting for expert states, and its share of the step),
    ``write_s`` (time handing new states to the store), ``experts_touched``,
    ``peak_rss_bytes`` (the process's peak resident memory so far), ``checkpoint`` (the
    snapshot tag) on steps that took one, and in ``queue`` mode ``prefetched`` (experts
    requested ahead from the routing history) and ``prefetch_accuracy`` (the share of those
    the routers then picked). They go to ``on_step`` and, one JSON object per line, to
    ``metrics_path``. ``trace_path`` records every (step, layer, expert) the routers picked,
    in the cache lab's CSV format with ``nbytes`` the expert's state bytes (weights and both
    moments); steps are numbered as in the metrics.
    """
    tc = train or TrainConfig()
    if steps < 0 or checkpoint_every < 0:
        raise ValueError("steps and checkpoint_every must be >= 0")
    imported = imported_model(store if store is not None else store_path)
    cfg: TrainModel
    if imported is not None:
        if model is not None and not (isinstance(model, ModelConfig)
                                      and model == finetune_config(imported, tc)):
            raise TrainerError(f"{imported.where} holds an imported {imported.family} model, "
                               "which is what it trains: drop --model")
        cfg = finetune_config(imported, tc)
        if corpus is None:
            corpus = corpus_for(tc, corpus_paths)
        if corpus.is_bytes:
            corpus = tokenize_corpus(corpus, imported.tokenizer(), cfg)
    elif model is None:
        where = f"store {store.path}" if store is not None else f"store {store_path}"
        raise TrainerError(f"{where} holds no imported model to fine-tune; name a model "
                           "preset (--model) or import one with `tierstore import-hf`")
    else:
        cfg = resolve_model_config(model, tc)
    # Indexed ("cuda:0"), as tensors report it: devices are compared and used as keys.
    dev = normalize_device(device)
    mode = resolve_fetch_mode(fetch, dev)
    # The device budget's split (trainer.train.budget): checked before anything is made.
    ahead = read_ahead if read_ahead is not None else dev.type != "cpu"
    check_budget_fits(None if device_budget is None else tierstore.parse_size(device_budget),
                      dev)
    plan = train_budget(cfg, tc, device_budget, ahead)
    check_step_fits(cfg, tc, dev, read_ahead=ahead,
                    host_cache=tierstore.parse_size(host_cache or 0) if store is None else 0)
    _seed_everything(seed)
    sampler, val_batches = training_batches(tc, seed, corpus, corpus_paths)

    if imported is None:
        net = MoEModel(cfg, seed=seed, resident_experts=False).to(dev)
    else:  # the weights come from the store (start_run): nothing to initialise
        with torch.device("meta"):
            net = MoEModel(cfg, seed=None, resident_experts=False)
        net = net.to_empty(device=dev)
    net.train()
    dense = list(net.named_parameters())
    opt = torch.optim.AdamW(param_groups(dense, tc.weight_decay), lr=tc.lr, betas=tc.betas,
                            eps=tc.eps)

    owned = store is None
    if store is None:
        if store_path is None:
            raise ValueError("train_store needs store_path or an open store")
        budget: Any = device_budget
        if budget is None and dev.type == "cuda":
            budget = {str(dev): cuda_budget(cfg, tc, dev)}
        store = tierstore.open(store_path, create=True, backing=backing, slab_size=slab_size,
                               pmem_path=pmem_path, pmem_size=pmem_size,
                               host_cache=host_cache, device_budget=budget)
    experts: ExpertStates | None = None
    try:
        tokens = tc.grad_accum * tc.batch_size * tc.seq_len
        if plan is not None:  # the step's expert weights (their gradients match them)
            store.prefetch_budget(dev, plan.fetch_bytes)
        experts = ExpertStates(store, cfg, dev, mode, tokens, read_ahead,
                               plan.fetch_bytes if plan is not None else None, zero_copy)
        experts.fetch.plan = plan
        start, start_metrics = start_run(store, cfg, tc, seed, resume, net, opt, sampler)
        run = _Run(store, experts, net, opt, sampler, val_batches, cfg, tc, seed, dev,
                   checkpoint_every, metrics_path, trace_path, start, start_metrics, on_step)
        return run.train(steps)
    finally:
        try:
            if experts is not None:
                experts.close()
        finally:
            if owned:
                store.close()


def cuda_budget(cfg: TrainModel, tc: TrainConfig, device: torch.device) -> int:
    """The prefetch budget the trainer asks for on a CUDA device when none is given: the
    expert weights one step can touch (what :class:`ExpertStates` checks against), capped
    at the store's default share of the device's memory. The store's own default (half the
    GPU) ignores the model and would keep that much device memory within the queue's reach
    however little the model needs."""
    tokens = tc.grad_accum * tc.batch_size * tc.seq_len
    per_layer = min(cfg.n_experts, tokens * cfg.top_k)
    expert_bytes = sum(4 * a * b for a, b in cfg.expert_shapes().values())
    need = len(cfg.moe_layers) * per_layer * expert_bytes
    total = torch.cuda.get_device_properties(device).total_memory
    return max(expert_bytes, min(need, int(total * DEFAULT_CUDA_FRACTION)))


class _Run:
    """The training loop of :func:`train_store` and the state it carries between steps."""

    def __init__(self, store: tierstore.Store, experts: ExpertStates, net: MoEModel,
                 opt: torch.optim.Optimizer, sampler: BatchSampler,
                 val_batches: list[tuple[Tensor, Tensor]], cfg: TrainModel, tc: TrainConfig,
                 seed: int, device: torch.device, checkpoint_every: int,
                 metrics_path: PathLike | None, trace_path: PathLike | None, start: int,
                 start_metrics: Metrics | None,
                 on_step: Callable[[Metrics], None] | None) -> None:
        self.store, self.experts, self.net, self.opt = store, experts, net, opt
        self.sampler, self.val_batches = sampler, val_batches
        self.cfg, self.tc, self.seed, self.device = cfg, tc, seed, device
        self.checkpoint_every, self.start, self.on_step = checkpoint_every, start, on_step
        self.dense = [p for _, p in net.named_parameters()]
        self.metrics_path, self.trace_path = metrics_path, trace_path
        self.start_metrics = start_metrics  # of the checkpoint step a resumed run starts at

    def train(self, steps: int) -> list[Metrics]:
        log = (MetricsLog(self.metrics_path, self.start, self.start_metrics)
               if self.metrics_path else None)
        trace = None
        if self.trace_path is not None:
            trace = tierstore.lab.TraceRecorder(
                self.trace_path, comment=f"tierstore train: {self.cfg.n_layers} layers, "
                f"{self.cfg.n_experts} experts, seed {self.seed}, from step {self.start + 1}")

        def one(step: int) -> Metrics:
            m, routed = self.step(step, steps)
            if trace is not None:
                for layer, ids in routed.items():
                    trace.record(step + 1, layer, ids, 3 * self.experts.expert_bytes)
            return m

        try:
            return run_steps(range(self.start, steps), one, log, self.on_step)
        finally:
            if trace is not None:
                trace.close()

    def step(self, step: int, steps: int) -> tuple[Metrics, dict[int, list[int]]]:
        """Run update ``step`` (0-based); returns its metrics and the routing it used."""
        tc, net, experts, dev = self.tc, self.net, self.experts, self.device
        before = store_counters(self.store)
        t0 = time.perf_counter()
        lr = tc.lr_for(step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        experts.begin(step + 1)
        ce_sum = aux_sum = z_sum = 0.0
        for micro in range(tc.grad_accum):
            x, y = self.sampler.next_batch()
            _, loss, info = net(x.to(dev), y.to(dev), experts=experts)
            assert loss is not None
            if micro == tc.grad_accum - 1:
                experts.forward_done()
            (loss / tc.grad_accum).backward()
            ce_sum += float(info["ce"])
            aux_sum += float(info["aux_loss"])
            z_sum += float(info["z_loss"])
        grads = [p.grad for p in self.dense if p.grad is not None] + experts.grads()
        # One global norm over every gradient, dense and expert alike.
        norm = (clip_grads_(grads, tc.clip) if tc.clip is not None
                else total_norm(grad_norms(grads)))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        touched = experts.update(lr, tc)
        stall_s, write_s = experts.fetch_s, experts.write_s
        fetch_metrics = experts.step_metrics()
        routed = experts.end()
        self.store.tick()
        m = step_metrics(step, tc, dev, t0, ce_sum, aux_sum, z_sum, norm, lr)
        dt = m["step_time_s"]
        m |= {
            **store_metrics(before, store_counters(self.store)),
            "stall_s": stall_s, "stall_frac": stall_s / dt if dt > 0 else 0.0,
            "write_s": write_s, "experts_touched": touched, "peak_rss_bytes": peak_rss(),
            **fetch_metrics,
        }
        done = step + 1
        if tc.eval_every > 0 and (done % tc.eval_every == 0 or done == steps):
            m["val_loss"] = evaluate_store(net, self.val_batches, experts, done, dev)
        if (self.checkpoint_every > 0 and done % self.checkpoint_every == 0) or done == steps:
            write_checkpoint(self.store, done, seed=self.seed, cfg=self.cfg, tc=self.tc,
                             net=self.net, opt=self.opt, sampler=self.sampler, metrics=m)
        return m, routed
