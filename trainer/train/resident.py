"""The reference trainer: the whole model in memory as plain torch modules.

Every parameter, experts included, is trained by ``torch.optim.AdamW``. Experts are one
parameter each per weight (``trainer.model.ExpertBank``), so an expert that gets no token in
a step has no gradient and AdamW leaves it alone: the lazy semantics of the store-backed
trainer, which this one is the correctness reference and the performance baseline for.

A checkpoint is one file (``resident.pt`` in the checkpoint directory, replaced atomically)
holding the model and optimizer state, the sampler position, the RNG states and the configs;
resuming from it reproduces the uninterrupted run's losses exactly on CPU.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tierstore.durable import replace_file

from ..model import ExpertProvider, MoEModel
from ..presets import PRESETS, TrainModel, config_from_dict, model_size, with_dtype
from .data import BatchSampler, Corpus, load_corpus
from .heap import SteadyHeap
from .optim import clip_grads_, grad_norms, lr_at, total_norm

CHECKPOINT_NAME = "resident.pt"
CHECKPOINT_VERSION = 1

Metrics = dict[str, Any]


@dataclass
class TrainConfig:
    """Training hyperparameters (the model's shape is :class:`MoEConfig`)."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 0
    decay_steps: int | None = None  # cosine decay length after warmup; None: constant lr
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # on matrices only (not norms)
    batch_size: int = 8
    seq_len: int = 128
    grad_accum: int = 1
    clip: float | None = 1.0  # global-norm clipping threshold; None: no clipping
    eval_every: int = 50  # validation every n steps (and at the last one); 0: never
    eval_batches: int = 4
    dtype: str | None = None  # compute dtype override ("float32" / "bfloat16")
    corpus_max_bytes: int | None = 8 * 1024 * 1024
    val_fraction: float = 0.1
    # How store-held experts no token reached are updated: "lazy" (not at all) or "dense"
    # (as torch.optim.AdamW updates fused [E, ...] parameters; trainer.train.dense_rule).
    # None: dense for an imported model, lazy for a preset (train_store resolves it).
    update_rule: str | None = None

    def lr_for(self, step: int) -> float:
        return lr_at(step, self.lr, self.warmup_steps, self.decay_steps, self.min_lr)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["update_rule"] is None:  # unresolved (the distributed trainer's): as recorded
            del d["update_rule"]      # before there were two rules
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        d["betas"] = tuple(d["betas"])
        return cls(**d)


def resolve_model_config(model: TrainModel | str, train: TrainConfig) -> TrainModel:
    """A preset name or a config, with the training dtype override applied."""
    if isinstance(model, str):
        try:
            model = PRESETS[model]
        except KeyError:
            raise ValueError(f"unknown model preset {model!r}; "
                             f"choose from {', '.join(PRESETS)}") from None
    limit = model.max_seq_len
    if train.seq_len > limit:
        raise ValueError(f"seq_len {train.seq_len} exceeds the model's {limit} positions")
    return with_dtype(model, train.dtype)


def param_groups(named: Sequence[tuple[str, nn.Parameter]], weight_decay: float
                 ) -> list[dict[str, Any]]:
    """Weight decay on matrices (projections, embeddings, experts), none on norm gains."""
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model: MoEModel, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device | str = "cpu", experts: ExpertProvider | None = None) -> float:
    """Mean cross-entropy (without router losses) over ``batches``."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        _, _, info = model(x.to(device), y.to(device), experts=experts)
        total += float(info["ce"])
    model.train(was_training)
    return total / max(1, len(batches))


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU of the machine that saved it: a resume on a machine with fewer
        # GPUs sets those it has (set_rng_state_all would index devices that do not exist).
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def save_checkpoint(directory: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    """Write ``payload`` as the directory's checkpoint: to a temporary file, fsync, rename,
    so a crash leaves either the previous checkpoint or the new one, never a torn file."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / CHECKPOINT_NAME
    replace_file(final, lambda f: torch.save(payload, f), tmp=d / f".{CHECKPOINT_NAME}.tmp")
    return final


def load_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The directory's checkpoint, or ``None`` if it has none."""
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    # The payload holds numpy and python RNG states besides tensors.
    return torch.load(path, map_location="cpu", weights_only=False)


def corpus_for(tc: TrainConfig,
               paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None
               ) -> Corpus:
    """The corpus a run with ``tc`` reads: ``paths``, or the default one, capped and split
    as ``tc`` says."""
    return load_corpus(paths, max_bytes=tc.corpus_max_bytes, val_fraction=tc.val_fraction)


