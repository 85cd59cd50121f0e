"""How expert states travel between the store and the device during a training step.

:class:`ExpertFetch` is what :class:`~.expert_states.ExpertStates` asks of a fetch mode, and
:func:`make_fetch` picks one of three:

- :class:`QueueFetch`: through the store's device prefetch queue. A MoE layer's exact set is
  requested at once, then the next MoE layer's experts, predicted from decayed routing
  counts, are requested while this layer computes, and finally the exact set is acquired.
  Device copies are released once their layer's update is in the store.
- :class:`DirectFetch`: ``get_many`` into pooled buffers, new states back with ``put_many``.
- :class:`ZeroCopyFetch` (CPU): read-only views of the host cache's own slots
  (``borrow_many``) as leaves and moments, and the update written straight into staged
  slots (``stage_many``), so no state is copied.

The first two read AdamW moments into pooled buffers (:class:`BufferPool`) and write with
``put_many``; they share that in :class:`CopyingFetch`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

import tierstore
from tierstore.devices import normalize_device

from ..model import ExpertWeights
from .checkpoint import MOMENTS, STEP_KIND, TrainerError
from .layout import ExpertLayout
from .optim import adamw_step
from .resident import Metrics, TrainConfig

FETCH_MODES = ("auto", "queue", "direct")

Key = tuple[int, int]  # (MoE layer, expert)


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


class Moments(NamedTuple):
    """A layer's moments and step counts by ``(name, kind)``, what to give back once they
    are used (a borrow, or nothing for pooled buffers), and, when read on a CUDA stream of
    its own, the event after which they are there."""

    states: dict[Any, Tensor]
    lent: Any
    ready: Any


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


# --------------------------------------------------------------------------- the interface


class ExpertFetch(ABC):
    """One way for a step's expert states to reach the device and go back to the store.

    Per step: :meth:`begin`; :meth:`experts` at every MoE layer's forward; :meth:`forward_done`
    after the last forward; then for each touched layer :meth:`moments`, :meth:`update`,
    :meth:`moments_done` and :meth:`release`; finally :meth:`end`. A validation batch is
    ``begin(step, grad=False)``, :meth:`experts` calls and :meth:`end`. :meth:`moments` may
    run on a reader thread; everything else runs on the training thread.
    """

    def __init__(self, store: tierstore.Store, layout: ExpertLayout, device: torch.device,
                 worst_step_bytes: int, budget: int | None) -> None:
        self.store, self.layout, self.device = store, layout, device
        self.expert_bytes = layout.expert_bytes  # fp32, every part
        self.worst_step_bytes = worst_step_bytes
        # Bytes of expert weights the device may hold (None: unbounded), and the device
        # budget they are a share of (a trainer.train.budget.TrainBudget, or None).
        self.budget = budget
        self.plan: Any = None

    def names(self, layer: int, e: int) -> tuple[str, ...]:
        return self.layout.names(layer, e)

    def check_budget(self, layer: int, need: int) -> None:
        """Fail now rather than wait for budget that only the end of the step frees."""
        if self.budget is not None and need > self.budget:
            if self.plan is not None:
                raise self.plan.step_error(layer, need, self.worst_step_bytes)
            raise TrainerError(
                f"layer {layer}'s experts do not fit the device budget: this step needs "
                f"{tierstore.format_size(need)} of expert weights on {self.device}, the budget "
                f"is {tierstore.format_size(self.budget)}; raise --device-budget (a step of "
                f"this model and batch can touch up to "
                f"{tierstore.format_size(self.worst_step_bytes)})")

    def begin(self, step: int, grad: bool) -> None:
        """Step ``step`` (1-based) starts; ``grad=False`` for a validation batch. Whatever
        an earlier step left is given back."""
        self.end()

    @abstractmethod
    def experts(self, layer: int, new: list[int]) -> dict[int, ExpertWeights]:
        """``layer``'s router ran: the fp32 weights of the experts ``new`` it picked that
        this step does not hold yet (possibly none: another micro-batch fetched them)."""

    def forward_done(self) -> None:  # noqa: B027  (a hook: most modes have nothing to do)
        """The step's last forward has run."""

    @abstractmethod
    def moments(self, keys: list[tuple[str, str]], stream: Any = None) -> Moments:
        """The entries ``keys`` (a layer's step counts and its touched experts' moments),
        read on CUDA stream ``stream`` if given."""

    @abstractmethod
    def moments_done(self, moments: Moments) -> None:
        """What :meth:`moments` read is no longer used."""

    @abstractmethod
    def update(self, layer: int, touched: list[tuple[int, ExpertWeights]],
               states: dict[Any, Tensor], counts: Tensor, lr: float, tc: TrainConfig) -> float:
        """AdamW for ``layer``'s ``touched`` experts (their leaves, with gradients), their
        moments in ``states``; the new states and the layer's step ``counts`` go to the
        store. Returns the seconds spent handing them to the store."""

    @abstractmethod
    def release(self, keys: list[Key]) -> None:
        """These experts' new states are in the store: give back what held the old ones."""

    def forget(self, layer: int, ids: list[int]) -> None:  # noqa: B027  (a hook)
        """``layer``'s experts ``ids`` were just rewritten in the store (the dense rule's
        catch-up), before this step acquired them: anything read of them ahead is stale."""

    @abstractmethod
    def end(self) -> None:
        """The step or validation batch is over: give back everything still held."""

    def close(self) -> None:  # noqa: B027  (a hook: most modes have nothing to do)
        """The trainer is done with the store."""

    def step_metrics(self) -> Metrics:
        """Figures of this mode to add to the step's metrics."""
        return {}

    def _adamw(self, layer: int, touched: list[tuple[int, ExpertWeights]],
               states: dict[Any, Tensor], counts: Tensor, lr: float, tc: TrainConfig,
               out_of: Callable[[str], tuple[Tensor, Tensor, Tensor]] | None
               ) -> list[tuple[str, str, Tensor]]:
        """The AdamW arithmetic of ``touched`` experts: in place (returning the put_many
        items), or into the tensors ``out_of(name)`` gives."""
        items: list[tuple[str, str, Tensor]] = []
        for e, leaves in touched:
            n = int(counts[e])
            for name, w in zip(self.names(layer, e), leaves):
                p, m, v = w.detach(), states[(name, MOMENTS[0])], states[(name, MOMENTS[1])]
                assert w.grad is not None
                out = None if out_of is None else out_of(name)
                # Lazy, as the dense parameters' groups (resident.param_groups): no weight
                # decay on vectors (an expert's biases). Dense, as torch.optim.AdamW on the
                # fused [E, ...] parameter, which is no vector even where an expert's is.
                wd = tc.weight_decay if p.dim() >= 2 or tc.update_rule == "dense" else 0.0
                adamw_step(p, w.grad, m, v, n, lr, tc.betas, tc.eps, wd, out=out)
                if out is None:
                    items += [(name, "param", p), (name, MOMENTS[0], m), (name, MOMENTS[1], v)]
        return items


