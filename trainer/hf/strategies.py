"""The inference modes as strategies of the experts backend: which source feeds a loaded
model's experts modules.

* ``on-demand``: each layer reads exactly its routed experts when it runs;
* ``expert``: the routed experts, a device-side expert cache, and a speculative prefetch of
  the next layer's likely experts (its router applied to the current hidden state);
* ``ring``: K device slots, each a whole MoE layer, the next K layers streaming in;
* ``resident``: every expert loaded once.

``auto`` picks one from the budget and the model and says which (:func:`choose_mode`). The
sources are :mod:`trainer.infer`'s, unchanged in what they hold and count (the device
prefetch queue's byte credits, the host cache, the budgets, their ``stats()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tierstore.trainer.infer.device_queue import queue_budget

import tierstore

from .served import ServedModel

MODES = ("auto", "expert", "on-demand", "ring", "resident")


def every_expert_bytes(served: ServedModel) -> int:
    return len(served.moe_layers) * served.n_experts * served.expert_bytes()


def choose_mode(served: ServedModel, budget: int) -> tuple[str, str]:
    """``(mode, why)`` for ``auto``: resident where the budget holds every expert (nothing
    to stream), else expert mode, which reads only what tokens route to and keeps what is
    reused. The ring reads whole layers, so it never decodes faster than expert mode under
    the same budget unless tokens route to most of every layer; ``auto`` does not pick it."""
    every = every_expert_bytes(served)
    fmt = tierstore.format_size
    if budget >= every:
        return "resident", f"the budget ({fmt(budget)}) holds every expert ({fmt(every)})"
    return "expert", (f"the budget ({fmt(budget)}) holds {budget / every:.0%} of the experts "
                      f"({fmt(every)}): routed experts with a cache and a prefetch of the next "
                      "layer's")


def make_source(mode: str, store: tierstore.Store, served: ServedModel, *,
                budget: int | None = None, ring_slots: int | str = "auto",
                policy_args: Mapping[str, Any] | None = None, host_pool: bool = False) -> Any:
    """The source of ``mode`` (not ``auto``; see :func:`choose_mode`). ``budget``: bytes of
    experts it may hold (default: the store's prefetch budget for the device)."""
    dev, dt = served.device, served.fetch_dtype  # None: quantized, kept as stored
    if mode == "ring" and served.visit_order != served.moe_layers:
        raise tierstore.StoreError(
            "the ring streams the MoE layers in module order, once a pass; this model runs "
            f"them as {served.visit_order} (a looped model): use --mode expert or on-demand")
    if mode == "ring":
        from tierstore.trainer.infer.ring import RingSource

        return RingSource(store, dev, slots=ring_slots, budget=budget, dtype=dt)
    if mode == "expert":
        from tierstore.trainer.infer.expert_mode import ExpertModeSource

        return ExpertModeSource(store, dev, budget=budget, policy_args=policy_args, dtype=dt,
                                host_pool=host_pool, speculate=served.can_predict())
    if mode == "resident":
        from tierstore.trainer.infer.sources import ResidentSource

        return ResidentSource(store, served)
    if mode == "on-demand":
        from tierstore.trainer.infer.sources import OnDemandSource

        return OnDemandSource(store, served, budget=budget)
    raise tierstore.StoreError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def resolve_mode(mode: str, store: tierstore.Store, served: ServedModel,
                 budget: int | None) -> tuple[str, str]:
    """``mode`` itself, or what ``auto`` picks, and why (empty for a named mode)."""
    if mode not in MODES:
        raise tierstore.StoreError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode != "auto":
        return mode, ""
    b = budget if budget is not None else queue_budget(store, torch.device(served.device))
    return choose_mode(served, b)
