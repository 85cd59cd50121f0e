"""Distributed training under torchrun with gloo on this machine: world size 2 (one node of
two ranks, or two nodes of one) and 4 (two "nodes" of two ranks, each node its own daemon
and store directory, launched as two torchrun agents with a static rendezvous).

- Both paradigms, at W = 2 and 4, equal the single-process store trainer on the same
  global batch: per-step losses and final expert weights within 1e-5 relative.
- Data-centric counters: each remote expert crosses to a node at most once per step, and
  exactly one pre-reduced gradient per (expert, remote node) comes back to its owner.
- After a run each node's store holds exactly the experts its ranks own.
- Checkpoint, resume at W = 4 from W = 2 and back: every expert state lands at its new owner
  unchanged, and the resumed run equals the uninterrupted one.
- SIGKILL of a rank during a checkpoint: the previous checkpoint is the latest on every
  node, every store is fsck-clean, and resuming from it gives the uninterrupted run.
- A re-shard (W = 1 -> 2) killed at several points of the move resumes, and equals the
  uninterrupted run; a store holding another run's experts is refused as a joining node.
- The hierarchical (two-stage) all-to-all equals the flat one bit for bit.
- `torchrun -m tierstore train --distributed`, credits, one-line refusals.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.trainer.dist import stop_daemon_at
from tierstore.trainer.dist.reshard import JOIN_TAG, prepare_joining
from tierstore.trainer.presets import PRESETS
from tierstore.trainer.train.data import load_corpus
from tierstore.trainer.train.resident import TrainConfig
from tierstore.trainer.train.store_trainer import train_store

import tierstore

CHILD = Path(__file__).with_name("dist_child.py")
CFG = PRESETS["tiny"]  # 2 MoE layers x 8 experts
GLOBAL_BATCH, SEQ, ACCUM, SEED = 4, 32, 2, 3
CORPUS_BYTES = 256 * 1024
TRAIN = {"seq_len": SEQ, "grad_accum": ACCUM, "eval_every": 0, "lr": 3e-3}
pytestmark = pytest.mark.timeout(600)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(tmp: Path, name: str, nodes: int, per_node: int, *, steps: int,
           paradigm: str = "token", resume: bool = False, checkpoint_every: int = 0,
           kill: list[Any] | None = None, device: str = "cpu",
           hierarchical: bool = False, spec: dict[str, Any] | None = None,
           child: Path = CHILD) -> list[int]:
    """Run one distributed training: ``nodes`` torchrun agents of ``per_node`` ranks on this
    machine, node ``i``'s store ``tmp/node{i}``; returns the agents' exit codes."""
    agents = start(tmp, name, nodes, per_node, steps=steps, paradigm=paradigm, resume=resume,
                   checkpoint_every=checkpoint_every, kill=kill, device=device,
                   hierarchical=hierarchical, spec=spec, child=child)
    return [p.wait(timeout=500) for p in agents]


def start(tmp: Path, name: str, nodes: int, per_node: int, *, steps: int,
          paradigm: str = "token", resume: bool = False, checkpoint_every: int = 0,
          kill: list[Any] | None = None, device: str = "cpu",
          hierarchical: bool = False, spec: dict[str, Any] | None = None,
          child: Path = CHILD) -> list[subprocess.Popen[bytes]]:
    """:func:`launch`, returning the running agents. ``spec``: fields of the ranks' spec
    (tests/dist_child.py) set over this module's; ``child``: the script each rank runs."""
    spec = {"model": "tiny", "steps": steps, "seed": SEED, "corpus_bytes": CORPUS_BYTES,
            "train": {**TRAIN, "batch_size": GLOBAL_BATCH // (nodes * per_node)},
            "store": str(tmp / "node{node}"), "paradigm": paradigm, "resume": resume,
            "checkpoint_every": checkpoint_every, "metrics": str(tmp / f"{name}.jsonl"),
            "kill": kill, "device": device, "hierarchical": hierarchical, **(spec or {})}
    spec_path = tmp / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for i in range(nodes):
        with open(tmp / f"{name}.node{i}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                 "--node-rank", str(i), "--nproc-per-node", str(per_node), "--master-addr",
                 "127.0.0.1", "--master-port", str(port), "--log-dir",
                 str(tmp / f"{name}.logs" / f"node{i}"), "--tee", "3", str(child),
                 str(spec_path)],
                env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def rank_stderr(tmp: Path, name: str, rank: int, per_node: int) -> list[str]:
    """The non-empty lines that rank ``rank`` of run ``name`` wrote to its stderr (torchrun
    keeps them in a file of their own under ``--log-dir``)."""
    node, local = divmod(rank, per_node)
    files = list((tmp / f"{name}.logs" / f"node{node}").glob(f"*/attempt_0/{local}/stderr.log"))
    assert len(files) == 1, files
    return [ln for ln in files[0].read_text(errors="replace").splitlines() if ln.strip()]


def metrics(tmp: Path, name: str, rank: int) -> list[dict[str, Any]]:
    lines = (tmp / f"{name}.jsonl.rank{rank}").read_text().splitlines()
    return [json.loads(line) for line in lines]


def stop_daemons(tmp: Path) -> None:
    """Stop the node daemons a run left (a killed run leaves them up, as designed)."""
    for sock in tmp.glob("node*.run/daemon.sock"):
        stop_daemon_at(sock)


def expert_weights(store: Path) -> dict[str, torch.Tensor]:
    with tierstore.open(store, host_cache=0) as st:
        names = [n for n in st.names("layers.", kind="param")]
        return dict(st.get_many(names))


def node_experts(store: Path) -> set[tuple[int, int]]:
    """The (layer, expert) pairs whose states a store holds."""
    with tierstore.open(store, host_cache=0) as st:
        keys = st.keys("layers.")
    found = set()
    for name, _ in keys:
        parts = name.split(".")
        found.add((int(parts[1]), int(parts[3])))
    return found


def owned_by_node(nodes: int, per_node: int, node: int) -> set[tuple[int, int]]:
    w = nodes * per_node
    per = CFG.n_experts // w
    ranks = range(node * per_node, (node + 1) * per_node)
    return {(layer, e) for layer in CFG.moe_layers for r in ranks
            for e in range(r * per, (r + 1) * per)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _no_daemon_left(tmp_path: Path) -> Any:
    """Whatever a test leaves running (a failed run keeps its daemons up) is stopped."""
    yield
    stop_daemons(tmp_path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The single-process store trainer on the global batch, 6 steps; its weights after 4
    and 6 steps."""
    d = tmp_path_factory.mktemp("reference")
    tc = TrainConfig(batch_size=GLOBAL_BATCH, **TRAIN)
    corpus = load_corpus(max_bytes=CORPUS_BYTES)
    kw = {"seed": SEED, "train": tc, "corpus": corpus, "host_cache": "64MiB"}
    at4 = train_store("tiny", 4, store_path=d / "four", **kw)
    at6 = train_store("tiny", 6, store_path=d / "six", **kw)
    assert [m["loss"] for m in at4] == [m["loss"] for m in at6[:4]]
    return {"losses": [m["loss"] for m in at6], "at4": expert_weights(d / "four"),
            "at6": expert_weights(d / "six")}


def check_weights(tmp: Path, nodes: int, want: dict[str, torch.Tensor]) -> None:
    got: dict[str, torch.Tensor] = {}
    for i in range(nodes):
        got.update(expert_weights(tmp / f"node{i}"))
    assert set(got) == set(want)
    worst = max(rel(got[n], want[n]) for n in want)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("paradigm", ["token", "data"])
@pytest.mark.parametrize("nodes,per_node", [(1, 2), (2, 2)])
def test_matches_the_single_process_trainer(tmp_path: Path, reference: dict[str, Any],
                                            paradigm: str, nodes: int, per_node: int) -> None:
    codes = launch(tmp_path, "run", nodes, per_node, steps=4, paradigm=paradigm)
    assert codes == [0] * nodes, (tmp_path / "run.node0.log").read_text()[-3000:]
    world = nodes * per_node
    runs = [metrics(tmp_path, "run", r) for r in range(world)]
    for history in runs:
        assert [m["paradigm"] for m in history] == [{"0": paradigm, "1": paradigm}] * 4
        for m, want in zip(history, reference["losses"][:4]):
            assert abs(m["loss"] - want) <= 1e-5 * abs(want)
    check_weights(tmp_path, nodes, reference["at4"])
    for i in range(nodes):  # each node holds exactly what its ranks own
        assert node_experts(tmp_path / f"node{i}") == owned_by_node(nodes, per_node, i)
    if paradigm == "data" and nodes > 1:
        for step in range(4):
            pulls = [tuple(p) for r in range(world) for p in runs[r][step]["cross_pulls"]]
            grads = [tuple(g) for r in range(world) for g in runs[r][step]["cross_grads"]]
            assert pulls, "no expert crossed between nodes"
            # (layer, expert, node): each at most once per node per step ...
            assert len(pulls) == len(set(pulls))
            # ... and exactly one pre-reduced gradient back for each
            assert sorted(grads) == sorted(pulls)
            moved = sum(runs[r][step]["experts_cross_bytes"] for r in range(world))
            assert moved == len(pulls) * 3 * CFG.d_model * CFG.d_ff * 4


def test_resume_at_another_world_size_and_back(tmp_path: Path,
                                               reference: dict[str, Any]) -> None:
    # Launched with --resume from its first start, as a preemptible job is: it says there
    # was nothing to resume and starts at step 0.
    assert launch(tmp_path, "a", 1, 2, steps=2, paradigm="data", resume=True) == [0]
    said = "holds no checkpoint to resume; training starts at step 0"
    assert said in (tmp_path / "a.node0.log").read_text()
    before = expert_weights(tmp_path / "node0")
    # W = 4 on two nodes: node 1 joins and receives experts 4..7 of every layer, unchanged.
    assert launch(tmp_path, "b", 2, 2, steps=2, resume=True) == [0, 0]
    assert said not in (tmp_path / "b.node0.log").read_text()
    moved = expert_weights(tmp_path / "node1")
    assert set(moved) and all(torch.equal(t, before[n]) for n, t in moved.items())
    for i in range(2):
        assert node_experts(tmp_path / f"node{i}") == owned_by_node(2, 2, i)
    assert launch(tmp_path, "c", 2, 2, steps=4, resume=True, paradigm="data") == [0, 0]
    # back to W = 2, one rank per node
    assert launch(tmp_path, "d", 2, 1, steps=6, resume=True) == [0, 0]
    for i in range(2):
        assert node_experts(tmp_path / f"node{i}") == owned_by_node(2, 1, i)
    losses = ([m["loss"] for m in metrics(tmp_path, "a", 0)]
              + [m["loss"] for m in metrics(tmp_path, "c", 0)]
              + [m["loss"] for m in metrics(tmp_path, "d", 0)])
    assert len(losses) == 6
    for got, want in zip(losses, reference["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want)
    check_weights(tmp_path, 2, reference["at6"])


def test_sigkill_during_a_checkpoint_keeps_the_previous_one(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    codes = launch(tmp_path, "a", 2, 1, steps=4, checkpoint_every=2,
                   kill=["snapshot", 4, 1])
    assert codes != [0, 0]
    for i in range(2):
        folder = tmp_path / f"node{i}.run" / "manifests"
        steps = sorted(json.loads(p.read_text())["step"] for p in folder.glob("ckpt-*.json"))
        assert steps == [2]
    stop_daemons(tmp_path)
    for i in range(2):
        with tierstore.open(tmp_path / f"node{i}", host_cache=0) as st:
            report = st.fsck()
        assert report.ok, report
    assert launch(tmp_path, "b", 2, 1, steps=4, resume=True) == [0, 0]
    resumed = [m["loss"] for m in metrics(tmp_path, "b", 0)]
    assert len(resumed) == 2
    for got, want in zip(resumed, reference["losses"][2:4]):
        assert abs(got - want) <= 1e-5 * abs(want)
    check_weights(tmp_path, 2, reference["at4"])


# Points of a W = 1 -> 2 re-shard (node 1 joins and receives experts 4..7 of both MoE layers,
# one commit each) at which a rank SIGKILLs itself: node 1 after its first expert arrived,
# node 0 while deleting what it sent, node 1 during the checkpoint in the new layout.
RESHARD_KILLS = [["moved", 1, 1], ["sent", 3, 0], ["snapshot", 2, 1]]


def fsck_all(tmp: Path, nodes: int) -> None:
    stop_daemons(tmp)
    for i in range(nodes):
        with tierstore.open(tmp / f"node{i}", host_cache=0) as st:
            report = st.fsck()
        assert report.ok, (i, report)


def rank_pids(agents: list[subprocess.Popen[bytes]]) -> list[int]:
    """The rank processes (the agents' children)."""
    pids = []
    for agent in agents:
        for task in Path(f"/proc/{agent.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(c) for c in (task / "children").read_text().split()]
    return pids


def resumes_equal_after(tmp: Path, reference: dict[str, Any], kills: list[list[Any]],
                        must_hit: bool = True) -> None:
    """From a W = 1 checkpoint at step 2 in ``tmp``: a W = 2 resume killed at each of
    ``kills`` in turn (every store fsck-clean after each), then one that runs to step 4,
    which must equal the uninterrupted run."""
    for n, kill in enumerate(kills):
        codes = launch(tmp, f"k{n}", 2, 1, steps=4, resume=True, kill=kill)
        assert codes != [0, 0] or not must_hit, (kill, (tmp / f"k{n}.node0.log").read_text())
        if codes != [0, 0]:  # the other rank ended with one line naming the one killed
            victim = kill[2]
            assert rank_stderr(tmp, f"k{n}", 1 - victim, 1) == [
                f"tierstore: rank {1 - victim}: stopped because rank {victim} (node {victim}) "
                "ended without a word (killed, or out of memory: its node's torchrun output "
                "says which); rerun with --resume to continue from the last complete "
                "checkpoint"]
        fsck_all(tmp, 2)
    assert launch(tmp, "done", 2, 1, steps=4, resume=True) == [0, 0], \
        (tmp / "done.node1.log").read_text()[-3000:]
    losses = [m["loss"] for m in metrics(tmp, "done", 0)]
    if losses:  # (a random kill may have come after the last checkpoint)
        for got, want in zip(losses, reference["losses"][4 - len(losses):4]):
            assert abs(got - want) <= 1e-5 * abs(want)
    check_weights(tmp, 2, reference["at4"])
    for i in range(2):
        assert node_experts(tmp / f"node{i}") == owned_by_node(2, 1, i)
    fsck_all(tmp, 2)


@pytest.mark.timeout(600 + 600 * int(os.environ.get("TIERSTORE_RESHARD_KILLS", "0")))
def test_an_interrupted_reshard_resumes_from_any_instant(tmp_path: Path,
                                                         reference: dict[str, Any]) -> None:
    """A W = 1 -> 2 re-shard killed at several points of the move is taken up again by the
    next resume, and the result equals the uninterrupted run (that a store holding another
    run's experts is still refused as the joining node: the next test).
    TIERSTORE_RESHARD_KILLS=N adds N kills, each from a fresh W = 1 run: a real SIGKILL of a
    random rank at a random moment of the resume once its ranks have formed the process
    group, or a random point of the move."""
    assert launch(tmp_path, "a", 1, 1, steps=2) == [0]
    resumes_equal_after(tmp_path, reference, RESHARD_KILLS)

    rng = random.Random(int(os.environ.get("TIERSTORE_RESHARD_SEED", "0")))
    for i in range(int(os.environ.get("TIERSTORE_RESHARD_KILLS", "0"))):
        d = tmp_path / f"random{i}"
        d.mkdir()
        assert launch(d, "a", 1, 1, steps=2) == [0]
        if rng.random() < 0.5:
            phase = rng.choice(["moved", "sent", "snapshot"])
            kill = [phase, 2, rng.randint(0, 1)] if phase == "snapshot" else \
                [phase, rng.randint(1, 8), 1 if phase == "moved" else 0]
            resumes_equal_after(d, reference, [kill])
        else:
            agents = start(d, "k", 2, 1, steps=4, resume=True)
            # Once every rank has joined the process group and the run's failure channel
            # (node 1 starts its daemon after that): a rank that dies before the group has
            # formed leaves the others in torch.distributed's rendezvous until its timeout.
            joined = d / "node1.run" / "daemon.sock"
            deadline = time.monotonic() + 300
            while not joined.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(rng.uniform(0.0, 15.0))
            pids = rank_pids(agents)
            if pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rng.choice(pids), signal.SIGKILL)
            for agent in agents:
                agent.wait(timeout=500)
            fsck_all(d, 2)
            resumes_equal_after(d, reference, [], must_hit=False)
        shutil.rmtree(d)  # its stores' slabs are large


def test_a_joining_store_is_prepared_or_refused(tmp_path: Path) -> None:
    """The joining node's side of a re-shard on a real store, case by case: an empty store
    is marked and snapshotted; its own run's partial entries are undone (by restoring that
    snapshot, or, once the snapshot is gone, by deleting them); another run's are refused."""
    ident = {"format": 1, "seed": 3}
    weights = {f"layers.0.experts.{e}.w1": torch.full((4,), float(e)) for e in range(3)}

    def store(name: str) -> tierstore.Store:
        return tierstore.open(tmp_path / name, create=True, slab_size="1MiB", host_cache=0)

    with store("empty") as st:
        assert prepare_joining(st, 1, "run-a", ident) is None
        assert JOIN_TAG in {s.tag for s in st.snapshots()} and not st.names("layers.")
        st.put_many(weights)  # an attempt that got part of the way
        assert prepare_joining(st, 1, "run-a", ident) is None  # ours: undone in one restore
        assert not st.names("layers.") and st.fsck().ok
        st.put_many(weights)
        st.drop_snapshot(JOIN_TAG)  # as once the node was in a checkpoint
        assert prepare_joining(st, 1, "run-a", ident) is None  # ours: deleted
        assert not st.names("layers.") and JOIN_TAG in {s.tag for s in st.snapshots()}
        st.put_many(weights)
        refused = prepare_joining(st, 1, "run-b", ident)  # another run's
        assert refused is not None and "holds expert entries of another run" in refused
        assert sorted(st.names("layers.")) == sorted(weights)  # untouched
    with store("foreign") as st:  # expert entries, and no record of any run joining
        st.put_many(weights)
        refused = prepare_joining(st, 1, "run-a", ident)
        assert refused is not None and str(tmp_path / "foreign") in refused


def test_the_command_line_under_torchrun(tmp_path: Path) -> None:
    """`torchrun -m tierstore train --distributed`: a summary on rank 0, credits that send
    tokens where the pulls would not fit, and a second start on the same store refused in
    one line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_port()), "-m", "tierstore", "train", "--distributed",
           "--store", str(tmp_path / "node"), "--model", "tiny", "--steps", "2",
           "--batch-size", "2", "--seq-len", "32", "--corpus-max-bytes", "256KiB",
           "--eval-every", "0", "--paradigm", "data", "--credits", "1",
           "--slab-size", "8MiB", "--metrics", str(tmp_path / "m.jsonl")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "distributed: steps 1-2" in done.stdout
    assert "bytes moved between ranks per step" in done.stdout
    # the store options reach the node daemon that makes the store
    marker = json.loads((tmp_path / "node" / "TIERSTORE").read_text())
    assert marker["backing"] == {"kind": "nvme", "slab_bytes": 8 << 20}
    first = [json.loads(line) for line in (tmp_path / "m.jsonl.rank0").read_text().splitlines()]
    # one pulled expert per rank cannot hold a layer's needs: those blocks sent tokens
    assert all("token" in m["paradigm"].values() or "mixed" in m["paradigm"].values()
               for m in first)
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0
    assert "already holds a training run; pass --resume" in again.stderr
    stop_daemons(tmp_path)


def test_the_two_stage_all_to_all_equals_the_flat_one_bit_for_bit(tmp_path: Path) -> None:
    """SE-MoE's hierarchical exchange (inside each node, then between ranks of equal local
    rank) moves the same rows in the same order: the same losses and weights, bit for bit."""
    flat, two = tmp_path / "flat", tmp_path / "two"
    flat.mkdir()
    two.mkdir()
    assert launch(flat, "run", 2, 2, steps=2) == [0, 0]
    assert launch(two, "run", 2, 2, steps=2, hierarchical=True) == [0, 0]
    for r in range(4):
        assert ([m["loss"] for m in metrics(flat, "run", r)]
                == [m["loss"] for m in metrics(two, "run", r)])
    for i in range(2):
        a, b = expert_weights(flat / f"node{i}"), expert_weights(two / f"node{i}")
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    stop_daemons(flat)
    stop_daemons(two)


@pytest.mark.gpu
def test_one_rank_per_gpu_with_nccl(tmp_path: Path, reference: dict[str, Any]) -> None:
    """NCCL on the machine's GPU (one rank per GPU, as many as there are, up to 2)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ranks = min(2, torch.cuda.device_count())
    codes = launch(tmp_path, "run", 1, ranks, steps=4, paradigm="data", device="cuda")
    assert codes == [0], (tmp_path / "run.node0.log").read_text()[-3000:]
    for m, want in zip(metrics(tmp_path, "run", 0), reference["losses"][:4]):
        assert abs(m["loss"] - want) <= 1e-4 * abs(want)
