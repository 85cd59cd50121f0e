"""All-or-nothing distributed checkpoints, resume, and re-sharding to another world size.

A checkpoint ``n`` (numbered in the order taken) is, on every node, a store snapshot
``dist-{n:06d}`` of the node's store, plus a manifest ``manifests/ckpt-{n:06d}.json`` in the
node's run directory. The dense part (model and optimizer state, sampler position, every
rank's RNG states, configs) is written into each node's store right before its snapshot, so
the snapshot's one catalog commit holds it with the node's experts.

Protocol (:func:`write_checkpoint`)
1. A barrier: every rank's expert updates have been acknowledged by its node's daemon, and
   an acknowledged write is durable.
2. Each node's local rank 0 writes the dense entry and takes the snapshot.
3. A barrier: every node's snapshot has committed.
4. Each node's local rank 0 writes the manifest (temporary file, fsync, rename, fsync of the
   directory), then drops the snapshots and manifests older than the latest
   :data:`KEEP_CHECKPOINTS`.

The checkpoint exists only where its manifest is on every node it was taken on. A rank
killed before step 3 completes leaves no manifest anywhere, so the previous checkpoint is
the latest everywhere; a node with a snapshot but no manifest keeps it until the next
checkpoint of that number replaces it. Resume (:func:`resume_run`) takes the latest
manifest found on every node it names, restores that snapshot on each of those nodes and
loads the dense state.

Re-sharding: when the manifest's world differs from this one, every expert whose owner now
lives on another node has its whole state (weights, moments, step count) read on the old
node, sent to the new node's local rank 0 and written there; once every node has written
what it received, the old nodes delete what they sent. A new checkpoint of the same step
is then taken, in the new layout. Nodes may be added; a checkpoint whose experts live on a
node that is not in the new run cannot be resumed (that node's store is out of reach).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tierstore

from ..model import MoEModel
from ..presets import TrainModel, config_from_dict
from ..train.checkpoint import DENSE_ENTRY, RUN_ENTRY, pack, unpack
from ..train.data import BatchSampler
from ..train.resident import TrainConfig, rng_state, set_rng_state
from .collectives import all_to_all_rows, comm_device
from .owned import OwnedExperts, state_keys
from .world import DistributedError, World, barrier, owner

KEEP_CHECKPOINTS = 2
NODE_ENTRY = ("trainer.node", "meta")
FORMAT = 1
_MANIFEST = re.compile(r"^ckpt-(\d{6})\.json$")
_TAG = re.compile(r"^dist-(\d{6})$")
PhaseHook = Callable[[str, int], None]


def tag_of(n: int) -> str:
    return f"dist-{n:06d}"


def _json(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()),
                            dtype=torch.uint8)


def _read_json(store: tierstore.Store, key: tuple[str, str]) -> Any:
    if key not in store:
        return None
    return json.loads(store.get(*key).numpy().tobytes())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifests(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The manifests in a node's run directory, by checkpoint number."""
    found: dict[int, dict[str, Any]] = {}
    folder = run_dir / "manifests"
    if not folder.is_dir():
        return found
    for p in folder.iterdir():
        m = _MANIFEST.match(p.name)
        if m:
            with contextlib.suppress(OSError, ValueError):
                found[int(m.group(1))] = json.loads(p.read_text())
    return found


def identity(cfg: TrainModel, tc: TrainConfig, seed: int) -> dict[str, Any]:
    """What a run is, whatever its world size (the batch is the global one)."""
    return {"format": FORMAT, "model_config": cfg.to_dict(), "train_config": tc.to_dict(),
            "seed": seed}


def saved_identity(store: tierstore.Store) -> dict[str, Any] | None:
    """The identity of the run a node's store holds (:func:`identity`), or ``None``."""
    saved = _read_json(store, RUN_ENTRY)
    return saved if saved is not None and saved.get("format") == FORMAT else None


def _node_id(store: tierstore.Store) -> str:
    saved = _read_json(store, NODE_ENTRY)
    if saved is None:
        saved = {"id": uuid.uuid4().hex}
        store.put(NODE_ENTRY[0], _json(saved), kind=NODE_ENTRY[1])
    return str(saved["id"])


def _gather(world: World, value: Any) -> list[Any]:
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def _fail_together(world: World, error: str | None) -> None:
    """Raise on every rank if any rank found ``error`` (the first one, by rank)."""
    errors = [e for e in _gather(world, error) if e]
    if errors:
        raise DistributedError(errors[0])


