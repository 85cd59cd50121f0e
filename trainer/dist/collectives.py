"""The collectives the expert-parallel layers use, and the byte counts they add up.

Every exchange is one ``all_to_all_single`` with per-rank split sizes (rows of a 2-D tensor).
:class:`AllToAll` makes it autograd-aware: the backward of a scatter of rows is the gather
that sends each row's gradient back the way it came, i.e. the same call with the split
sizes swapped. The forward and backward both run on every rank in the same order, because
every rank builds the same chain of exchanges (one dispatch and one combine per MoE layer).

:class:`Traffic` counts the bytes each exchange moves between ranks, split into what stays
on a node and what crosses between nodes, by what it carries (tokens, experts, gradients):
the exact figures a step reports, whatever the transport.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..train.optim import clip_coef
from .world import World


class Traffic:
    """Bytes sent by this rank, per ``(what, 'intra' | 'cross')``, since :meth:`reset`."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def reset(self) -> None:
        self.bytes.clear()

    def add(self, what: str, rows_to: Sequence[int], row_bytes: int) -> None:
        """``rows_to[r]`` rows of ``row_bytes`` each went to rank ``r`` (itself excluded)."""
        me, node_of = self.world.rank, self.world.node_of
        for r, n in enumerate(rows_to):
            if n and r != me:
                where = "intra" if node_of(r) == node_of(me) else "cross"
                self.bytes[(what, where)] += n * row_bytes

    def figures(self) -> dict[str, int]:
        """``{'tokens_cross_bytes': ..., ...}``, with every kind present."""
        out = {f"{what}_{where}_bytes": 0 for what in ("tokens", "experts", "grads")
               for where in ("intra", "cross")}
        for (what, where), n in self.bytes.items():
            out[f"{what}_{where}_bytes"] = out.get(f"{what}_{where}_bytes", 0) + n
        return out


def exchange_counts(counts: Sequence[int], world: World) -> list[int]:
    """Send ``counts[r]`` to rank ``r``; returns what each rank sent here."""
    send = torch.tensor(list(counts), dtype=torch.int64, device=comm_device(world))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.tolist()


def comm_device(world: World) -> torch.device:
    return world.device if world.backend == "nccl" else torch.device("cpu")


def all_to_all_rows(x: Tensor, send: Sequence[int], recv: Sequence[int],
                    group: Any = None) -> Tensor:
    """Rows ``x[sum(send[:r]) : sum(send[:r+1])]`` go to rank ``r`` of ``group``; returns the
    rows received, ``recv[r]`` from rank ``r``, in rank order (no gradient)."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)
    return out


def count_matrix(send: Sequence[int], world: World) -> list[list[int]]:
    """Every rank's send counts: ``m[a][b]`` rows go from rank ``a`` to rank ``b``."""
    mine = torch.tensor(list(send), dtype=torch.int64, device=comm_device(world))
    rows = [torch.empty_like(mine) for _ in range(world.size)]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def two_stage_rows(x: Tensor, m: list[list[int]], world: World,
                   traffic: Traffic | None = None, what: str = "tokens") -> Tensor:
    """The exchange :func:`all_to_all_rows` makes over the world, in SE-MoE's two stages
    (its section 4.2): first inside the node, each rank gathering the rows bound for the
    ranks of its own local rank on every node; then between the ranks of equal local rank,
    one message per node pair instead of one per rank pair. The rows arrive in the same
    order as the flat exchange's (source rank, then the source's order), so the result is
    the same, bit for bit. ``m`` is :func:`count_matrix`'s; needs the same number of ranks
    on every node. ``traffic`` counts what each stage sends."""
    size, nodes = world.local_size, world.n_nodes
    me, node, lr = world.rank, world.node, world.local_rank
    send = m[me]
    offsets = [0]
    for c in send:
        offsets.append(offsets[-1] + c)
    # stage 1: to local rank l, what goes to local rank l of every node, by node
    pieces, send1 = [], [0] * size
    for lo in range(size):
        for n in range(nodes):
            d = n * size + lo
            pieces.append(x[offsets[d]:offsets[d + 1]])
            send1[lo] += send[d]
    recv1 = [sum(m[node * size + s][n * size + lr] for n in range(nodes)) for s in range(size)]
    row_bytes = x.shape[1:].numel() * x.element_size()  # x may be empty yet forward rows
    if traffic is not None:
        traffic.add(what, [send1[r - node * size] if world.node_of(r) == node else 0
                           for r in range(world.size)], row_bytes)
    got = all_to_all_rows(torch.cat(pieces) if pieces else x[:0], send1, recv1,
                          group=world.node_group) if size > 1 else torch.cat(pieces)
    # stage 2: arrived by (local source, node); leaves by (node, local source)
    where, pos = {}, 0
    for s in range(size):
        for n in range(nodes):
            c = m[node * size + s][n * size + lr]
            where[(n, s)] = (pos, c)
            pos += c
    parts = [got[p:p + c] for n in range(nodes) for s in range(size)
             for p, c in [where[(n, s)]]]
    buf = torch.cat(parts) if parts else got[:0]
    send2 = [sum(m[node * size + s][n * size + lr] for s in range(size)) for n in range(nodes)]
    recv2 = [sum(m[n * size + s][me] for s in range(size)) for n in range(nodes)]
    if nodes == 1:
        return buf
    if traffic is not None:
        traffic.add(what, [send2[world.node_of(r)] if r % size == lr else 0
                           for r in range(world.size)], row_bytes)
    return all_to_all_rows(buf, send2, recv2, group=world.peer_group)


