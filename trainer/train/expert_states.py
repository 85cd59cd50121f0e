"""The experts' states in a store during training, as the model's expert provider.

The experts are named by the model's :class:`~.layout.ExpertLayout`. Two kinds of model
call it: a preset's :class:`trainer.model.MoEModel` (``states(layer, ids)``, an expert
provider) and a ``transformers`` model through the :mod:`tierstore.hf` backend
(``states.experts(layer, ids, x)``, its experts source: the backend computes each expert
with the module's own activation and applies ``top_k_weights`` as ``transformers`` does,
so autograd gives the routed experts' weight gradients and the router's).

One step
1. Forward: each MoE layer's router runs, then the model calls :class:`ExpertStates` with the
   exact set of experts the layer routed to. It fetches the ones the step does not hold yet
   (through its :class:`~.fetch.ExpertFetch`, picked once at construction) and hands them
   back as fp32 leaves that require grad. With gradient accumulation every micro-batch
   reuses the step's leaves, so gradients accumulate there. After the last forward
   (:meth:`ExpertStates.forward_done`) a call is a recomputation (gradient checkpointing
   runs a layer again in backward): it gets the step's leaves and fetches, prefetches and
   writes nothing.
2. Backward, then one global-norm clip over dense and expert gradients together
   (:meth:`ExpertStates.grads` gives the experts').
3. :meth:`ExpertStates.update`: for each touched expert a lazy
   :func:`trainer.train.optim.adamw_step` with its own step count, on the device, its moments
   read from the store layer by layer (with ``read_ahead``, on a thread: the first layer's
   during the backward pass, the next layer's during this layer's update). The new states go
   back to the store and land in the host cache as dirty entries.

Memory: besides the dense model, the device holds the weights and gradients of the experts
one step touches (bounded by the device budget, checked before every fetch so that an
over-full step is an error rather than a wait that never ends) and, during the update, the
moments of one layer (two with ``read_ahead``). Each layer's leaves are freed as soon as its
new states are in the store.

Two update rules (``rule``):

- ``lazy``: an expert that received no token in a step gets no gradient and is not updated
  at all (no weight decay, no moment decay, no step count). ``torch.optim.AdamW`` does the
  same for a parameter whose ``.grad`` is ``None``, which is what the resident reference
  sees for an unrouted expert, so the two trainers agree.
- ``dense``: what ``torch.optim.AdamW`` does to ``transformers``' fused ``[E, ...]`` expert
  parameters, whose unrouted experts get zero gradients (:mod:`.dense_rule`): every step
  that updates experts advances one global step, an expert behind it is caught up when it
  is next fetched (before the forward computes with it), and :meth:`ExpertStates.catch_up_all`
  brings every expert there before a checkpoint or an export.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from tierstore.cache.pinned import cuda_consumer
from torch import Tensor

import tierstore

from ..model import ExpertWeights
from .checkpoint import MOMENTS, STEP_KIND
from .dense_rule import (
    StepHistory,
    catch_up_all,
    catch_up_layer,
    check_rule,
    history_key,
    require_rule,
)
from .fetch import ExpertFetch, Moments, RoutingPredictor, make_fetch
from .layout import ExpertLayout
from .resident import TrainConfig


class ExpertStates:
    """The experts' states in a store, and the :data:`trainer.model.ExpertProvider` a
    store-backed model fetches them through.

    Per step: :meth:`begin`, the model's forward passes call the instance, :meth:`forward_done`
    after the last one, then :meth:`grads` (for clipping), :meth:`update` and :meth:`end`.
    Validation uses ``begin(step, grad=False)`` and :meth:`drop_all` after each batch.

    ``fetch`` is ``queue`` or ``direct`` (:func:`~.fetch.make_fetch` says which strategy
    serves it; ``budget`` and ``zero_copy`` go there). ``rule``: the update rule, ``lazy``
    or ``dense`` (see the module docstring; :meth:`set_rule`). ``agree``: where several
    processes train one model's experts (expert parallelism), whether any of them has an
    expert gradient this step, given whether this one has: the dense rule's global step is
    taken by all or by none.
    """

    def __init__(self, store: tierstore.Store, layout: ExpertLayout, device: torch.device,
                 fetch: str, tokens_per_step: int, read_ahead: bool | None = None,
                 budget: int | str | None = None, zero_copy: bool | None = None,
                 rule: str = "lazy", agree: Callable[[bool], bool] | None = None) -> None:
        self.store, self.layout, self.device = store, layout, device
        self.agree = agree
        self.rule = check_rule(rule)
        self.history: StepHistory | None = None  # the dense rule's, read by set_rule
        self.layers = layout.keys
        self.expert_bytes = layout.expert_bytes
        # The most experts one step can touch: every expert of every MoE layer, or one per
        # routed token slot if that is fewer.
        per_layer = layout.per_step_experts(tokens_per_step)
        self.worst_step_bytes = len(self.layers) * per_layer * self.expert_bytes
        self.predictor = RoutingPredictor(self.layers, layout.n_experts)
        # With an accelerator computing, moment reads run on a host thread, one layer ahead
        # of the update that needs them (the first during the backward pass). On a CPU
        # device they run inline by default: a reader thread takes a core from the compute
        # threads, and on 2 cores that slowed the step by more than the reads it hid.
        if read_ahead is None:
            read_ahead = device.type != "cpu"
        self._reader = (ThreadPoolExecutor(1, thread_name_prefix="trainer-moments")
                        if read_ahead else None)
        # On CUDA the reader copies on a stream of its own: on the main stream its copies
        # would queue behind the backward pass they are meant to overlap. Events order the
        # update after the copies, and the copies after the last use of a reused buffer.
        self._read_stream = (torch.cuda.Stream(device)
                             if read_ahead and device.type == "cuda" else None)
        if device.type == "cuda":
            cuda_consumer()  # the host cache's slots are copied from: page-lock them
        self._moments: dict[int, Future[Moments]] = {}
        self.fetch: ExpertFetch = make_fetch(fetch, store, layout, device, self.worst_step_bytes,
                                             self.predictor, budget, zero_copy)
        self.step, self.grad = 0, True
        self.forwarding = False  # between begin() and forward_done()
        self.leaves: dict[tuple[int, int], ExpertWeights] = {}
        self.routed: dict[int, set[int]] = {}
        self.fetch_s = 0.0  # waiting for experts (params in forward, moments in update)
        self.write_s = 0.0
        self.set_rule(rule)

    def set_rule(self, rule: str) -> None:
        """Train under ``rule`` from now on (a store whose experts took steps under the other
        rule is refused), and (re)read the dense rule's history from the store: call it
        again after restoring a snapshot."""
        require_rule(self.store, self.layout, rule)
        self.rule = rule
        key = history_key(self.layout)
        self.history = (StepHistory.read(self.store, key) or StepHistory(key=key)) \
            if rule == "dense" else None

    def catch_up_all(self) -> int:
        """Dense rule: bring every expert to the global step (before a checkpoint or an
        export; between steps). Returns how many experts moved."""
        if self.history is None:
            return 0
        return catch_up_all(self.store, self.layout, self.history)

    # -- the provider -----------------------------------------------------------------

    def begin(self, step: int, grad: bool = True) -> None:
        """Start step ``step`` (1-based); ``grad=False`` for validation passes."""
        self.step, self.grad = step, grad
        self.forwarding = True
        self.leaves.clear()
        self.routed = {}
        self.fetch_s = self.write_s = 0.0
        self.fetch.begin(step, grad)

    def __call__(self, layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        """``{e: (w1, w2, w3)}`` for the experts ``ids`` that ``layer``'s router picked: fp32
        leaves (requiring grad while training), fetched once per step and shared by its
        micro-batches so that their gradients accumulate."""
        t0 = time.perf_counter()
        self.routed.setdefault(layer, set()).update(ids)
        new = [e for e in ids if (layer, e) not in self.leaves]
        # After the last forward, a call is a recomputation (gradient checkpointing runs
        # the layer again in backward): the step holds its experts already, and nothing
        # is fetched, predicted or written for it.
        if new and self.history is not None:
            # Dense rule: an expert behind the global step takes the zero-gradient updates
            # it missed before anything computes with it.
            behind = catch_up_layer(self.store, self.layout, layer, new, self.history,
                                    self.device)
            self.fetch.forget(layer, behind)  # a copy requested ahead is of the old states
        if new or self.forwarding:
            for e, weights in self.fetch.experts(layer, new).items():
                self.leaves[(layer, e)] = tuple(  # type: ignore[assignment]
                    w.detach().requires_grad_(self.grad) for w in weights)
        self.fetch_s += time.perf_counter() - t0
        return {e: self.leaves[(layer, e)] for e in ids}

    # The experts source protocol of tierstore.hf's backend (a transformers model's experts
    # modules ask it, layer by layer, with the layer's normalised hidden states).

    def experts(self, layer: int, ids: list[int], x: Tensor) -> dict[int, ExpertWeights]:
        return self(layer, ids)

    def layer_done(self, layer: int) -> None:
        """The leaves stay until the layer's update: backward needs them."""

    def drop_all(self) -> None:
        """Give back every expert the step holds (after a validation batch, at the end of a
        step)."""
        self.forwarding = False
        self.leaves.clear()
        self.fetch.end()

    # -- the update -------------------------------------------------------------------

    def forward_done(self) -> None:
        """The step's last forward has run: unused prefetches go back and, with a reader
        thread, the first touched layer's moments start to be read, overlapping the
        backward pass."""
        self.forwarding = False
        self.fetch.forward_done()
        layers = self._touched_layers()
        if layers and self._reader is not None:
            self._start_moments(layers[0])

    def tensors(self) -> list[Tensor]:
        """The step's expert leaves fetched so far."""
        return [w for ws in self.leaves.values() for w in ws]

    def grads(self) -> list[Tensor]:
        return [w.grad for w in self.tensors() if w.grad is not None]

    def _touched_layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.leaves})

    def _moment_keys(self, layer: int) -> list[tuple[str, str]]:
        """The step counts of ``layer`` and the moments of its experts this step touched."""
        keys: list[tuple[str, str]] = [(self.layout.counts_name(layer), STEP_KIND)]
        for (lay, e) in sorted(self.leaves):
            if lay == layer:
                keys += [(n, k) for n in self.fetch.names(layer, e) for k in MOMENTS]
        return keys

    def _start_moments(self, layer: int) -> None:
        """Start reading ``layer``'s moments on the reader thread (keys taken here: the
        step's bookkeeping is the main thread's)."""
        assert self._reader is not None
        self._moments[layer] = self._reader.submit(self.fetch.moments,
                                                   self._moment_keys(layer), self._read_stream)

    def _moments_of(self, layer: int) -> Moments:
        """``layer``'s moments: from the read started earlier, or read now. Either way the
        time spent waiting counts as stall (host time: on CUDA the update's stream waits on
        the reader's event instead, and that wait is not in it)."""
        t0 = time.perf_counter()
        pending = self._moments.pop(layer, None)
        if pending is not None:
            moments = pending.result()
        else:
            moments = self.fetch.moments(self._moment_keys(layer))
        if moments.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(moments.ready)
            for key, t in moments.states.items():
                if key[1] not in MOMENTS:
                    # Allocated on the reader's stream, used and dropped on this one.
                    t.record_stream(current)
        self.fetch_s += time.perf_counter() - t0
        return moments

    def update(self, lr: float, tc: TrainConfig) -> int:
        """AdamW for the step's experts, written back to the store layer by layer; returns
        how many experts were updated. Lazy: those that got gradients. Dense: when any did,
        the step is a global step (recorded in the history first) and every expert the step
        fetched is updated, one without a gradient as with a zero one; when none did, the
        step changes nothing (``torch.optim.AdamW`` skips parameters without ``.grad``)."""
        layers = self._touched_layers()
        tc = replace(tc, lr=lr, update_rule=self.rule)
        if self.history is not None:
            leaves = self.tensors()
            has = any(w.grad is not None for w in leaves)
            if not (has if self.agree is None else self.agree(has)):
                return 0
            for w in leaves:
                if w.grad is None:
                    w.grad = torch.zeros_like(w)
            self.history.advance((lr, *tc.betas, tc.eps, tc.weight_decay))
            self.history.write(self.store)
        updated = 0
        for i, layer in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            if self._reader is not None and nxt is not None and nxt not in self._moments:
                # Read the next layer's moments while this one is updated.
                self._start_moments(nxt)
            moments = self._moments_of(layer)
            try:
                updated += self._update_layer(layer, moments.states, lr, tc)
            finally:
                # The layer is done: its leaves and gradients can go (peak memory is one
                # step's weights and gradients plus one or two layers' moments).
                self.fetch.moments_done(moments)
                done = [k for k in self.leaves if k[0] == layer]
                for k in done:
                    del self.leaves[k]
                self.fetch.release(done)
        return updated

    def _update_layer(self, layer: int, states: dict[Any, Tensor], lr: float,
                      tc: TrainConfig) -> int:
        """AdamW for ``layer``'s touched experts; their new states go to the store together
        with the layer's step counts."""
        # A lent view must not change: work on a copy.
        counts = states[(self.layout.counts_name(layer), STEP_KIND)].clone()
        touched = [e for e in sorted(e for lay, e in self.leaves if lay == layer)
                   if all(w.grad is not None for w in self.leaves[(layer, e)])]
        for e in touched:  # lazy: an expert no token reached keeps its states and count
            counts[e] += 1
        if self.history is not None:  # dense: every expert of the layer is at the step now
            assert all(int(counts[e]) == self.history.step for e in touched), counts
        self.write_s += self.fetch.update(layer, [(e, self.leaves[(layer, e)]) for e in touched],
                                          states, counts, lr, tc)
        return len(touched)

    def end(self) -> dict[int, list[int]]:
        """Close the step: experts given back, the routing history updated. Returns the
        experts each MoE layer routed to this step."""
        self.drop_all()
        routed = {layer: sorted(ids) for layer, ids in sorted(self.routed.items())}
        for layer in self.layers:
            self.predictor.observe(layer, routed.get(layer, []))
        return routed

    def step_metrics(self) -> dict[str, Any]:
        """The fetch's own figures for the step's metrics."""
        return self.fetch.step_metrics()

    def close(self) -> None:
        for f in self._moments.values():
            if not f.cancel():  # read already: give back what it holds
                with contextlib.suppress(Exception):  # its own error was reported or moot
                    self.fetch.moments_done(f.result())
        self._moments.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        self.fetch.close()