def training_batches(
    tc: TrainConfig, seed: int, corpus: Corpus | None = None,
    corpus_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
) -> tuple[BatchSampler, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Both trainers' data: the training sampler and the fixed validation batches (none when
    ``tc`` never evaluates), from ``corpus`` or the one :func:`corpus_for` reads."""
    if corpus is None:
        corpus = corpus_for(tc, corpus_paths)
    sampler = BatchSampler(corpus.train, tc.batch_size, tc.seq_len, seed)
    val_batches = (BatchSampler(corpus.val, tc.batch_size, tc.seq_len, seed)
                   .fixed_batches(tc.eval_batches) if tc.eval_every > 0 else [])
    return sampler, val_batches


def step_metrics(
    step: int, tc: TrainConfig, dev: torch.device, t0: float, ce_sum: float, aux_sum: float,
    z_sum: float, norm: torch.Tensor, lr: float,
) -> Metrics:
    """The metrics every trainer reports for a finished step (losses averaged over the
    micro-batches; the step's time measured once the device has caught up)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    n_tok = tc.grad_accum * tc.batch_size * tc.seq_len
    return {
        "step": step + 1, "loss": ce_sum / tc.grad_accum,
        "aux_loss": aux_sum / tc.grad_accum, "z_loss": z_sum / tc.grad_accum,
        "grad_norm": float(norm), "lr": lr, "tokens": n_tok, "step_time_s": dt,
        "tokens_per_s": n_tok / dt if dt > 0 else float("inf"),
    }


def train_resident(
    model: TrainModel | str,
    steps: int,
    seed: int = 0,
    train: TrainConfig | None = None,
    *,
    corpus: Corpus | None = None,
    corpus_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    device: str | torch.device = "cpu",
    on_step: Callable[[Metrics], None] | None = None,
) -> list[Metrics]:
    """Train ``model`` (a config or preset name) until ``steps`` optimizer steps are done.

    With ``resume`` and a checkpoint in ``checkpoint_dir``, training continues from it (the
    configs stored there must match); ``steps`` is always the total. A checkpoint is written
    every ``checkpoint_every`` steps and after the last step when ``checkpoint_dir`` is set.
    Returns the metrics of the steps this call ran, each ``{step, loss, aux_loss, z_loss,
    grad_norm, lr, tokens, step_time_s, tokens_per_s}`` plus ``val_loss`` on evaluation
    steps; ``on_step`` sees each as it is produced. (An imported model is fine-tuned in
    memory by :func:`trainer.train.hf_resident.train_hf_resident`.)
    """
    tc = train or TrainConfig()
    cfg = resolve_model_config(model, tc)
    dev = torch.device(device)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    from .budget import TrainShape, check_step_fits  # (budget imports this module)

    check_step_fits(TrainShape.of_preset(cfg), tc, dev,
                    dense_params=model_size(cfg).total_params, layout=None)
    sampler, val_batches = training_batches(tc, seed, corpus, corpus_paths)

    net = MoEModel(cfg, seed=seed).to(dev)
    net.train()
    params = list(net.named_parameters())
    opt = torch.optim.AdamW(param_groups(params, tc.weight_decay), lr=tc.lr, betas=tc.betas,
                            eps=tc.eps)

    start = 0
    if resume and checkpoint_dir is not None:
        ckpt = load_checkpoint(checkpoint_dir)
        if ckpt is not None:
            _check_compatible(ckpt, cfg, tc, seed)
            net.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            sampler.load_state_dict(ckpt["sampler"])
            set_rng_state(ckpt["rng"])
            start = int(ckpt["step"])

    def checkpoint(step: int) -> None:
        assert checkpoint_dir is not None
        save_checkpoint(checkpoint_dir, {
            "version": CHECKPOINT_VERSION, "kind": "resident", "step": step, "seed": seed,
            "model_config": cfg.to_dict(), "train_config": tc.to_dict(),
            "model": net.state_dict(), "optimizer": opt.state_dict(),
            "sampler": sampler.state_dict(), "rng": rng_state(),
        })

    history: list[Metrics] = []
    with SteadyHeap() as heap:  # see .heap: as the store trainer's steps
        for step in range(start, steps):
            t0 = time.perf_counter()
            lr = tc.lr_for(step)
            for group in opt.param_groups:
                group["lr"] = lr
            ce_sum = aux_sum = z_sum = 0.0
            for _ in range(tc.grad_accum):
                x, y = sampler.next_batch()
                _, loss, info = net(x.to(dev), y.to(dev))
                assert loss is not None
                (loss / tc.grad_accum).backward()
                ce_sum += float(info["ce"])
                aux_sum += float(info["aux_loss"])
                z_sum += float(info["z_loss"])
            grads = [p.grad for _, p in params if p.grad is not None]
            # One global norm over every gradient, dense and expert alike.
            norm = (clip_grads_(grads, tc.clip) if tc.clip is not None
                    else total_norm(grad_norms(grads)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            m = step_metrics(step, tc, dev, t0, ce_sum, aux_sum, z_sum, norm, lr)
            heap.step_done()
            done = step + 1
            if tc.eval_every > 0 and (done % tc.eval_every == 0 or done == steps):
                m["val_loss"] = evaluate(net, val_batches, dev)
            if checkpoint_dir is not None and (
                    (checkpoint_every > 0 and done % checkpoint_every == 0) or done == steps):
                checkpoint(done)
            history.append(m)
            if on_step is not None:
                on_step(m)
    return history


def _check_compatible(ckpt: dict[str, Any], cfg: TrainModel, tc: TrainConfig,
                      seed: int) -> None:
    if ckpt.get("kind") != "resident" or ckpt.get("version") != CHECKPOINT_VERSION:
        raise ValueError("checkpoint is not a resident-trainer checkpoint of this version")
    if config_from_dict(ckpt["model_config"]) != cfg:
        raise ValueError("checkpoint was written for a different model configuration")
    saved = TrainConfig.from_dict(ckpt["train_config"])
    if saved != tc:
        raise ValueError("checkpoint was written with different training hyperparameters")
    if ckpt["seed"] != seed:
        raise ValueError(f"checkpoint was written with seed {ckpt['seed']}, not {seed}")
