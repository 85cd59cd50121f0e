"""One distributed step's metrics, the same for every model the distributed trainer runs."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor

import tierstore

from ..train.metrics import peak_rss, store_counters, store_metrics
from ..train.resident import Metrics, TrainConfig
from .collectives import sum_over_ranks
from .world import World


def step_record(world: World, store: tierstore.Store, step: int, tc: TrainConfig,
                global_tc: TrainConfig, t0: float, sums: Tensor, norm: Tensor, lr: float,
                touched: int, before: dict[str, Any], figures: dict[str, Any]) -> Metrics:
    """The metrics of step ``step`` (0-based) on this rank: ``sums`` is this rank's sum of
    (cross-entropy, router loss, z-loss) over its micro-batches, averaged here over every
    rank's; ``before`` the store's counters at the step's start (``t0``); ``figures`` the
    expert exchange's (its byte counts, ``comm_s``)."""
    sums = sum_over_ranks(sums, world) / (tc.grad_accum * world.size)
    dt = time.perf_counter() - t0
    n_tok = tc.grad_accum * global_tc.batch_size * tc.seq_len
    m: Metrics = {
        "step": step + 1, "loss": float(sums[0]), "aux_loss": float(sums[1]),
        "z_loss": float(sums[2]), "grad_norm": float(norm), "lr": lr, "tokens": n_tok,
        "step_time_s": dt, "tokens_per_s": n_tok / dt if dt > 0 else math.inf,
        "rank": world.rank, "node": world.node, "world_size": world.size,
        "experts_touched": touched, "peak_rss_bytes": peak_rss(),
        **store_metrics(before, store_counters(store)), **figures,
        "stall_s": figures["comm_s"], "stall_frac": figures["comm_s"] / dt if dt else 0.0,
    }
    mine = sum(v for k, v in figures.items() if k.endswith("_bytes") and
               k.split("_")[0] in ("tokens", "experts", "grads"))
    m["moved_bytes_total"] = int(sum_over_ranks(torch.tensor([mine], dtype=torch.int64),
                                                world)[0])
    return m
