"""Store-backed MoE training: dense parameters on the device, experts in a tierstore Store.

What lives where
- Dense parameters (embeddings, attention, norms, routers, dense FFNs) are a normal torch
  module on the device, trained by ``torch.optim.AdamW`` exactly as in :mod:`trainer.resident`.
- Every expert weight's fp32 master copy and its two AdamW moments live in the store as
  ``layers.{l}.experts.{e}.{w1,w2,w3}`` with kinds ``param``, ``exp_avg`` and ``exp_avg_sq``.
  The per-expert AdamW step counts of MoE layer ``l`` are one int64 ``[n_experts]`` entry,
  ``layers.{l}.experts`` of kind ``step``.

One step
1. Forward: each MoE layer's router runs, then the model calls the provider
   (:class:`ExpertStates`) with the exact set of experts the layer routed to. The provider
   fetches the ones it does not hold yet and hands them back as fp32 leaves that require
   grad. In ``queue`` mode the fetch goes through the store's device prefetch queue: the
   exact set is requested at once, then the next MoE layer's experts, predicted from decayed
   routing counts, are requested while this layer computes, and finally the exact set is
   acquired. In ``direct`` mode the experts are read with ``get_many``. With gradient
   accumulation every micro-batch reuses the step's leaves, so gradients accumulate there.
2. Backward, then one global-norm clip over dense and expert gradients together.
3. Dense ``opt.step()``; for each touched expert a lazy :func:`trainer.optim.adamw_step` with
   its own step count, on the device, its moments read from the store layer by layer (with
   ``read_ahead``, on a thread: the first layer's during the backward pass, the next layer's
   during this layer's update). The new states go back with ``put_many`` and land in the
   host cache as dirty entries. ``store.tick()`` advances the cache policy's clock.

Memory: besides the dense model, the device holds the weights and gradients of the experts
one step touches (bounded by the device budget, checked before every fetch so that an
over-full step is an error rather than a wait that never ends) and, during the
update, the moments of one layer (two with ``read_ahead``). Each layer's leaves are freed as
soon as its new states are in the store.

Lazy semantics: an expert that received no token in a step gets no gradient and is not
updated at all (no weight decay, no moment decay, no step count). ``torch.optim.AdamW`` does
the same for a parameter whose ``.grad`` is ``None``, which is what the resident reference
sees for an unrouted expert, so the two trainers agree.

Checkpoints
A checkpoint is one store snapshot, ``step-{n}``. The dense part (model and optimizer state,
sampler position, RNG states, configs) is serialised into the store entry ``trainer.dense``
(kind ``checkpoint``) right before the snapshot is taken, so the snapshot's single catalog
transaction records it together with every expert entry: there is no moment at which a
checkpoint exists whose dense and expert parts come from different steps. A crash before
that transaction commits leaves the previous checkpoints as they were (the live entries may
hold newer, partly flushed versions; resuming restores the snapshot over them); a crash
after it leaves a complete new checkpoint. The latest :data:`KEEP_CHECKPOINTS` snapshots are
kept; older ones are dropped after each new one commits (a crash in between only leaves an
extra snapshot, dropped by the next checkpoint). ``resume=True`` restores the latest
snapshot, loads the dense state from it and continues to ``steps`` total.

Reusing a store
The first run writes ``trainer.run`` (kind ``meta``: the model and training configs and
the seed, as JSON) and initialises every expert from :func:`trainer.model.init_expert`. A
store that already holds a run is only used again with ``resume=True`` and the same configs
and seed; otherwise :class:`TrainerError` says so and nothing is touched. Resuming a run that
never reached a checkpoint starts it over from the initial weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import resource
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tierstore.cache.pinned import cuda_consumer
from torch import Tensor

import tierstore
from tierstore import StoreError
from tierstore.devices import normalize_device
from tierstore.prefetch import DEFAULT_CUDA_FRACTION

from .data import BatchSampler, Corpus
from .model import (
    EXPERT_WEIGHTS,
    ExpertWeights,
    MoEConfig,
    MoEModel,
    expert_name,
    init_expert,
)
from .optim import adamw_step, clip_grads_, grad_norms, total_norm
from .resident import (
    Metrics,
    TrainConfig,
    param_groups,
    resolve_model_config,
    rng_state,
    set_rng_state,
    step_metrics,
    training_batches,
)

MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_KIND = "step"
RUN_ENTRY = ("trainer.run", "meta")
DENSE_ENTRY = ("trainer.dense", "checkpoint")
CHECKPOINT_VERSION = 1
KEEP_CHECKPOINTS = 2
FETCH_MODES = ("auto", "queue", "direct")
_TAG = re.compile(r"^step-(\d+)$")

PathLike = str | os.PathLike[str]


class TrainerError(StoreError):
    """The store cannot be trained on as asked (it holds another run, the device budget
    cannot hold a step's experts, ...). A :class:`tierstore.StoreError`, so the CLI reports
    it as one line."""


def step_counts_name(layer: int) -> str:
    """The store name of MoE layer ``layer``'s per-expert AdamW step counts."""
    return f"layers.{layer}.experts"


def checkpoint_tag(step: int) -> str:
    return f"step-{step}"


def checkpoint_steps(store: tierstore.Store) -> list[int]:
    """Steps of the checkpoints (``step-{n}`` snapshots) the store holds, ascending."""
    found = (_TAG.match(s.tag) for s in store.snapshots())
    return sorted(int(m.group(1)) for m in found if m)


# --------------------------------------------------------------------------- serialisation


def _pack(obj: Any) -> Tensor:
    """``torch.save`` bytes as a uint8 tensor, so a Python object can be a store entry."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _unpack(t: Tensor) -> Any:
    # The payload holds numpy and python RNG states besides tensors.
    return torch.load(io.BytesIO(t.numpy().tobytes()), map_location="cpu", weights_only=False)


def _json_entry(obj: Any) -> Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


# --------------------------------------------------------------------------- routing history


class RoutingPredictor:
    """Which experts a MoE layer will route to next, from its routing history.

    Each layer keeps ``count_e <- decay * count_e + [e was routed]`` per step; the prediction
    is the layer's experts with the highest decayed counts, as many as it used last step.
    Only prefetching depends on it (never the numbers a step computes), so it is not part of
    a checkpoint: a resumed run starts with an empty history and predicts nothing at first.
    """

    def __init__(self, layers: Iterable[int], n_experts: int, decay: float = 0.5) -> None:
        self.decay = decay
        self.counts = {layer: [0.0] * n_experts for layer in layers}
        self.last = {layer: 0 for layer in self.counts}

    def observe(self, layer: int, ids: Iterable[int]) -> None:
        counts = self.counts[layer]
        for e in range(len(counts)):
            counts[e] *= self.decay
        n = 0
        for e in ids:
            counts[e] += 1.0
            n += 1
        self.last[layer] = n

    def predict(self, layer: int) -> list[int]:
        counts = self.counts[layer]
        ranked = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        return sorted(ranked[: self.last[layer]])


# --------------------------------------------------------------------------- expert states


def resolve_fetch_mode(fetch: str, device: torch.device) -> str:
    """``auto`` is the prefetch queue on an accelerator, where its threads overlap reads and
    host-to-device copies with compute the host CPU does not take part in, and ``get_many``
    on the CPU. There the "device" is host memory, so the queue has no transfer to hide,
    and its threads' copies compete with the compute threads for the same cores (measured
    on 2 cores: the backward pass took twice as long)."""
    if fetch not in FETCH_MODES:
        raise ValueError(f"fetch must be one of {', '.join(FETCH_MODES)}, got {fetch!r}")
    if fetch == "auto":
        return "direct" if device.type == "cpu" else "queue"
    return fetch


class BufferPool:
    """Reusable tensors for the expert states a step reads, by (shape, dtype, device).

    Every step reads the same shapes again; taking fresh tensors each time would make the
    allocator hand memory back to the system and fault it in again (hundreds of microseconds
    per 128 KiB entry on a virtual machine), which costs more than the copy out of the host
    cache itself. Buffers go back once the values they held have been written to the store.

    Devices in keys are normalised (:func:`tierstore.devices.normalize_device`): a caller's
    ``"cuda"`` and a tensor's ``cuda:0`` are one key, or no buffer would ever be reused and
    every step would allocate afresh. On CUDA a buffer given back carries an event recorded
    on the giver's current stream, and whoever takes it makes its own current stream wait on
    that event: the reader thread's stream must not overwrite moments the update's kernels
    on the main stream are still reading.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype, torch.device],
                         list[tuple[Tensor, Any]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(shape: Sequence[int], dtype: torch.dtype,
            device: str | torch.device) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
        return tuple(shape), dtype, normalize_device(device)

    def take(self, shape: Sequence[int], device: str | torch.device,
             dtype: torch.dtype = torch.float32) -> Tensor:
        key = self.key(shape, dtype, device)
        with self._lock:
            free = self._free.get(key)
            got = free.pop() if free else None
        if got is None:
            return torch.empty(key[0], dtype=dtype, device=key[2])
        t, ready = got
        if ready is not None:
            torch.cuda.current_stream(t.device).wait_event(ready)
        return t

    def give(self, tensors: Iterable[Tensor]) -> None:
        items = []
        for t in tensors:
            ready = None
            if t.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(t.device))
            items.append((t, ready))
        with self._lock:
            for t, ready in items:
                self._free.setdefault(self.key(t.shape, t.dtype, t.device), []).append((t, ready))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())


