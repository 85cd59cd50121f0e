"""Resuming an imported model's fine-tune on fewer ranks or fewer nodes (scale-in).

A checkpoint records the world it was taken on (its manifest: world size, each node's ranks,
each node store's id; ownership is consecutive). Resumed on another world, every expert
whose owning node changes has its whole training state (fp32 master and both AdamW moments
of every part, and its step count) moved to its new owner's node store before training goes
on; an expert that stays on its node keeps its entries, and only its step count moves to its
new owner's count entry (``{module}.owned{lo}-{hi}``, one per rank).

Under the dense update rule each rank also keeps its history of the steps' hyperparameters
(``trainer.dense_rule.owned{lo}-{hi}``, :mod:`..train.dense_rule`); per expert the rule keeps
nothing beyond the lazy rule's states and the step count, which move as above. A checkpoint
catches every expert up and cuts every history to the same global step, so the old ranks'
histories are equal: that is checked (a mismatch is one line: the stores are not one
checkpoint's), every new rank gets that history under its own range's name, and the
histories of ranks that no longer exist are deleted with their count entries.

The stores of nodes that leave the run are reached where the user says they are
(``--node-store PATH`` on any remaining node: the departed node's store directory on a
shared path, or a copy of it; a store a left-over daemon still serves is read through that
daemon). Each named store must be the store the checkpoint names for a departing node (its
``trainer.node`` id); it is brought to the checkpoint's snapshot (a restore: one commit,
undoing anything after the checkpoint) and then only read. A departing node's experts are
read by the first remaining node that reached its store and sent to their new owners' nodes
(:func:`~.collectives.all_to_all_rows`); remaining nodes send their own the same way. Every
read goes through the store API, which checks each entry's checksum, so a damaged state stops
the move with the store's one-line error instead of landing.

Crash safety: nothing here writes a departing store but its restore to the checkpoint, and a
remaining store is restored to the checkpoint's snapshot before the move writes anything.
The caller takes a checkpoint in the new layout right after the move; that snapshot's commit
(and the manifests) is the commit point. A move interrupted anywhere (SIGKILL included)
leaves the old checkpoint the latest, and the next ``--resume`` with the same stores named
starts it over from that checkpoint and ends in the same state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import tierstore

from ..train.checkpoint import HISTORY, MOMENTS, STEP_KIND
from ..train.layout import ExpertLayout, LayerEntries, owned_suffix
from . import records
from .collectives import all_to_all_rows, comm_device
from .reshard import PhaseHook
from .sidecar import default_run_dir
from .world import AgreedError, World, owned, owner

PathLike = str | os.PathLike[str]
# What either update rule keeps per part of an expert (the dense rule adds only its
# per-rank history, moved by _agreed_history, and the step count, moved with these).
KINDS = ("param", *MOMENTS)
ROUND_BYTES = 256 << 20  # expert states in flight per round of the move, over all ranks


def open_node_store(path: PathLike) -> tierstore.Store:
    """Another node's store: opened directly, or through the daemon a run left serving it
    (at ``PATH.run/daemon.sock``, checked to serve that store)."""
    try:
        return tierstore.open(path, host_cache=0)
    except tierstore.StoreLockedError:
        sock = default_run_dir(path) / "daemon.sock"
        if tierstore.probe_daemon(sock, store=path) is None:
            raise
        return tierstore.connect(sock)


def departed_stores(world: World, m: dict[str, Any], paths: Sequence[PathLike]
                    ) -> dict[int, tierstore.Store]:
    """The departing nodes' stores this node's leader reaches among ``paths``, by their
    node index in checkpoint ``m``, each restored to the checkpoint's snapshot. The nodes
    try in turn, each only while a departing store is still unreached, so that a shared path
    that every node names is opened by one of them. Raises on every rank where a path is not
    such a store, or a departing node is reached by none."""
    what = f"checkpoint {m['number']} (step {m['step']})"
    n_old = len(m["nodes"])
    found: dict[int, tierstore.Store] = {}
    have: set[int] = set()
    busy = ""  # why a named store could not be opened here (another node holds it, say)
    for turn in range(world.n_nodes):
        error = None
        wanted = set(range(world.n_nodes, n_old)) - have
        if turn == world.node and world.is_node_leader and wanted:
            try:
                for path in paths:
                    try:
                        st = open_node_store(path)
                    except tierstore.StoreLockedError as e:
                        busy = busy or f" ({e})"
                        continue
                    i = _departing_index(st, m, world, what)
                    if i in found or i in have:
                        st.close()
                        continue
                    found[i] = st
                    if m["tag"] not in {s.tag for s in st.snapshots()}:
                        raise AgreedError(f"--node-store {os.fspath(path)} is node {i}'s store "
                                          f"of {what} but holds no snapshot {m['tag']}: name "
                                          "the store as that checkpoint left it, or a copy")
                    st.restore(m["tag"])
            except (tierstore.StoreError, AgreedError, OSError) as e:
                error = f"--node-store: {e}"
        reached: list[Any] = [None] * world.size
        dist.all_gather_object(reached, [error, sorted(found), busy])
        errors = [r[0] for r in reached if r[0]]
        if errors:
            close_all(found)
            raise AgreedError(errors[0])
        have |= {i for r in reached for i in r[1]}
        busy = next((r[2] for r in reached if r[2]), "")
    for i in range(world.n_nodes, n_old):
        if i not in have:
            close_all(found)
            ids = owned(m["nodes"][i][0], m["n_experts"], m["world_size"])
            last = owned(m["nodes"][i][-1], m["n_experts"], m["world_size"])
            raise AgreedError(
                f"{what} was taken on {n_old} nodes and node {i}'s store (id "
                f"{m['node_ids'][i]}) holds experts {ids.start}-{last.stop - 1} of every MoE "
                f"layer; resuming on {world.n_nodes} node(s) moves them: name where that store "
                "is reachable with --node-store PATH (a shared path, or a copy of its "
                f"directory){busy}")
    return found


def close_all(stores: dict[int, tierstore.Store]) -> None:
    """Let go of the departing stores (:func:`departed_stores`)."""
    for st in stores.values():
        st.close()


def _departing_index(st: tierstore.Store, m: dict[str, Any], world: World, what: str) -> int:
    ident = records.node_id(st, create=False)
    if ident not in m["node_ids"]:
        raise AgreedError(f"{st.path} is not a node store of {what}, which this run resumes")
    i = m["node_ids"].index(ident)
    if i < world.n_nodes:
        raise AgreedError(f"{st.path} is node {i}'s store, which stays in the run: name only "
                          "the stores of the nodes that leave")
    return i


def move_states(world: World, store: tierstore.Store, layout: ExpertLayout,
                m: dict[str, Any], departed: dict[int, tierstore.Store],
                on_phase: PhaseHook | None = None) -> int:
    """Re-shard checkpoint ``m``'s experts (its snapshot restored on this node) to this
    world (see the module docstring); returns how many experts this node received.
    ``on_phase("moved", count)`` follows each expert written here."""
    n, old_size = layout.n_experts, m["world_size"]
    old_node_of = {r: i for i, ranks in enumerate(m["nodes"]) for r in ranks}
    reached: list[Any] = [None] * world.size
    dist.all_gather_object(reached, sorted(departed) if world.is_node_leader else None)
    reader = {i: i for i in range(min(world.n_nodes, len(m["nodes"])))}
    for r, got in enumerate(reached):
        for i in got or ():
            reader.setdefault(i, world.node_of(r))  # the first node to reach it reads it
    # Checked before anything is written here (a mismatch leaves the stores as restored).
    history = _agreed_history(world, store, departed, reader, m)
    leader = [ranks[0] for ranks in world.nodes]
    mine = list(world.nodes[world.node])
    counts = {r: {lay.key: torch.zeros(n, dtype=torch.int64) for lay in layout.layers}
              for r in mine}
    old_counts: dict[tuple[int, int, int], torch.Tensor] = {}

    def count(src: tierstore.Store, i: int, lay: LayerEntries, e: int) -> torch.Tensor:
        o = owner(e, n, old_size)
        if (i, lay.key, o) not in old_counts:
            name = lay.prefix + owned_suffix(owned(o, n, old_size))
            old_counts[(i, lay.key, o)] = src.get(name, STEP_KIND)
        return old_counts[(i, lay.key, o)][e].reshape(1)

    received = 0
    width = 3 * lay_numel(layout)
    per_round = max(1, ROUND_BYTES // (4 * max(width, 1)))
    dev = comm_device(world)
    for lay in layout.layers:
        moving = []
        for e in range(n):
            src, dst = old_node_of[owner(e, n, old_size)], world.node_of(owner(e, n, world.size))
            if src != dst:
                moving.append((e, src, dst))
            elif dst == world.node and world.is_node_leader:  # stays: only its count moves
                counts[owner(e, n, world.size)][lay.key][e] = count(store, src, lay, e)[0]
        # In rounds of a bounded number of experts, so that no rank holds a layer's worth.
        for first in range(0, len(moving), per_round):
            send, recv = [0] * world.size, [0] * world.size
            out_ids: list[tuple[int, int]] = []  # (destination node, expert)
            in_ids: list[tuple[int, int]] = []  # (reading node, expert)
            for e, src, dst in moving[first:first + per_round]:
                if reader[src] == world.node and world.is_node_leader:
                    send[leader[dst]] += 1
                    out_ids.append((dst, e))
                if dst == world.node and world.is_node_leader:
                    recv[leader[reader[src]]] += 1
                    in_ids.append((reader[src], e))
            out_ids.sort()
            in_ids.sort()
            rows, cnts = [], []
            for _, e in out_ids:
                i = old_node_of[owner(e, n, old_size)]
                src_store = store if i == world.node else departed[i]
                keys = [(name, k) for name in lay.names(e) for k in KINDS]
                got = src_store.get_many(keys)  # checksums verified as read
                row = torch.cat([got[k].reshape(-1).to(torch.float32) for k in keys])
                rows.append(torch.nn.functional.pad(row, (0, width - row.numel())))
                cnts.append(count(src_store, i, lay, e))
            floats = torch.stack(rows) if rows else torch.empty((0, width))
            steps = torch.stack(cnts) if cnts else torch.empty((0, 1), dtype=torch.int64)
            got_f = all_to_all_rows(floats.to(dev), send, recv).cpu()
            got_c = all_to_all_rows(steps.to(dev), send, recv).cpu()
            for j, (_, e) in enumerate(in_ids):
                store.put_many(_unpack(lay, e, got_f[j]))
                counts[owner(e, n, world.size)][lay.key][e] = got_c[j][0]
                received += 1
                if on_phase is not None:
                    on_phase("moved", received)
    if world.is_node_leader:
        new_suffixes = {owned_suffix(owned(r, n, world.size)) for r in mine}
        items = [(lay.prefix + suffix, STEP_KIND, counts[r][lay.key])
                 for r in mine for lay in layout.layers
                 for suffix in [owned_suffix(owned(r, n, world.size))]]
        if history is not None:
            items += [(HISTORY[0] + suffix, HISTORY[1], torch.tensor(history, dtype=torch.float64))
                      for suffix in sorted(new_suffixes)]
        store.put_many(items)
        for o, i in old_node_of.items():
            suffix = owned_suffix(owned(o, n, old_size))
            if i != world.node or suffix in new_suffixes:
                continue
            for lay in layout.layers:
                store.delete(lay.prefix + suffix, STEP_KIND, missing_ok=True)
            store.delete(HISTORY[0] + suffix, HISTORY[1], missing_ok=True)
    return received


def _agreed_history(world: World, store: tierstore.Store, departed: dict[int, tierstore.Store],
                    reader: dict[int, int], m: dict[str, Any]) -> list[list[float]] | None:
    """The dense rule's history every old rank of checkpoint ``m`` keeps (None: a lazy
    run, which keeps none), each read by the node that reads that rank's store."""
    n, old_size = m["n_experts"], m["world_size"]
    mine: dict[int, list[list[float]] | None] = {}
    if world.is_node_leader:
        for i, ranks in enumerate(m["nodes"]):
            if reader.get(i) != world.node:
                continue
            src = store if i == world.node else departed[i]
            for o in ranks:
                key = (HISTORY[0] + owned_suffix(owned(o, n, old_size)), HISTORY[1])
                mine[o] = src.get(*key).tolist() if key in src else None
    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, mine)
    return agreed_history({o: h for got in gathered for o, h in got.items()},
                          f"checkpoint {m['number']} (step {m['step']})")


