"""Ring-memory expert source: K device slots, each holding one MoE layer's experts.

SE-MoE §3.2 keeps the dense weights on the device and cycles the MoE layers' experts
through K slots: when layer i has computed, its slot is released and refilled with the
experts of layer i+K while layers i+1 … i+K-1 compute. Decoding runs the layers in the same
order once per token, so the ring wraps into the next forward pass. The paper leaves K
open; loading layer i+K behind K-1 layers of compute hides the transfer only if
``(K-1) · t_compute >= t_transfer`` (see :func:`choose_slots`).

The slots are the store's device prefetch queue (:meth:`tierstore.Store.prefetch`): a
layer's entries are requested at priority ``(pass, layer index)``, acquired when the layer
runs and released after it; the queue's byte budget bounds what the ring may hold and its
copy stream (a worker thread on the CPU) does the transfers.

``slots="auto"`` measures a layer's transfer through the queue before the first pass, runs
the first pass with as many slots as the budget holds, then picks K before each pass from
the per-layer compute time measured in the previous one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any

import torch
from torch import Tensor

import tierstore

from .decoder import expert_names

ExpertWeights = tuple[Tensor, Tensor, Tensor]


def expert_entry_names(layer: int, expert: int) -> tuple[str, str, str]:
    """Store names of one expert's (w1, w2, w3) (the trainer's naming)."""
    return expert_names(layer, expert)


def queue_budget(store: tierstore.Store, device: torch.device) -> int:
    """The byte budget of the store's prefetch queue for ``device`` (made on first use)."""
    store.prefetch([], device=device)
    dev = device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    stats = (store.stats().get("prefetch") or {}).get(str(dev))
    if stats is None:
        raise tierstore.StoreError(f"the store reports no prefetch queue for {dev}")
    return int(stats["budget_bytes"])


def queue_bytes_moved(store: tierstore.Store, device: torch.device) -> int:
    """Bytes the store's prefetch queue for ``device`` has moved so far."""
    dev = device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    stats = (store.stats().get("prefetch") or {}).get(str(dev)) or {}
    return int(stats.get("bytes_moved", 0))


def layer_entry_bytes(store: tierstore.Store, layer: int, n_experts: int) -> int:
    """Bytes of every expert of MoE layer ``layer`` as stored."""
    return sum(store.info(n).nbytes for e in range(n_experts) for n in expert_entry_names(layer, e))


