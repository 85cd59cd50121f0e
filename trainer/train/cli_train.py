"""What ``tierstore train`` runs: either trainer over the same options, with a progress bar
and a closing summary. The ``train`` click command only parses options."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

import tierstore

from ..presets import TrainModel, config_from_dict
from .checkpoint import is_finetune, saved_run
from .metrics import MetricsLog
from .resident import Metrics, TrainConfig, load_checkpoint, train_resident
from .store_trainer import train_store


def run_settings(store: str | tierstore.Store | None, resident: bool, resume: bool
                 ) -> tuple[TrainModel | str | None, TrainConfig, int, bool]:
    """The model, hyperparameters and seed options start from: those the run in ``store``
    was started with when resuming it, else the preset ``tiny``, defaults and seed 0; and
    whether there was such a run. The model is ``None`` where the store holds an imported
    model (which is what it trains)."""
    saved = None
    if resume and store is not None:
        saved = load_checkpoint(store) if resident else saved_run(store)
    if saved is None:
        return (None if not resident and holds_import(store) else "tiny"), TrainConfig(), 0, \
            False
    record = saved["model_config"]
    return (None if is_finetune(record) else config_from_dict(record),
            TrainConfig.from_dict(saved["train_config"]), int(saved["seed"]), True)


def holds_import(store: str | tierstore.Store | None) -> bool:
    """Whether ``store`` (a path, or an open store) holds a model ``tierstore import-hf``
    put there; False where there is no store."""
    from tierstore.hf.layout import MODEL_ENTRY

    if store is None:
        return False
    if not isinstance(store, str):
        return MODEL_ENTRY in store
    try:
        opened = tierstore.open(store, host_cache=0)
    except tierstore.NotAStoreError:
        return False
    with opened:
        return MODEL_ENTRY in opened


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _postfix(m: Metrics) -> str:
    parts = [f"loss {m['loss']:.3f}", f"{m['tokens_per_s']:,.0f} tok/s"]
    if m.get("hit_rate") is not None:
        parts.append(f"hit {m['hit_rate']:.0%}")
    parts.append(f"stall {m.get('stall_frac', 0.0):.0%}")
    return " ".join(parts)


def summarise(history: Sequence[Metrics], what: str) -> list[str]:
    """Closing lines: the steps run, the loss, throughput, and the store's figures."""
    if not history:
        return [f"{what}: nothing to do, the run is already at the requested step count"]
    first, last = history[0], history[-1]
    # The first step pays for warm-up (allocations, cold caches): leave it out of rates.
    steady = history[1:] or history
    tps = statistics.fmean(m["tokens_per_s"] for m in steady)
    lines = [f"{what}: steps {first['step']}-{last['step']}, loss {first['loss']:.3f} -> "
             f"{last['loss']:.3f}, {tps:,.0f} tokens/s"]
    vals = [m for m in history if "val_loss" in m]
    if vals:
        lines.append(f"validation loss {vals[-1]['val_loss']:.3f} at step {vals[-1]['step']}")
    hits = [m["hit_rate"] for m in steady if m.get("hit_rate") is not None]
    if hits:
        stall = statistics.fmean(m["stall_frac"] for m in steady)
        evictions = sum(m.get("evictions", 0) for m in history)
        lines.append(f"host cache hit rate {statistics.fmean(hits):.1%}, stall {stall:.1%} of "
                     f"step time, {evictions} evictions")
    tags = [m["checkpoint"] for m in history if "checkpoint" in m]
    if tags:
        lines.append(f"checkpoint {tags[-1]}")
    return lines


