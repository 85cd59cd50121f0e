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

The model is a :class:`~.nets.TrainNet`: a trainer preset (:class:`~.nets.PresetNet`), or,
for a store that holds a model imported by ``tierstore import-hf``, that model as its own
``transformers`` class through the :mod:`tierstore.hf` backend
(:class:`~.hf_finetune.HFNet`), whose text is encoded by its own tokenizer. The loop, the
experts' states and the checkpoints are the same for both.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

import tierstore
from tierstore.devices import normalize_device
from tierstore.prefetch import DEFAULT_CUDA_FRACTION

from ..infer.budget import check_budget_fits
from ..presets import TrainModel, model_size
from .budget import TrainShape, check_step_fits, train_budget
from .checkpoint import TrainerError, saved_run, start_run, write_checkpoint
from .data import BatchSampler, Corpus
from .dense_rule import check_rule
from .expert_states import ExpertStates
from .fetch import resolve_fetch_mode
from .layout import ExpertLayout, preset_layout
from .metrics import MetricsLog, peak_rss, run_steps, store_counters, store_metrics
from .nets import PresetNet, TrainNet
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
def evaluate_store(net: TrainNet, batches: Sequence[tuple[Tensor, Tensor]],
                   experts: ExpertStates, step: int, device: torch.device) -> float:
    """Mean cross-entropy over ``batches`` (as :func:`trainer.train.resident.evaluate`),
    fetching each batch's experts and giving them back before the next."""
    module = net.module
    was_training = module.training
    module.eval()
    total = 0.0
    try:
        for x, y in batches:
            experts.begin(step, grad=False)
            _, parts = net.losses(x.to(device), y.to(device), experts)
            total += float(parts["ce"])
            experts.drop_all()
    finally:
        module.train(was_training)
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
    gradient_checkpointing: bool = False,
) -> list[Metrics]:
    """Train ``model`` (a config or preset name) over the store at ``store_path`` until
    ``steps`` optimizer steps are done; returns the metrics of the steps this call ran.
    ``model=None`` fine-tunes the model the store holds (imported by ``tierstore
    import-hf``, any family the :mod:`tierstore.hf` backend serves; a store holding one
    accepts nothing else): ``corpus`` or ``corpus_paths`` is then text encoded by the
    model's tokenizer (:mod:`trainer.train.hf_finetune`), ``seed`` fixes the batch order,
    and ``gradient_checkpointing`` recomputes each decoder layer in backward
    (``transformers``' ``gradient_checkpointing_enable``; the recomputation reuses the
    step's experts and writes nothing). ``train.update_rule`` says how experts no token
    reached are updated (:func:`resolve_rule`: ``dense`` by default for an import, the only
    rule a preset has is ``lazy``; :mod:`.dense_rule`).

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
    # Indexed ("cuda:0"), as tensors report it: devices are compared and used as keys.
    dev = normalize_device(device)
    mode = resolve_fetch_mode(fetch, dev)
    ahead = read_ahead if read_ahead is not None else dev.type != "cpu"
    cfg = None if model is None else resolve_model_config(model, tc)
    if cfg is not None and tc.update_rule not in (None, "lazy"):
        # Checked before a store is made: the resident trainer, a preset's reference, has
        # one parameter per expert and no other rule.
        raise TrainerError(f"update rule {tc.update_rule!r} is for fine-tuning imported "
                           "models; a preset trains with the lazy rule")
    check_budget_fits(None if device_budget is None else tierstore.parse_size(device_budget),
                      dev)
    cache = tierstore.parse_size(host_cache or 0) if store is None else 0
    plan = None
    if cfg is not None:  # the device budget's split (trainer.train.budget), checked first
        shape, layout = TrainShape.of_preset(cfg), preset_layout(cfg)
        plan = train_budget(shape, layout, tc, device_budget, ahead)
        check_step_fits(shape, tc, dev, dense_params=model_size(cfg).dense_params,
                        layout=layout, host_cache=cache, read_ahead=ahead)
        if corpus is None:  # a corpus that is no text is refused before a store is made
            corpus = corpus_for(tc, corpus_paths)
    owned = store is None
    if store is None:
        if store_path is None:
            raise ValueError("train_store needs store_path or an open store")
        store = _open(store_path, cfg, tc, dev, create=cfg is not None, backing=backing,
                      slab_size=slab_size, pmem_path=pmem_path, pmem_size=pmem_size,
                      host_cache=host_cache, device_budget=device_budget)
    experts: ExpertStates | None = None
    try:
        _seed_everything(seed)
        net, corpus = _make_net(store, cfg, tc, seed, dev, corpus, corpus_paths,
                                gradient_checkpointing)
        if cfg is None:
            plan = train_budget(net.shape, net.layout, tc, device_budget, ahead)
            check_step_fits(net.shape, tc, dev, layout=net.layout, host_cache=cache,
                            dense_params=sum(p.numel() for p in net.module.parameters()),
                            read_ahead=ahead)
            if device_budget is None and dev.type == "cuda":
                store.prefetch_budget(dev, cuda_budget(net.layout, tc, dev))
        tc = replace(tc, update_rule=resolve_rule(tc.update_rule, net.finetune, store))
        _seed_everything(seed)
        sampler, val_batches = training_batches(tc, seed, corpus, corpus_paths)
        dense = list(net.module.named_parameters())
        opt = torch.optim.AdamW(param_groups(dense, tc.weight_decay), lr=tc.lr,
                                betas=tc.betas, eps=tc.eps)
        tokens = tc.grad_accum * tc.batch_size * tc.seq_len
        if plan is not None:  # the step's expert weights (their gradients match them)
            store.prefetch_budget(dev, plan.fetch_bytes)
        experts = ExpertStates(store, net.layout, dev, mode, tokens, read_ahead,
                               plan.fetch_bytes if plan is not None else None, zero_copy,
                               rule=tc.update_rule or "lazy")
        experts.fetch.plan = plan
        net.attach(experts)
        start, start_metrics = start_run(store, net, tc, seed, resume, opt, sampler)
        experts.set_rule(tc.update_rule or "lazy")  # the history as the start left it
        run = _Run(store, experts, net, opt, sampler, val_batches, tc, seed, dev,
                   checkpoint_every, metrics_path, trace_path, start, start_metrics, on_step)
        return run.train(steps)
    finally:
        try:
            if experts is not None:
                experts.close()
        finally:
            if owned:
                store.close()


def resolve_rule(rule: str | None, finetune: bool, store: tierstore.Store) -> str:
    """The update rule of a run: the one asked for; else the one the store's run was
    started with (``lazy`` for runs recorded before there were two); else ``dense`` for an
    imported model (what ``transformers`` with ``torch.optim.AdamW`` does) and ``lazy`` for
    a preset (what the resident trainer, its reference, does; the only rule it has)."""
    if rule is None:
        saved = saved_run(store)
        if saved is not None:
            rule = saved["train_config"].get("update_rule") or "lazy"
        else:
            rule = "dense" if finetune else "lazy"
    return check_rule(rule)


def _open(path: PathLike, cfg: TrainModel | None, tc: TrainConfig, dev: torch.device, *,
          create: bool, device_budget: int | str | None, **kw: Any) -> tierstore.Store:
    """The store at ``path``: created for a preset's run; a fine-tune's must hold its
    import."""
    budget: Any = device_budget
    if budget is None and dev.type == "cuda" and cfg is not None:
        budget = {str(dev): cuda_budget(preset_layout(cfg), tc, dev)}
    try:
        return tierstore.open(path, create=create, device_budget=budget, **kw)
    except tierstore.NotAStoreError:
        raise TrainerError(f"store {path} holds no imported model to fine-tune; name a "
                           "model preset (--model) or import one with `tierstore import-hf`"
                           ) from None


def _make_net(store: tierstore.Store, cfg: TrainModel | None, tc: TrainConfig, seed: int,
              dev: torch.device, corpus: Corpus | None,
              corpus_paths: PathLike | Sequence[PathLike] | None,
              gradient_checkpointing: bool) -> tuple[TrainNet, Corpus | None]:
    """The model to train (a preset, or the store's import) and, for an import, the corpus
    in its tokens."""
    from .hf_finetune import HFNet, imported, model_corpus

    stored = imported(store)
    if stored is not None:
        if cfg is not None:
            raise TrainerError(f"store {store.path} holds an imported {stored.family} model, "
                               "which is what it trains: drop --model")
        net = HFNet(store, stored, tc, dev)
        if gradient_checkpointing:
            # transformers 5 names it activation checkpointing (the old name warns).
            enable = getattr(net.module, "activation_checkpointing_enable", None)
            (enable or net.module.gradient_checkpointing_enable)()
        if corpus is None:
            corpus = corpus_for(tc, corpus_paths)
        return net, model_corpus(corpus, net.tokenizer(store), net.module.config)
    if cfg is None:
        raise TrainerError(f"store {store.path} holds no imported model to fine-tune; name a "
                           "model preset (--model) or import one with `tierstore import-hf`")
    if gradient_checkpointing:
        raise ValueError("gradient checkpointing is for imported models")
    return PresetNet(cfg, seed, dev), corpus


def cuda_budget(layout: ExpertLayout, tc: TrainConfig, device: torch.device) -> int:
    """The prefetch budget the trainer asks for on a CUDA device when none is given: the
    expert weights one step can touch (what :class:`ExpertStates` checks against), capped
    at the store's default share of the device's memory. The store's own default (half the
    GPU) ignores the model and would keep that much device memory within the queue's reach
    however little the model needs."""
    tokens = tc.grad_accum * tc.batch_size * tc.seq_len
    need = len(layout.keys) * layout.per_step_experts(tokens) * layout.expert_bytes
    total = torch.cuda.get_device_properties(device).total_memory
    return max(layout.expert_bytes, min(need, int(total * DEFAULT_CUDA_FRACTION)))


class _Run:
    """The training loop of :func:`train_store` and the state it carries between steps."""

    def __init__(self, store: tierstore.Store, experts: ExpertStates, net: TrainNet,
                 opt: torch.optim.Optimizer, sampler: BatchSampler,
                 val_batches: list[tuple[Tensor, Tensor]], tc: TrainConfig,
                 seed: int, device: torch.device, checkpoint_every: int,
                 metrics_path: PathLike | None, trace_path: PathLike | None, start: int,
                 start_metrics: Metrics | None,
                 on_step: Callable[[Metrics], None] | None) -> None:
        self.store, self.experts, self.net, self.opt = store, experts, net, opt
        self.sampler, self.val_batches = sampler, val_batches
        self.tc, self.seed, self.device = tc, seed, device
        self.checkpoint_every, self.start, self.on_step = checkpoint_every, start, on_step
        self.dense = [p for _, p in net.module.named_parameters()]
        self.metrics_path, self.trace_path = metrics_path, trace_path
        self.start_metrics = start_metrics  # of the checkpoint step a resumed run starts at

    def train(self, steps: int) -> list[Metrics]:
        log = (MetricsLog(self.metrics_path, self.start, self.start_metrics)
               if self.metrics_path else None)
        trace = None
        if self.trace_path is not None:
            layout = self.net.layout
            trace = tierstore.lab.TraceRecorder(
                self.trace_path, comment=f"tierstore train: {len(layout.keys)} MoE layers, "
                f"{layout.n_experts} experts, seed {self.seed}, from step {self.start + 1}")

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
            loss, parts = net.losses(x.to(dev), y.to(dev), experts)
            if micro == tc.grad_accum - 1:
                experts.forward_done()
            (loss / tc.grad_accum).backward()
            ce_sum += float(parts["ce"])
            aux_sum += float(parts["aux_loss"])
            z_sum += float(parts["z_loss"])
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
            experts.catch_up_all()  # dense rule: the checkpoint holds every expert current
            write_checkpoint(self.store, done, seed=self.seed, net=self.net, tc=self.tc,
                             opt=self.opt, sampler=self.sampler, metrics=m)
        return m, routed