# --------------------------------------------------------------------------- writing


def write_checkpoint(world: World, store: tierstore.Store, run_dir: Path, number: int,
                     step: int, payload: dict[str, Any],
                     on_phase: PhaseHook | None = None) -> str:
    """Take checkpoint ``number`` after ``step`` steps (the protocol in the module
    docstring). ``payload`` is the dense state; every rank's RNG states are added."""
    tag = tag_of(number)
    barrier(world)
    rngs = _gather(world, rng_state())
    if world.is_node_leader:
        store.put(DENSE_ENTRY[0], pack({**payload, "rng": rngs, "step": step}),
                  kind=DENSE_ENTRY[1])
        if tag in {s.tag for s in store.snapshots()}:
            store.drop_snapshot(tag)  # a checkpoint of this number that never completed
        store.snapshot(tag)
    if on_phase is not None:
        on_phase("snapshot", step)
    node_ids = _gather(world, _node_id(store) if world.is_node_leader else None)
    barrier(world)
    if world.is_node_leader:
        manifest = {
            "format": FORMAT, "number": number, "step": step, "tag": tag,
            "world_size": world.size, "nodes": world.nodes,
            "node_ids": [node_ids[ranks[0]] for ranks in world.nodes],
            "ownership": "consecutive", "n_experts": payload["model_config"]["n_experts"],
            "sampler": payload["sampler"], "time": time.time(),
        }
        folder = run_dir / "manifests"
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / f"ckpt-{number:06d}.json", json.dumps(manifest, indent=1))
        _prune(store, run_dir)
    if on_phase is not None:
        on_phase("manifest", step)
    return tag


def _prune(store: tierstore.Store, run_dir: Path) -> None:
    keep = sorted(manifests(run_dir))[-KEEP_CHECKPOINTS:]
    if not keep:
        return
    for n in sorted(manifests(run_dir)):
        if n < keep[0]:
            (run_dir / "manifests" / f"ckpt-{n:06d}.json").unlink(missing_ok=True)
    for s in store.snapshots():
        m = _TAG.match(s.tag)
        if m and int(m.group(1)) < keep[0]:
            store.drop_snapshot(s.tag)


# --------------------------------------------------------------------------- starting


def latest_manifest(world: World, run_dir: Path) -> dict[str, Any] | None:
    """The latest checkpoint whose manifest is on every node it was taken on; the same on
    every rank."""
    mine = manifests(run_dir) if world.is_node_leader else None
    by_node = {world.node_of(r): found for r, found in enumerate(_gather(world, mine))
               if found is not None}
    candidates: dict[int, dict[str, Any]] = {}
    for found in by_node.values():
        candidates.update(found)
    for number in sorted(candidates, reverse=True):
        m = candidates[number]
        n_old = len(m["nodes"])
        if all(number in by_node.get(i, {}) for i in range(min(n_old, world.n_nodes))):
            if n_old > world.n_nodes:
                raise DistributedError(
                    f"checkpoint {number} (step {m['step']}) was taken on {n_old} nodes and "
                    f"their stores hold its experts: resume with at least {n_old} nodes")
            return m
    return None


def start_run(world: World, store: tierstore.Store, run_dir: Path, experts: OwnedExperts,
              cfg: TrainModel, tc: TrainConfig, seed: int, resume: bool, net: MoEModel,
              opt: torch.optim.Optimizer, sampler: BatchSampler
              ) -> tuple[int, int, bool]:
    """Bring every node's store and this rank's model, optimizer, sampler and RNGs to where
    training starts. Returns ``(first step, next checkpoint number, re-sharded)``; when
    re-sharded the caller takes a checkpoint before training on."""
    where = f"node {world.node}'s store {store.path}"
    mine = identity(cfg, tc, seed)
    error = None
    if world.is_node_leader:
        saved = _read_json(store, RUN_ENTRY)
        has_manifests = bool(manifests(run_dir))
        if saved is not None and not resume:
            error = (f"{where} already holds a training run; pass --resume to continue it, "
                     "or train in new stores")
        elif saved is not None and saved != json.loads(json.dumps(mine)):
            error = f"{where} holds another run ({_difference(saved, mine, world.size)})"
        elif saved is None and (has_manifests or store.names("layers.")):
            error = f"{where} holds expert entries or checkpoints of no run of this trainer"
    _fail_together(world, error)
    manifest = latest_manifest(world, run_dir) if resume else None
    if manifest is None:
        if world.is_node_leader:
            store.put(RUN_ENTRY[0], _json(mine), kind=RUN_ENTRY[1])
            _node_id(store)
        experts.initialise(seed)
        barrier(world)
        return 0, 1, False
    return _resume(world, store, run_dir, experts, cfg, manifest, net, opt, sampler)


