"""All-or-nothing distributed checkpoints, and resuming from them at any world size.

A checkpoint ``n`` (numbered in the order taken) is, on every node, a store snapshot
``dist-{n:06d}`` of the node's store, plus a manifest ``manifests/ckpt-{n:06d}.json`` in the
node's run directory (:mod:`.manifests`). The dense part (model and optimizer state, sampler
position, every rank's RNG states, configs) is written into each node's store right before
its snapshot, so the snapshot's one catalog commit holds it with the node's experts.

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
checkpoint of that number replaces it.

Resume (:func:`choose_checkpoint`) validates every manifest as a whole, checks the copies of
one checkpoint against each other and against the stores (each node's store id, and the
snapshot the manifest names), and takes the latest checkpoint whose manifest is on every
node it names: anything else is one line, on every rank, naming the manifest or node. Only
the latest checkpoint can be incomplete (checkpoint n's manifests are written after every
node wrote n-1's); falling back from it is said, and its leftover manifests are removed so
that they can never pair with a later attempt's. That checkpoint's snapshot is restored on
each of its nodes and the dense state loaded. When the world differs, the experts are
re-sharded (:mod:`.reshard`, resumable from any instant) and a checkpoint of the same step is
taken in the new layout. Nodes may be added; a preset's checkpoint whose experts live on a
node that is not in the new run cannot be resumed (that node's store is out of reach), an
imported model's can, with the departing stores named (:mod:`.hf_reshard`).
"""

from __future__ import annotations

import json
import re
import sys
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
from . import manifests, records
from .manifests import FORMAT, tag_of
from .owned import OwnedExperts
from .reshard import JOIN_TAG, PhaseHook, prepare_joining, reshard
from .world import AgreedError, World, barrier

KEEP_CHECKPOINTS = 2
_TAG = re.compile(r"^dist-(\d{6})$")


def identity(cfg: TrainModel, tc: TrainConfig, seed: int) -> dict[str, Any]:
    """What a run is, whatever its world size (the batch is the global one)."""
    return {"format": FORMAT, "model_config": cfg.to_dict(), "train_config": tc.to_dict(),
            "seed": seed}


def saved_identity(store: tierstore.Store) -> dict[str, Any] | None:
    """The identity of the run a node's store holds (:func:`identity`), or ``None``."""
    saved = records.read(store, RUN_ENTRY)
    return saved if isinstance(saved, dict) and saved.get("format") == FORMAT else None


def _gather(world: World, value: Any) -> list[Any]:
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def fail_together(world: World, error: str | None) -> None:
    """Raise on every rank if any rank found ``error`` (the first one, by rank)."""
    errors = [e for e in _gather(world, error) if e]
    if errors:
        raise AgreedError(errors[0])


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
    node_ids = _gather(world, records.node_id(store) if world.is_node_leader else None)
    barrier(world)
    if world.is_node_leader:
        manifests.write(run_dir, manifests.make(
            number, step, world.nodes, [node_ids[ranks[0]] for ranks in world.nodes],
            payload["model_config"]["n_experts"], payload["sampler"]))
        _prune(store, run_dir)
    if on_phase is not None:
        on_phase("manifest", step)
    return tag


def _prune(store: tierstore.Store, run_dir: Path) -> None:
    keep = manifests.numbers(run_dir)[-KEEP_CHECKPOINTS:]
    if not keep:
        return
    for n in manifests.numbers(run_dir):
        if n < keep[0]:
            manifests.remove(run_dir, n)
    for s in store.snapshots():
        m = _TAG.match(s.tag)
        # A joining node's snapshot of itself is not needed once it is in a checkpoint.
        if (m and int(m.group(1)) < keep[0]) or s.tag == JOIN_TAG:
            store.drop_snapshot(s.tag)


# --------------------------------------------------------------------------- starting


