"""The states of the experts this rank owns, in its node's store, and their AdamW update.

Layout in a node's store (the single-process trainer's names, so a node store reads like
one): ``layers.{l}.experts.{e}.{w1,w2,w3}`` kinds ``param``, ``exp_avg`` and ``exp_avg_sq``,
and the expert's own AdamW step count as ``layers.{l}.experts.{e}`` kind ``step`` (one int64;
per expert rather than per layer, because several ranks share a node's store and each must
write only what it owns, and because re-sharding moves experts one by one).

Per step an owned expert is fetched once, when the first token (token-centric) or the first
rank that pulls it (data-centric) needs it, as fp32 leaves that require grad; gradients
accumulate there over micro-batches and over the ranks that send theirs. :meth:`update`
then runs the lazy AdamW of :func:`trainer.train.optim.adamw_step` on every owned expert
that received a gradient and writes its new states back, one ``put_many`` per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

import tierstore

from ..model import EXPERT_WEIGHTS, ExpertWeights, expert_name, init_expert
from ..presets import TrainModel
from ..train.checkpoint import MOMENTS, STEP_KIND
from ..train.optim import adamw_step
from ..train.resident import TrainConfig
from .world import World, owned


def count_name(layer: int, expert: int) -> str:
    """The store name of one expert's AdamW step count (kind ``step``)."""
    return f"layers.{layer}.experts.{expert}"


def state_keys(layer: int, expert: int) -> list[tuple[str, str]]:
    """Every entry of one expert's training state: weights, moments and step count."""
    keys = [(expert_name(layer, expert, w), k) for w in EXPERT_WEIGHTS
            for k in ("param", *MOMENTS)]
    return keys + [(count_name(layer, expert), STEP_KIND)]


class OwnedExperts:
    """The experts ``world.rank`` owns, over its node's ``store``."""

    def __init__(self, store: tierstore.Store, cfg: TrainModel, world: World,
                 device: torch.device) -> None:
        self.store, self.cfg, self.world, self.device = store, cfg, world, device
        self.ids = owned(world.rank, cfg.n_experts, world.size)
        self.leaves: dict[tuple[int, int], ExpertWeights] = {}
        self.grad = True

    def owns(self, expert: int) -> bool:
        return expert in self.ids

    def names(self, layer: int, expert: int) -> list[str]:
        return [expert_name(layer, expert, w) for w in EXPERT_WEIGHTS]

    def begin(self, grad: bool = True) -> None:
        self.leaves.clear()
        self.grad = grad

    def weights(self, layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        """``{e: (w1, w2, w3)}`` for owned experts ``ids``: fp32 leaves, read from the store
        the first time the step asks for them."""
        new = [e for e in ids if (layer, e) not in self.leaves]
        if new:
            names = [n for e in new for n in self.names(layer, e)]
            got = self.store.get_many(names, device=self.device)
            for e in new:
                self.leaves[(layer, e)] = tuple(  # type: ignore[assignment]
                    got[n].requires_grad_(self.grad) for n in self.names(layer, e))
        return {e: self.leaves[(layer, e)] for e in ids}

    def grads(self) -> list[Tensor]:
        return [w.grad for ws in self.leaves.values() for w in ws if w.grad is not None]

    @torch.no_grad()
    def update(self, lr: float, tc: TrainConfig) -> int:
        """Lazy AdamW for every owned expert that got a gradient this step; its new states
        go to the store. Returns how many were updated. The step's leaves are let go."""
        updated = 0
        for layer in sorted({lay for lay, _ in self.leaves}):
            touched = [e for (lay, e), ws in sorted(self.leaves.items())
                       if lay == layer and all(w.grad is not None for w in ws)]
            if not touched:
                continue
            keys = [(n, k) for e in touched for n in self.names(layer, e) for k in MOMENTS]
            keys += [(count_name(layer, e), STEP_KIND) for e in touched]
            states = self.store.get_many(keys, device=self.device)
            items: list[tuple[str, str, Tensor]] = []
            for e in touched:
                count = states[(count_name(layer, e), STEP_KIND)].clone() + 1
                for name, w in zip(self.names(layer, e), self.leaves[(layer, e)]):
                    p, m, v = w.detach(), states[(name, MOMENTS[0])], states[(name, MOMENTS[1])]
                    assert w.grad is not None
                    adamw_step(p, w.grad, m, v, int(count), lr, tc.betas, tc.eps,
                               tc.weight_decay)
                    items += [(name, "param", p), (name, MOMENTS[0], m), (name, MOMENTS[1], v)]
                items.append((count_name(layer, e), STEP_KIND, count))
            self.store.put_many(items)
            updated += len(touched)
        self.leaves.clear()
        return updated

    def initialise(self, seed: int) -> None:
        """Write the owned experts' initial weights (:func:`trainer.model.init_expert`, so
        every world size starts from the same model), zero moments and zero counts."""
        zeros = {w: torch.zeros(shape) for w, shape in self.cfg.expert_shapes().items()}
        for layer in self.cfg.moe_layers:
            for e in self.ids:
                items: list[tuple[str, str, Tensor]] = []
                for w, t in zip(EXPERT_WEIGHTS, init_expert(self.cfg, seed, layer, e)):
                    name = expert_name(layer, e, w)
                    items += [(name, "param", t), (name, MOMENTS[0], zeros[w]),
                              (name, MOMENTS[1], zeros[w])]
                items.append((count_name(layer, e), STEP_KIND, torch.zeros(1, dtype=torch.int64)))
                self.store.put_many(items)