def run_train(*, store: str | None, resident: bool, model: str | None, steps: int,
              seed: int | None, device_budget: int | None, host_cache: int,
              backing: str | None, pmem_path: str | None, pmem_size: int | None,
              slab_size: int, checkpoint_every: int, resume: bool, metrics: str | None,
              trace: str | None, corpus: Sequence[str], overrides: dict[str, Any],
              device: str, fetch: str, echo: Callable[[str], Any] = print,
              connect: str | None = None) -> list[Metrics]:
    """Train as ``tierstore train`` was asked to; returns the metrics of the steps run.

    ``model`` and ``seed`` (``None``: not given) and ``overrides`` (the
    :class:`TrainConfig` fields given) apply on top of :func:`run_settings`, so ``--resume``
    needs no option the run was started with; one given must match it. ``connect`` trains
    over the store a ``tierstore serve`` daemon owns (its socket) instead of ``store``.
    """
    remote = tierstore.connect(connect) if connect is not None else None
    try:
        return _run_train(store=store, resident=resident, model=model, steps=steps, seed=seed,
                          device_budget=device_budget, host_cache=host_cache, backing=backing,
                          pmem_path=pmem_path, pmem_size=pmem_size, slab_size=slab_size,
                          checkpoint_every=checkpoint_every, resume=resume, metrics=metrics,
                          trace=trace, corpus=corpus, overrides=overrides, device=device,
                          fetch=fetch, echo=echo, remote=remote,
                          where=f"daemon {connect}" if connect else f"store {store}")
    finally:
        if remote is not None:
            remote.close()


def _run_train(*, store: str | None, resident: bool, model: str | None, steps: int,
               seed: int | None, device_budget: int | None, host_cache: int,
               backing: str | None, pmem_path: str | None, pmem_size: int | None,
               slab_size: int, checkpoint_every: int, resume: bool, metrics: str | None,
               trace: str | None, corpus: Sequence[str], overrides: dict[str, Any],
               device: str, fetch: str, echo: Callable[[str], Any], remote: Any,
               where: str) -> list[Metrics]:
    from tqdm import tqdm

    if resident and holds_import(store):
        raise ValueError(f"{where} holds an imported model, which trains over the store: "
                         "drop --resident")
    base_model, base_tc, base_seed, found = run_settings(remote or store, resident, resume)
    if resume and not found:
        # Not an error: a preemptible job is launched with --resume from its first start.
        what = "checkpoint" if resident else "training run"
        print(f"tierstore train: {where} holds no {what} to resume; training starts at "
              "step 0", file=sys.stderr, flush=True)
    model_arg = base_model if model is None else model
    seed = base_seed if seed is None else seed
    tc = replace(base_tc, **overrides)
    dev = resolve_device(device)
    corpus_paths = list(corpus) or None
    log: list[MetricsLog] = []  # opened at the first step, when the resumed step is known
    with tqdm(total=steps, desc="resident" if resident else "train", unit="step",
              disable=None, dynamic_ncols=True) as bar:

        def on_step(m: Metrics) -> None:
            if resident:  # the same keys as the store trainer writes; there is no cache
                m.setdefault("hit_rate", None)
                m.setdefault("stall_frac", 0.0)
                if metrics is not None:
                    if not log:
                        log.append(MetricsLog(metrics, m["step"] - 1))
                    log[0].write(m)
            bar.update(m["step"] - bar.n)
            bar.set_postfix_str(_postfix(m), refresh=False)
            if not math.isfinite(m["loss"]):
                bar.write(f"step {m['step']}: loss is {m['loss']}")

        try:
            if resident:
                history = train_resident(model_arg, steps, seed, tc, corpus_paths=corpus_paths,
                                         checkpoint_dir=store, checkpoint_every=checkpoint_every,
                                         resume=resume, device=dev, on_step=on_step)
            else:
                assert store is not None or remote is not None
                history = train_store(
                    model_arg, steps, seed, tc, store_path=store, host_cache=host_cache,
                    device_budget=device_budget, backing=backing, pmem_path=pmem_path,
                    pmem_size=pmem_size, slab_size=slab_size, checkpoint_every=checkpoint_every,
                    resume=resume, metrics_path=metrics, trace_path=trace,
                    corpus_paths=corpus_paths, device=dev, fetch=fetch, on_step=on_step,
                    store=remote)
        finally:
            for f in log:
                f.close()
    for line in summarise(history, "resident" if resident else where):
        echo(line)
    return history
