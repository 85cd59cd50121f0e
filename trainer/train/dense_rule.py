"""The dense-equivalent update rule for experts kept in a store.

``torch.optim.AdamW`` over ``transformers``' fused ``[E, ...]`` expert parameters updates
every expert at every step: an expert no token reached has a zero gradient, so its moments
decay (``m = b1 * m``, ``v = b2 * v``), decoupled weight decay shrinks its weights, and the
Adam update of the decayed moments still moves them. All experts of a fused parameter share
one step count, the global step. The store trainer reproduces that while reading and writing
only the experts each step routes to:

- Every step that updates experts records its hyperparameters (``lr``, ``betas``, ``eps``,
  ``weight_decay``: a scheduler may change them step to step) in one small store entry,
  :data:`HISTORY` (:class:`StepHistory`), written with the step's expert states.
- An expert's step count (the layer's ``step`` entry) is the global step its states are
  brought up to. When a step fetches an expert whose count is behind, the zero-gradient
  updates of the steps it missed are applied first, in order, each with its own step's
  hyperparameters (:func:`catch_up`), and written back with the count; the step's own update
  then follows as for any routed expert.
- Before a checkpoint and before an export every expert is caught up
  (:func:`catch_up_all`), and the history is cut to the step they are all at, so the entry
  holds at most the steps since the last checkpoint (five float64 a step).

Catching an expert up costs one elementwise AdamW pass over its weights and moments per
missed step, on reads and writes the step would mostly do anyway (the expert's moments are
read again by its update, from the host cache).

A store is trained under one rule: :data:`HISTORY` exists once a dense-rule step ran, and a
store whose experts took lazy steps (step counts above zero, no history) stays lazy
(:func:`rule_of`).

Expert-parallel, the ranks of a node share its store and each trains the experts it owns
(the layout's ``owned``): each keeps its own history beside its own step counts, both named
with the layout's ``counts_suffix`` (:func:`history_key`). So one writer orders a history's
rows before its experts' states (a rank writes its history first, then its states), and
the reader of a history is the writer of the counts it pairs with; every rank records the
same rows, since every rank takes every global step (:meth:`ExpertStates.update` agrees
across the ranks whether one is taken). :func:`catch_up_import` finds every history a store
holds, so an export of a node store catches up each rank's experts with its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import tierstore

from .checkpoint import HISTORY, MOMENTS, STEP_KIND, TrainerError
from .layout import ExpertLayout, LayerEntries, owned_of_suffix
from .optim import adamw_step

RULES = ("dense", "lazy")
# HISTORY holds one float64 row per recorded step: (lr, beta1, beta2, eps, weight_decay);
# row 0 holds the global step the first recorded row follows (its other fields unused).
Hyper = tuple[float, float, float, float, float]
Key = tuple[str, str]


def history_key(layout: ExpertLayout) -> Key:
    """Where the history of ``layout``'s experts is: :data:`HISTORY`, with the suffix of an
    expert-parallel rank's own entries."""
    return HISTORY[0] + layout.counts_suffix, HISTORY[1]


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"update rule must be one of {', '.join(RULES)}, got {rule!r}")
    return rule


class StepHistory:
    """The global step and the hyperparameters of the steps since ``base`` (the step every
    expert was last caught up to, at a checkpoint or an export)."""

    def __init__(self, base: int = 0, rows: list[Hyper] | None = None,
                 key: Key = HISTORY) -> None:
        self.base = base
        self.rows: list[Hyper] = rows or []
        self.key = key

    @property
    def step(self) -> int:
        """The global step: how many dense-rule steps the store's experts have taken."""
        return self.base + len(self.rows)

    @classmethod
    def read(cls, store: tierstore.Store, key: Key = HISTORY) -> StepHistory | None:
        if key not in store:
            return None
        t = store.get(*key).tolist()
        return cls(int(t[0][0]), [tuple(r) for r in t[1:]], key)  # type: ignore[misc]

    def write(self, store: tierstore.Store) -> None:
        rows = [[float(self.base), 0.0, 0.0, 0.0, 0.0], *map(list, self.rows)]
        store.put(self.key[0], torch.tensor(rows, dtype=torch.float64), kind=self.key[1])

    def advance(self, hyper: Hyper) -> int:
        """Record one more step; returns its (1-based) global step."""
        self.rows.append(tuple(float(x) for x in hyper))  # type: ignore[arg-type]
        return self.step

    def hyper(self, step: int) -> Hyper:
        if not self.base < step <= self.step:
            raise TrainerError(f"the dense rule's history holds steps {self.base + 1}-"
                               f"{self.step}, not step {step}; restore the store's latest "
                               "checkpoint")
        return self.rows[step - self.base - 1]