def _difference(saved: dict[str, Any], mine: dict[str, Any], world_size: int) -> str:
    mine = json.loads(json.dumps(mine))
    keys = [k for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]
    if keys == ["model_config"]:
        return f"a different model: {config_from_dict(saved['model_config'])}"
    if keys == ["train_config"]:
        a, b = saved["train_config"], mine["train_config"]
        fields = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if fields == ["batch_size"]:
            g = a["batch_size"]
            per = f"--batch-size {g // world_size}" if g % world_size == 0 else (
                f"a world size that divides {g}")
            return (f"its global batch is {g} rows, this run's {b['batch_size']}: at "
                    f"{world_size} ranks pass {per}")
        return "different " + ", ".join(f"{k} ({a.get(k)!r}, now {b.get(k)!r})" for k in fields)
    return "different " + ", ".join(keys)


def _resume(world: World, store: tierstore.Store, run_dir: Path, experts: OwnedExperts,
            cfg: TrainModel, m: dict[str, Any], net: MoEModel, opt: torch.optim.Optimizer,
            sampler: BatchSampler) -> tuple[int, int, bool]:
    old_nodes: list[list[int]] = m["nodes"]
    error = None
    if world.is_node_leader and world.node < len(old_nodes):
        if _node_id(store) != m["node_ids"][world.node]:
            error = (f"node {world.node}'s store {store.path} is not the store checkpoint "
                     f"{m['number']} was taken with on node {world.node}")
        else:
            store.restore(m["tag"])
    elif world.is_node_leader and store.names("layers."):
        error = (f"node {world.node}'s store {store.path} already holds expert entries; a "
                 "node joining a run needs an empty store")
    _fail_together(world, error)
    box: list[Any] = [unpack(store.get(*DENSE_ENTRY)) if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    payload = box[0]
    net.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    sampler.load_state_dict(payload["sampler"])
    same = m["world_size"] == world.size and old_nodes == world.nodes
    if m["world_size"] == world.size:
        set_rng_state(payload["rng"][world.rank])
    if world.is_node_leader and world.node >= len(old_nodes):
        store.put(RUN_ENTRY[0], _json(payload["identity"]), kind=RUN_ENTRY[1])
    if not same:
        reshard(world, store, cfg, old_nodes, m["world_size"])
    barrier(world)
    return int(m["step"]), int(m["number"]) + 1, not same


def reshard(world: World, store: tierstore.Store, cfg: TrainModel,
            old_nodes: list[list[int]], old_size: int) -> int:
    """Move every expert whose owning node changed from ``old_nodes`` (world size
    ``old_size``) to this world's, one MoE layer at a time; returns how many experts this
    rank's node received."""
    old_node_of = {r: i for i, ranks in enumerate(old_nodes) for r in ranks}
    n = cfg.n_experts
    received = 0
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
        if in_ids:
            store.put_many(_unpack_states(cfg, layer, in_ids, got_f, got_c))
            received += len(in_ids)
        barrier(world)  # every node holds what it received: the senders may let go
        for e in out_ids:
            for name, kind in state_keys(layer, e):
                store.delete(name, kind)
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


def _unpack_states(cfg: TrainModel, layer: int, ids: list[int], floats: torch.Tensor,
                   counts: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    shapes = cfg.expert_shapes()
    items = []
    for i, e in enumerate(ids):
        keys = state_keys(layer, e)
        offset = 0
        for name, kind in keys[:-1]:
            a, b = shapes[name.rsplit(".", 1)[1]]
            items.append((name, kind, floats[i, offset:offset + a * b].reshape(a, b).clone()))
            offset += a * b
        items.append((keys[-1][0], keys[-1][1], counts[i].clone()))
    return items


def dense_payload(cfg: TrainModel, tc: TrainConfig, seed: int, net: MoEModel,
                  opt: torch.optim.Optimizer, sampler: BatchSampler,
                  metrics: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "seed": seed, "model_config": cfg.to_dict(),
            "train_config": asdict(tc), "identity": identity(cfg, tc, seed),
            "model": net.state_dict(), "optimizer": opt.state_dict(),
            "sampler": sampler.state_dict(), "metrics": dict(metrics)}
