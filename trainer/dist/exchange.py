"""Expert parallelism for the model's MoE layers: tokens to experts, or experts to tokens.

Both paradigms compute exactly what one process computes on the global batch, whose rows
are the ranks' batches in rank order:

Token-centric (:meth:`ExpertParallel._token_centric`)
    Each routed slot ``(token, j)`` goes to its expert's owner by one all-to-all, sorted by
    expert (which, ownership being consecutive, is sorted by owner). The owner receives
    rank 0's rows first, then rank 1's, ..., so a stable sort by expert gives every expert
    its rows in the global batch's order, and it runs :func:`trainer.model.expert_forward`
    on them exactly as :func:`trainer.model.moe_combine` would. A second all-to-all brings
    the outputs back, and they are mixed with the routing weights. Both exchanges are
    autograd-aware (:class:`.collectives.AllToAll`), so the backward pass sends the
    gradients of the outputs to the owners and the gradients of the rows back, and every
    owned expert's gradient is the sum over the global batch. With ``hierarchical`` both
    exchanges go in SE-MoE's two stages (:func:`.collectives.two_stage_rows`): the same rows
    in the same order, in one message per node pair between nodes.

Data-centric, after Janus (:meth:`ExpertParallel._data_centric`)
    The ranks tell each other which experts their tokens need (one all-gather of a mask);
    from that every rank derives the same plan. An owner sends each expert once to every
    other node that needs it (to one rank there, the node's receiver for that expert) and
    directly to the ranks of its own node that need it; receivers pass it on inside their
    node. So each expert crosses between nodes at most once per node per step, and the
    experts a step pulls are held (and reused by later micro-batches) until its gradients
    go back. After the backward pass (:meth:`ExpertParallel.reduce_grads`) the gradients
    take the same paths in reverse: pre-reduced on the receiver, then one message per
    (expert, node) to the owner, which adds them to its own. Every rank computes its own
    tokens with :func:`trainer.model.moe_combine`, as one process would.

    The node's daemon is the node's cache of its own experts (each is read from the node's
    store once and lent to every rank of the node through shared memory); pulled experts
    travel between ranks over torch.distributed and are not written to any store.

Credits bound how many pulled experts a rank holds at once (``credits``; ``None``: no bound).
A layer whose pulls would take any rank past its credits runs token-centric for that
micro-batch instead; every rank sees the same needs, so every rank decides the same.

Gradient scale: each rank's loss is its own batch's mean, divided by the world size before
the backward pass, so that sums over ranks (the all-to-all backward, the gradient messages,
the dense all-reduce) give the global batch's mean in both paradigms.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..model import (
    ExpertSource,
    ExpertWeights,
    Routing,
    expert_forward,
    model_config,
    moe_combine,
)
from ..presets import TrainModel
from .collectives import (
    Traffic,
    all_to_all_rows,
    comm_device,
    count_matrix,
    exchange,
    exchange_counts,
    inverse_permutation,
)
from .owned import OwnedExperts
from .world import DistributedError, World, owner

PARADIGMS = ("token", "data", "auto")


def janus_ratio(cfg: TrainModel, tokens_per_rank: int, world: World) -> float:
    """Janus's R = Comm_EC / Comm_DC for one MoE block (its Eq. 1, ``B*S*k / (4*n*H*E)``,
    for an FFN expert of ``8*H*H`` parameters; here for the experts' own size): tokens per
    rank ``T = B*S*k``, ``n`` nodes, ``E`` experts per rank. R > 1: pulling experts moves
    fewer bytes between nodes than sending tokens."""
    expert_params = sum(a * b for a, b in cfg.expert_shapes().values())
    return ratio_of(model_config(cfg).hidden_size, cfg.top_k, expert_params, cfg.n_experts,
                    tokens_per_rank, world)


def ratio_of(hidden: int, top_k: int, expert_params: int, n_experts: int,
             tokens_per_rank: int, world: World) -> float:
    """Janus's R for a block of ``n_experts`` experts of ``expert_params`` parameters each,
    ``top_k`` routed per token of width ``hidden``, ``tokens_per_rank`` tokens per rank."""
    per_rank = n_experts // world.size
    t = tokens_per_rank * top_k
    return 2 * hidden * t / (max(1, world.n_nodes) * expert_params * per_rank)


def check_paradigm(paradigm: str) -> str:
    """``paradigm``, if it is one of :data:`PARADIGMS`; else a one-line ValueError."""
    if paradigm not in PARADIGMS:
        raise ValueError(f"paradigm must be one of {', '.join(PARADIGMS)}, not {paradigm!r}")
    return paradigm


def choose_paradigms(cfg: TrainModel, paradigm: str, tokens_per_rank: int,
                     world: World) -> dict[int, str]:
    """The paradigm of every MoE layer: ``paradigm``, or with ``auto`` data-centric where
    :func:`janus_ratio` exceeds 1."""
    check_paradigm(paradigm)
    out = {}
    for layer in cfg.moe_layers:
        if paradigm != "auto":
            out[layer] = paradigm
        else:
            out[layer] = "data" if janus_ratio(cfg, tokens_per_rank, world) > 1 else "token"
    return out


def pull_plan(world: World, n_experts: int, new: Tensor, held: Tensor
              ) -> list[tuple[int, int, int, int]]:
    """Transfers for the ``[W, E]`` masks ``new`` (experts each rank needs and does not
    hold) and ``held`` (what each rank holds from earlier micro-batches): ``(e, src,
    dst, stage)``, stage 1 from the owner, stage 2 from a rank of the same node that
    holds it (the node's receiver). Identical on every rank."""
    plan = []
    for e in range(n_experts):
        needers = [r for r in range(world.size) if bool(new[r, e])]
        if not needers:
            continue
        o = owner(e, n_experts, world.size)
        for node, ranks in enumerate(world.nodes):
            here = [r for r in needers if r in ranks and r != o]
            if not here:
                continue
            if node == world.node_of(o):
                plan += [(e, o, r, 1) for r in here]
                continue
            holders = [r for r in ranks if bool(held[r, e])]
            if holders:  # already on this node: it does not cross again
                plan += [(e, holders[0], r, 2) for r in here]
            else:
                plan.append((e, o, here[0], 1))
                plan += [(e, here[0], r, 2) for r in here[1:]]
    return plan


def exchange_rows(world: World, traffic: Traffic, to: list[int], frm: list[int],
                  rows: list[Tensor], width: int, device: torch.device, what: str) -> Tensor:
    """One all-to-all of ``width``-element fp32 rows: ``rows[i]`` to rank ``to[i]``
    (ascending); returns the rows from ranks ``frm`` (ascending), in that order."""
    send, recv = [0] * world.size, [0] * world.size
    for r in to:
        send[r] += 1
    for r in frm:
        recv[r] += 1
    buf = torch.stack(rows) if rows else torch.empty((0, width), device=device)
    got = all_to_all_rows(buf, send, recv)
    traffic.add(what, send, width * 4)
    return got


class ExpertParallel(ExpertSource):
    """The distributed trainer's expert source: MoE layers computed across the ranks."""

    def __init__(self, world: World, cfg: TrainModel, experts: OwnedExperts,
                 paradigms: Mapping[int, str], credits: int | None = None,
                 hierarchical: bool = False) -> None:
        if hierarchical and len({len(ranks) for ranks in world.nodes}) > 1:
            raise DistributedError("the two-stage all-to-all needs the same number of ranks "
                                   "on every node")
        self.world, self.cfg, self.owned = world, cfg, experts
        self.hierarchical = hierarchical
        self.paradigms = dict(paradigms)
        self.credits = credits
        self.traffic = Traffic(world)
        self.n_experts = cfg.n_experts
        self.expert_numel = sum(a * b for a, b in cfg.expert_shapes().values())
        self.shapes = [cfg.expert_shapes()[w] for w in ("w1", "w2", "w3")]
        self.comm_s = 0.0
        self.count_reducer = _sum_over_ranks
        self._owners = self._owner_mask()
        self._reset()

    # -- the step ---------------------------------------------------------------------

    def _reset(self) -> None:
        # Pulled experts this step: (layer, e) -> leaves; and per layer the [W, E] mask of
        # what every rank holds (identical on every rank).
        self.pulled: dict[tuple[int, int], ExpertWeights] = {}
        self.held: dict[int, Tensor] = {}
        self.edges: dict[int, list[tuple[int, int, int, int]]] = {}  # the pulls' paths
        self.used: dict[int, str] = {}  # what each layer ran this step ('token'/'data'/both)
        self.cross_pulls: list[tuple[int, int, int]] = []  # (layer, e, node) sent from here
        self.cross_grads: list[tuple[int, int, int]] = []  # (layer, e, node) received here

    def begin(self, grad: bool = True) -> None:
        self.owned.begin(grad)
        self._reset()
        self.traffic.reset()
        self.comm_s = 0.0

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        raise RuntimeError("expert-parallel layers are computed by moe(), not experts()")

    def moe(self, layer: int, x: Tensor, routing: Routing) -> Tensor:
        mode = self.paradigms.get(layer, "token")
        if mode == "data":
            y = self._data_centric(layer, x, routing)
            if y is not None:
                return y
            mode = "token"  # over the credits: this micro-batch sends tokens
        self._mark(layer, "token")
        return self._token_centric(layer, x, routing)

    def _mark(self, layer: int, mode: str) -> None:
        seen = self.used.setdefault(layer, mode)
        if seen != mode:
            self.used[layer] = "mixed"

    # -- token-centric ----------------------------------------------------------------

    def _token_centric(self, layer: int, x: Tensor, routing: Routing) -> Tensor:
        w, e_total = self.world.size, self.n_experts
        n_tok, k = routing.topk_idx.shape
        flat = routing.topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots by expert, hence by owner
        sorted_ids = flat[order]
        dest = sorted_ids * w // e_total
        send = torch.bincount(dest, minlength=w).tolist()
        t0 = time.perf_counter()
        if self.hierarchical:
            m: list[list[int]] | None = count_matrix(send, self.world)
            assert m is not None
            recv = [m[r][self.world.rank] for r in range(w)]
            back: list[list[int]] | None = [list(col) for col in zip(*m)]
        else:
            m = back = None
            recv = exchange_counts(send, self.world)
        rows = exchange(x[order // k], send, recv, m, self.world, self.traffic)
        # the expert id of each row, counted with the rows
        got_ids = exchange(sorted_ids[:, None], send, recv, m, self.world, self.traffic)[:, 0]
        self.comm_s += time.perf_counter() - t0
        # The owner's work: each expert on its rows, in the global batch's order.
        by_expert = torch.argsort(got_ids, stable=True)
        ids, counts = torch.unique_consecutive(got_ids[by_expert], return_counts=True)
        weights = self.owned.weights(layer, ids.tolist())
        pieces, start = [], 0
        for e, c in zip(ids.tolist(), counts.tolist()):
            pieces.append(expert_forward(rows[by_expert[start:start + c]], *weights[e]))
            start += c
        if pieces:
            # In the rows' dtype, as the empty answer below is: under autocast the experts
            # answer in bf16, and a rank that got no rows must not expect other bytes per
            # row than its peers send.
            out_sorted = torch.cat(pieces).to(rows.dtype)
            out = out_sorted[inverse_permutation(by_expert)]
        else:  # nothing routed here; still part of the graph, so the backward exchange runs
            out = rows[:0]
        t0 = time.perf_counter()
        y_sorted = exchange(out, recv, send, back, self.world, self.traffic)
        self.comm_s += time.perf_counter() - t0
        y = y_sorted[inverse_permutation(order)].view(n_tok, k, -1)
        return (y.float() * routing.topk_weight.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    # -- data-centric -----------------------------------------------------------------

    def _plan(self, new: Tensor, held: Tensor) -> list[tuple[int, int, int, int]]:
        return pull_plan(self.world, self.n_experts, new, held)

    def _owner_mask(self) -> Tensor:
        w, n = self.world.size, self.n_experts
        mask = torch.zeros(w, n, dtype=torch.bool)
        for e in range(n):
            mask[owner(e, n, w), e] = True
        return mask

    def _data_centric(self, layer: int, x: Tensor, routing: Routing) -> Tensor | None:
        world = self.world
        ids = torch.unique(routing.topk_idx)
        mine = torch.zeros(self.n_experts, dtype=torch.uint8, device=comm_device(world))
        mine[ids.to(mine.device)] = 1
        t0 = time.perf_counter()
        gathered = [torch.empty_like(mine) for _ in range(world.size)]
        dist.all_gather(gathered, mine)
        self.comm_s += time.perf_counter() - t0
        need = torch.stack(gathered).bool().cpu()
        held = self.held.get(layer, torch.zeros_like(need))
        plan = self._plan(need & ~held, held)
        if self.credits is not None:
            pulls = torch.zeros(world.size, dtype=torch.int64)
            for mask in self.held.values():
                pulls += (mask & ~self._owners).sum(dim=1)
            for _, _, dst, _ in plan:
                pulls[dst] += 1
            if int(pulls.max()) > self.credits:
                return None
        self.held[layer] = held | need
        self.edges.setdefault(layer, []).extend(plan)
        # Owners fetch what anyone needs from them (their own leaves, shared by all).
        wanted = [e for e in range(self.n_experts)
                  if self.owned.owns(e) and bool(need[:, e].any())]
        own = self.owned.weights(layer, wanted)
        for stage in (1, 2):
            self._send_experts(layer, [p for p in plan if p[3] == stage], own)
        self._mark(layer, "data")
        weights = {e: own[e] if e in own else self.pulled[(layer, e)] for e in ids.tolist()}
        return moe_combine(x, routing.topk_idx, routing.topk_weight, weights)

    def _flat(self, ws: ExpertWeights) -> Tensor:
        return torch.cat([w.detach().reshape(-1) for w in ws])

    def _unflat(self, row: Tensor) -> ExpertWeights:
        out, offset = [], 0
        for a, b in self.shapes:
            out.append(row[offset:offset + a * b].view(a, b))
            offset += a * b
        return tuple(out)  # type: ignore[return-value]

    def _send_experts(self, layer: int, moves: list[tuple[int, int, int, int]],
                      own: Mapping[int, ExpertWeights]) -> None:
        """One all-to-all carrying ``moves``' expert weights; received ones become this
        step's pulled leaves."""
        world, me = self.world, self.world.rank
        if not moves:  # the same on every rank: nobody calls the collective
            return
        outgoing = sorted((dst, e) for e, src, dst, _ in moves if src == me)
        incoming = sorted((src, e) for e, src, dst, _ in moves if dst == me)
        got = self._exchange_rows(
            [dst for dst, _ in outgoing], [src for src, _ in incoming],
            [self._flat(own[e] if e in own else self.pulled[(layer, e)]) for _, e in outgoing],
            "experts")
        for dst, e in outgoing:
            if world.node_of(dst) != world.node:
                self.cross_pulls.append((layer, e, world.node_of(dst)))
        for i, (_, e) in enumerate(incoming):
            self.pulled[(layer, e)] = tuple(  # type: ignore[assignment]
                w.clone().requires_grad_(self.owned.grad) for w in self._unflat(got[i]))

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """After the step's last backward: every pulled expert's gradient goes back to its
        owner, pre-reduced on each node, and is added to the owner's own."""
        if not self.edges:
            return
        world, me = self.world, self.world.rank
        # The pulls' paths reversed: first each node's other ranks to the receiver, which
        # adds theirs to its own, then receivers and the owner's node-mates to the owner.
        for stage in (2, 1):
            moves = [(layer, e, dst, src) for layer, plan in sorted(self.edges.items())
                     for e, src, dst, st in plan if st == stage]
            outgoing = sorted((to, layer, e) for layer, e, frm, to in moves if frm == me)
            incoming = sorted((frm, layer, e) for layer, e, frm, to in moves if to == me)
            if not moves:
                continue
            got = self._exchange_rows([to for to, _, _ in outgoing],
                                      [frm for frm, _, _ in incoming],
                                      [self._pulled_grad(layer, e) for _, layer, e in outgoing],
                                      "grads")
            for i, (frm, layer, e) in enumerate(incoming):
                if world.node_of(frm) != world.node:
                    self.cross_grads.append((layer, e, world.node_of(frm)))
                target = (self.owned.leaves[(layer, e)] if self.owned.owns(e)
                          else self.pulled[(layer, e)])
                for w, g in zip(target, self._unflat(got[i])):
                    w.grad = g.clone() if w.grad is None else w.grad.add_(g)
        self.pulled.clear()

    def _exchange_rows(self, to: list[int], frm: list[int], rows: list[Tensor],
                       what: str) -> Tensor:
        t0 = time.perf_counter()
        got = exchange_rows(self.world, self.traffic, to, frm, rows, self.expert_numel,
                            self.owned.device, what)
        self.comm_s += time.perf_counter() - t0
        return got

    def _pulled_grad(self, layer: int, e: int) -> Tensor:
        ws = self.pulled[(layer, e)]
        return torch.cat([(w.grad if w.grad is not None else torch.zeros_like(w)).reshape(-1)
                          for w in ws])

    def end(self) -> None:
        self.pulled.clear()
        self.held.clear()
        self.edges.clear()

    def step_figures(self) -> dict[str, Any]:
        return {**self.traffic.figures(), "comm_s": self.comm_s,
                "paradigm": {str(k): v for k, v in sorted(self.used.items())},
                "cross_pulls": sorted(self.cross_pulls), "cross_grads": sorted(self.cross_grads)}


def _sum_over_ranks(t: Tensor) -> Tensor:
    out = t.detach().clone()
    dist.all_reduce(out)
    return out
