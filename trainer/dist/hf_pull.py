"""Data-centric MoE blocks (after Janus) for a ``transformers`` model: experts to the tokens.

The plan and the paths are the preset trainer's (:mod:`.exchange`: :func:`~.exchange.pull_plan`,
one all-to-all per stage): the ranks all-gather which experts their tokens need; an owner
sends each expert once to every other node that needs it (to that node's receiver) and to
the ranks of its own node that need it, receivers pass it on inside their node. The experts
a step pulls are held, and reused by its later micro-batches, until their gradients go back
(:meth:`Pulls.return_grads`): the same paths reversed, pre-reduced on each node's receiver,
then one message per (expert, node) to the owner, which adds them to its own leaves' before
the update. Every rank computes its own tokens with the backend's own per-expert math
(:func:`tierstore.hf.backend.local_forward`), as one process would.

An expert's tensors travel as one fp32 row (its entries in the layout's order, flattened).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tierstore.hf.backend import ExpertLayer, local_forward
from torch import Tensor, nn

from .collectives import Traffic, comm_device
from .exchange import exchange_rows, pull_plan
from .world import World, owned


class _Given:
    """A source of the weights already at hand (owned leaves and pulled copies)."""

    def __init__(self, weights: Mapping[int, Sequence[Tensor]]) -> None:
        self.weights = weights

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, Sequence[Tensor]]:
        return self.weights

    def layer_done(self, layer: int) -> None:
        pass


class Pulls:
    """This rank's data-centric blocks of one step (see the module docstring)."""

    def __init__(self, world: World, states: Any, n_experts: int, traffic: Traffic) -> None:
        self.world, self.states, self.n_experts, self.traffic = world, states, n_experts, traffic
        self.ids = owned(world.rank, n_experts, world.size)
        self.comm_s = 0.0
        self.reset()

    def reset(self) -> None:
        self.pulled: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self.held: dict[int, Tensor] = {}  # per layer: the [W, E] mask of what each rank holds
        self.edges: dict[int, list[tuple[int, int, int, int]]] = {}  # the pulls' paths
        self.cross: list[tuple[int, int, int]] = []  # (layer, e, node) sent across nodes

    def _shapes(self, key: int) -> tuple[tuple[int, ...], ...]:
        return tuple(self.states.layout.shapes(key))

    def _width(self, key: int) -> int:
        return sum(math.prod(s) for s in self._shapes(key))

    def forward(self, module: nn.Module, layer: ExpertLayer, x: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor) -> Tensor:
        world, key = self.world, layer.key
        ids = torch.unique(top_k_index).tolist()
        mine = torch.zeros(self.n_experts, dtype=torch.uint8, device=comm_device(world))
        mine[ids] = 1
        t0 = time.perf_counter()
        gathered = [torch.empty_like(mine) for _ in range(world.size)]
        dist.all_gather(gathered, mine)
        self.comm_s += time.perf_counter() - t0
        need = torch.stack(gathered).bool().cpu()
        held = self.held.get(key, torch.zeros_like(need))
        plan = pull_plan(world, self.n_experts, need & ~held, held)
        self.held[key] = held | need
        self.edges.setdefault(key, []).extend(plan)
        wanted = [e for e in self.ids if bool(need[:, e].any())]
        own = self.states(key, wanted) if wanted else {}
        for stage in (1, 2):
            self._send(key, [p for p in plan if p[3] == stage], own)
        weights = {e: own[e] if e in own else self.pulled[(key, e)] for e in ids}
        return local_forward(module, layer, _Given(weights), x, top_k_index, top_k_weights)

    def _send(self, key: int, moves: list[tuple[int, int, int, int]],
              own: Mapping[int, Sequence[Tensor]]) -> None:
        """One all-to-all carrying ``moves``' experts; received ones become pulled leaves."""
        if not moves:  # the same on every rank: nobody calls the collective
            return
        me = self.world.rank
        outgoing = sorted((dst, e) for e, src, dst, _ in moves if src == me)
        incoming = sorted((src, e) for e, src, dst, _ in moves if dst == me)
        rows = [torch.cat([w.detach().reshape(-1) for w in
                           (own[e] if e in own else self.pulled[(key, e)])])
                for _, e in outgoing]
        got = self._rows([d for d, _ in outgoing], [s for s, _ in incoming], rows, key,
                         "experts")
        for dst, e in outgoing:
            if self.world.node_of(dst) != self.world.node:
                self.cross.append((key, e, self.world.node_of(dst)))
        for i, (_, e) in enumerate(incoming):
            self.pulled[(key, e)] = tuple(w.clone().requires_grad_(torch.is_grad_enabled())
                                          for w in self._unflat(got[i], key))

    def _rows(self, to: list[int], frm: list[int], rows: list[Tensor], key: int,
              what: str) -> Tensor:
        t0 = time.perf_counter()
        got = exchange_rows(self.world, self.traffic, to, frm, rows, self._width(key),
                            self.states.device, what)
        self.comm_s += time.perf_counter() - t0
        return got

    def _unflat(self, row: Tensor, key: int) -> tuple[Tensor, ...]:
        out, offset = [], 0
        for shape in self._shapes(key):
            n = math.prod(shape)
            out.append(row[offset:offset + n].view(shape))
            offset += n
        return tuple(out)

    @torch.no_grad()
    def return_grads(self) -> None:
        """After the step's last backward: every pulled expert's gradient to its owner,
        pre-reduced on each node, added to the owner's own. The step's pulls end here."""
        me = self.world.rank
        for stage in (2, 1):
            moves = [(key, e, dst, src) for key, plan in sorted(self.edges.items())
                     for e, src, dst, st in plan if st == stage]
            if not moves:
                continue
            outgoing = sorted((to, key, e) for key, e, frm, to in moves if frm == me)
            incoming = sorted((frm, key, e) for key, e, frm, to in moves if to == me)
            # Rows of one all-to-all share a width: one exchange per layer shape.
            for key in sorted({k for k, _, _, _ in moves}):
                out = [(to, e) for to, k, e in outgoing if k == key]
                inc = [(frm, e) for frm, k, e in incoming if k == key]
                got = self._rows([t for t, _ in out], [f for f, _ in inc],
                                 [self._grad_row(key, e) for _, e in out], key, "grads")
                for i, (_, e) in enumerate(inc):
                    target = (self.states.leaves[(key, e)] if e in self.ids
                              else self.pulled[(key, e)])
                    for w, g in zip(target, self._unflat(got[i], key)):
                        w.grad = g.clone() if w.grad is None else w.grad.add_(g)
        self.reset()

    def _grad_row(self, key: int, e: int) -> Tensor:
        return torch.cat([(w.grad if w.grad is not None else torch.zeros_like(w)).reshape(-1)
                          for w in self.pulled[(key, e)]])