def max_slots(layer_bytes: int, budget: int, n_layers: int) -> int:
    """The most slots ``budget`` holds, at most one per MoE layer (K = n_layers keeps every
    layer resident); a clear error when not even one layer fits."""
    if layer_bytes <= 0 or n_layers <= 0:
        raise ValueError("layer_bytes and n_layers must be positive")
    cap = min(budget // layer_bytes, n_layers)
    if cap < 1:
        raise tierstore.StoreError(
            f"the device budget ({tierstore.format_size(budget)}) cannot hold one MoE layer's "
            f"experts ({tierstore.format_size(layer_bytes)}); raise --device-budget or use "
            "--mode expert")
    return cap


def choose_slots(t_transfer: float, t_compute: float, layer_bytes: int, budget: int,
                 n_layers: int) -> int:
    """The ring size K: the smallest K with ``(K-1) · t_compute >= t_transfer`` (the
    transfer of layer i+K hides behind the compute of the K-1 layers before it), capped by
    the slots the budget holds (``budget // layer_bytes``) and by the number of MoE layers
    (K = n_layers keeps every layer resident). When the budget cannot hold the K that hides
    the transfer, the cap is returned and the remaining transfer time shows up as stall."""
    cap = max_slots(layer_bytes, budget, n_layers)
    if t_transfer <= 0:
        return 1
    if t_compute <= 0:
        return cap
    need = 1 + math.ceil(t_transfer / t_compute - 1e-9)  # tolerate ratios like 2.0000000001
    return max(1, min(need, cap))


class RingSource:
    """An :class:`trainer.decoder.ExpertSource` holding K MoE layers' experts at a time.

    ``slots``: ``"auto"`` (see the module docstring) or a fixed K (capped by the budget and
    the number of MoE layers). ``budget``: bytes the ring may hold (default, and at most,
    the store's prefetch budget for ``device``). ``dtype``: experts stored in another dtype
    are converted to it on use.
    """

    def __init__(self, store: tierstore.Store, device: str | torch.device, *,
                 slots: int | str = "auto", budget: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if slots != "auto" and (not isinstance(slots, int) or slots < 1):
            raise tierstore.StoreError(f"ring slots must be 'auto' or a positive integer, "
                                       f"got {slots!r}")
        self.store = store
        self.device = torch.device(device)
        self.auto = slots == "auto"
        self.fixed = None if self.auto else int(slots)
        self.dtype = dtype
        queue = queue_budget(store, self.device)
        self.budget = queue if budget is None else min(int(budget), queue)
        self.layers: list[int] = []
        self.slots = 0
        self.layer_bytes = 0
        self.t_transfer = 0.0  # seconds to bring one layer's experts through the queue
        self.t_compute = 0.0  # seconds per MoE layer in the last pass, stall excluded
        self.stall_s = 0.0  # blocked in experts() waiting for transfers
        self.busy_s = 0.0  # inside passes
        self.passes = 0
        self.hits = self.accesses = 0  # experts already on the device when their layer ran
        self.slot_history: list[int] = []
        self._pos = 0  # ring position of the next layer to run: pass * L + index
        self._requested: dict[int, dict[str, Future[Tensor]]] = {}  # position -> futures
        self._held: dict[int, dict[int, ExpertWeights]] = {}  # layer -> acquired experts
        self._pass_start = 0.0
        self._pass_stall = 0.0
        self._moved_start = 0

    # -- ring bookkeeping -------------------------------------------------------------
    def _bind(self, model: Any) -> None:
        self.layers = list(model.moe_layers)
        if not self.layers:
            raise tierstore.StoreError("the model has no MoE layers to put in a ring")
        self.n_experts = int(model.cfg.n_experts)
        self.layer_bytes = layer_entry_bytes(self.store, self.layers[0], self.n_experts)
        self._names = {layer: [expert_entry_names(layer, e) for e in range(self.n_experts)]
                       for layer in self.layers}
        self._moved_start = queue_bytes_moved(self.store, self.device)
        cap = max_slots(self.layer_bytes, self.budget, len(self.layers))
        if self.auto:
            self._calibrate()
            self.slots = cap  # no compute measured yet: as many slots as the budget holds
        else:
            self.slots = min(self.fixed or 1, cap)

    def _layer_at(self, pos: int) -> int:
        return self.layers[pos % len(self.layers)]

    def _request(self, pos: int) -> None:
        if pos in self._requested:
            return
        layer = self._layer_at(pos)
        names = [n for trio in self._names[layer] for n in trio]
        futures = self.store.prefetch(names, device=self.device,
                                      priority=(pos // len(self.layers), pos % len(self.layers)))
        self._requested[pos] = dict(zip(names, futures))

    def _top_up(self) -> None:
        for pos in range(self._pos, self._pos + self.slots):
            self._request(pos)

    def _calibrate(self) -> None:
        """Time one layer's transfer through the queue: the first layer the ring needs,
        which then stays in its slot."""
        t0 = time.perf_counter()
        self._request(self._pos)
        wait(list(self._requested[self._pos].values()))
        for f in self._requested[self._pos].values():
            f.result()  # a failed read fails here, with the store's message
        self.t_transfer = time.perf_counter() - t0

    # -- the ExpertSource protocol ------------------------------------------------------
    def begin_pass(self, model: Any, n_tokens: int) -> None:
        if not self.layers:
            self._bind(model)
        elif self._pos % len(self.layers):
            # The last pass stopped part way (an exception in the model): start this one
            # from the first MoE layer with an empty ring.
            self.close()
            self._pos += len(self.layers) - self._pos % len(self.layers)
        if self.auto and self.t_compute > 0:
            self.slots = choose_slots(self.t_transfer, self.t_compute, self.layer_bytes,
                                      self.budget, len(self.layers))
        self.slot_history.append(self.slots)
        self._pass_start = time.perf_counter()
        self._pass_stall = 0.0
        self._top_up()

    def experts(self, layer: int, ids: Sequence[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        expected = self._layer_at(self._pos)
        if layer != expected:
            raise tierstore.StoreError(f"the ring expected MoE layer {expected} next, "
                                       f"the model asked for layer {layer}")
        self._request(self._pos)
        futures = self._requested[self._pos]
        held = self._held.setdefault(layer, {})
        out: dict[int, ExpertWeights] = {}
        t0 = time.perf_counter()
        for e in ids:
            weights = held.get(e)
            if weights is None:
                names = self._names[layer][e]
                self.hits += all(futures[n].done() for n in names)
                weights = tuple(self._convert(self.store.acquire(n, device=self.device))
                                for n in names)  # type: ignore[assignment]
                held[e] = weights
            else:
                self.hits += 1
            self.accesses += 1
            out[e] = weights
        stall = time.perf_counter() - t0
        self.stall_s += stall
        self._pass_stall += stall
        return out

    def _convert(self, t: Tensor) -> Tensor:
        return t if self.dtype is None or t.dtype == self.dtype else t.to(self.dtype)

    def layer_done(self, layer: int) -> None:
        pos = self._pos
        self._requested.pop(pos, None)
        self._pos += 1
        # The slot is freed unless the same layer comes back within the ring (K = L).
        if self.slots < len(self.layers):
            self._held.pop(layer, None)
            self.store.cancel([n for trio in self._names[layer] for n in trio],
                              device=self.device)
            # Requests for this layer's next turn, made while K was larger, were cancelled
            # with it: forget them so that the turn asks again.
            for p in [p for p in self._requested if self._layer_at(p) == layer]:
                del self._requested[p]
        self._top_up()

    def end_pass(self) -> None:
        elapsed = time.perf_counter() - self._pass_start
        self.busy_s += elapsed
        self.passes += 1
        self.t_compute = max(elapsed - self._pass_stall, 0.0) / len(self.layers)

    def close(self) -> None:
        """Give every slot back to the device budget."""
        names = [n for layer in self.layers for trio in self._names[layer] for n in trio]
        if names:
            self.store.cancel(names, device=self.device)
        self._requested.clear()
        self._held.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "mode": "ring",
            "slots": self.slots,
            "slot_history": list(self.slot_history),
            "moe_layers": len(self.layers),
            "layer_bytes": self.layer_bytes,
            "budget_bytes": self.budget,
            "t_transfer_s": self.t_transfer,
            "t_compute_s": self.t_compute,
            "stall_s": self.stall_s,
            "busy_s": self.busy_s,
            "stall_frac": self.stall_s / self.busy_s if self.busy_s else 0.0,
            "hit_rate": self.hits / self.accesses if self.accesses else None,
            "spec_accuracy": None,
            "bytes_moved": (queue_bytes_moved(self.store, self.device) - self._moved_start
                            if self.layers else 0),
        }