def rule_of(store: tierstore.Store, layout: ExpertLayout) -> str | None:
    """The rule the store's experts were trained under: ``dense`` where the history is,
    ``lazy`` where some expert took a step without it, ``None`` where none took any."""
    if history_key(layout) in store:
        return "dense"
    keys = [(layout.counts_name(k), STEP_KIND) for k in layout.keys]
    present = [k for k in keys if k in store]
    counts = store.get_many(present) if present else {}
    return "lazy" if any(int(c.max()) > 0 for c in counts.values()) else None


def require_rule(store: tierstore.Store, layout: ExpertLayout, rule: str) -> None:
    """Refuse to train a store under another rule than its experts' steps were taken."""
    check_rule(rule)
    found = rule_of(store, layout)
    if found is not None and found != rule:
        raise TrainerError(f"store {store.path}: its experts were trained with the {found} "
                           f"update rule; continue with that one (rule={found!r}, "
                           f"--update-rule {found})")


@torch.no_grad()
def catch_up(p: Tensor, m: Tensor, v: Tensor, count: int, history: StepHistory) -> None:
    """Apply to one expert tensor, in place, the zero-gradient AdamW updates of the global
    steps ``count + 1`` to ``history.step`` (what ``torch.optim.AdamW`` does to a fused
    expert parameter's unrouted slices); weight decay applies whatever the tensor's rank,
    as it does to the fused parameter."""
    if count >= history.step:
        return
    zero = torch.zeros_like(p)
    for s in range(count + 1, history.step + 1):
        lr, b1, b2, eps, wd = history.hyper(s)
        adamw_step(p, zero, m, v, s, lr, (b1, b2), eps, wd)


def catch_up_layer(store: tierstore.Store, layout: ExpertLayout, layer: int,
                   experts: list[int] | None, history: StepHistory,
                   device: torch.device | str = "cpu") -> list[int]:
    """Catch up ``layer``'s ``experts`` (None: all the layout trains) that are behind the global step: their
    states and the layer's counts written back in one ``put_many``. Returns those caught
    up."""
    counts_key = (layout.counts_name(layer), STEP_KIND)
    counts = store.get(*counts_key).clone()
    ids = layout.expert_ids if experts is None else experts
    behind = [e for e in ids if int(counts[e]) < history.step]
    if not behind:
        return []
    keys = [(n, k) for e in behind for n in layout.names(layer, e) for k in ("param", *MOMENTS)]
    got = store.get_many(keys, device=device)
    items = []
    for e in behind:
        for n in layout.names(layer, e):
            p, m, v = (got[(n, k)] for k in ("param", *MOMENTS))
            catch_up(p, m, v, int(counts[e]), history)
            items += [(n, "param", p), (n, MOMENTS[0], m), (n, MOMENTS[1], v)]
        counts[e] = history.step
    store.put_many([*items, (*counts_key, counts)])
    return behind


def catch_up_all(store: tierstore.Store, layout: ExpertLayout,
                 history: StepHistory | None = None) -> int:
    """Bring every expert of a dense-rule store to the global step and cut the history
    there (a no-op for a lazy or untrained store). Returns how many experts moved."""
    history = history or StepHistory.read(store, history_key(layout))
    if history is None:
        return 0
    moved = sum(len(catch_up_layer(store, layout, k, None, history)) for k in layout.keys)
    history.base, history.rows = history.step, []
    history.write(store)
    return moved


def catch_up_import(store: tierstore.Store, modules: list[Any]) -> int:
    """:func:`catch_up_all` for a store ``tierstore import-hf`` filled, its experts modules
    (:class:`tierstore.hf.layout.ExpertsModule`) read off ``model.json``: what ``export-hf``
    runs first, so that no loaded model is needed. Every history the store holds is caught
    up to: the single process's, and in a node store of an expert-parallel run each rank's,
    over the experts that rank owns."""
    if not modules:
        return 0
    layers = tuple(LayerEntries(i, m.prefix, tuple(p for _, parts in m.params for p in parts),
                                ()) for i, m in enumerate(modules))
    n = int(modules[0].num_experts)
    moved = 0
    for name, kind in store.keys(HISTORY[0]):
        suffix = name[len(HISTORY[0]):]
        owned = None if not suffix else owned_of_suffix(suffix)
        if kind != HISTORY[1] or (suffix and owned is None):
            continue
        layout = ExpertLayout(layers, n, 0, suffix, owned)
        moved += catch_up_all(store, layout)
    return moved