class ExpertStates:
    """The experts' states in a store, and the :data:`trainer.model.ExpertProvider` a
    store-backed model fetches them through.

    Per step: :meth:`begin`, the model's forward passes call the instance, :meth:`forward_done`
    after the last one, then :meth:`grads` (for clipping), :meth:`update` and :meth:`end`.
    Validation uses ``begin(step, grad=False)`` and :meth:`drop_all` after each batch.
    """

    def __init__(self, store: tierstore.Store, cfg: MoEConfig, device: torch.device,
                 fetch: str, tokens_per_step: int, read_ahead: bool | None = None,
                 budget: int | str | None = None, zero_copy: bool | None = None) -> None:
        self.store, self.cfg, self.device = store, cfg, device
        self.queue = fetch == "queue"
        self.layers = cfg.moe_layers
        self.next_layer = dict(zip(self.layers, self.layers[1:]))
        self.shapes = cfg.expert_shapes()
        self.expert_bytes = sum(4 * a * b for a, b in self.shapes.values())  # fp32 w1+w2+w3
        # The most experts one step can touch: every expert of every MoE layer, or one per
        # routed token slot if that is fewer.
        per_layer = min(cfg.n_experts, tokens_per_step * cfg.top_k)
        self.worst_step_bytes = len(self.layers) * per_layer * self.expert_bytes
        self.predictor = RoutingPredictor(self.layers, cfg.n_experts)
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
        self._moments: dict[int, Future[tuple[dict[Any, Tensor], Any, Any]]] = {}
        # Queue mode: experts holding (or about to hold) device budget -> acquired yet?
        self._held: dict[tuple[int, int], bool] = {}
        # Bytes of expert weights the device may hold: the queue's budget, or in direct mode
        # the one given (none: unbounded).
        if self.queue:
            self.budget: int | None = self._queue_budget()
        else:
            self.budget = None if budget is None else tierstore.parse_size(budget)
        self.step, self.grad = 0, True
        self.leaves: dict[tuple[int, int], ExpertWeights] = {}
        # Direct mode reads parameters and moments into pooled buffers (see BufferPool);
        # the buffers behind a leaf are kept here until its new value is in the store.
        self.pool = BufferPool()
        self._leaf_bufs: dict[tuple[int, int], list[Tensor]] = {}
        # On the CPU the device is host memory: leaves and moments can be read-only views
        # of the host cache's slots (store.borrow_many) and the update can write the new
        # states straight into staged slots (store.stage_many), so no state is copied. The
        # views pin their slots for the step, though, so this only pays when the cache
        # holds a step's states with room to spare (by default: four times the weights one
        # step can touch); otherwise pinned leaves would crowd out the moments.
        possible = (not self.queue and device.type == "cpu"
                    and hasattr(store, "borrow_many") and hasattr(store, "stage_many"))
        if zero_copy is None:
            cache = (store.stats().get("cache") or {}) if possible else {}
            zero_copy = cache.get("capacity_bytes", 0) >= 4 * self.worst_step_bytes
        self.zero_copy = possible and zero_copy
        self._borrows: dict[tuple[int, int], Any] = {}
        self.routed: dict[int, set[int]] = {}
        self.fetch_s = 0.0  # waiting for experts (params in forward, moments in update)
        self.write_s = 0.0
        self.predicted = self.predicted_used = 0  # queue mode: experts requested ahead

    # -- set-up ---------------------------------------------------------------------

    def _queue_budget(self) -> int:
        """The device queue's byte budget, as the store reports it (made on first use)."""
        self.store.prefetch([], device=self.device)
        queues = self.store.stats().get("prefetch") or {}
        dev = normalize_device(self.device)
        stats = queues.get(str(dev))
        if stats is None:
            raise TrainerError(f"the store reports no prefetch queue for {dev}")
        return int(stats["budget_bytes"])

    def initialise(self, seed: int) -> None:
        """Write every expert's initial weights, zero moments and zero step counts.

        Writes are flushed whenever about half the host cache has been filled, so that
        making room evicts clean entries instead of writing dirty ones back one commit at a
        time.
        """
        cache = self.store.stats()["cache"]
        flush_every = cache["capacity_bytes"] // 2 if cache else 0
        zeros = {w: torch.zeros(shape) for w, shape in self.shapes.items()}
        pending = 0
        for layer in self.layers:
            for e in range(self.cfg.n_experts):
                items: list[tuple[str, str, Tensor]] = []
                for w, t in zip(EXPERT_WEIGHTS, init_expert(self.cfg, seed, layer, e)):
                    name = expert_name(layer, e, w)
                    items += [(name, "param", t), (name, MOMENTS[0], zeros[w]),
                              (name, MOMENTS[1], zeros[w])]
                self.store.put_many(items)
                pending += 3 * self.expert_bytes
                if flush_every and pending >= flush_every:
                    self.store.flush()
                    pending = 0
            self.store.put(step_counts_name(layer),
                           torch.zeros(self.cfg.n_experts, dtype=torch.int64), kind=STEP_KIND)
        self.store.flush()

    # -- the provider -----------------------------------------------------------------

    def begin(self, step: int, grad: bool = True) -> None:
        """Start step ``step`` (1-based); ``grad=False`` for validation passes."""
        self.step, self.grad = step, grad
        self._clear_leaves()
        self.routed = {}
        self.fetch_s = self.write_s = 0.0
        self.predicted = self.predicted_used = 0
        if self.queue and grad and self.layers:
            self._predict(self.layers[0])

    def __call__(self, layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        """``{e: (w1, w2, w3)}`` for the experts ``ids`` that ``layer``'s router picked: fp32
        leaves (requiring grad while training), fetched once per step and shared by its
        micro-batches so that their gradients accumulate."""
        t0 = time.perf_counter()
        self.routed.setdefault(layer, set()).update(ids)
        new = [e for e in ids if (layer, e) not in self.leaves]
        if new:
            fetch = self._fetch_queue if self.queue else self._fetch_direct
            fetched = fetch(layer, new)
            for e, weights in fetched.items():
                self.leaves[(layer, e)] = tuple(  # type: ignore[assignment]
                    w.detach().requires_grad_(self.grad) for w in weights)
        elif self.queue and layer in self.next_layer:
            self._predict(self.next_layer[layer])
        self.fetch_s += time.perf_counter() - t0
        return {e: self.leaves[(layer, e)] for e in ids}

    def _names(self, layer: int, e: int) -> list[str]:
        return [expert_name(layer, e, w) for w in EXPERT_WEIGHTS]

    def _check_budget(self, layer: int, need: int) -> None:
        """Fail now rather than wait for budget that only the end of the step frees."""
        if self.budget is not None and need > self.budget:
            raise TrainerError(
                f"layer {layer}'s experts do not fit the device budget: this step needs "
                f"{tierstore.format_size(need)} of expert weights on {self.device}, the budget "
                f"is {tierstore.format_size(self.budget)}; raise --device-budget (a step of "
                f"this model and batch can touch up to "
                f"{tierstore.format_size(self.worst_step_bytes)})")

    def _fetch_direct(self, layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        self._check_budget(layer, (len(self.leaves) + len(ids)) * self.expert_bytes)
        if self.zero_copy:
            got = {}
            for e in ids:
                lent = self.store.borrow_many(self._names(layer, e))
                self._borrows[(layer, e)] = lent
                got[e] = tuple(lent.tensors[n] for n in self._names(layer, e))
            return got  # type: ignore[return-value]
        out: dict[str, Tensor] = {}
        for e in ids:
            bufs = [self.pool.take(self.shapes[w], self.device) for w in EXPERT_WEIGHTS]
            self._leaf_bufs[(layer, e)] = bufs
            out.update(zip(self._names(layer, e), bufs))
        got = self.store.get_many(list(out), device=self.device, out=out)
        return {e: tuple(got[n] for n in self._names(layer, e)) for e in ids}  # type: ignore[misc]

    def _clear_leaves(self, keys: Iterable[tuple[int, int]] | None = None) -> None:
        """Forget leaves (all, or ``keys``) and give their buffers back to the pool."""
        everything = {**self.leaves, **self._leaf_bufs, **self._borrows}
        for k in list(everything) if keys is None else keys:
            self.leaves.pop(k, None)
            self.pool.give(self._leaf_bufs.pop(k, ()))
            lent = self._borrows.pop(k, None)
            if lent is not None:
                lent.release()

    def _fetch_queue(self, layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        # Predictions for this layer that missed are no use now and their budget may be
        # needed: cancel them before asking for the exact set.
        wanted = set(ids)
        self._drop([k for k, got in self._held.items()
                    if k[0] == layer and not got and k[1] not in wanted], release=False)
        missing = [e for e in ids if (layer, e) not in self._held]
        self.predicted_used += len(ids) - len(missing)
        self._check_budget(layer, self._held_bytes() + len(missing) * self.expert_bytes)
        self._request(layer, missing, (self.step, layer))
        if layer in self.next_layer:  # read while this layer computes
            self._predict(self.next_layer[layer])
        out: dict[int, ExpertWeights] = {}
        for e in ids:
            out[e] = tuple(self.store.acquire(n, device=self.device)  # type: ignore[assignment]
                           for n in self._names(layer, e))
            self._held[(layer, e)] = True
        return out

    def _request(self, layer: int, ids: Sequence[int], priority: tuple[int, int]) -> None:
        if ids:
            self.store.prefetch([n for e in ids for n in self._names(layer, e)],
                                device=self.device, priority=priority)
            for e in ids:
                self._held.setdefault((layer, e), False)

    def _predict(self, layer: int) -> None:
        """Request the predicted experts of ``layer`` that fit the budget's spare room."""
        assert self.budget is not None
        room = (self.budget - self._held_bytes()) // self.expert_bytes
        guess = [e for e in self.predictor.predict(layer) if (layer, e) not in self._held]
        guess = guess[: max(0, room)]
        self._request(layer, guess, (self.step, layer))
        self.predicted += len(guess)

    def _held_bytes(self) -> int:
        return len(self._held) * self.expert_bytes

    def _drop(self, keys: Iterable[tuple[int, int]], *, release: bool) -> None:
        """Release acquired experts / cancel requested ones, giving their budget back."""
        keys = list(keys)
        if not keys:
            return
        names = [n for layer, e in keys for n in self._names(layer, e)]
        if release:
            for n in names:
                self.store.release(n, device=self.device)
        else:
            self.store.cancel(names, device=self.device)
        for k in keys:
            self._held.pop(k, None)

    def drop_all(self) -> None:
        """Give back every device copy (after a validation batch, at the end of a step)."""
        self._clear_leaves()
        if self.queue:
            self._drop([k for k, got in self._held.items() if got], release=True)
            self._drop(list(self._held), release=False)

    # -- the update -------------------------------------------------------------------

    def forward_done(self) -> None:
        """The step's last forward has run: cancel predictions that were never used and,
        with a reader thread, start reading the first touched layer's moments so that the
        read overlaps the backward pass."""
        if self.queue:
            self._drop([k for k, got in self._held.items() if not got], release=False)
        layers = self._touched_layers()
        if layers and self._reader is not None:
            self._start_moments(layers[0])

    def grads(self) -> list[Tensor]:
        return [w.grad for ws in self.leaves.values() for w in ws if w.grad is not None]

    def _touched_layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.leaves})

    def _moment_keys(self, layer: int) -> list[tuple[str, str]]:
        """The step counts of ``layer`` and the moments of its experts this step touched."""
        keys: list[tuple[str, str]] = [(step_counts_name(layer), STEP_KIND)]
        for (lay, e) in sorted(self.leaves):
            if lay == layer:
                keys += [(n, k) for n in self._names(layer, e) for k in MOMENTS]
        return keys

    def _read_moments(self, keys: list[tuple[str, str]], stream: Any = None
                      ) -> tuple[dict[Any, Tensor], Any, Any]:
        """A layer's moments and step counts, what to give back once they are used (a
        borrow (zero-copy) or pooled buffers; the step counts entry is small: read plainly),
        and, read on ``stream`` (CUDA), the event after which they are there."""
        if self.zero_copy:
            lent = self.store.borrow_many(keys)
            return lent.tensors, lent, None
        if stream is None:
            return self._get_moments(keys), None, None
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            states = self._get_moments(keys)
            ready = torch.cuda.Event()
            ready.record(stream)
        return states, None, ready

    def _get_moments(self, keys: list[tuple[str, str]]) -> dict[Any, Tensor]:
        out = {k: self.pool.take(self.shapes[k[0].rsplit(".", 1)[1]], self.device)
               for k in keys if k[1] in MOMENTS}
        return self.store.get_many(keys, device=self.device, out=out)

    def _done_with_moments(self, states: dict[Any, Tensor], lent: Any, ready: Any = None
                           ) -> None:
        if lent is not None:
            lent.release()
        else:
            self.pool.give(t for key, t in states.items() if key[1] in MOMENTS)

    def _start_moments(self, layer: int) -> None:
        """Start reading ``layer``'s moments on the reader thread (keys taken here: the
        step's bookkeeping is the main thread's)."""
        assert self._reader is not None
        self._moments[layer] = self._reader.submit(self._read_moments,
                                                   self._moment_keys(layer), self._read_stream)

    def _moments_of(self, layer: int) -> tuple[dict[Any, Any], Any]:
        """``layer``'s moments: from the read started earlier, or read now. Either way the
        time spent waiting counts as stall (host time: on CUDA the update's stream waits on
        the reader's event instead, and that wait is not in it)."""
        t0 = time.perf_counter()
        pending = self._moments.pop(layer, None)
        if pending is not None:
            states, lent, ready = pending.result()
        else:
            states, lent, ready = self._read_moments(self._moment_keys(layer))
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            for key, t in states.items():
                if key[1] not in MOMENTS:
                    # Allocated on the reader's stream, used and dropped on this one.
                    t.record_stream(current)
        self.fetch_s += time.perf_counter() - t0
        return states, lent

    def update(self, lr: float, tc: TrainConfig) -> int:
        """Lazy AdamW for every expert that got gradients this step, written back to the
        store layer by layer; returns how many experts were updated."""
        layers = self._touched_layers()
        updated = 0
        for i, layer in enumerate(layers):
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            if self._reader is not None and nxt is not None and nxt not in self._moments:
                # Read the next layer's moments while this one is updated.
                self._start_moments(nxt)
            states, lent = self._moments_of(layer)
            try:
                updated += self._update_layer(layer, states, lr, tc)
            finally:
                # The layer is done: its leaves and gradients can go (peak memory is one
                # step's weights and gradients plus one or two layers' moments), and its
                # device copies are of the old version now.
                self._done_with_moments(states, lent)
                done = [k for k in self.leaves if k[0] == layer]
                self._clear_leaves(done)
                if self.queue:
                    self._drop([k for k in done if k in self._held], release=True)
        return updated

    def _update_layer(self, layer: int, states: dict[Any, Tensor], lr: float,
                      tc: TrainConfig) -> int:
        """AdamW for ``layer``'s touched experts; their new states go to the store (staged in
        place, or with put_many) together with the layer's step counts."""
        counts_key = (step_counts_name(layer), STEP_KIND)
        counts = states[counts_key].clone()  # a lent view must not change: work on a copy
        touched = [e for e in sorted(e for lay, e in self.leaves if lay == layer)
                   if all(w.grad is not None for w in self.leaves[(layer, e)])]
        for e in touched:  # lazy: an expert no token reached keeps its states and count
            counts[e] += 1
        t0 = time.perf_counter()
        if self.zero_copy:
            wanted = [(name, k, torch.float32, self.shapes[w])
                      for e in touched for w, name in zip(EXPERT_WEIGHTS, self._names(layer, e))
                      for k in ("param", *MOMENTS)]
            wanted.append((*counts_key, counts.dtype, tuple(counts.shape)))
            with self.store.stage_many(wanted) as staged:
                new = staged.tensors
                self.write_s += time.perf_counter() - t0
                self._adamw(layer, touched, states, counts, lr, tc,
                            lambda name: (new[(name, "param")], new[(name, MOMENTS[0])],
                                          new[(name, MOMENTS[1])]))
                new[counts_key].copy_(counts)
                t0 = time.perf_counter()
                staged.commit()
        else:
            items = self._adamw(layer, touched, states, counts, lr, tc, None)
            items.append((*counts_key, counts))
            t0 = time.perf_counter()
            self.store.put_many(items)
        self.write_s += time.perf_counter() - t0
        return len(touched)

    def _adamw(self, layer: int, touched: list[int], states: dict[Any, Tensor],
               counts: Tensor, lr: float, tc: TrainConfig,
               out_of: Callable[[str], tuple[Tensor, Tensor, Tensor]] | None
               ) -> list[tuple[str, str, Tensor]]:
        """The AdamW arithmetic of ``touched`` experts: in place (returning the put_many
        items), or into the tensors ``out_of(name)`` gives."""
        items: list[tuple[str, str, Tensor]] = []
        for e in touched:
            n = int(counts[e])
            for name, w in zip(self._names(layer, e), self.leaves[(layer, e)]):
                p, m, v = w.detach(), states[(name, MOMENTS[0])], states[(name, MOMENTS[1])]
                assert w.grad is not None
                out = None if out_of is None else out_of(name)
                adamw_step(p, w.grad, m, v, n, lr, tc.betas, tc.eps, tc.weight_decay, out=out)
                if out is None:
                    items += [(name, "param", p), (name, MOMENTS[0], m), (name, MOMENTS[1], v)]
        return items

    def end(self) -> dict[int, list[int]]:
        """Close the step: device copies given back, the routing history updated. Returns
        the experts each MoE layer routed to this step."""
        self.drop_all()
        routed = {layer: sorted(ids) for layer, ids in sorted(self.routed.items())}
        for layer in self.layers:
            self.predictor.observe(layer, routed.get(layer, []))
        return routed

    def close(self) -> None:
        for f in self._moments.values():
            if not f.cancel():  # read already: give back what it holds
                with contextlib.suppress(Exception):  # its own error was reported or moot
                    self._done_with_moments(*f.result())
        self._moments.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self.queue:
            self.drop_all()


# --------------------------------------------------------------------------- the run record


def _run_identity(cfg: MoEConfig, tc: TrainConfig, seed: int) -> dict[str, Any]:
    return {"version": CHECKPOINT_VERSION, "model_config": cfg.to_dict(),
            "train_config": tc.to_dict(), "seed": seed}


def _differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    return [f"{k}={saved.get(k)!r} (now {mine.get(k)!r})"
            for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]


def _check_identity(saved: dict[str, Any], cfg: MoEConfig, tc: TrainConfig, seed: int,
                    where: str) -> None:
    """Refuse to continue a run with other configs or another seed than it started with."""
    if saved.get("version") != CHECKPOINT_VERSION:
        raise TrainerError(f"{where} holds a training run of format {saved.get('version')!r}, "
                           f"this trainer writes {CHECKPOINT_VERSION}")
    if MoEConfig.from_dict(saved["model_config"]) != cfg:
        diff = _differences(saved["model_config"], cfg.to_dict())
        raise TrainerError(f"{where} holds a run of a different model: {', '.join(diff)}")
    saved_tc = json.loads(json.dumps(saved["train_config"]))
    mine_tc = json.loads(json.dumps(tc.to_dict()))
    if saved_tc != mine_tc:
        diff = _differences(saved_tc, mine_tc)
        raise TrainerError(f"{where} holds a run with different training hyperparameters: "
                           f"{', '.join(diff)}")
    if saved["seed"] != seed:
        raise TrainerError(f"{where} holds a run with seed {saved['seed']}, not {seed}")


def saved_run(store_path: PathLike | tierstore.Store) -> dict[str, Any] | None:
    """The model config, training config and seed (``model_config``, ``train_config``,
    ``seed``) of the run the store at ``store_path`` (or the open store given) holds;
    ``None`` if there is no store or no run in it."""
    if not isinstance(store_path, str | os.PathLike):
        raw = _read_entry(store_path, RUN_ENTRY)
    else:
        try:
            store = tierstore.open(store_path, host_cache=0)
        except tierstore.NotAStoreError:
            return None
        with store:
            raw = _read_entry(store, RUN_ENTRY)
    return None if raw is None else json.loads(raw.numpy().tobytes())


def _read_entry(store: tierstore.Store, entry: tuple[str, str]) -> Tensor | None:
    try:
        return store.get(*entry)
    except tierstore.EntryNotFoundError:
        return None


def _start(store: tierstore.Store, experts: ExpertStates, cfg: MoEConfig, tc: TrainConfig,
           seed: int, resume: bool) -> tuple[int, dict[str, Any] | None]:
    """Bring the store to the state training starts from: the first step to run and the
    dense checkpoint payload to load (``None``: a fresh start from the initial weights)."""
    where = f"store {store.path}"
    raw = _read_entry(store, RUN_ENTRY)
    saved = None if raw is None else json.loads(raw.numpy().tobytes())
    if saved is None:
        if store.names("layers.") or checkpoint_steps(store):
            raise TrainerError(f"{where} holds expert entries or checkpoints that no training "
                               "run of this trainer wrote; train in a new store")
    else:
        if not resume:
            ckpts = checkpoint_steps(store)
            last = f"its latest checkpoint is step {ckpts[-1]}" if ckpts else "no checkpoint yet"
            raise TrainerError(f"{where} already holds a training run ({last}); pass --resume "
                               "to continue it, or train in a new store")
        _check_identity(saved, cfg, tc, seed, where)
        ckpts = checkpoint_steps(store)
        if ckpts:
            store.restore(checkpoint_tag(ckpts[-1]))
            dense = _read_entry(store, DENSE_ENTRY)
            if dense is None:
                raise TrainerError(f"{where}: checkpoint step-{ckpts[-1]} has no dense state")
            payload = _unpack(dense)
            if payload.get("step") != ckpts[-1]:
                raise TrainerError(f"{where}: checkpoint step-{ckpts[-1]} holds the dense state "
                                   f"of step {payload.get('step')}")
            return int(payload["step"]), payload
    # A new run, or one that crashed before its first checkpoint: start from scratch. The
    # run record goes first, so an interrupted initialisation is recognised as this run.
    store.put(RUN_ENTRY[0], _json_entry(_run_identity(cfg, tc, seed)), kind=RUN_ENTRY[1])
    experts.initialise(seed)
    return 0, None


def _checkpoint(store: tierstore.Store, step: int, payload: dict[str, Any]) -> None:
    """Dense entry, then the snapshot that makes the checkpoint (see the module docstring),
    then drop what is no longer among the latest :data:`KEEP_CHECKPOINTS`."""
    tag = checkpoint_tag(step)
    store.put(DENSE_ENTRY[0], _pack(payload), kind=DENSE_ENTRY[1])
    if step in checkpoint_steps(store):
        # Training only moves past the latest checkpoint, so this is a snapshot someone
        # named by hand; the checkpoint of this step replaces it.
        store.drop_snapshot(tag)
    store.snapshot(tag)
    for old in checkpoint_steps(store)[:-KEEP_CHECKPOINTS]:
        store.drop_snapshot(checkpoint_tag(old))


# --------------------------------------------------------------------------- metrics


class MetricsLog:
    """One JSON object per line. A resumed run keeps the lines of the steps its checkpoint
    covers and drops the rest (the steps it is about to run again). ``last`` is the
    checkpoint step's own line, kept in the checkpoint: a crash between the snapshot and
    writing that line would otherwise leave a gap."""

    def __init__(self, path: PathLike, keep_through: int, last: Metrics | None = None) -> None:
        kept: dict[int, str] = {}
        p = Path(path)
        if keep_through > 0 and p.exists():
            for line in p.read_text().splitlines():
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash
                if step <= keep_through:
                    kept[step] = line
        if last is not None and last["step"] <= keep_through:
            kept.setdefault(last["step"], json.dumps(last))
        self._f = open(p, "w", encoding="utf-8")  # noqa: SIM115  (closed in close())
        for _, line in sorted(kept.items()):
            self._f.write(line + "\n")
        self._f.flush()

    def write(self, m: Metrics) -> None:
        self._f.write(json.dumps(m) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _peak_rss() -> int:
    """The process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _store_counters(store: tierstore.Store) -> dict[str, int]:
    s = store.stats()
    cache = s["cache"] or {}
    tiers = s["tiers"].values()
    return {"hits": cache.get("hits", 0), "misses": cache.get("misses", 0),
            "evictions": cache.get("evictions", 0),
            "bytes_read": sum(t["bytes_read"] for t in tiers),
            "bytes_written": sum(t["bytes_written"] for t in tiers)}


def _store_metrics(before: dict[str, int], after: dict[str, int]) -> Metrics:
    d = {k: after[k] - before[k] for k in after}
    accesses = d["hits"] + d["misses"]
    return {"hit_rate": d["hits"] / accesses if accesses else None,
            "cache_hits": d["hits"], "cache_misses": d["misses"], "evictions": d["evictions"],
            "bytes_read": d["bytes_read"], "bytes_written": d["bytes_written"]}


# --------------------------------------------------------------------------- training


@torch.no_grad()
def evaluate_store(net: MoEModel, batches: Sequence[tuple[Tensor, Tensor]],
                   experts: ExpertStates, step: int, device: torch.device) -> float:
    """Mean cross-entropy over ``batches`` (as :func:`trainer.resident.evaluate`), fetching
    each batch's experts and giving them back before the next."""
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
    model: MoEConfig | str,
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

    The store is created if missing (``backing``: ``nvme`` by default, or ``pmem`` with
    ``pmem_path`` and ``pmem_size``; ``slab_size`` sizes NVMe slab files) and opened with a
    host cache of ``host_cache`` bytes and a device prefetch budget of ``device_budget``
    (the store's default when ``None``), which also bounds the expert weights one step may
    hold on the device in ``direct`` mode. ``fetch`` picks how experts reach ``device``:
    ``queue`` (the prefetch queue), ``direct`` (``get_many``) or ``auto`` (see
    :func:`resolve_fetch_mode`). ``read_ahead`` reads the next layer's AdamW moments on a
    thread while the current layer is updated (``None``: on accelerators only, where the
    host's cores are free). ``zero_copy`` (CPU, direct mode) lends expert states straight
    out of the host cache and stages new ones in it instead of copying them (``None``: when
    the cache is at least four times the weights a step can touch). ``store``: an open store
    to train over instead of opening ``store_path`` (a ``tierstore.connect`` client of a
    daemon, say; left open). A checkpoint is taken every ``checkpoint_every`` steps and
    after the last one; ``resume`` continues from the latest (see the module docstring).

    Each step's metrics are those of :func:`trainer.resident.train_resident` plus
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
    cfg = resolve_model_config(model, tc)
    if steps < 0 or checkpoint_every < 0:
        raise ValueError("steps and checkpoint_every must be >= 0")
    # Indexed ("cuda:0"), as tensors report it: devices are compared and used as keys.
    dev = normalize_device(device)
    mode = resolve_fetch_mode(fetch, dev)
    _seed_everything(seed)
    sampler, val_batches = training_batches(tc, seed, corpus, corpus_paths)

    net = MoEModel(cfg, seed=seed, resident_experts=False).to(dev)
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
        experts = ExpertStates(store, cfg, dev, mode, tokens, read_ahead, device_budget,
                               zero_copy)
        start, payload = _start(store, experts, cfg, tc, seed, resume)
        if payload is not None:
            net.load_state_dict(payload["model"])
            opt.load_state_dict(payload["optimizer"])
            sampler.load_state_dict(payload["sampler"])
            set_rng_state(payload["rng"])
        run = _Run(store, experts, net, opt, sampler, val_batches, cfg, tc, seed, dev,
                   checkpoint_every, metrics_path, trace_path, start,
                   None if payload is None else payload.get("metrics"), on_step)
        return run.train(steps)
    finally:
        try:
            if experts is not None:
                experts.close()
        finally:
            if owned:
                store.close()


def cuda_budget(cfg: MoEConfig, tc: TrainConfig, device: torch.device) -> int:
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
                 val_batches: list[tuple[Tensor, Tensor]], cfg: MoEConfig, tc: TrainConfig,
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
        history: list[Metrics] = []
        try:
            for step in range(self.start, steps):
                m, routed = self.step(step, steps)
                if trace is not None:
                    for layer, ids in routed.items():
                        trace.record(step + 1, layer, ids, 3 * self.experts.expert_bytes)
                history.append(m)
                if log is not None:
                    log.write(m)
                if self.on_step is not None:
                    self.on_step(m)
        finally:
            if log is not None:
                log.close()
            if trace is not None:
                trace.close()
        return history

    def step(self, step: int, steps: int) -> tuple[Metrics, dict[int, list[int]]]:
        """Run update ``step`` (0-based); returns its metrics and the routing it used."""
        tc, net, experts, dev = self.tc, self.net, self.experts, self.device
        before = _store_counters(self.store)
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
        predicted, used = experts.predicted, experts.predicted_used
        routed = experts.end()
        self.store.tick()
        m = step_metrics(step, tc, dev, t0, ce_sum, aux_sum, z_sum, norm, lr)
        dt = m["step_time_s"]
        m |= {
            **_store_metrics(before, _store_counters(self.store)),
            "stall_s": stall_s, "stall_frac": stall_s / dt if dt > 0 else 0.0,
            "write_s": write_s, "experts_touched": touched, "peak_rss_bytes": _peak_rss(),
        }
        if experts.queue:
            m["prefetched"] = predicted
            m["prefetch_accuracy"] = used / predicted if predicted else None
        done = step + 1
        if tc.eval_every > 0 and (done % tc.eval_every == 0 or done == steps):
            m["val_loss"] = evaluate_store(net, self.val_batches, experts, done, dev)
        if (self.checkpoint_every > 0 and done % self.checkpoint_every == 0) or done == steps:
            # The tag goes into the metrics the checkpoint itself keeps: if the snapshot
            # never commits, neither does this claim.
            m["checkpoint"] = checkpoint_tag(done)
            _checkpoint(self.store, done, self.payload(done, m))
        return m, routed

    def payload(self, step: int, metrics: Metrics) -> dict[str, Any]:
        """Everything of a checkpoint that is not an expert entry."""
        return {
            "version": CHECKPOINT_VERSION, "kind": "store", "step": step, "seed": self.seed,
            "model_config": self.cfg.to_dict(), "train_config": asdict(self.tc),
            "model": self.net.state_dict(), "optimizer": self.opt.state_dict(),
            "sampler": self.sampler.state_dict(), "rng": rng_state(), "metrics": dict(metrics),
        }
