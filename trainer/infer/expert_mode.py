"""Expert-granular source: only the experts the routers pick reach the device.

Three parts, all on the store's device prefetch queue (:meth:`tierstore.Store.prefetch`):

- **Speculative prefetch.** When MoE layer i asks for its experts, the next MoE layer's
  router is applied to layer i's normalised hidden state (``model.router_topk``) and the
  experts it picks are requested at once, so their transfer overlaps layer i's compute (and
  the attention of the layer after). Between adjacent layers the residual stream changes
  little, so the guess is usually right; a wrong guess is cancelled when the real routing
  is known. Prediction accuracy is ``|predicted ∩ routed| / |routed|`` over the layers that
  had a prediction. Only a guess the cache does not already hold costs a read, and those
  are the hard ones (rarely routed experts); so the source keeps a running precision of
  what it fetched on a guess (the fraction then routed) and, while that falls below
  ``SPEC_MIN_PRECISION``, guesses only every ``SPEC_PROBE_EVERY``-th time, to notice when
  guessing pays again. A wrong guess moves as many bytes as a right one saves.
- **A device-side expert cache** of ``cache_bytes`` whose eviction and admission follow a
  cache policy from the cache lab (``lfu-decay`` by default): experts that keep being routed
  to stay on the device across tokens. Hit rate is over every routed expert access.
- **Budget.** Everything held (cached experts, the current layer's others, predictions in
  flight) stays within the queue's byte budget; when a layer needs room, cached experts are
  evicted in the policy's order and predictions are made only in the room that is left.
- **One cache on a CPU** (``host_pool``). There the queue lends views of host-cache slots,
  so a device cache would pin experts the host cache already holds, and the two budgets
  would overlap instead of adding up. Where the experts stream from the backing tier,
  ``tierstore generate`` gives the experts' share of the device budget to the host cache
  instead (:func:`trainer.infer.budget.pooled_host_cache`), and the source keeps no cache
  of its own and makes no guesses, and the hit rate reported is the host cache's over the
  experts read through it. Guessing does not pay there: a CPU computes a layer in less
  time than the backing tier takes to read one expert, so a right guess hides less than a
  wrong one costs. On the Mixtral-shaped model of docs/inference.md (24 MiB experts, a
  555 MiB pool, about 2 GB/s) guessing read 228 MB per decoded token against 157 MB
  without (the top-2 guesses were right 0.57 of the time; the top-1 guess alone, right
  0.70 of the time, still read 182 MB), and it decoded no faster. With nothing left to
  read ahead, the source reads each layer's routed experts on the calling thread, as on
  demand does (:class:`~trainer.infer.sources.OnDemandSource`), and the model computes on
  every core: a queue's read thread would only overlap the layer's hits, and on a core
  the compute threads also spin on, it slows them more than it hides. On that model
  (2 vCPUs, 15 decode steps) the queue's thread decoded in 1.94-2.44 s on two compute
  threads and 2.08-2.21 s on one, reads on the calling thread in 1.66-1.81 s on two.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import tierstore
from tierstore.lab import admit_miss, make_policy

from ..model import ExpertSource, ExpertWeights, RoutedExperts
from .budget import too_small
from .device_queue import lend_views, queue_budget, queue_bytes_moved
from .sources import OnDemandSource

Key = tuple[int, int]  # (layer, expert)

# Decode-like traces (one token per step) favour a short memory: see docs/performance.md's cache
# policy tables, where lfu-decay with period=16 matched lru and arc.
DEFAULT_POLICY_ARGS: dict[str, Any] = {"period": 16}

_CACHED, _TRANSIENT, _PREDICTED = "cached", "transient", "predicted"
# Below this running precision of the experts read on a guess, a guess reads more bytes for
# nothing than it saves (both cost one expert's transfer): guess only now and then.
SPEC_MIN_PRECISION = 0.5
SPEC_PROBE_EVERY = 8
SPEC_MEMORY = 0.95  # weight of the past in the running precision, per resolved layer


class ExpertModeSource(ExpertSource):
    """An :class:`trainer.model.ExpertSource` loading routed experts only.

    ``budget``: bytes of experts the device may hold (default, and at most, the store's
    prefetch budget for ``device``). ``cache_bytes``: the expert cache's share of it
    (default, set again before every pass: the budget less room for two layers' routed
    experts at most, ``2 · min(experts, top_k · tokens)``, so decoding one token keeps a
    larger cache than a prefill; at least a quarter of the budget).
    ``policy``/``policy_args``: the cache's eviction policy (see ``tierstore.lab.POLICIES``).
    ``speculate=False`` turns the next-layer prediction off. ``host_pool``: the store's
    host cache is the expert cache (see the module docstring): no cache of the source's
    own, no guesses, each layer's routed experts are read on the calling thread, and
    ``hit_rate`` is the host cache's over the expert entries loaded since the first pass.
    """

    def __init__(self, store: tierstore.Store, device: str | torch.device, *,
                 budget: int | None = None, cache_bytes: int | None = None,
                 policy: str = "lfu-decay", policy_args: Mapping[str, Any] | None = None,
                 speculate: bool = True, dtype: torch.dtype | None = None,
                 host_pool: bool = False) -> None:
        self.store = store
        self.device = torch.device(device)
        self.dtype = dtype
        queue = queue_budget(store, self.device)
        self.budget = queue if budget is None else min(int(budget), queue)
        self.views = lend_views(store, self.device)  # on the CPU: pins, not copies
        self.host_pool = host_pool
        self._cache_bytes_arg = 0 if host_pool else cache_bytes
        args = dict(DEFAULT_POLICY_ARGS if policy == "lfu-decay" and policy_args is None
                    else policy_args or {})
        try:
            self.policy = make_policy(policy, **args)
        except (TypeError, ValueError) as e:
            raise tierstore.StoreError(f"expert cache policy {policy!r}: {e}") from None
        self.speculate = speculate and not host_pool
        # Pooled, the source reads as on demand does (see the module docstring).
        self._reader = OnDemandSource(store, budget=self.budget) if host_pool else None
        self._tier_read_start = 0
        self.model: Any = None
        self.expert_bytes = 0
        self.cache_bytes = 0
        self._state: dict[Key, str] = {}  # every expert holding (or about to hold) budget
        self._in: dict[str, set[Key]] = {_CACHED: set(), _TRANSIENT: set(), _PREDICTED: set()}
        self._weights: dict[Key, ExpertWeights] = {}  # acquired ones
        self._predicted: dict[int, set[int]] = {}  # layer -> experts predicted for it
        self._fetched: dict[int, set[int]] = {}  # layer -> experts read because predicted
        self._spec_used = self._spec_read = 0.0  # running (decayed) counts behind precision
        self._spec_turn = 0
        self._pass = 0
        self.hits = self.misses = 0
        self.spec_correct = self.spec_routed = self.spec_requested = 0
        self.spec_useful = self.spec_skipped = 0
        self.stall_s = 0.0
        self.busy_s = 0.0
        self._pass_start = 0.0
        self._moved_start = self._read_start = 0
        self._pool_start = (0, 0)  # the host cache's hits and misses when bound

    # -- set-up -----------------------------------------------------------------------
    def _bind(self, model: Any) -> None:
        self.model = model
        layers = list(model.moe_layers)
        if not layers:
            raise tierstore.StoreError("the model has no MoE layers")
        self._index = {layer: i for i, layer in enumerate(layers)}
        self.n_experts = int(model.n_experts)
        self.expert_bytes = sum(self.store.info(n).nbytes
                                for n in model.expert_names(layers[0], 0))
        if self.budget < self.expert_bytes * model.top_k:
            raise too_small(f"the {model.top_k} experts one token routes to",
                            self.expert_bytes * model.top_k, self.budget)
        self.top_k = int(model.top_k)
        self._size_cache(1)
        self.policy.attach(self.cache_bytes)
        self._moved_start = queue_bytes_moved(self.store, self.device)
        self._read_start = queue_bytes_moved(self.store, self.device, "bytes_read")
        self._pool_start = self._pool_counts()
        self._tier_read_start = self._tier_bytes_read()

    def _pool_counts(self) -> tuple[int, int]:
        cache = self.store.stats().get("cache") or {}
        return int(cache.get("hits", 0)), int(cache.get("misses", 0))

    def _tier_bytes_read(self) -> int:
        tiers = self.store.stats().get("tiers") or {}
        return sum(int(t.get("bytes_read", 0)) for t in tiers.values())

    # -- bookkeeping --------------------------------------------------------------------
    def _size_cache(self, n_tokens: int) -> None:
        """The cache's share of the budget for a pass over ``n_tokens`` tokens: what is left
        after room for the current and the predicted layer's routed experts. A smaller
        share evicts on the next miss (the policy picks what goes)."""
        if self._cache_bytes_arg is not None:
            self.cache_bytes = min(int(self._cache_bytes_arg), self.budget)
            return
        per_layer = min(self.n_experts, self.top_k * max(1, n_tokens))
        reserve = 2 * per_layer * self.expert_bytes
        self.cache_bytes = max(self.budget - reserve, self.budget // 4)

    def _names(self, key: Key) -> tuple[str, ...]:
        return tuple(self.model.expert_names(*key))

    def _held_bytes(self) -> int:
        return len(self._state) * self.expert_bytes

    def _cached_bytes(self) -> int:
        return len(self._in[_CACHED]) * self.expert_bytes

    def _set(self, k: Key, state: str) -> None:
        old = self._state.get(k)
        if old is not None:
            self._in[old].discard(k)
        self._state[k] = state
        self._in[state].add(k)

    def _drop(self, keys: Sequence[Key]) -> None:
        """Give keys' device copies (or requests) back to the budget."""
        if not keys:
            return
        self.store.cancel([n for k in keys for n in self._names(k)], device=self.device)
        for k in keys:
            old = self._state.pop(k, None)
            if old is not None:
                self._in[old].discard(k)
            self._weights.pop(k, None)

    def _evict(self, k: Key) -> None:
        self.policy.record_remove(k, evicted=True)
        self._drop([k])

    def _make_room(self, nbytes: int, pinned: set[Key]) -> None:
        """Evict cached experts (policy order, ``pinned`` spared) until ``nbytes`` more fit
        in the budget; predictions for layers other than the pinned ones go first."""
        if self._held_bytes() + nbytes <= self.budget:
            return
        stale = [k for k in self._in[_PREDICTED] if k not in pinned]
        while stale and self._held_bytes() + nbytes > self.budget:
            self._drop([stale.pop()])  # still counted as predicted for the accuracy
        while self._held_bytes() + nbytes > self.budget:
            victim = self.policy.victim(None, lambda k: k not in pinned
                                        and self._state.get(k) == _CACHED)
            if victim is None:
                held = sum(1 for k in self._state if k in pinned)
                raise too_small(f"the {held + nbytes // self.expert_bytes} experts one MoE "
                                "layer routes to", held * self.expert_bytes + nbytes,
                                self.budget)
            self._evict(victim)

    def _request(self, keys: Sequence[Key], state: str) -> None:
        if not keys:
            return
        layer = keys[0][0]
        self.store.prefetch([n for k in keys for n in self._names(k)], device=self.device,
                            priority=(self._pass, self._index[layer]))
        for k in keys:
            self._set(k, state)

    def _convert(self, t: Tensor) -> Tensor:
        return t if self.dtype is None or t.dtype == self.dtype else t.to(self.dtype)

    # -- the ExpertSource protocol ------------------------------------------------------
    def begin_pass(self, model: Any, n_tokens: int) -> None:
        if self.model is None:
            self._bind(model)
        self._size_cache(n_tokens)
        self._pass_start = time.perf_counter()
        if self._reader is not None:
            self._reader.begin_pass(model, n_tokens)

    def experts(self, layer: int, ids: Sequence[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        if self._reader is not None:
            return self._reader.experts(layer, list(ids), x)
        keys = [(layer, int(e)) for e in ids]
        self._resolve_guess(layer, keys)
        group = self.budget // self.expert_bytes
        if len(keys) <= group:
            return self._serve(layer, keys, x, self.speculate)
        # More routed experts than the budget holds (a long prefill on a small budget):
        # served in groups as the model reaches them, no guess made for the next layer.
        return _Groups(self, layer, keys, group, x)

    def _resolve_guess(self, layer: int, keys: list[Key]) -> None:
        """Score the guess made for ``layer`` and cancel what it got wrong."""
        wanted = set(keys)
        # Predictions for this layer that missed: cancel them, their room is needed.
        guessed = self._predicted.pop(layer, None)
        if guessed is not None:
            routed = {k[1] for k in keys}
            self.spec_correct += len(guessed & routed)
            self.spec_routed += len(keys)
            fetched = self._fetched.pop(layer, set())
            if fetched:
                used = len(fetched & routed)
                self.spec_useful += used
                self._spec_used = SPEC_MEMORY * self._spec_used + used
                self._spec_read = SPEC_MEMORY * self._spec_read + len(fetched)
            self._drop([(layer, e) for e in guessed
                        if (layer, e) not in wanted and self._state.get((layer, e)) == _PREDICTED])

    def _serve(self, layer: int, keys: list[Key], x: Tensor, speculate: bool
               ) -> Mapping[int, ExpertWeights]:
        """``keys``' weights on the device (``speculate``: guess the next layer's too)."""
        wanted = set(keys)
        # This layer's missing experts first, so that they lead the queue.
        missing = [k for k in keys if k not in self._state]
        self._make_room(len(missing) * self.expert_bytes, wanted)
        self._request(missing, _TRANSIENT)
        for k in keys:
            if self._state[k] == _PREDICTED:
                self._set(k, _TRANSIENT)
        if speculate:
            self._speculate(layer, x, wanted)
        for k in keys:
            self._account(k, wanted)
        # Each expert is waited for when the model looks it up, in ascending id order: the
        # ones already here run while the later ones are still being read.
        return _Landing(self, keys)

    def _weights_of(self, k: Key) -> ExpertWeights:
        """``k``'s weights on the device, waiting for its transfer (the stall)."""
        w = self._weights.get(k)
        if w is None:
            t0 = time.perf_counter()
            w = tuple(self._convert(self.store.acquire(n, device=self.device))
                      for n in self._names(k))  # type: ignore[assignment]
            self.stall_s += time.perf_counter() - t0
            self._weights[k] = w
        return w

    def spec_precision(self) -> float:
        """Running fraction of the experts read on a guess that their layer then routed to
        (a prior of one in two before any)."""
        return (self._spec_used + 1.0) / (self._spec_read + 2.0)

    def predict(self, layer: int, x: Tensor) -> set[int]:
        """The experts MoE layer ``layer`` is guessed to route ``x`` (the normalised hidden
        states of the layer running now) to: its own router applied to them."""
        ids = self.model.router_topk(layer, x)[0]
        # Decoding routes a handful of tokens: a set of a short list beats torch.unique.
        if ids.numel() <= 256:
            return set(ids.flatten().tolist())
        return set(torch.unique(ids).tolist())

    def _speculate(self, layer: int, x: Tensor, pinned: set[Key]) -> None:
        nxt = self.model.next_moe_layer(layer)
        if nxt is None:
            return
        self._spec_turn += 1
        if (self.spec_precision() < SPEC_MIN_PRECISION
                and self._spec_turn % SPEC_PROBE_EVERY):
            self.spec_skipped += 1
            return
        pred = self.predict(nxt, x)
        self._predicted[nxt] = pred
        room = (self.budget - self._held_bytes()) // self.expert_bytes
        guess = [(nxt, e) for e in sorted(pred) if (nxt, e) not in self._state][:max(0, room)]
        self._request(guess, _PREDICTED)
        if guess:
            self._fetched[nxt] = {k[1] for k in guess}
        self.spec_requested += len(guess)

    def _account(self, k: Key, pinned: set[Key]) -> None:
        """One access of the device cache, through the policy's protocol."""
        if self._state.get(k) == _CACHED:
            self.hits += 1
            self.policy.record_hit(k)
            return
        self.misses += 1
        self.policy.record_miss(k, self.expert_bytes)
        victims = admit_miss(self.policy, k, self.expert_bytes,
                             self.cache_bytes - self._cached_bytes(),
                             lambda _: self.expert_bytes, lambda c: c not in pinned)
        if victims is None:
            return  # stays transient
        for v in victims:
            self._evict(v)
        self.policy.record_insert(k, self.expert_bytes)
        self._set(k, _CACHED)

    def layer_done(self, layer: int) -> None:
        if self._reader is not None:
            self._reader.layer_done(layer)
        self._drop([k for k in self._in[_TRANSIENT] if k[0] == layer])

    def end_pass(self) -> None:
        if self._reader is not None:
            self._reader.end_pass()
        self.busy_s += time.perf_counter() - self._pass_start
        self._pass += 1

    def close(self) -> None:
        """Give every expert back to the device budget."""
        if self._reader is not None:
            self._reader.close()
        self._drop(list(self._state))
        self._predicted.clear()
        self._fetched.clear()

    def stats(self) -> dict[str, Any]:
        accesses = self.hits + self.misses
        hit_rate = self.hits / accesses if accesses else None
        stall_s, moved, read = self.stall_s, 0, 0
        if self.model is not None and self._reader is not None:
            hits, misses = (now - then for now, then in zip(self._pool_counts(),
                                                            self._pool_start))
            hit_rate = hits / (hits + misses) if hits + misses else None
            stall_s, moved = self._reader.load_s, self._reader.loaded_bytes
            read = self._tier_bytes_read() - self._tier_read_start
        elif self.model is not None:
            moved = queue_bytes_moved(self.store, self.device) - self._moved_start
            read = queue_bytes_moved(self.store, self.device, "bytes_read") - self._read_start
        return {
            "mode": "expert",
            "budget_bytes": self.budget,
            "cache_bytes": self.cache_bytes,
            "cached_experts": len(self._in[_CACHED]),
            "expert_bytes": self.expert_bytes,
            "policy": self.policy.name,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": hit_rate,
            "host_pool": self.host_pool,
            "spec_accuracy": (self.spec_correct / self.spec_routed if self.spec_routed
                              else None),
            "spec_requested": self.spec_requested,
            # of those, routed before they were dropped; and guesses left out while the
            # running precision was low
            "spec_useful": self.spec_useful,
            "spec_precision": self.spec_precision(),
            "spec_skipped": self.spec_skipped,
            "stall_s": stall_s,
            "busy_s": self.busy_s,
            "stall_frac": stall_s / self.busy_s if self.busy_s else 0.0,
            # as the ring's: landed on the device (on the CPU pinned, not copied), and read
            # from the backing tier (speculation that was cancelled in flight counts here)
            "bytes_moved": moved,
            "bytes_read": read,
        }


class _Landing(RoutedExperts):
    """A layer's routed experts, each acquired when it is first looked up."""

    def __init__(self, source: ExpertModeSource, keys: list[Key]) -> None:
        self._source = source
        self._keys = {k[1]: k for k in keys}
        super().__init__(list(self._keys))

    def __getitem__(self, e: int) -> ExpertWeights:
        return self._source._weights_of(self._keys[e])  # KeyError for one not routed to


class _Groups(RoutedExperts):
    """A layer's routed experts when they are more than the budget holds: looked up in
    ascending id order (as the model does), they are fetched ``group`` at a time, the group
    before let go of first (the ones the cache took stay, evictable)."""

    def __init__(self, source: ExpertModeSource, layer: int, keys: list[Key], group: int,
                 x: Tensor) -> None:
        self._source, self._layer, self._keys, self._group, self._x = (
            source, layer, keys, group, x)
        self._index = {k[1]: i for i, k in enumerate(keys)}
        super().__init__(list(self._index))
        self._got: Mapping[int, ExpertWeights] = {}
        self._current: list[Key] = []

    def __getitem__(self, e: int) -> ExpertWeights:
        weights = self._got.get(e)
        if weights is None:
            i = self._index[e]  # KeyError for an expert not routed to
            src = self._source
            src._drop([k for k in self._current if src._state.get(k) == _TRANSIENT])
            self._current = self._keys[i:i + self._group]
            self._got = src._serve(self._layer, self._current, self._x, False)
            weights = self._got[e]
        return weights
