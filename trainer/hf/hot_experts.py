"""Quantized experts kept dequantized while they stay hot, beside the packed host cache.

On a CPU, dequantizing a packed expert costs 14-22x reading it from the store
(docs/inference.md, "Quantized experts"), and expert mode dequantizes every routed expert
at every use, hits of the packed host cache included. :class:`HotExperts` keeps some
experts as the experts function uses them, in the compute dtype: a routed expert it holds
is neither asked of the source (no read, no host-cache lookup) nor dequantized again.

A dequantized expert takes ``byte ratio`` (2x for FP8, 3.76x for MXFP4) the bytes of a
packed one, so only what is routed to often earns a place: the same ``lfu-decay`` policy
as expert mode's device cache (decayed counts, a ghost table, and admission that refuses
a new key whose count is below a resident one's it would evict). Its bytes are a share of
the memory budget (``--dequantized-cache``, :func:`split_budget`), never on top of it.

Each tensor it holds is its own: copied out of the
:class:`~tierstore.hf.quant.Dequantizer`'s reused buffers (which the next expert
overwrites) and, for unquantized parameters (biases), out of the source's borrowed slots,
into the tensors of an expert it evicted or new ones (:meth:`HotExperts.miss`).
Its values are those of a fresh dequantization, since the stored experts do not change
while a source serves them; it belongs to one source (:attr:`source`) and serves nothing
to another (a trainer's, or the next attached one). It is used from the thread that runs
the model only (the experts function), never from a prefetch thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from tierstore.lab import admit_miss, make_policy

Key = tuple[int, int]  # (layer, expert)
Weights = dict[str, list[Tensor]]

# As expert mode's device cache (DEFAULT_POLICY_ARGS there): decode-like traces favour a
# short memory.
POLICY_ARGS: dict[str, Any] = {"period": 16}
# auto: the packed experts held are made up to this share of them all before any budget
# goes to dequantized ones (split_budget).
PACKED_FLOOR = 0.5


def split_budget(spare: int, setting: str | int | None, device_type: str, *,
                 packed_held: int = 0, every_packed: int = 0, one_token: int = 0) -> int:
    """The dequantized cache's bytes out of ``spare``, the experts' share of the device
    budget beyond what the mode needs at the least. ``setting``: ``auto`` (None), a
    fraction of ``spare`` (a float in [0, 1] given as a string) or bytes (an int, at most
    ``spare``).

    ``auto`` on a CPU: breadth first, then depth. The packed experts held otherwise
    (``packed_held``: the host cache, or every expert when resident) are first made up to
    :data:`PACKED_FLOOR` of every packed expert (``every_packed``) out of ``spare``, and
    the dequantized cache takes the rest. A packed byte holds ``byte ratio`` times the
    experts a dequantized one does and saves their reads; a dequantized byte saves a read
    and a dequantization 14-22x longer, but only for the experts that keep being routed
    to. With all of ``spare`` dequantized, the FP8 study's host cache held 27 % of the
    packed experts, read 82 MB a token and decoded at 0.42 of its bf16 twin; with half,
    1.20, and with this rule 0.88. With half, the MXFP4 study's dequantized cache held 18
    experts, fewer than a token routes to, hit none and decoded at 0.19 of bf16; with all
    (its host cache already held half of them, so this rule gives all), 0.37-0.60
    (docs/inference.md, one round each on a shared machine). So ``auto`` keeps nothing
    dequantized where its share would hold fewer bytes than ``one_token``, the experts one
    decoded token routes to in every MoE layer, dequantized: each token then evicts what
    the next one needs, and the room serves the packed cache better. On a GPU ``auto``
    keeps nothing dequantized: there the dequantization is a few kernels (well under a
    millisecond) and the packed bytes hold 2-4x the experts (not measured)."""
    spare = max(0, int(spare))
    if setting is None or setting == "auto":
        if device_type != "cpu":
            return 0
        share = max(0, spare - max(0, int(PACKED_FLOOR * every_packed) - packed_held))
        return share if share >= max(1, one_token) else 0
    if isinstance(setting, int):
        return min(setting, spare)
    return int(spare * float(setting))


class HotExperts:
    """A bounded cache of dequantized experts (see the module docstring). ``capacity``:
    bytes it may hold."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self.policy = make_policy("lfu-decay", **POLICY_ARGS)
        self.policy.attach(self.capacity)
        self.source: Any = None  # the source whose experts these are
        self._held: dict[Key, Weights] = {}
        self._sizes: dict[Key, int] = {}
        self.held_bytes = self.peak_bytes = 0
        self.hits = self.misses = self.dequantized = self.admitted = self.evicted = 0

    def serves(self, source: Any) -> bool:
        """Whether this cache may answer for ``source``'s experts (or those of the source
        it wraps for one generation, its ``inner``)."""
        while source is not None and source is not self.source:
            source = getattr(source, "inner", None)
        return self.capacity > 0 and source is not None

    def bind(self, source: Any) -> None:
        """Serve ``source`` from now on; what was held for another is dropped."""
        if source is not self.source:
            self.clear()
        self.source = source

    def holds(self, key: Key) -> bool:
        return key in self._held

    def hit(self, key: Key) -> Weights:
        """``key``'s weights (it is held), counted as a hit."""
        self.hits += 1
        self.policy.record_hit(key)
        return self._held[key]

    def miss(self, key: Key, nbytes: int, dequantize: Callable[[bool], Weights],
             pinned: set[Key]) -> Weights:
        """``key`` (``nbytes`` dequantized) was routed to and is not held: its weights from
        ``dequantize(reuse=True)`` (the dequantizer's reused buffers), and, when the policy
        admits it, a copy of them kept. ``pinned``: keys not to evict (this layer's hits,
        which the source was not asked for).

        The copy goes into the tensors of an expert just evicted where they have its
        shapes (they always do within a model), else into new ones: evictions and
        admissions then allocate nothing, so the process's memory stays the cache's
        bytes instead of growing with the allocator's fragments (on gpt-oss-shaped
        experts, fresh tensors for every admission and every dequantization's scratch
        took the peak RSS to 1.80 GB with 0.47 GB held, against 1.32 GB recycled)."""
        self.misses += 1
        self.dequantized += 1
        freed: list[Weights] = []
        if not self._admit(key, nbytes, pinned, freed):
            return dequantize(True)
        weights = _copy(dequantize(True), freed)
        self._held[key], self._sizes[key] = weights, nbytes
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.admitted += 1
        return weights

    def _admit(self, key: Key, nbytes: int, pinned: set[Key], freed: list[Weights]) -> bool:
        """The policy's protocol for a miss (``cache.policies.base``): whether ``key`` is
        kept, having evicted what makes room for it (their weights put in ``freed``)."""
        if nbytes > self.capacity:
            return False
        policy = self.policy
        policy.record_miss(key, nbytes)
        victims = admit_miss(policy, key, nbytes, self.capacity - self.held_bytes,
                             self._sizes.__getitem__, lambda k: k not in pinned)
        if victims is None:
            return False
        for v in victims:
            policy.record_remove(v, evicted=True)
            freed.append(self._held[v])
            self._forget(v)
            self.evicted += 1
        policy.record_insert(key, nbytes)
        return True

    def _forget(self, key: Key) -> None:
        self._held.pop(key, None)
        self.held_bytes -= self._sizes.pop(key, 0)

    def clear(self) -> None:
        for key in list(self._held):
            self.policy.record_remove(key, evicted=False)
            self._forget(key)

    def stats(self) -> dict[str, Any]:
        accesses = self.hits + self.misses
        return {"capacity_bytes": self.capacity, "held_bytes": self.held_bytes,
                "peak_bytes": self.peak_bytes, "experts": len(self._held),
                "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / accesses if accesses else None,
                "dequantized": self.dequantized, "admitted": self.admitted,
                "evicted": self.evicted}


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype \
        and a.device == b.device


def _copy(weights: Weights, freed: list[Weights]) -> Weights:
    """``weights`` (the dequantizer's reused buffers, borrowed slots) copied into tensors
    of the cache's own: those of a ``freed`` expert laid out alike, else new ones."""
    for old in freed:
        if old.keys() == weights.keys() and all(
                len(old[r]) == len(weights[r])
                and all(_same_layout(a, b) for a, b in zip(old[r], weights[r]))
                for r in weights):
            for r in weights:
                for a, b in zip(old[r], weights[r]):
                    a.copy_(b)
            return old
    return {r: [t.clone() for t in ts] for r, ts in weights.items()}