def choose_checkpoint(world: World, store: tierstore.Store, run_dir: Path, n_experts: int,
                      fewer_nodes: bool = False) -> dict[str, Any] | None:
    """The checkpoint to resume from (see the module docstring), the same on every rank;
    ``None`` where there is none. Raises :class:`~.world.AgreedError` on every rank for an
    invalid manifest, or one that does not fit the other nodes' or the stores.
    ``fewer_nodes``: a checkpoint of more nodes than this world's is chosen too (the caller
    reaches the departing nodes' stores, :mod:`.hf_reshard`)."""
    mine = None
    if world.is_node_leader:
        found, errors = manifests.read(run_dir, n_experts)
        mine = {"found": found, "errors": errors, "id": records.node_id(store, create=False),
                "tags": sorted(s.tag for s in store.snapshots()), "store": str(store.path),
                "run_dir": str(run_dir)}
    nodes = {world.node_of(r): got for r, got in enumerate(_gather(world, mine)) if got}
    errors = [e for i in sorted(nodes) for e in nodes[i]["errors"]]
    if errors:
        raise AgreedError(errors[0])
    _check_run_dirs(nodes)
    numbers = sorted({n for got in nodes.values() for n in got["found"]}, reverse=True)
    incomplete = None
    for number in numbers:
        copies = {i: got["found"][number] for i, got in sorted(nodes.items())
                  if number in got["found"]}
        first, m = next(iter(copies.items()))
        what = f"checkpoint {number} (step {m['step']})"
        for i, other in copies.items():
            if not manifests.same_checkpoint(m, other):
                raise AgreedError(
                    f"the manifests of checkpoint {number} differ between node {first} "
                    f"({_manifest(nodes[first], number)}) and node {i} "
                    f"({_manifest(nodes[i], number)}): one of them was edited")
        missing = [i for i in range(min(len(m["nodes"]), world.n_nodes)) if i not in copies]
        if missing and incomplete is None:
            # The run stopped while taking it: fall back to the one before, and say so.
            incomplete = (f"{what} is incomplete: node {missing[0]}'s run directory "
                          f"{nodes[missing[0]]['run_dir']} has no manifest of it (the run "
                          "stopped while taking it)")
            continue
        if missing:
            raise AgreedError(
                f"node {missing[0]}'s run directory {nodes[missing[0]]['run_dir']} has no "
                f"manifest of {what}, which node {first} has with a later one: pass that "
                "node the run's --run-dir")
        _check_stores(world, nodes, m, what, fewer_nodes)
        if incomplete is not None and world.rank == 0:
            print(f"tierstore train: {incomplete}; resuming from {what}, the one before",
                  file=sys.stderr, flush=True)
        return m
    for i, got in sorted(nodes.items()):
        held = [t for t in got["tags"] if _TAG.match(t) and int(t[5:]) > 1]
        if held and not numbers:
            raise AgreedError(f"node {i}'s store {got['store']} holds checkpoint snapshots "
                              f"(the latest {held[-1]}), but its run directory "
                              f"{got['run_dir']} has no manifest: pass the run's --run-dir")
    if incomplete is not None and world.rank == 0:
        print(f"tierstore train: {incomplete}, and there is none before it", file=sys.stderr,
              flush=True)
    return None


def _manifest(node: dict[str, Any], number: int) -> Path:
    return manifests.path_of(Path(node["run_dir"]), number)


def _check_run_dirs(nodes: dict[int, dict[str, Any]]) -> None:
    """Every manifest in node i's run directory is of a checkpoint taken with node i's store,
    in this run (node 0's store)."""
    run = nodes[0]
    for i, got in sorted(nodes.items()):
        for number, m in sorted(got["found"].items()):
            if i >= len(m["node_ids"]) or m["node_ids"][i] != got["id"]:
                raise AgreedError(f"the manifest {_manifest(got, number)} is of a checkpoint "
                                  f"not taken with node {i}'s store {got['store']}: give each "
                                  "node its own run's store and --run-dir")
            if m["node_ids"][0] != run["id"]:
                raise AgreedError(f"the manifest {_manifest(got, number)} is of another run, "
                                  f"not taken with node 0's store {run['store']}: give each "
                                  "node its own run's store and --run-dir")


def _check_stores(world: World, nodes: dict[int, dict[str, Any]], m: dict[str, Any],
                  what: str, fewer_nodes: bool = False) -> None:
    """Checkpoint ``m`` fits the stores: each of its nodes is here (or, ``fewer_nodes``,
    those of its nodes that are), with its snapshot."""
    old = len(m["nodes"])
    if old > world.n_nodes and not fewer_nodes:
        raise AgreedError(f"{what} was taken on {old} nodes and their stores hold its experts: "
                          f"resume with at least {old} nodes")
    for i in range(min(old, world.n_nodes)):
        got = nodes[i]
        if m["tag"] not in got["tags"]:
            raise AgreedError(
                f"the manifest {_manifest(got, m['number'])} of {what} names snapshot "
                f"{m['tag']}, which node {i}'s store {got['store']} does not hold: move that "
                "manifest away to resume from an earlier checkpoint")


