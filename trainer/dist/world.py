"""Who is where in a distributed run: ranks, nodes, expert ownership, and the process groups.

torchrun (``env://`` rendezvous) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (the node's index). Ranks are numbered node by node,
so a node's ranks are consecutive; :func:`init_world` checks that rather than trusting it,
because ownership and the per-node stores are laid out by node.

Ownership (SE-MoE): with world size W every rank owns E/W consecutive experts of every MoE
layer, rank ``r`` the experts ``[r*E/W, (r+1)*E/W)``. A node owns what its ranks own, and its
store holds exactly those experts' states. Consecutive ownership keeps "sorted by expert"
equal to "sorted by owner", which the token exchange relies on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..train.checkpoint import TrainerError


class DistributedError(TrainerError):
    """The distributed run cannot start or continue as asked (one line, no traceback)."""


class AgreedError(DistributedError):
    """A :class:`DistributedError` that every rank raises at the same point, from facts all
    of them share: no rank waits for another, so none of them is "the one that failed"."""


@dataclass
class World:
    """This process's place in the run. ``nodes[i]`` lists node ``i``'s global ranks."""

    rank: int
    size: int
    local_rank: int
    node: int
    nodes: list[list[int]]
    backend: str
    device: torch.device
    node_group: Any = field(default=None, repr=False)  # this node's ranks
    # ranks of equal local rank, one per node (the second stage of a hierarchical exchange)
    peer_group: Any = field(default=None, repr=False)
    owns_process_group: bool = False  # init_world made it, so close_world ends it

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node])

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0

    def node_of(self, rank: int) -> int:
        return self._node_of[rank]

    def __post_init__(self) -> None:
        self._node_of = {r: i for i, ranks in enumerate(self.nodes) for r in ranks}


def owner(expert: int, n_experts: int, world_size: int) -> int:
    """The rank that owns ``expert`` at world size ``world_size``."""
    return expert * world_size // n_experts


def owned(rank: int, n_experts: int, world_size: int) -> range:
    """The experts ``rank`` owns (of every MoE layer)."""
    per = n_experts // world_size
    return range(rank * per, (rank + 1) * per)


def check_divides(n_experts: int, world_size: int) -> None:
    if world_size < 1 or n_experts % world_size:
        raise AgreedError(f"{n_experts} experts per layer cannot be split evenly over "
                          f"{world_size} ranks: use a world size that divides {n_experts}")


def launched() -> bool:
    """Whether this process was started by torchrun (or with its environment)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_world(device: str = "cpu", timeout_s: float = 600.0) -> World:
    """Join the process group torchrun described (gloo on the CPU, NCCL on CUDA) and work
    out the nodes. Every rank must call it."""
    if not launched():
        raise DistributedError("--distributed runs under torchrun (it sets RANK, WORLD_SIZE, "
                               "MASTER_ADDR and MASTER_PORT): torchrun --nproc-per-node R "
                               "-m tierstore train --distributed ...")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device)
    if dev.type == "cuda":
        # Modulo the GPUs this process sees: one each where the launcher sets
        # CUDA_VISIBLE_DEVICES per rank, all of the node's otherwise.
        dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend, init_method="env://",
                                timeout=timedelta(seconds=timeout_s))
    rank, size = dist.get_rank(), dist.get_world_size()
    node_index = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    # Everyone's (node, local rank), so that nodes are known from facts, not assumed.
    places: list[Any] = [None] * size
    dist.all_gather_object(places, (node_index, local_rank))
    node_ids = sorted({n for n, _ in places})
    nodes = [[r for r in range(size) if places[r][0] == n] for n in node_ids]
    for i, ranks in enumerate(nodes):
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise DistributedError(f"node {node_ids[i]}'s ranks {ranks} are not consecutive")
        if sorted(places[r][1] for r in ranks) != list(range(len(ranks))):
            raise DistributedError(f"node {node_ids[i]}'s local ranks are not 0..{len(ranks) - 1}")
    node = node_ids.index(node_index)
    world = World(rank, size, local_rank, node, nodes, backend, dev,
                  owns_process_group=owns)
    # Every rank creates every group, in the same order (a torch.distributed rule).
    for ranks in nodes:
        group = dist.new_group(ranks)
        if rank in ranks:
            world.node_group = group
    widest = max(len(r) for r in nodes)
    for lr in range(widest):
        ranks = [n[lr] for n in nodes if lr < len(n)]
        group = dist.new_group(ranks)
        if rank in ranks:
            world.peer_group = group
    return world


def close_world(world: World) -> None:
    """End the process group :func:`init_world` made (one a caller made is the caller's):
    NCCL's communicators are released here rather than at exit, where torch warns of a
    group never destroyed and some versions hang. Every rank calls it, after a run that
    finished (after a failure the other ranks may be gone)."""
    if world.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
        world.owns_process_group = False


def barrier(world: World) -> None:
    """All ranks here; on gloo a plain barrier, on NCCL one bound to this rank's device."""
    if world.backend == "nccl":
        dist.barrier(device_ids=[world.device.index])
    else:
        dist.barrier()


def node_barrier(world: World) -> None:
    """The ranks of this node here (as :func:`barrier`, bound to the device on NCCL)."""
    if world.local_size > 1:
        if world.backend == "nccl":
            dist.barrier(group=world.node_group, device_ids=[world.device.index])
        else:
            dist.barrier(group=world.node_group)
