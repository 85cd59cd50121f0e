"""The two simple expert sources: every expert resident, or each routed expert read when
its layer asks. The prefetching ones are :mod:`trainer.infer.ring` and
:mod:`trainer.infer.expert_mode`."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import tierstore

from ..model import ExpertSource, ExpertWeights, RoutedExperts
from .budget import too_small


def _expert_tensors(got: Mapping[Any, Tensor], names: Sequence[str], device: torch.device,
                    dtype: torch.dtype | None) -> ExpertWeights:
    return tuple(got[n].to(device=device, dtype=dtype) for n in names)


def fetch_dtype(model: Any) -> torch.dtype | None:
    """The dtype a model's experts are fetched in: its own, or None (as stored) where the
    model dequantizes them after the fetch."""
    return getattr(model, "fetch_dtype", model.dtype)


class ResidentSource(ExpertSource):
    """Every expert loaded once onto the model's device (the fully resident model)."""

    def __init__(self, store: tierstore.Store, model: Any) -> None:
        self.weights: dict[int, dict[int, ExpertWeights]] = {}
        dev, dt = model.device, fetch_dtype(model)
        for layer in model.moe_layers:
            per = {e: model.expert_names(layer, e) for e in range(model.n_experts)}
            got = store.get_many([n for names in per.values() for n in names])
            self.weights[layer] = {e: _expert_tensors(got, names, dev, dt)
                                   for e, names in per.items()}

    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for layer in self.weights.values()
                   for ws in layer.values() for w in ws)

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        return self.weights[layer]


class OnDemandSource(ExpertSource):
    """The synchronous baseline: each call reads exactly the routed experts from the store
    (``get_many``), moves them to the device and keeps nothing afterwards. On a CPU, where
    the store lends its host cache (``capabilities.zero_copy``), the experts are borrowed
    instead of copied (a layer's routed experts are hundreds of MB per token on a large
    model) and given back when the layer is done.

    ``budget``: bytes of experts it may hold at once (None: a layer's routed experts,
    whatever they come to). Where a layer routes to more, they are read in groups that
    fit, each when the model reaches its first expert (experts are applied in ascending
    id order), the group before it let go first."""

    def __init__(self, store: tierstore.Store, model: Any = None, *,
                 budget: int | None = None) -> None:
        self.store = store
        self.model = model
        self.budget = budget
        self.loaded_bytes = 0  # bytes moved to the device, for the bandwidth arithmetic
        self.loads = 0  # experts loaded
        self.load_s = 0.0  # time spent loading them
        self._expert_bytes: int | None = None
        self._lent: tierstore.Borrowed | None = None

    def begin_pass(self, model: Any, n_tokens: int) -> None:
        self.model = model

    def _load(self, layer: int, ids: Sequence[int]) -> dict[int, ExpertWeights]:
        assert self.model is not None, "begin_pass was not called"
        t0 = time.perf_counter()
        dev, dt = self.model.device, fetch_dtype(self.model)
        per = {e: self.model.expert_names(layer, e) for e in ids}
        names = [n for one in per.values() for n in one]
        self._give_back()  # the layer or group before is done with
        got: Mapping[Any, Tensor]
        if dev.type == "cpu" and self.store.capabilities.zero_copy:
            self._lent = self.store.borrow_many(names)
            got = self._lent.tensors  # .to() below keeps them as they are where it can
        else:
            got = self.store.get_many(names)
        out = {e: _expert_tensors(got, per[e], dev, dt) for e in ids}
        self.loads += len(ids)
        self.loaded_bytes += sum(t.numel() * t.element_size() for t in got.values())
        self.load_s += time.perf_counter() - t0
        return out

    def _give_back(self) -> None:
        if self._lent is not None:
            lent, self._lent = self._lent, None
            lent.release()

    def layer_done(self, layer: int) -> None:
        self._give_back()

    def end_pass(self) -> None:
        self._give_back()

    def close(self) -> None:
        self._give_back()

    def stats(self) -> dict[str, Any]:
        # The loads of a layer served in groups happen as the model looks experts up,
        # after experts() has returned: timing that call alone would miss them.
        return {"stall_s": self.load_s, "bytes_moved": self.loaded_bytes}

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        if self.budget is None:
            return self._load(layer, ids)
        if self._expert_bytes is None:
            assert self.model is not None, "begin_pass was not called"
            one = self.model.expert_bytes()
            stored = sum(self.store.info(n).nbytes for n in self.model.expert_names(layer, 0))
            self._expert_bytes = max(one, stored)  # a converted copy is the larger
            if self.budget < self._expert_bytes:
                raise too_small("one expert (on-demand mode)", self._expert_bytes,
                                self.budget)
        group = max(1, self.budget // self._expert_bytes)
        if len(ids) <= group:
            return self._load(layer, ids)
        return _Grouped(self, layer, list(ids), group)


class _Grouped(RoutedExperts):
    """A layer's routed experts read ``group`` at a time, as the model reaches them."""

    def __init__(self, source: OnDemandSource, layer: int, ids: list[int], group: int) -> None:
        self._source, self._layer, self._group = source, layer, group
        self._index = {e: i for i, e in enumerate(ids)}
        super().__init__(ids)
        self._loaded: dict[int, ExpertWeights] = {}

    def __getitem__(self, e: int) -> ExpertWeights:
        weights = self._loaded.get(e)
        if weights is None:
            i = self._index[e]  # KeyError for an expert not routed to
            self._loaded = {}  # the group before goes before the next is read
            self._loaded = self._source._load(self._layer, self._ids[i:i + self._group])
            weights = self._loaded[e]
        return weights