def agreed_history(by_rank: dict[int, list[list[float]] | None], what: str
                   ) -> list[list[float]] | None:
    """The one history the old ranks ``by_rank`` keep; raises where two differ (a checkpoint
    holds every rank's cut to the same step, so the stores are not one checkpoint's)."""
    def say(h: list[list[float]] | None) -> str:
        return "none" if h is None else f"at global step {int(h[0][0]) + len(h) - 1}"

    ranks = sorted(by_rank)
    first = by_rank[ranks[0]]
    for r in ranks[1:]:
        if by_rank[r] != first:
            raise AgreedError(f"{what}: the dense rule's history of rank {ranks[0]} "
                              f"({say(first)}) and of rank {r} ({say(by_rank[r])}) differ, so "
                              "the node stores are not that checkpoint's: name each departing "
                              "node's store as the checkpoint left it")
    return first


def lay_numel(layout: ExpertLayout) -> int:
    """Elements of the widest layer's expert (every part)."""
    return max((lay.numel for lay in layout.layers), default=0)


def _unpack(lay: LayerEntries, e: int, row: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    items = []
    offset = 0
    for name, shape in zip(lay.names(e), lay.shapes):
        size = int(torch.Size(shape).numel())
        for k in KINDS:
            items.append((name, k, row[offset:offset + size].reshape(shape).clone()))
            offset += size
    return items
