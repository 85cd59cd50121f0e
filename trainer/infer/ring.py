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
threads do the transfers: reads from the backing tier, then a copy on CUDA's copy stream,
or on the CPU a pin (the experts are views of their host-cache slots, never copied, and
``_convert`` makes a new tensor rather than writing into one). A layer whose entries are
still cached as they were when its slot was last released is pinned again by renewing that
borrow (:meth:`tierstore.Borrowed.renew`), which costs a third of a new one. A layer that
must be read from the backing tier is borrowed in parts of consecutive experts, and the
model starts on it once its first part has landed (:class:`~.ring_loans.Streamed`).

``slots="auto"`` runs the first pass with as many slots as the budget holds, timing the
first layer's transfer through the queue as it goes (without waiting for it), then picks K
before each pass from that and the per-layer compute time measured in the previous one.

On the CPU, where the host cache cannot hold the K layers the budget allows (or the budget
not one layer), pinning them there would evict everything else or spill into buffers the
store allocates per read. The ring then owns its slots (:mod:`trainer.infer.ring_parts`):
as many parts of consecutive experts as the budget holds, each read straight into memory
allocated once, so what the ring holds is bounded by the budget and K follows from it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

import tierstore

from ..model import ExpertSource, ExpertWeights
from .budget import BudgetError
from .device_queue import (
    DeviceClock,
    host_cache_bytes,
    lend_views,
    queue_budget,
    queue_bytes_moved,
)
from .ring_loans import Done, Loan, Streamed, release_when_done
from .ring_parts import PartRing, PartsOfLayer

INLINE_BORROW_S = 1e-3  # a layer's borrow faster than this read nothing: see RingSource
STREAM_PARTS = 4  # a layer read from the backing tier is borrowed in this many parts
# A part of the ring's own slots holds at least this many bytes of experts (where the budget
# allows two such parts): its two reading threads each keep one part's requests in flight,
# and parts of 48 MiB (six 8 MiB chunks) left the disk's queue short. A cold prefill of a
# 1.6 GB model read at 3.0 GB/s with them against 3.4 with parts of 72 or 96 MiB.
OWN_PART_MIN_BYTES = 64 << 20


def layer_entry_bytes(store: tierstore.Store, names: Sequence[Sequence[str]]) -> int:
    """Bytes of a layer's experts as stored (``names``: each expert's entries)."""
    return sum(store.info(n).nbytes for one in names for n in one)