class TwoStage(torch.autograd.Function):
    """:func:`two_stage_rows` with its backward: the transposed exchange, in two stages."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, m: list[list[int]], world: World,
                traffic: Traffic | None, what: str) -> Tensor:
        ctx.m, ctx.world, ctx.traffic, ctx.what = m, world, traffic, what
        return two_stage_rows(x, m, world, traffic, what)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        transposed = [list(col) for col in zip(*ctx.m)]
        out = two_stage_rows(grad.contiguous(), transposed, ctx.world, ctx.traffic, ctx.what)
        return out, None, None, None, None


def exchange(x: Tensor, send: list[int], recv: list[int], m: list[list[int]] | None,
             world: World, traffic: Traffic | None = None, what: str = "tokens") -> Tensor:
    """Rows to their ranks, autograd-aware: flat (:func:`all_to_all`), or in two stages
    when the count matrix ``m`` is given (:func:`two_stage_rows`)."""
    if m is None:
        return all_to_all(x, send, recv, traffic, what)
    if x.requires_grad:
        return TwoStage.apply(x, m, world, traffic, what)  # type: ignore[no-any-return]
    return two_stage_rows(x, m, world, traffic, what)


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all_rows` with a backward that sends the gradients back (and counts
    them in ``traffic`` as ``what``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int],
                traffic: Traffic | None, what: str) -> Tensor:
        ctx.send, ctx.recv, ctx.traffic, ctx.what = send, recv, traffic, what
        return all_to_all_rows(x, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.traffic is not None:
            ctx.traffic.add(ctx.what, ctx.recv, grad.shape[1:].numel() * grad.element_size())
        return all_to_all_rows(grad.contiguous(), ctx.recv, ctx.send), None, None, None, None


def all_to_all(x: Tensor, send: list[int], recv: list[int], traffic: Traffic | None = None,
               what: str = "tokens") -> Tensor:
    """The autograd-aware exchange (a plain one where no gradient is needed). ``traffic``
    counts the rows this rank sends, forward and backward."""
    if traffic is not None:
        traffic.add(what, send, x.shape[1:].numel() * x.element_size())
    if x.requires_grad:
        return AllToAll.apply(x, send, recv, traffic, what)  # type: ignore[no-any-return]
    return all_to_all_rows(x, send, recv)


def inverse_permutation(order: Tensor) -> Tensor:
    """``inv`` with ``inv[order[i]] == i``: ``x[order][inv]`` is ``x`` again."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def sum_over_ranks(t: Tensor, world: World) -> Tensor:
    """``t`` (a host tensor of figures) summed over the ranks, back on the host: NCCL only
    reduces device tensors."""
    out = t.to(comm_device(world), copy=True)
    dist.all_reduce(out)
    return out.cpu()


def all_reduce_sum_(tensors: Sequence[Tensor], group: Any = None) -> None:
    """Sum ``tensors`` over the ranks, in place, as one flat message."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def clip_global(dense: Sequence[Tensor], owned: Sequence[Tensor], world: World,
                clip: float | None) -> Tensor:
    """The global norm over dense gradients (replicated, summed over the ranks already)
    and expert gradients (each held by its owner only), and clipping by it, as one process
    does; returns the norm before clipping."""
    def squares(grads: Sequence[Tensor]) -> Tensor:
        return torch.tensor([sum(float(torch.linalg.vector_norm(g, 2)) ** 2
                                 for g in grads)], dtype=torch.float64)

    expert_sq = sum_over_ranks(squares(owned), world)
    norm = torch.sqrt(squares(dense)[0] + expert_sq[0]).float()
    if clip is not None:
        coef = clip_coef(norm, clip)
        with torch.no_grad():
            for g in [*dense, *owned]:
                g.mul_(coef.to(g.device))
    return norm
