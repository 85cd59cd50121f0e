"""Re-sharding a checkpoint to another world size, resumable from any instant.

Every expert whose owning node changes has its whole state (weights, both moments, step
count) read on its old node, sent to the new node's local rank 0 and written there, one
expert per commit; once every node has written what it received (a barrier), the old nodes
delete what they sent. The caller then takes a checkpoint of the same step in the new layout.

Interrupted at any instant (a rank killed, a node out of disk), the next resume at the new
size starts over from the same checkpoint and ends in the same state:

- A node that was in the checkpoint restores its snapshot first, which undoes whatever the
  move did to it (experts received or deleted).
- A joining node (one the checkpoint did not have) records which run it joins
  (:data:`~.records.JOIN_ENTRY`: the run's id, which is node 0's store id) and takes a
  snapshot :data:`JOIN_TAG` of itself before the first expert arrives. A later attempt that
  finds its own run's record restores that snapshot, in one commit, or, where the snapshot
  is gone (it is dropped once the node is in a checkpoint, and that checkpoint may have
  been left incomplete), deletes the expert entries. A store holding expert entries without
  this run's record is another run's, and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import tierstore

from ..presets import TrainModel
from ..train.checkpoint import RUN_ENTRY
from . import records
from .collectives import all_to_all_rows, comm_device
from .owned import state_keys
from .world import World, barrier, owner

JOIN_TAG = "dist-join"
# ``on_phase(phase, n)``: ``snapshot`` and ``manifest`` (n: the step) during a checkpoint,
# ``moved`` and ``sent`` (n: how many so far) after each expert a re-shard wrote on its new
# node or deleted on its old one. Tests kill a rank at a chosen one.
PhaseHook = Callable[[str, int], None]


def prepare_joining(store: tierstore.Store, node: int, run_id: str,
                    identity: dict[str, Any]) -> str | None:
    """Make a joining node's store ready to receive its experts (see the module docstring);
    returns why it cannot be, or ``None``."""
    mark = records.read(store, records.JOIN_ENTRY)
    ours = isinstance(mark, dict) and mark.get("run") == run_id
    if not ours:
        if store.names("layers."):
            return (f"node {node}'s store {store.path} holds expert entries of another run; a "
                    "node joining a run needs a store without any (or the one that an "
                    "interrupted re-shard of this run left)")
        store.put_many([(*records.JOIN_ENTRY, records.as_tensor({"run": run_id})),
                        (*RUN_ENTRY, records.as_tensor(identity))])
        records.node_id(store)
    tags = {s.tag for s in store.snapshots()}
    if ours and JOIN_TAG in tags:
        store.restore(JOIN_TAG)  # all that an earlier attempt received goes, in one commit
        return None
    for name, kind in store.keys("layers."):
        store.delete(name, kind)
    if JOIN_TAG in tags:
        store.drop_snapshot(JOIN_TAG)  # another run's, whose record this run replaced
    store.snapshot(JOIN_TAG)
    return None


def reshard(world: World, store: tierstore.Store, cfg: TrainModel,
            old_nodes: list[list[int]], old_size: int,
            on_phase: PhaseHook | None = None) -> int:
    """Move every expert whose owning node changed from ``old_nodes`` (world size
    ``old_size``) to this world's, one MoE layer at a time; returns how many experts this
    rank's node received. ``on_phase("moved" | "sent", count)`` follows each expert written
    here or deleted here."""
    old_node_of = {r: i for i, ranks in enumerate(old_nodes) for r in ranks}
    n = cfg.n_experts
    received = sent = 0
    for layer in cfg.moe_layers:
        moves = []
        for e in range(n):
            src = old_node_of[owner(e, n, old_size)]
            dst = world.node_of(owner(e, n, world.size))
            if src != dst:
                moves.append((e, src, dst))
        if not moves:
            continue
        leader = [ranks[0] for ranks in world.nodes]
        send, recv = [0] * world.size, [0] * world.size
        out_ids = [e for e, src, _ in moves if src == world.node and world.is_node_leader]
        in_ids = [e for e, _, dst in moves if dst == world.node and world.is_node_leader]
        for _e, src, dst in moves:
            if world.is_node_leader and src == world.node:
                send[leader[dst]] += 1
            if world.is_node_leader and dst == world.node:
                recv[leader[src]] += 1
        out_ids.sort(key=lambda e: (world.node_of(owner(e, n, world.size)), e))
        in_ids.sort(key=lambda e: (old_node_of[owner(e, n, old_size)], e))
        width = 3 * sum(a * b for a, b in cfg.expert_shapes().values())
        floats, counts = _pack_states(store, layer, out_ids, width)
        dev = comm_device(world)
        got_f = all_to_all_rows(floats.to(dev), send, recv).cpu()
        got_c = all_to_all_rows(counts.to(dev), send, recv).cpu()
        for i, e in enumerate(in_ids):
            store.put_many(_unpack_states(cfg, layer, e, got_f[i], got_c[i]))
            received += 1
            if on_phase is not None:
                on_phase("moved", received)
        barrier(world)  # every node holds what it received: the senders may let go
        for e in out_ids:
            for name, kind in state_keys(layer, e):
                store.delete(name, kind)
            sent += 1
            if on_phase is not None:
                on_phase("sent", sent)
    return received


def _pack_states(store: tierstore.Store, layer: int, ids: list[int], width: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every state of experts ``ids`` as rows of ``width`` floats (weights and moments),
    and their step counts."""
    rows, counts = [], []
    for e in ids:
        keys = state_keys(layer, e)
        got = store.get_many(keys)
        rows.append(torch.cat([got[k].reshape(-1) for k in keys[:-1]]))
        counts.append(got[keys[-1]].reshape(1))
    if not rows:
        return torch.empty((0, width)), torch.empty((0, 1), dtype=torch.int64)
    return torch.stack(rows), torch.stack(counts)


def _unpack_states(cfg: TrainModel, layer: int, e: int, floats: torch.Tensor,
                   count: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """Expert ``e``'s entries from its row of floats and its step count."""
    shapes = cfg.expert_shapes()
    keys = state_keys(layer, e)
    items = []
    offset = 0
    for name, kind in keys[:-1]:
        a, b = shapes[name.rsplit(".", 1)[1]]
        items.append((name, kind, floats[offset:offset + a * b].reshape(a, b).clone()))
        offset += a * b
    items.append((keys[-1][0], keys[-1][1], count.clone()))
    return items