def max_slots(layer_bytes: int, budget: int, n_layers: int) -> int:
    """The most slots ``budget`` holds, at most one per MoE layer (K = n_layers keeps every
    layer resident); a clear error when not even one layer fits."""
    if layer_bytes <= 0 or n_layers <= 0:
        raise ValueError("layer_bytes and n_layers must be positive")
    cap = min(budget // layer_bytes, n_layers)
    if cap < 1:
        raise BudgetError(
            f"the device budget ({tierstore.format_size(budget)}) cannot hold one MoE layer's "
            f"experts ({tierstore.format_size(layer_bytes)}); raise --device-budget or use "
            "--mode expert", need=layer_bytes, what="one MoE layer's experts (the ring)")
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


class RingSource(ExpertSource):
    """An :class:`trainer.model.ExpertSource` holding K MoE layers' experts at a time.

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
        self.views = lend_views(store, self.device)
        # On the CPU a slot is a pin, and per-entry queue bookkeeping (a future, a heap item,
        # an acquire, a release for each of a layer's 3·E entries) costs more than a decode
        # step's compute. So a slot is filled with one borrow of the whole layer, made by a
        # worker thread (the ring's "copy stream"): one batched lookup, one parallel read of
        # the misses, one batched release when the layer is done.
        self._layerwise = self.views and self.device.type == "cpu"
        self._worker: ThreadPoolExecutor | None = None  # made on first use, ended by close()
        self._lent: dict[int, Loan] = {}  # layer -> its borrows, while its slot holds it
        # layer -> its last loan, released, and the expert tuples made from it: where the
        # layer's entries are still cached as they were, renewing it pins them again for a
        # fraction of a new borrow's cost (decoding from host memory, every token).
        self._spent: dict[int, tuple[Loan, dict[int, ExpertWeights]]] = {}
        # A borrow that finds every entry cached is a few hundred microseconds of Python;
        # handed to the worker it would contend with the compute for the interpreter, so it
        # runs in line while the last borrow was that cheap (see _borrow).
        self._inline = False
        # A borrow that reads is split into parts of consecutive experts, read in order:
        # the model applies experts in ascending id order, so it starts on a layer once
        # its first part has landed (see ring_loans.Streamed). In one pass (a prefill) the last
        # layer's compute then hides behind its own reads, and every layer gives its slot
        # back sooner, so the next layer's read starts sooner.
        self._per_part = 1
        # Where the host cache cannot hold the ring, its slots are memory of its own,
        # filled part by part (see ring_parts); None while the slots are cache pins.
        self._parts_ring: PartRing | None = None
        self._lent_bytes = 0
        self.peak_bytes = 0  # most layer bytes lent and requested at once (layer by layer)
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
        self._clock = DeviceClock(torch.device(device))
        self._pass_mark: Any = None
        # (start, end) points around each acquire of the pass; on CUDA they are read at the
        # end of the pass, when the stream has run past them.
        self._stall_marks: list[tuple[Any, Any]] = []
        self._moved_start = self._read_start = 0
        self._calibrating: tuple[float, list[Future[Tensor]], list[float]] | None = None
        self._final = self._final_next = False  # see final_pass
        self._pass_end = 0  # ring position just past the running pass

    # -- ring bookkeeping -------------------------------------------------------------
    def _bind(self, model: Any) -> None:
        self.layers = list(model.moe_layers)
        if not self.layers:
            raise tierstore.StoreError("the model has no MoE layers to put in a ring")
        self.n_experts = int(model.n_experts)
        self._expert_names = model.expert_names
        self._names = {layer: [tuple(model.expert_names(layer, e)) for e in range(self.n_experts)]
                       for layer in self.layers}
        self.layer_bytes = layer_entry_bytes(self.store, self._names[self.layers[0]])
        self._flat = {layer: [n for one in experts for n in one]
                      for layer, experts in self._names.items()}
        self._per_part = -(-self.n_experts // STREAM_PARTS)
        per = len(self._names[self.layers[0]][0])  # entries of one expert
        self._parts = {layer: [self._flat[layer][per * e:per * (e + self._per_part)]
                               for e in range(0, self.n_experts, self._per_part)]
                       for layer in self.layers}
        self._moved_start = queue_bytes_moved(self.store, self.device)
        self._read_start = self._bytes_read()
        if self._layerwise and not self._fits_host_cache():
            self._own_slots()
            return
        cap = max_slots(self.layer_bytes, self.budget, len(self.layers))
        if self.auto:
            # The first pass times a layer's transfer as it begins (_calibrate): binding
            # reads nothing.
            self.slots = cap  # no compute measured yet: as many slots as the budget holds
        else:
            self.slots = min(self.fixed or 1, cap)

    def _fits_host_cache(self) -> bool:
        """Whether the host cache holds the K layers the budget (or a fixed K) asks for:
        then the ring's slots are pins of its slots; else the ring reads into its own."""
        k = min(self.budget // self.layer_bytes, len(self.layers))
        if self.fixed is not None:
            k = min(k, self.fixed)
        return k >= 1 and host_cache_bytes(self.store) >= k * self.layer_bytes

    def _own_slots(self) -> None:
        """Slots of the ring's own, as many parts as the budget holds (after room for one
        layer's experts converted to the model's dtype, where they are stored in another)."""
        budget = self.budget
        stored = self.store.info(self._names[self.layers[0]][0][0]).dtype
        if self.dtype is not None and stored != self.dtype:
            per = torch.empty(0, dtype=self.dtype).element_size()
            budget -= self.layer_bytes // torch.empty(0, dtype=stored).element_size() * per
        expert = max(1, self.layer_bytes // self.n_experts)
        per_part = max(self._per_part, -(-OWN_PART_MIN_BYTES // expert))
        parts = PartRing(self.store, self.layers, self.n_experts, max(budget, 0),
                         per_part=per_part, names=self._expert_names, layers_held=self.fixed)
        self._parts_ring = parts
        self.slots = parts.slots // parts.n_parts

    def _parts_end(self) -> int:
        """The position past the last part the ring may read now: the running pass's end
        on the last pass, else none."""
        assert self._parts_ring is not None
        return self._parts_ring.position(self._pass_end) if self._final else 1 << 62

    def _layer_at(self, pos: int) -> int:
        return self.layers[pos % len(self.layers)]

    def _bytes_read(self) -> int:
        """Bytes read from the backing tier so far: the queue's count, or, where the ring
        borrows whole layers or reads into its own slots, the store's."""
        if not self._layerwise:
            return queue_bytes_moved(self.store, self.device, "bytes_read")
        return int(sum(t.get("bytes_read", 0) for t in self.store.stats()["tiers"].values()))

    def _request(self, pos: int) -> None:
        if pos in self._requested:
            return
        layer = self._layer_at(pos)
        names = self._flat[layer]
        if self._layerwise:
            if layer in self._lent:
                return  # its slot still holds it (K = number of layers)
            if self._worker is None:
                self._worker = ThreadPoolExecutor(2, thread_name_prefix="tierstore-ring")
            spent = self._spent.pop(layer, None)
            renewed = spent is not None and spent[0].renew()
            parts: list[Any]
            if renewed and len(spent[0].parts) == 1:
                parts = [Done(spent[0].parts[0].result())]
                self._held[layer] = spent[1]
            elif renewed or self._inline:
                # In line: a Future (a lock and a condition) would cost a tenth of this
                # borrow. A layer borrowed in parts whose parts are all still cached is
                # borrowed whole now, and renewed once per turn from then on.
                done = Done()
                try:
                    done.value = self._borrow(names)
                except Exception as e:  # noqa: BLE001 (raised where the layer asks for it)
                    done.error = e
                if renewed:
                    spent[0].release()
                parts = [done]
            else:
                parts = [self._worker.submit(self._borrow, group)
                         for group in self._parts[layer]]
            self._requested[pos] = dict(enumerate(parts))
            layers = set(self._lent) | {self._layer_at(p) for p in self._requested}
            self.peak_bytes = max(self.peak_bytes, len(layers) * self.layer_bytes)
            return
        futures = self.store.prefetch(names, device=self.device,
                                      priority=(pos // len(self.layers), pos % len(self.layers)))
        self._requested[pos] = dict(zip(names, futures))

    def _top_up(self) -> None:
        end = self._pos + self.slots
        if self._final:  # nothing comes after this pass: no layer of the next is read
            end = min(end, self._pass_end)
        for pos in range(self._pos, end):
            self._request(pos)

    def final_pass(self) -> None:
        """The next pass is the last (the generation ends with it): the ring does not
        wrap into a pass that will not run, so it reads no layer for it."""
        self._final_next = True

    def _calibrate(self) -> None:
        """Time one layer's transfer through the queue without waiting for it (the pass's
        compute starts meanwhile): the first layer the ring needs is requested first, the
        moment its last entry lands is noted as it happens, and ``t_transfer`` is taken when
        the first pass ends. The layers requested right behind it share the tier with it,
        so the figure errs long and K towards more slots, never fewer."""
        t0 = time.perf_counter()
        self._request(self._pos)
        futures = list(self._requested[self._pos].values())
        landed = [t0]

        def note(_: Future[Tensor]) -> None:  # runs on the queue's thread as each lands
            landed[0] = max(landed[0], time.perf_counter())

        for f in futures:
            f.add_done_callback(note)
        self._calibrating = (t0, futures, landed)

    def _calibrated(self) -> None:
        if self._calibrating is None:
            return
        t0, futures, landed = self._calibrating
        if all(f.done() for f in futures):
            self.t_transfer = landed[0] - t0
            self._calibrating = None

    # -- the ExpertSource protocol ------------------------------------------------------
    def prepare(self, model: Any) -> None:
        """Bind to ``model``: name its layers' experts and, where the ring owns its slots,
        make them (every page touched, so no read of the first pass waits for the kernel
        to fault in and zero the memory it lands in: 0.3 s of a 0.9 s cold prefill on a
        1.6 GB model with 400 MiB of slots). Reads nothing."""
        if not self.layers:
            self._bind(model)

    def begin_pass(self, model: Any, n_tokens: int) -> None:
        if not self.layers:
            self._bind(model)
        elif self._pos % len(self.layers):
            # The last pass stopped part way (an exception in the model): start this one
            # from the first MoE layer with an empty ring.
            self.close()
            self._pos += len(self.layers) - self._pos % len(self.layers)
        if self._parts_ring is not None:
            self._begin_owned_pass()
            return
        if self.auto and not self.slot_history:  # the first pass
            self._calibrate()
        if self.auto and self.t_compute > 0 and self._calibrating is None:
            self.slots = choose_slots(self.t_transfer, self.t_compute, self.layer_bytes,
                                      self.budget, len(self.layers))
        self.slot_history.append(self.slots)
        self._pass_start = time.perf_counter()
        self._pass_mark = self._clock.mark()
        self._pass_stall = 0.0
        self._stall_marks.clear()
        self._final, self._final_next = self._final_next, False
        self._pass_end = (self._pos // len(self.layers) + 1) * len(self.layers)
        self._top_up()

    def _begin_owned_pass(self) -> None:
        parts = self._parts_ring
        assert parts is not None
        if parts.closed or parts.position(self._pos) != parts.freed:
            parts.restart(parts.position(self._pos))
        self.slot_history.append(self.slots)
        self._pass_start = time.perf_counter()
        self._pass_stall = 0.0
        self._final, self._final_next = self._final_next, False
        self._pass_end = (self._pos // len(self.layers) + 1) * len(self.layers)
        parts.top_up(self._parts_end())

    def experts(self, layer: int, ids: Sequence[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        expected = self._layer_at(self._pos)
        if layer != expected:
            raise tierstore.StoreError(f"the ring expected MoE layer {expected} next, "
                                       f"the model asked for layer {layer}")
        if self._parts_ring is not None:
            return PartsOfLayer(self, self._parts_ring.position(self._pos),
                                self._names[layer], ids, self._held.setdefault(layer, {}))
        if self._layerwise:
            return self._lent_experts(layer, ids)
        self._request(self._pos)
        futures = self._requested[self._pos]
        held = self._held.setdefault(layer, {})
        out: dict[int, ExpertWeights] = {}
        # On CUDA acquire() makes the stream wait, not the host: the stall is the stream's
        # time between these two points (see DeviceClock).
        t0 = self._clock.mark()
        for e in ids:
            weights = held.get(e)
            if weights is None:
                names = self._names[layer][e]
                landed = all(futures[n].done() and not futures[n].cancelled() for n in names)
                self.hits += landed
                if landed and self.device.type == "cpu":
                    # The futures hold what acquire would return, and on the CPU there is
                    # no stream to order after the copy: skip the queue's bookkeeping.
                    got = [futures[n].result() for n in names]
                else:
                    got = [self.store.acquire(n, device=self.device) for n in names]
                weights = tuple(self._convert(t) for t in got)  # type: ignore[assignment]
                held[e] = weights
            else:
                self.hits += 1
            self.accesses += 1
            out[e] = weights
        t1 = self._clock.mark()
        if self._clock.cuda:
            self._stall_marks.append((t0, t1))
        else:
            stall = self._clock.seconds(t0, t1)
            self.stall_s += stall
            self._pass_stall += stall
        return out

    def _borrow(self, names: list[str]) -> Any:
        t0 = time.perf_counter()
        lent = self.store.borrow_many(names)
        # Cheap means nothing was read from the backing tier: keep borrowing in line. A
        # borrow that had to read goes back to the worker, so reads overlap compute.
        self._inline = time.perf_counter() - t0 < INLINE_BORROW_S
        return lent

    def _lent_experts(self, layer: int, ids: Sequence[int]) -> Mapping[int, ExpertWeights]:
        loan = self._lent.get(layer)
        landed = loan is not None
        if loan is None:
            self._request(self._pos)
            loan = self._lent[layer] = Loan(list(self._requested[self._pos].values()))
            self._lent_bytes += self.layer_bytes
        held = self._held.setdefault(layer, {})
        if len(loan.parts) > 1:
            return Streamed(self, loan, held, self._names[layer], ids)
        if not landed:
            landed = loan.parts[0].done()
            self._stalled(loan.parts[0])
        out: dict[int, ExpertWeights] = {}
        tensors, names = loan.parts[0].result().tensors, self._names[layer]
        for e in ids:
            weights = held.get(e)
            if weights is None:
                weights = held[e] = self._weights(tensors, names[e])
            self.hits += landed
            self.accesses += 1
            out[e] = weights
        return out

    def _weights(self, tensors: Mapping[str, Tensor], names: tuple[str, ...]) -> ExpertWeights:
        got = tuple(tensors[n] for n in names)
        if self.dtype is None:
            return got
        return tuple(self._convert(t) for t in got)

    def _stalled(self, future: Any) -> Any:
        """The borrow ``future`` holds, counting the wait for it as stall."""
        if future.done():
            return future.result()
        t0 = time.perf_counter()
        try:
            return future.result()
        finally:
            stall = time.perf_counter() - t0
            self.stall_s += stall
            self._pass_stall += stall

    def _unlend(self, layer: int) -> None:
        loan = self._lent.pop(layer, None)
        held = self._held.pop(layer, None)
        if loan is None:
            return
        loan.release()
        if not loan.renewable():
            return  # buffers of its own, not cache slots: kept, they would outlive the slot
        # Converted experts are copies, made again from the bytes on the next turn.
        self._spent[layer] = (loan, held if held is not None and self.dtype is None else {})

    def _convert(self, t: Tensor) -> Tensor:
        return t if self.dtype is None or t.dtype == self.dtype else t.to(self.dtype)

    def layer_done(self, layer: int) -> None:
        if self._parts_ring is not None:
            self._held.pop(layer, None)
            self._pos += 1
            self._parts_ring.release_below(self._parts_ring.position(self._pos))
            self._parts_ring.top_up(self._parts_end())
            return
        pos = self._pos
        self._requested.pop(pos, None)
        self._pos += 1
        # The slot is freed unless the same layer comes back within the ring (K = L).
        if self.slots < len(self.layers) and self._layerwise:
            self._unlend(layer)
        elif self.slots < len(self.layers):
            self._held.pop(layer, None)
            self.store.cancel(self._flat[layer],
                              device=self.device)
            # Requests for this layer's next turn, made while K was larger, were cancelled
            # with it: forget them so that the turn asks again.
            for p in [p for p in self._requested if self._layer_at(p) == layer]:
                del self._requested[p]
        self._top_up()

    def end_pass(self) -> None:
        if self._clock.cuda and self._pass_mark is not None:
            end = self._clock.mark()
            elapsed = self._clock.seconds(self._pass_mark, end)
            stall = sum(self._clock.seconds(a, b) for a, b in self._stall_marks)
            self._stall_marks.clear()
            self.stall_s += stall
            self._pass_stall += stall
        else:
            elapsed = time.perf_counter() - self._pass_start
        self.busy_s += elapsed
        self.passes += 1
        self.t_compute = max(elapsed - self._pass_stall, 0.0) / len(self.layers)
        if self._parts_ring is not None:
            reads = list(self._parts_ring.read_s)
            if reads:  # a layer's transfer: its parts one after another
                self.t_transfer = sum(reads) / len(reads) * self._parts_ring.n_parts
            return
        self._calibrated()

    def close(self) -> None:
        """Give every slot back to the device budget."""
        if self._parts_ring is not None:
            self._parts_ring.close()
            self._held.clear()
            return
        names = [n for layer in self.layers for n in self._flat[layer]]
        if names and not self._layerwise:
            self.store.cancel(names, device=self.device)
        for futures in self._requested.values():
            for f in futures.values():
                if self._layerwise:  # a borrow still running is given back when it ends
                    f.add_done_callback(release_when_done)
        for layer in list(self._lent):
            self._unlend(layer)
        self._requested.clear()
        self._held.clear()
        if self._worker is not None:  # its threads would otherwise outlive the source
            self._worker.shutdown(wait=False)
            self._worker = None

    def stats(self) -> dict[str, Any]:
        parts = self._parts_ring
        if parts is not None:
            self.peak_bytes = max(self.peak_bytes, parts.arena_bytes)
        return {
            "mode": "ring",
            "slots": self.slots,
            # the slots are the ring's own memory (the host cache cannot hold them), in
            # parts of experts_per_part experts, part_slots of them
            "own_slots": parts is not None,
            "part_slots": parts.slots if parts is not None else None,
            "experts_per_part": parts.per_part if parts is not None else None,
            "slot_history": list(self.slot_history),
            "moe_layers": len(self.layers),
            "layer_bytes": self.layer_bytes,
            "budget_bytes": self.budget,
            "peak_bytes": self.peak_bytes,
            "t_transfer_s": self.t_transfer,
            "t_compute_s": self.t_compute,
            "stall_s": self.stall_s,
            "busy_s": self.busy_s,
            "stall_frac": self.stall_s / self.busy_s if self.busy_s else 0.0,
            "hit_rate": self.hits / self.accesses if self.accesses else None,
            "spec_accuracy": None,
            # bytes landed on the device (on the CPU: pinned, not copied), and the part of
            # them read from the backing tier (the rest were host-cache hits)
            "bytes_moved": ((parts.bytes_moved if parts is not None else
                             self._lent_bytes if self._layerwise else
                             queue_bytes_moved(self.store, self.device) - self._moved_start)
                            if self.layers else 0),
            "bytes_read": self._bytes_read() - self._read_start if self.layers else 0,
        }