def claim_stores(world: World, store: tierstore.Store, run_dir: Path, ident: dict[str, Any],
                 resume: bool, n_experts: int, difference: Callable[[Any], str],
                 stray: str | None = None, fewer_nodes: bool = False) -> dict[str, Any] | None:
    """Check every node's store for the run ``ident`` (one already there needs ``resume``
    and the same identity, ``difference(saved)`` saying how another differs; without a run,
    expert entries under ``stray`` or manifests mean the store is someone else's) and
    choose the checkpoint to resume from (``fewer_nodes``: see :func:`choose_checkpoint`).
    Returns its manifest; ``None`` for a new run,
    whose identity is then recorded in every node's store (before its experts are made)."""
    where = f"node {world.node}'s store {store.path}"
    error = None
    if world.is_node_leader:
        saved = records.read(store, RUN_ENTRY)
        if saved is not None and not resume:
            error = (f"{where} already holds a training run; pass --resume to continue it, "
                     "or train in new stores")
        elif saved is not None and saved != json.loads(json.dumps(ident)):
            error = f"{where} holds another run ({difference(saved)})"
        elif saved is None and (manifests.numbers(run_dir)
                                or (stray is not None and store.names(stray))):
            error = f"{where} holds expert entries or checkpoints of no run of this trainer"
    fail_together(world, error)
    manifest = (choose_checkpoint(world, store, run_dir, n_experts, fewer_nodes) if resume
                else None)
    if world.is_node_leader:  # manifests of a checkpoint newer than the one resumed
        for n in manifests.numbers(run_dir):
            if manifest is None or n > manifest["number"]:
                manifests.remove(run_dir, n)
        if manifest is None:
            store.put(RUN_ENTRY[0], records.as_tensor(ident), kind=RUN_ENTRY[1])
            records.node_id(store)
    return manifest


def start_run(world: World, store: tierstore.Store, run_dir: Path, experts: OwnedExperts,
              cfg: TrainModel, tc: TrainConfig, seed: int, resume: bool, net: MoEModel,
              opt: torch.optim.Optimizer, sampler: BatchSampler,
              on_phase: PhaseHook | None = None) -> tuple[int, int, bool]:
    """Bring every node's store and this rank's model, optimizer, sampler and RNGs to where
    training starts. Returns ``(first step, next checkpoint number, re-sharded)``; when
    re-sharded the caller takes a checkpoint before training on."""
    mine = identity(cfg, tc, seed)
    manifest = claim_stores(world, store, run_dir, mine, resume, cfg.n_experts,
                            lambda saved: _difference(saved, mine, world.size), "layers.")
    if manifest is None:
        experts.initialise(seed)
        barrier(world)
        return 0, 1, False
    return _resume(world, store, cfg, mine, manifest, net, opt, sampler, on_phase)


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


def _resume(world: World, store: tierstore.Store, cfg: TrainModel, mine: dict[str, Any],
            m: dict[str, Any], net: MoEModel, opt: torch.optim.Optimizer,
            sampler: BatchSampler, on_phase: PhaseHook | None) -> tuple[int, int, bool]:
    old_nodes: list[list[int]] = m["nodes"]
    what = f"checkpoint {m['number']} (step {m['step']})"
    error = None
    if world.is_node_leader:
        try:
            if world.node < len(old_nodes):
                store.restore(m["tag"])
            else:
                error = prepare_joining(store, world.node, m["node_ids"][0], mine)
        except tierstore.StoreError as e:
            error = (f"node {world.node}'s store {store.path} cannot be brought to {what}: "
                     f"{e}; once that is fixed, rerun with --resume")
    fail_together(world, error)
    box: list[Any] = [None]
    if world.rank == 0:
        try:
            box = [unpack(store.get(*DENSE_ENTRY))]
        except (tierstore.StoreError, ValueError, KeyError) as e:
            box = [f"node 0's snapshot {m['tag']} of {what} in {store.path} holds no usable "
                   f"dense state: {e}"]
    dist.broadcast_object_list(box, src=0)
    payload = box[0]
    if isinstance(payload, str):
        raise AgreedError(payload)
    if payload.get("step") != m["step"] or payload.get("sampler") != m["sampler"]:
        raise AgreedError(f"the manifests of {what} do not fit its snapshot {m['tag']} in node "
                          f"0's store {store.path} (which holds step {payload.get('step')}): "
                          "one of them was edited or replaced")
    net.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    sampler.load_state_dict(payload["sampler"])
    same = m["world_size"] == world.size and old_nodes == world.nodes
    set_rng_state(rank_rng(payload["rng"], world.rank))
    if not same:
        reshard(world, store, cfg, old_nodes, m["world_size"], on_phase)
    barrier(world)
    return int(m["step"]), int(m["number"]) + 1, not same


def rank_rng(saved: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """The RNG states (torch's CPU and CUDA generators, Python's, NumPy's) that ``rank``
    resumes with, from a checkpoint's per-rank ``saved``: old rank ``rank mod W_old``'s. At
    the checkpoint's world size that is the rank's own, so the streams go on exactly; on
    another world each new rank continues the stream of an old one, the same whenever the
    checkpoint is resumed on that world. The data order needs none of them: the sampler
    draws batch ``n`` of the global batch from ``(seed, n)`` (:mod:`..train.data`)."""
    return saved[rank % len(saved)]


def dense_payload(cfg: TrainModel, tc: TrainConfig, seed: int, net: MoEModel,
                  opt: torch.optim.Optimizer, sampler: BatchSampler,
                  metrics: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "seed": seed, "model_config": cfg.to_dict(),
            "train_config": asdict(tc), "identity": identity(cfg, tc, seed),
            "model": net.state_dict(), "optimizer": opt.state_dict(),
            "sampler": sampler.state_dict(), "metrics": dict(metrics)}