# --------------------------------------------------------------------------- copying modes


class CopyingFetch(ExpertFetch):
    """Moments read into pooled buffers with ``get_many``, new states written with
    ``put_many``: what the queue and direct modes share."""

    def __init__(self, store: tierstore.Store, layout: ExpertLayout, device: torch.device,
                 worst_step_bytes: int, budget: int | None) -> None:
        super().__init__(store, layout, device, worst_step_bytes, budget)
        self.pool = BufferPool()

    def moments(self, keys: list[tuple[str, str]], stream: Any = None) -> Moments:
        # The step counts entry is small: read plainly.
        if stream is None:
            return Moments(self._get_moments(keys), None, None)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            states = self._get_moments(keys)
            ready = torch.cuda.Event()
            ready.record(stream)
        return Moments(states, None, ready)

    def _get_moments(self, keys: list[tuple[str, str]]) -> dict[Any, Tensor]:
        out = {k: self.pool.take(self.layout.shape_of(k[0]), self.device)
               for k in keys if k[1] in MOMENTS}
        return self.store.get_many(keys, device=self.device, out=out)

    def moments_done(self, moments: Moments) -> None:
        self.pool.give(t for key, t in moments.states.items() if key[1] in MOMENTS)

    def update(self, layer: int, touched: list[tuple[int, ExpertWeights]],
               states: dict[Any, Tensor], counts: Tensor, lr: float, tc: TrainConfig) -> float:
        items = self._adamw(layer, touched, states, counts, lr, tc, None)
        items.append((self.layout.counts_name(layer), STEP_KIND, counts))
        t0 = time.perf_counter()
        self.store.put_many(items)
        return time.perf_counter() - t0


