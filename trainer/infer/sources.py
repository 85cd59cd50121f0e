"""The two simple expert sources: every expert resident, or each routed expert read when
its layer asks. The prefetching ones are :mod:`trainer.infer.ring` and
:mod:`trainer.infer.expert_mode`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import tierstore

from ..model import ExpertSource, ExpertWeights, MoEModel, expert_names


def _expert_tensors(got: Mapping[Any, Tensor], layer: int, e: int, device: torch.device,
                    dtype: torch.dtype) -> ExpertWeights:
    w1, w2, w3 = (got[n].to(device=device, dtype=dtype) for n in expert_names(layer, e))
    return w1, w2, w3


class ResidentSource(ExpertSource):
    """Every expert loaded once onto the model's device (the fully resident model)."""

    def __init__(self, store: tierstore.Store, model: MoEModel) -> None:
        self.weights: dict[int, dict[int, ExpertWeights]] = {}
        dev, dt = model.device, model.dtype
        for layer in model.moe_layers:
            names = [n for e in range(model.cfg.n_experts) for n in expert_names(layer, e)]
            got = store.get_many(names)
            self.weights[layer] = {e: _expert_tensors(got, layer, e, dev, dt)
                                   for e in range(model.cfg.n_experts)}

    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for layer in self.weights.values()
                   for ws in layer.values() for w in ws)

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        return self.weights[layer]


class OnDemandSource(ExpertSource):
    """The synchronous baseline: each call reads exactly the routed experts from the store
    (``get_many``), moves them to the device and keeps nothing afterwards."""

    def __init__(self, store: tierstore.Store, model: MoEModel | None = None) -> None:
        self.store = store
        self.model = model
        self.loaded_bytes = 0  # bytes moved to the device, for the bandwidth arithmetic
        self.loads = 0  # experts loaded

    def begin_pass(self, model: MoEModel, n_tokens: int) -> None:
        self.model = model

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        assert self.model is not None, "begin_pass was not called"
        dev, dt = self.model.device, self.model.dtype
        names = [n for e in ids for n in expert_names(layer, e)]
        got = self.store.get_many(names)
        out = {e: _expert_tensors(got, layer, e, dev, dt) for e in ids}
        self.loads += len(ids)
        self.loaded_bytes += sum(t.numel() * t.element_size() for t in got.values())
        return out
