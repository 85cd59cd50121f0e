"""Replay traces against policies at a byte capacity, without real memory.

The simulator is pure accounting: resident keys and their sizes, with the capacity checked
in bytes (no slots, so no fragmentation: it measures the policy, not the allocator). It
drives the same ``Policy`` objects as ``HostCache`` through the same protocol.

What is counted:
- ``hit_rate``: hits / accesses.
- ``bytes_read``: bytes fetched from the backing tier, i.e. the size of every miss, whether
  or not the missed entry was then admitted.
- ``bytes_written``: bytes written back to the backing tier. An access is a write (the
  expert's state is updated, as in a training step) with probability ``write_fraction``,
  drawn once per trace position from ``seed`` so every policy sees the same writes; a
  written resident entry becomes dirty; a dirty entry costs its size when it is evicted,
  and, with ``flush_at_end``, when the replay ends (every update reaches the backing tier
  eventually, so policies are compared on the same terms). A write to an entry the policy
  did not admit goes straight to the backing tier (write-through).
Use ``write_fraction=1.0`` for training traces, where every routed expert is updated, and
0.0 (the default) for inference.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .policies import Policy, admit_miss, make_policy
from .traces import Trace

__all__ = ["AccountingCache", "SimResult", "policy_overhead_ns", "simulate", "sweep"]


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity_bytes: int
    capacity_fraction: float
    accesses: int
    hits: int
    hit_rate: float
    bytes_read: int
    bytes_written: int
    evictions: int
    admissions_refused: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class AccountingCache:
    """What HostCache does with a policy, minus the bytes, the slots and the threads.

    ``access(key, nbytes, write)`` returns True on a hit. ``sizes`` maps resident keys to
    their sizes; with ``log_evictions`` every evicted key is appended to ``evicted``.
    """

    def __init__(self, policy: Policy, capacity_bytes: int, log_evictions: bool = False) -> None:
        self.policy = policy
        self.capacity = int(capacity_bytes)
        policy.attach(self.capacity)
        self.evicted: list[Hashable] | None = [] if log_evictions else None
        self.sizes: dict[Hashable, int] = {}
        self.dirty: set[Hashable] = set()
        self.used = 0
        self.hits = self.bytes_read = self.bytes_written = 0
        self.evictions = self.refused = 0

    def access(self, key: Hashable, nbytes: int, write: bool = False) -> bool:
        policy = self.policy
        if key in self.sizes:
            self.hits += 1
            policy.record_hit(key)
            if write:
                self.dirty.add(key)
            return True
        self.bytes_read += nbytes
        policy.record_miss(key, nbytes)
        if self._try_insert(key, nbytes):
            if write:
                self.dirty.add(key)
        else:
            self.refused += 1
            if write:
                self.bytes_written += nbytes
        return False

    def _try_insert(self, key: Hashable, nbytes: int) -> bool:
        policy = self.policy
        if nbytes > self.capacity:
            return False
        victims = admit_miss(policy, key, nbytes, self.capacity - self.used,
                             self.sizes.__getitem__)
        if victims is None:
            return False
        for victim in victims:
            policy.record_remove(victim, evicted=True)
            size = self.sizes.pop(victim)
            self.used -= size
            if victim in self.dirty:
                self.dirty.discard(victim)
                self.bytes_written += size
            self.evictions += 1
            if self.evicted is not None:
                self.evicted.append(victim)
        policy.record_insert(key, nbytes)
        self.sizes[key] = nbytes
        self.used += nbytes
        return True

    def flush(self) -> None:
        """Write back every dirty resident entry (counted in ``bytes_written``)."""
        for key in self.dirty:
            self.bytes_written += self.sizes[key]
        self.dirty.clear()


def _capacity(trace: Trace, capacity_bytes: int | None, capacity_fraction: float | None) -> int:
    if (capacity_bytes is None) == (capacity_fraction is None):
        raise ValueError("give exactly one of capacity_bytes and capacity_fraction")
    if capacity_bytes is not None:
        return int(capacity_bytes)
    if not capacity_fraction or capacity_fraction < 0:
        raise ValueError(f"capacity_fraction must be > 0, got {capacity_fraction}")
    return int(capacity_fraction * trace.distinct_bytes())


def _build(name: str | Policy, args: dict[str, Any] | None, trace: Trace) -> Policy:
    if isinstance(name, Policy):
        return name
    args = dict(args or {})
    if name == "belady" and "future" not in args:
        args["future"] = trace.keys()
    return make_policy(name, **args)


def simulate(
    trace: Trace,
    policy: str | Policy = "lfu-decay",
    *,
    capacity_bytes: int | None = None,
    capacity_fraction: float | None = None,
    policy_args: dict[str, Any] | None = None,
    write_fraction: float = 0.0,
    seed: int = 0,
    flush_at_end: bool = True,
    tick_per_step: bool = True,
) -> SimResult:
    """Replay ``trace`` against one policy at one capacity.

    Capacity is ``capacity_bytes``, or ``capacity_fraction`` of the trace's distinct bytes.
    ``belady`` gets the trace as its future unless ``policy_args`` gives one. With
    ``tick_per_step`` (the default) the policy's ``tick()`` is called whenever the trace's
    step changes, as the trainer calls ``Store.tick()`` once per training step, so
    lfu-decay decays per step; ``tick_per_step=False`` replays a caller that never ticks
    (lfu-decay's default clock then finds the steps itself, as passes over the keys).
    """
    capacity = _capacity(trace, capacity_bytes, capacity_fraction)
    pol = _build(policy, policy_args, trace)
    replay = AccountingCache(pol, capacity)
    writes = _write_mask(len(trace), write_fraction, seed)
    last_step = None
    for i, (step, key, nbytes) in enumerate(trace.accesses()):
        if tick_per_step and step != last_step:
            if last_step is not None:
                pol.tick()
            last_step = step
        replay.access(key, nbytes, bool(writes[i]))
    if flush_at_end:
        replay.flush()
    distinct = trace.distinct_bytes()
    n = len(trace)
    return SimResult(
        policy=pol.name,
        capacity_bytes=capacity,
        capacity_fraction=capacity / distinct if distinct else math.nan,
        accesses=n,
        hits=replay.hits,
        hit_rate=replay.hits / n if n else 0.0,
        bytes_read=replay.bytes_read,
        bytes_written=replay.bytes_written,
        evictions=replay.evictions,
        admissions_refused=replay.refused,
    )


def _write_mask(n: int, write_fraction: float, seed: int) -> np.ndarray:
    if not 0.0 <= write_fraction <= 1.0:
        raise ValueError(f"write_fraction must be in [0, 1], got {write_fraction}")
    if write_fraction in (0.0, 1.0):
        return np.full(n, write_fraction == 1.0)
    return np.random.default_rng(seed).random(n) < write_fraction


def sweep(
    trace: Trace,
    policies: Sequence[str],
    capacities: Iterable[float],
    *,
    policy_args: dict[str, dict[str, Any]] | None = None,
    write_fraction: float = 0.0,
    seed: int = 0,
    tick_per_step: bool = True,
) -> list[dict[str, Any]]:
    """Every policy at every capacity fraction, with Belady's hit rate as the ceiling.

    Returns one dict per (policy, capacity) with ``policy, capacity_fraction, hit_rate,
    opt_fraction, bytes_read, bytes_written, evictions``; ``opt_fraction`` is the hit rate
    divided by ``belady``'s at the same capacity (NaN when Belady gets no hits).
    ``policy_args`` maps a policy name to its constructor arguments.
    """
    policy_args = policy_args or {}
    rows = []
    for fraction in capacities:
        common = dict(capacity_fraction=fraction, write_fraction=write_fraction, seed=seed,
                      tick_per_step=tick_per_step)
        opt = simulate(trace, "belady", policy_args=policy_args.get("belady"), **common)
        for name in policies:
            res = (
                opt
                if name == "belady"
                else simulate(trace, name, policy_args=policy_args.get(name), **common)
            )
            rows.append(
                {
                    "policy": name,
                    "capacity_fraction": float(fraction),
                    "hit_rate": res.hit_rate,
                    "opt_fraction": res.hit_rate / opt.hit_rate if opt.hit_rate else math.nan,
                    "bytes_read": res.bytes_read,
                    "bytes_written": res.bytes_written,
                    "evictions": res.evictions,
                }
            )
    return rows


def policy_overhead_ns(
    policy: str,
    n_entries: int,
    accesses: int = 100_000,
    *,
    policy_args: dict[str, Any] | None = None,
    zipf_a: float = 0.8,
    seed: int = 0,
) -> float:
    """Average nanoseconds per simulated access with about ``n_entries`` resident.

    Keys are drawn Zipf(``zipf_a``) from 2 * ``n_entries`` candidates, entries are all one
    byte and the capacity is ``n_entries`` bytes, so the cache is full and roughly half the
    accesses miss and evict. The cache is filled first and only the steady state is timed.
    The figure includes the simulator's own bookkeeping, which is the same for every policy,
    so comparing policies, or one policy at several ``n_entries``, is meaningful.
    """
    n_entries = int(n_entries)
    if n_entries < 1:
        raise ValueError("n_entries must be >= 1")
    rng = np.random.default_rng(seed)
    universe = 2 * n_entries
    weights = 1.0 / np.arange(1, universe + 1) ** zipf_a
    stream = rng.choice(universe, size=accesses, p=weights / weights.sum()).tolist()
    warm = list(range(n_entries))
    args = dict(policy_args or {})
    if policy == "belady":
        args.setdefault("future", warm + stream)
    replay = AccountingCache(make_policy(policy, **args), n_entries)
    for key in warm:
        replay.access(key, 1)
    access = replay.access
    start = time.perf_counter_ns()
    for key in stream:
        access(key, 1)
    return (time.perf_counter_ns() - start) / max(1, accesses)