class DirectFetch(CopyingFetch):
    """Expert weights read with ``get_many`` into pooled buffers, kept until their new
    values are in the store."""

    def __init__(self, store: tierstore.Store, layout: ExpertLayout, device: torch.device,
                 worst_step_bytes: int, budget: int | None) -> None:
        super().__init__(store, layout, device, worst_step_bytes, budget)
        self._bufs: dict[Key, list[Tensor]] = {}

    def experts(self, layer: int, new: list[int]) -> dict[int, ExpertWeights]:
        if not new:
            return {}
        self.check_budget(layer, (len(self._bufs) + len(new)) * self.expert_bytes)
        out: dict[str, Tensor] = {}
        shapes = self.layout.shapes(layer)
        for e in new:
            bufs = [self.pool.take(s, self.device) for s in shapes]
            self._bufs[(layer, e)] = bufs
            out.update(zip(self.names(layer, e), bufs))
        got = self.store.get_many(list(out), device=self.device, out=out)
        return {e: tuple(got[n] for n in self.names(layer, e)) for e in new}  # type: ignore[misc]

    def release(self, keys: list[Key]) -> None:
        for k in keys:
            self.pool.give(self._bufs.pop(k, ()))

    def end(self) -> None:
        self.release(list(self._bufs))


class QueueFetch(CopyingFetch):
    """Expert weights through the store's device prefetch queue, whose byte budget bounds
    what the device holds; the next MoE layer's experts are requested ahead, as
    ``predictor`` guesses them."""

    def __init__(self, store: tierstore.Store, layout: ExpertLayout, device: torch.device,
                 worst_step_bytes: int, predictor: RoutingPredictor) -> None:
        super().__init__(store, layout, device, worst_step_bytes, None)
        self.budget = self._queue_budget()
        self.predictor = predictor
        self.layers = layout.keys
        self.next_layer = dict(zip(self.layers, self.layers[1:]))
        self.step = 0
        # Experts holding (or about to hold) device budget -> acquired yet?
        self._held: dict[Key, bool] = {}
        self.predicted = self.predicted_used = 0  # experts requested ahead, and then routed

    def _queue_budget(self) -> int:
        """The device queue's byte budget, as the store reports it (made on first use)."""
        self.store.prefetch([], device=self.device)
        queues = self.store.stats().get("prefetch") or {}
        dev = normalize_device(self.device)
        stats = queues.get(str(dev))
        if stats is None:
            raise TrainerError(f"the store reports no prefetch queue for {dev}")
        return int(stats["budget_bytes"])

    def begin(self, step: int, grad: bool) -> None:
        self.step = step
        self.predicted = self.predicted_used = 0
        if grad and self.layers:
            self._predict(self.layers[0])

    def experts(self, layer: int, new: list[int]) -> dict[int, ExpertWeights]:
        if not new:
            if layer in self.next_layer:
                self._predict(self.next_layer[layer])
            return {}
        # Predictions for this layer that missed are no use now and their budget may be
        # needed: cancel them before asking for the exact set.
        wanted = set(new)
        self._drop([k for k, got in self._held.items()
                    if k[0] == layer and not got and k[1] not in wanted], release=False)
        missing = [e for e in new if (layer, e) not in self._held]
        self.predicted_used += len(new) - len(missing)
        self.check_budget(layer, self._held_bytes() + len(missing) * self.expert_bytes)
        self._request(layer, missing, (self.step, layer))
        if layer in self.next_layer:  # read while this layer computes
            self._predict(self.next_layer[layer])
        out: dict[int, ExpertWeights] = {}
        for e in new:
            out[e] = tuple(self.store.acquire(n, device=self.device)  # type: ignore[assignment]
                           for n in self.names(layer, e))
            self._held[(layer, e)] = True
        return out

    def forward_done(self) -> None:
        # Predictions never used: their budget goes back.
        self._drop([k for k, got in self._held.items() if not got], release=False)

    def release(self, keys: list[Key]) -> None:
        # The device copies are of the old version now.
        self._drop([k for k in keys if k in self._held], release=True)

    def forget(self, layer: int, ids: list[int]) -> None:
        # Requested ahead (a prediction), never acquired: cancelled, so that the exact
        # request reads the new states.
        self._drop([(layer, e) for e in ids if (layer, e) in self._held], release=False)

    def end(self) -> None:
        self._drop([k for k, got in self._held.items() if got], release=True)
        self._drop(list(self._held), release=False)

    def close(self) -> None:
        self.end()

    def step_metrics(self) -> Metrics:
        return {"prefetched": self.predicted,
                "prefetch_accuracy": (self.predicted_used / self.predicted
                                      if self.predicted else None)}

    def _request(self, layer: int, ids: Sequence[int], priority: tuple[int, int]) -> None:
        if ids:
            self.store.prefetch([n for e in ids for n in self.names(layer, e)],
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

    def _drop(self, keys: Iterable[Key], *, release: bool) -> None:
        """Release acquired experts / cancel requested ones, giving their budget back."""
        keys = list(keys)
        if not keys:
            return
        names = [n for layer, e in keys for n in self.names(layer, e)]
        if release:
            for n in names:
                self.store.release(n, device=self.device)
        else:
            self.store.cancel(names, device=self.device)
        for k in keys:
            self._held.pop(k, None)


# --------------------------------------------------------------------------- zero-copy


class ZeroCopyFetch(ExpertFetch):
    """On the CPU the device is host memory: leaves and moments are read-only views of the
    host cache's slots (``borrow_many``) and the update writes the new states straight into
    staged slots (``stage_many``). The views pin their slots for the step."""

    def __init__(self, store: tierstore.Store, layout: ExpertLayout, device: torch.device,
                 worst_step_bytes: int, budget: int | None) -> None:
        super().__init__(store, layout, device, worst_step_bytes, budget)
        self._borrows: dict[Key, Any] = {}

    def experts(self, layer: int, new: list[int]) -> dict[int, ExpertWeights]:
        if not new:
            return {}
        self.check_budget(layer, (len(self._borrows) + len(new)) * self.expert_bytes)
        got = {}
        for e in new:
            names = self.names(layer, e)
            lent = self.store.borrow_many(names)
            self._borrows[(layer, e)] = lent
            got[e] = tuple(lent.tensors[n] for n in names)
        return got  # type: ignore[return-value]

    def moments(self, keys: list[tuple[str, str]], stream: Any = None) -> Moments:
        lent = self.store.borrow_many(keys)
        return Moments(lent.tensors, lent, None)

    def moments_done(self, moments: Moments) -> None:
        moments.lent.release()

    def update(self, layer: int, touched: list[tuple[int, ExpertWeights]],
               states: dict[Any, Tensor], counts: Tensor, lr: float, tc: TrainConfig) -> float:
        counts_key = (self.layout.counts_name(layer), STEP_KIND)
        t0 = time.perf_counter()
        shapes = self.layout.shapes(layer)
        wanted = [(name, k, torch.float32, s)
                  for e, _ in touched for s, name in zip(shapes, self.names(layer, e))
                  for k in ("param", *MOMENTS)]
        wanted.append((*counts_key, counts.dtype, tuple(counts.shape)))
        with self.store.stage_many(wanted) as staged:
            new = staged.tensors
            spent = time.perf_counter() - t0
            self._adamw(layer, touched, states, counts, lr, tc,
                        lambda name: (new[(name, "param")], new[(name, MOMENTS[0])],
                                      new[(name, MOMENTS[1])]))
            new[counts_key].copy_(counts)
            t0 = time.perf_counter()
            staged.commit()
        return spent + time.perf_counter() - t0

    def release(self, keys: list[Key]) -> None:
        for k in keys:
            lent = self._borrows.pop(k, None)
            if lent is not None:
                lent.release()

    def end(self) -> None:
        self.release(list(self._borrows))


def make_fetch(mode: str, store: tierstore.Store, layout: ExpertLayout, device: torch.device,
               worst_step_bytes: int, predictor: RoutingPredictor,
               budget: int | str | None = None, zero_copy: bool | None = None) -> ExpertFetch:
    """The fetch for ``mode`` (``queue`` or ``direct``, see :func:`resolve_fetch_mode`).

    ``direct`` on a CPU device over a store whose borrows lend the host cache's own memory
    (``store.capabilities.zero_copy``) is zero-copy when ``zero_copy`` says so, or by
    default when the cache holds four times the weights one step can touch: the views pin
    their slots for the step, so this only pays when the cache holds a step's states with
    room to spare; otherwise pinned leaves would crowd out the moments. ``budget`` bounds
    the expert weights a direct or zero-copy step may hold (the queue has its own).
    """
    if mode == "queue":
        return QueueFetch(store, layout, device, worst_step_bytes, predictor)
    limit = None if budget is None else tierstore.parse_size(budget)
    possible = device.type == "cpu" and store.capabilities.zero_copy
    if zero_copy is None:
        cache = (store.stats().get("cache") or {}) if possible else {}
        zero_copy = cache.get("capacity_bytes", 0) >= 4 * worst_step_bytes
    if possible and zero_copy:
        return ZeroCopyFetch(store, layout, device, worst_step_bytes, limit)
    return DirectFetch(store, layout, device, worst_step_bytes, limit)
